"""The progress topic: where shards publish their progress documents, and reading them back.

Shards publish a progress document every few seconds (and when they stop) to a progress topic
next to the catalog (`<catalog topic>_progress`, one partition, time-retained, keyed by
`<subscription>/<shard>`, a standby instance by `<subscription>/<shard>/standby/<instance>`, a
member of the library runtime by `<subscription>/member/<member>`: `varadhi.library`). It
is not compacted: its history is what the status notebook plots. `varadhi.ops.status` reads the
newest document of each shard.

Every batch of every shard of every subscription publishes there, so the newest document of a
shard may lie far back behind other shards' documents. A reader (`progress_of_subscriptions`)
reads the topic backward from its end, `SCAN_RECORDS` records first and twice as many each time,
keeping the newest document of each key, until it has seen every key it wants, or it reaches
the time the subscription was created (nothing of it is older), the topic's start (its
retention, `RETENTION_MS`) or `SCAN_LIMIT` records (logged). What it reads is the traffic since
the oldest of those documents. Callers want only the shards that have ever held their lease at
the current shard count (`varadhi.ops.status.shards_that_ran`; a shard that never ran has no
document to find), so a new shard costs no long read.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from kafka import TopicPartition

from varadhi.core.errors import KafkaUnavailable
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import decode_record
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

RETENTION_MS = 7 * 24 * 3600 * 1000
SCAN_RECORDS = 5_000  # the first window of a backward read; each next one is twice as large
# The most records one read goes back: about 40 s of reading on 2 cores, a week of 3 documents a
# second. A shard whose newest document lies further back shows as if it had not reported.
SCAN_LIMIT = 2_000_000


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


MEMBER = "member/"  # the key suffix of a library member's documents: `member/<member>`


class ProgressPublisher:
    """Sends a shard's (or a library member's) progress documents, at most every `interval_s`
    unless forced."""

    def __init__(
        self,
        settings: Settings,
        subscription: str,
        shard: int | None,
        interval_s: float = 5.0,
        standby: str | None = None,
        member: str | None = None,
    ):
        """Documents of shard `shard`, of its standby instance `standby`, or (`shard` None) of
        the library member `member` (a name without "/")."""
        if (shard is None) == (member is None) or (member is not None and "/" in member):
            raise ValueError("a progress publisher is a shard's or a member's")
        ensure_progress_topic(settings)
        self.topic = progress_topic(settings)
        # A standby instance reports under `<sub>/<shard>/standby/<instance>` (`standbys_of`),
        # never under the shard's own key, whose newest document is the active instance's.
        suffix = f"/standby/{standby}" if standby else ""
        where = f"{MEMBER}{member}" if shard is None else f"{shard}{suffix}"
        self.key = f"{subscription}/{where}".encode()
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


def latest_progress(
    settings: Settings,
    subscription: str,
    shards: Collection[int] | None = None,
    since_ms: int | None = None,
) -> dict[int, dict[str, Any]]:
    """The newest progress document of every shard of `subscription` (shard -> document);
    `shards`: the ones wanted (the read stops once it has seen them all), `since_ms`: when the
    subscription was created (the read goes no further back)."""
    wanted = {subscription: {str(s) for s in shards}} if shards is not None else None
    found = progress_of_subscriptions(settings, {subscription}, wanted, since_ms)
    return shard_documents(found.get(subscription, {}))


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


def member_documents(found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The library members' documents among `progress_documents` (pure): member -> document."""
    return {k.removeprefix(MEMBER): doc for k, doc in found.items() if k.startswith(MEMBER)}


def progress_documents(
    settings: Settings,
    subscription: str,
    shards: Collection[int] | None = None,
    since_ms: int | None = None,
) -> dict[str, dict[str, Any]]:
    """The newest progress document per key of `subscription`, by key suffix: `<shard>` for a
    shard, `<shard>/standby/<instance>` for a standby instance. With `shards`, the read stops
    once it has seen those shards' keys (other keys: as far as it read); without, it reads back
    to `since_ms` or the topic's start and finds every key."""
    wanted = {subscription: {str(s) for s in shards}} if shards is not None else None
    found = progress_of_subscriptions(settings, {subscription}, wanted, since_ms)
    return found.get(subscription, {})


