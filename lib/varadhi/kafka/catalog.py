"""The catalog: topics, subscriptions, leases and operations, in a compacted Kafka topic.

Like Kafka Connect's config topic, the catalog is a single-partition, compacted topic whose
records are `key -> JSON document` (a `None` value deletes the key). Every process can read it
with kafka-python alone, so producers and operators need no Spark.

Writes are read-modify-write under a fence: a writer uses the one transactional id
`varadhi-catalog-writer`; `init_transactions` bumps its epoch and so fences every earlier writer.
A writer reads the catalog (read_committed) after its own fence and commits its changes in one
transaction. Any commit by somebody else in between needs a newer epoch, which makes our commit
fail with a fencing error; `mutate` then re-fences, re-reads and re-applies (bounded retries).
So concurrent or repeated commands can never interleave half-applied changes.

Lease documents are the exception: each lease is written only through a writer of its own
(`Catalog(writer=...)`, transactional id `varadhi-catalog-writer.<topic>.lease.<owner>`), so its
writes fence one another (each is still an atomic read-modify-write of that document) while a
shard's heartbeat every few seconds fences none of the catalog's other writers
(`varadhi.kafka.leases`).

Keys are `<kind>/<name>`, for example `topic/orders`, `subscription/orders-http`,
`lease/orders-http/0`, `operation/orders-http`.

Hazard: a writer that dies inside its transaction (a shard SIGKILLed during a lease heartbeat)
leaves the transaction open, and every read_committed reader, so every catalog reader, sees
nothing past it until the broker aborts it. Kafka's client default gives that 60 s, longer than
a reader waits (`timeout_s`, 30 s): commands failed with "timed out waiting for the commit" and
shards stopped seeing their leases. Catalog transactions are a few small records, so writers ask
for `TRANSACTION_TIMEOUT_MS`; the broker aborts such a transaction within that plus its check
interval (`transaction.abort.timed.out.transaction.cleanup.interval.ms`, 10 s by default).
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic
from kafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
)

from varadhi.core import faults
from varadhi.core.errors import (
    ConcurrentModification,
    InvalidArgument,
    KafkaUnavailable,
    NotAuthorized,
    VaradhiError,
)
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

SEGMENT_MS = 3_600_000  # the catalog topic's segment.ms: compaction runs on closed segments
WRITER_ID = "varadhi-catalog-writer"  # + "." + catalog topic: one fence per catalog
# How long the broker lets a catalog transaction stay open (see the hazard above).
TRANSACTION_TIMEOUT_MS = 10_000
Document = dict[str, Any]
Changes = Mapping[str, Document | None]


def key(kind: str, name: str) -> str:
    return f"{kind}/{name}"


def decode_record(key: bytes | None, value: bytes | None) -> tuple[str, Document | None] | None:
    """A catalog (or progress) record as (key, document); document None is a deletion. None
    for a record another program wrote or a broken one (no key, a key that is not UTF-8, a
    value that is not a JSON object): readers skip it, so it can never stop a shard, a lease
    check or a command (pure)."""
    if not key:
        return None
    try:
        name = key.decode("utf-8")
        doc = None if value is None else json.loads(value)
    except (UnicodeDecodeError, ValueError):
        return None
    if doc is not None and not isinstance(doc, dict):
        return None
    return name, doc


class Snapshot:
    """An immutable view of the catalog at one point: key -> document."""

    def __init__(self, entries: Mapping[str, Document]):
        self._entries = dict(entries)

    def get(self, kind: str, name: str) -> Document | None:
        return self._entries.get(key(kind, name))

    def all_keys(self) -> list[str]:
        """Every key, sorted (`<kind>/<name>`)."""
        return sorted(self._entries)

    def items(self, kind: str) -> dict[str, Document]:
        prefix = f"{kind}/"
        return {
            k[len(prefix) :]: v for k, v in sorted(self._entries.items()) if k.startswith(prefix)
        }


class Catalog:
    """Reads and writes the catalog topic. One instance per process; thread-safe."""

    def __init__(
        self, settings: Settings | None = None, timeout_s: float = 30.0, writer: str | None = None
    ):
        self.settings = settings or Settings.from_env()
        self.topic = self.settings.catalog_topic
        # `writer`: a transactional id of its own (`WRITER_ID.<topic>.<writer>`), for documents
        # only ever written through it (a lease: `varadhi.kafka.leases`); None: the shared one.
        self.writer = writer
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._entries: dict[str, Document] = {}
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._tp = TopicPartition(self.topic, 0)
        self._checked = False  # a pre-existing catalog topic was found fit
        self._read_at = -math.inf  # when the last complete read began (`time.monotonic`)

    # -- set-up ---------------------------------------------------------------------------
    def ensure_topic(self) -> None:
        """Create the catalog topic (compacted, one partition) if it does not exist, with the
        cluster configuration's `varadhi.topic.[catalog.]*` settings (replication factor: the
        cluster's default unless set). A pre-created one is accepted when it is compacted and
        has one partition; otherwise `InvalidArgument` says what is wrong."""
        ts = kafka_clients.config_of(self.settings).topics("catalog")
        configs = ts.config(
            {
                "cleanup.policy": "compact",
                "min.compaction.lag.ms": "60000",
                # lease renewals add a record every few seconds per shard: roll
                # segments so compaction keeps the catalog small to read
                "segment.ms": str(SEGMENT_MS),
            }
        )
        admin = self._admin()
        try:
            if self.topic not in admin.list_topics():
                try:
                    admin.create_topics(
                        [NewTopic(self.topic, 1, ts.replication_factor, topic_configs=configs)]
                    )
                    return
                except TopicAlreadyExistsError:
                    pass
            self._check_existing(admin)
        finally:
            admin.close()

    def _check_existing(self, admin: KafkaAdminClient) -> None:
        """A catalog topic that already exists (made by an earlier run or by an operator)."""
        if self._checked:
            return
        found = admin.describe_topics([self.topic])[0]
        if found.get("error_code") == TopicAuthorizationFailedError.errno:
            raise NotAuthorized(
                "Describe", "Topic", self.topic, kafka_clients.principal(self.settings)
            )
        count = len(found["partitions"])
        policy = kafka_clients.topic_configs(
            admin, self.settings, [self.topic], ["cleanup.policy"]
        )[self.topic]["cleanup.policy"]
        if "compact" not in policy.split(","):
            raise InvalidArgument(
                f"the catalog topic {self.topic} has cleanup.policy={policy}: it must be "
                f"compacted, or deleting old segments would lose topics and subscriptions (set "
                f"cleanup.policy=compact with kafka-configs, or choose another "
                f"VARADHI_CATALOG_TOPIC)"
            )
        if count != 1:
            raise InvalidArgument(
                f"the catalog topic {self.topic} has {count} partitions: it must have one "
                f"(choose another VARADHI_CATALOG_TOPIC, or re-create it)"
            )
        self._checked = True

    def ensure_segment_roll(self) -> None:
        """Give a catalog topic created before `segment.ms` was set (Kafka's default is 7 days)
        hourly segments, so compaction can drop superseded lease renewals. Idempotent; a
        failure is only logged (shards call this once at their start)."""
        admin = self._admin()
        try:
            found = kafka_clients.topic_configs(admin, self.settings, [self.topic], ["segment.ms"])
            if int(found[self.topic]["segment.ms"]) > SEGMENT_MS:
                admin.alter_configs(
                    [
                        ConfigResource(
                            ConfigResourceType.TOPIC,
                            self.topic,
                            configs={"segment.ms": str(SEGMENT_MS)},
                        )
                    ]
                )
                log.info("catalog %s: segment.ms set to %d", self.topic, SEGMENT_MS)
        except (KafkaError, VaradhiError, KeyError, TypeError, ValueError) as e:
            log.warning("catalog %s: could not check segment.ms: %s", self.topic, e)
        finally:
            admin.close()

    def _admin(self) -> KafkaAdminClient:
        try:
            return kafka_clients.admin(
                self.settings,
                client_id="varadhi-catalog-admin",
                request_timeout_ms=int(self.timeout_s * 1000),
            )
        except KafkaError as e:
            raise KafkaUnavailable(f"cannot reach Kafka at {self.settings.bootstrap}: {e}") from e

    # -- reading --------------------------------------------------------------------------
    def snapshot(self, max_age_s: float = 0.0) -> Snapshot:
        """Everything committed so far (reads only what is new since the last read). With
        `max_age_s`, what a read that began at most that many seconds ago found is fresh
        enough, and no request goes to Kafka: a shard's micro-batch reads its filter and
        re-drives right after its lease check read the catalog."""
        with self._lock:
            if max_age_s <= 0 or time.monotonic() - self._read_at > max_age_s:
                self._catch_up()
            return Snapshot(self._entries)

    def get(self, kind: str, name: str) -> Document | None:
        return self.snapshot().get(kind, name)

    def _catch_up(self, past: int = -1) -> None:
        """Read up to the last stable offset; first wait until it is beyond offset `past`.

        `commit_transaction` returns once the coordinator has decided, before the commit markers
        are on the catalog partition, so a writer that wants to read its own write passes the
        offset of its last record (without the wait, `create` then `get` can miss the topic).
        """
        consumer = self._consumer_or_create()
        started = time.monotonic()
        deadline = started + self.timeout_s
        end = consumer.end_offsets([self._tp])[self._tp]
        while end <= past:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"timed out waiting for the commit on {self.topic}")
            time.sleep(0.01)
            end = consumer.end_offsets([self._tp])[self._tp]
        while consumer.position(self._tp) < end:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"timed out reading the catalog topic {self.topic}")
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    entry = decode_record(record.key, record.value)
                    if entry is None:
                        log.warning(
                            "catalog %s: skipped a record another program wrote (offset %d): "
                            "its key is not text or its value not a JSON object",
                            self.topic,
                            record.offset,
                        )
                    elif entry[1] is None:
                        self._entries.pop(entry[0], None)
                    else:
                        self._entries[entry[0]] = entry[1]
        self._read_at = started  # everything committed before it is in `_entries`

    def _consumer_or_create(self) -> KafkaConsumer:
        if self._consumer is None:
            self.ensure_topic()
            try:
                consumer = kafka_clients.consumer(
                    self.settings,
                    isolation_level="read_committed",
                    auto_offset_reset="earliest",
                    enable_auto_commit=False,
                    group_id=None,
                    client_id="varadhi-catalog-reader",
                    request_timeout_ms=int(self.timeout_s * 1000) + 5000,
                )
            except KafkaError as e:
                raise KafkaUnavailable(
                    f"cannot reach Kafka at {self.settings.bootstrap}: {e}"
                ) from e
            consumer.assign([self._tp])
            consumer.seek_to_beginning(self._tp)
            self._consumer = consumer
        return self._consumer

    # -- writing --------------------------------------------------------------------------
    def mutate(self, change: Callable[[Snapshot], Changes], attempts: int = 10) -> Changes:
        """Apply `change(snapshot)` atomically and return what it wrote.

        `change` must be a pure function of the snapshot: it may be called more than once (after
        a concurrent write) and must raise a `VaradhiError` to refuse, which writes nothing.

        Hazard (kafka-python 3.0.12): when a transactional send fails because a newer writer
        fenced us, the client may bump its epoch, drop the record and then report
        `commit_transaction()` as successful with nothing written. So every record's
        acknowledgement is checked before the commit, as Java's `commitTransaction` does.
        Contending writers fence each other; retries back off with random jitter so that one of
        them gets through.
        """
        with self._lock:
            last: Exception | None = None
            for attempt in range(attempts):
                producer = self._producer_or_create()
                self._catch_up()
                changes = change(Snapshot(self._entries))
                if not changes:
                    return changes
                try:
                    producer.begin_transaction()
                    futures = []
                    for name, doc in changes.items():
                        value = None if doc is None else json.dumps(doc, sort_keys=True).encode()
                        futures.append(
                            producer.send(
                                self.topic, key=name.encode("utf-8"), value=value, partition=0
                            )
                        )
                    last_offset = max(f.get(timeout=self.timeout_s).offset for f in futures)
                    faults.crash_point("catalog_in_transaction")
                    kafka_clients.end_transaction(
                        producer, commit=True, timeout_s=self.timeout_s, what="the catalog write"
                    )
                except KafkaError as e:  # fenced by a concurrent writer, or the broker went away
                    last = e
                    log.info("catalog write attempt %d failed (%s); retrying", attempt + 1, e)
                    self._close_producer()
                    time.sleep(random.uniform(0.02, 0.05 * 2 ** min(attempt, 4)))
                    continue
                self._catch_up(past=last_offset)
                return changes
            raise ConcurrentModification(f"catalog write failed after {attempts} attempts: {last}")

    def _producer_or_create(self) -> KafkaProducer:
        if self._producer is None:
            self.ensure_topic()
            try:
                producer = kafka_clients.producer(
                    self.settings,
                    transactional_id=f"{WRITER_ID}.{self.topic}"
                    + (f".{self.writer}" if self.writer else ""),
                    client_id="varadhi-catalog-writer",
                    acks="all",
                    request_timeout_ms=int(self.timeout_s * 1000),
                    transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
                )
                producer.init_transactions()
            except KafkaError as e:
                raise KafkaUnavailable(
                    f"cannot reach Kafka at {self.settings.bootstrap}: {e}"
                ) from e
            self._producer = producer
        return self._producer

    def _close_producer(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=1)
            except Exception:  # noqa: BLE001 - closing a fenced producer may raise; it is discarded
                pass
            self._producer = None

    def close(self) -> None:
        with self._lock:
            self._close_producer()
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


def require(doc: Document | None, error: VaradhiError) -> Document:
    """`doc`, or raise `error` when it is missing."""
    if doc is None:
        raise error
    return doc
