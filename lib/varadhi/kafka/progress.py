"""The progress topic: where shards publish their progress documents, and reading them back.

Shards publish a progress document every few seconds (and when they stop) to a progress topic
next to the catalog (`<catalog topic>_progress`, one partition, time-retained, keyed by
`<subscription>/<shard>`, a standby instance by `<subscription>/<shard>/standby/<instance>`). It
is not compacted: its history is what the status notebook plots. `varadhi.ops.status` reads the
newest document of each shard.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection
from typing import Any

from kafka import TopicPartition

from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import decode_record
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

RETENTION_MS = 7 * 24 * 3600 * 1000
SCAN_RECORDS = 5_000  # how far back status looks for each shard's newest document


def progress_topic(settings: Settings) -> str:
    return f"{settings.catalog_topic}_progress"


def ensure_progress_topic(settings: Settings) -> None:
    """Create the progress topic (one partition; `varadhi.topic.[progress.]*` settings of the
    cluster configuration), or check a pre-created one has one partition."""
    ts = kafka_clients.config_of(settings).topics("progress")
    admin = kafka_clients.admin(settings, client_id="varadhi-status")
    try:
        topics.ensure_kafka_topic(
            admin,
            progress_topic(settings),
            1,
            ts.with_defaults({"retention.ms": str(RETENTION_MS)}),
            what="the progress topic",
        )
    finally:
        admin.close()


class ProgressPublisher:
    """Sends a shard's progress documents, at most every `interval_s` unless forced."""

    def __init__(
        self,
        settings: Settings,
        subscription: str,
        shard: int,
        interval_s: float = 5.0,
        standby: str | None = None,
    ):
        ensure_progress_topic(settings)
        self.topic = progress_topic(settings)
        # A standby instance reports under `<sub>/<shard>/standby/<instance>` (`standbys_of`),
        # never under the shard's own key, whose newest document is the active instance's.
        suffix = f"/standby/{standby}" if standby else ""
        self.key = f"{subscription}/{shard}{suffix}".encode()
        self.interval_s = interval_s
        self._last = 0.0
        self._lock = threading.Lock()
        self._producer = kafka_clients.producer(settings, linger_ms=50)

    def publish(self, doc: dict[str, Any], force: bool = False, flush: bool = False) -> None:
        """Send `doc` unless one went out less than `interval_s` ago (`force`: send anyway);
        `flush` waits until the broker has it."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last < self.interval_s:
                return
            self._last = now
            body = dict(doc, updated_ms=int(time.time() * 1000))
            self._producer.send(
                self.topic, key=self.key, value=json.dumps(body).encode(), partition=0
            )
            if flush:
                self._producer.flush(5)

    def close(self) -> None:
        self._producer.close(timeout=5)


def latest_progress(settings: Settings, subscription: str) -> dict[int, dict[str, Any]]:
    """The newest progress document of every shard of `subscription` (shard -> document)."""
    return shard_documents(progress_documents(settings, subscription))


def shard_documents(found: dict[str, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The shards' own documents among `progress_documents` (pure)."""
    return {int(k): doc for k, doc in found.items() if k.isdigit()}


STANDBY_FRESH_MS = 15_000  # a standby reports every 5 s; silent this long, it is gone


def standbys_of(
    found: dict[str, dict[str, Any]], now_ms: int, fresh_ms: int = STANDBY_FRESH_MS
) -> dict[int, list[dict[str, Any]]]:
    """Standby instances waiting per shard, from `progress_documents` (pure): the newest
    document of each is `standby` and recent."""
    out: dict[int, list[dict[str, Any]]] = {}
    for k, doc in sorted(found.items()):
        shard, _, instance = k.partition("/standby/")
        if not instance or not shard.isdigit() or doc.get("state") != "standby":
            continue
        if now_ms - int(doc.get("updated_ms") or 0) < fresh_ms:
            out.setdefault(int(shard), []).append(doc)
    return out


def progress_documents(settings: Settings, subscription: str) -> dict[str, dict[str, Any]]:
    """The newest progress document per key of `subscription`, by key suffix: `<shard>` for a
    shard, `<shard>/standby/<instance>` for a standby instance."""
    return progress_of_subscriptions(settings, {subscription}).get(subscription, {})


def progress_of_subscriptions(
    settings: Settings, names: Collection[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    """`progress_documents` of each subscription in `names`, from one read of the progress
    topic (its last `SCAN_RECORDS` records); a subscription with none is left out."""
    ensure_progress_topic(settings)
    tp = TopicPartition(progress_topic(settings), 0)
    consumer = kafka_clients.consumer(settings, enable_auto_commit=False)
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek(tp, max(0, end - SCAN_RECORDS))
        found: dict[str, dict[str, dict[str, Any]]] = {}
        deadline = time.monotonic() + 10
        while consumer.position(tp) < end and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                for r in records:
                    entry = decode_record(r.key, r.value)
                    if entry is None:
                        log.warning("progress topic: skipped a record another program wrote")
                        continue
                    key, doc = entry
                    name, _, suffix = key.partition("/")  # names hold no "/"
                    if name not in names:
                        continue
                    if doc is None:  # a tombstone (`subscription delete`): forget the key
                        found.get(name, {}).pop(suffix, None)
                    else:
                        found.setdefault(name, {})[suffix] = doc
        return found
    finally:
        consumer.close()