def progress_of_subscriptions(
    settings: Settings,
    names: Collection[str],
    wanted: Mapping[str, Collection[str]] | None = None,
    since_ms: int | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """`progress_documents` of each subscription in `names`, from one backward read of the
    progress topic (module docstring): until every key suffix of `wanted` (subscription ->
    suffixes) was seen, or back to `since_ms` (the oldest subscription's creation) or the
    topic's start. A tombstone (`subscription delete`) hides the key's older documents; a
    subscription with none is left out."""
    ensure_progress_topic(settings)
    tp = TopicPartition(progress_topic(settings), 0)
    consumer = kafka_clients.consumer(settings, enable_auto_commit=False)
    try:
        consumer.assign([tp])
        begin = consumer.beginning_offsets([tp])[tp]
        end = consumer.end_offsets([tp])[tp]
        floor = begin
        if since_ms is not None and end > begin:
            at = consumer.offsets_for_times({tp: int(since_ms)}).get(tp)
            floor = max(begin, at.offset if at is not None else end)
        seen: dict[str, dict[str, dict[str, Any] | None]] = {}
        floor = max(floor, end - SCAN_LIMIT)
        hi, window = end, SCAN_RECORDS
        while hi > floor:
            lo = max(floor, hi - window)
            for name, docs in _read(consumer, tp, lo, hi, names).items():
                for suffix, doc in docs.items():
                    seen.setdefault(name, {}).setdefault(suffix, doc)  # newer windows win
            if wanted is not None and all(
                set(keys) <= set(seen.get(name, {})) for name, keys in wanted.items()
            ):
                break
            hi, window = lo, window * 2
        if wanted is not None and hi <= floor and floor == end - SCAN_LIMIT:
            missing = {
                name: sorted(set(keys) - set(seen.get(name, {})))
                for name, keys in wanted.items()
                if set(keys) - set(seen.get(name, {}))
            }
            if missing:
                log.warning(
                    "progress topic: no document of %s in its last %d records", missing, SCAN_LIMIT
                )
        return {
            name: {k: d for k, d in docs.items() if d is not None}
            for name, docs in seen.items()
            if any(d is not None for d in docs.values())
        }
    finally:
        consumer.close()


# How long one window's read may take before the reader gives up (Kafka not answering): a
# base, and more per record (kafka-python reads some 50,000 small records a second here).
READ_BASE_S = 10.0
READ_PER_RECORD_S = 0.001


def _read(consumer, tp, lo: int, hi: int, names: Collection[str]):
    """The newest document (None: a tombstone) per key of `names`' subscriptions among the
    records at offsets [lo, hi) (name -> suffix -> document). Raises `KafkaUnavailable` when
    they cannot be read in time: a partial read would show shards as never started."""
    consumer.seek(tp, lo)
    latest: dict[str, dict[str, dict[str, Any] | None]] = {}
    deadline = time.monotonic() + READ_BASE_S + READ_PER_RECORD_S * (hi - lo)
    while consumer.position(tp) < hi:
        if time.monotonic() > deadline:
            raise KafkaUnavailable(
                f"the progress topic {tp.topic} could not be read (offsets {lo}..{hi}) in time"
            )
        for records in consumer.poll(timeout_ms=200).values():
            for r in records:
                if r.offset >= hi:
                    continue
                entry = decode_record(r.key, r.value)
                if entry is None:
                    log.warning("progress topic: skipped a record another program wrote")
                    continue
                key, doc = entry
                name, _, suffix = key.partition("/")  # names hold no "/"
                if name in names:
                    latest.setdefault(name, {})[suffix] = doc
    return latest
