"""The producer library: write messages to a composite topic with shard-consistent routing.

    with Producer("orders") as p:
        p.send(b'{"id": 1}', group_id="customer-42").get(timeout=10)
        p.send_many([Message(b"a", "g1"), Message(b"b", "g2")])  # one Kafka transaction

Contract (what readers of the topic rely on):

- A record's key is its group id (UTF-8), or none when ungrouped; its headers follow
  `varadhi.core.messages` (`varadhi-msg-id` always, `varadhi-group-id` when grouped,
  `varadhi-produced-ms`); its partition is chosen here by `plan`, never by Kafka's partitioner.
- Messages go to the composite topic's current produce topic. A background thread re-reads the
  catalog every `refresh_interval_s`, so after `topic switch-produce` a running producer moves to
  the new storage topic within about that interval. Sends already handed to Kafka complete on the
  old storage topic (at most once each: the producer is idempotent); that is safe because readers
  drain a storage topic, plus a grace period (`topics.sealed`), before they read the next one.
  Hazard: the Kafka client retries a batch for up to `delivery_timeout_ms` (30 s here), so a
  record can reach the old storage topic up to that long after a switch; shards wait
  `topics.SEAL_GRACE_MS` (35 s) before they leave a storage topic. Do not raise the timeout
  above the grace period.
- `send` is asynchronous and at-least-once from the caller's point of view: if `get` raises, the
  message may or may not have been written; re-sending it with the same `message_id` lets
  subscribers recognise the duplicate.
- `send_many` is all-or-nothing: one Kafka transaction. Only readers with
  `isolation.level=read_committed` get that guarantee (the Spark Kafka source reads
  `read_uncommitted` unless `kafka.isolation.level` says otherwise); others may see records of
  an aborted batch.

Everything is validated before anything is sent; bad input raises `InvalidArgument`, an unknown
topic `NotFound`, and a failure inside Kafka `SendFailed` (all `VaradhiError`s).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kafka import KafkaProducer
from kafka.errors import (
    AuthorizationError,
    KafkaConfigurationError,
    KafkaError,
    KafkaTimeoutError,
)
from kafka.producer.future import FutureRecordMetadata, RecordMetadata

from varadhi.core import names, routing
from varadhi.core.errors import InvalidArgument, KafkaUnavailable, NotAuthorized, VaradhiError
from varadhi.core.messages import H_GROUP_ID, H_MSG_ID, H_PRODUCED_MS
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

RESERVED_HEADER_PREFIX = "varadhi-"

# Defaults of the Kafka client, overridable through `**kafka_config`. acks=all is what the
# idempotent producer needs (no duplicates from its own retries); linger_ms=5 is the Java client's
# default since Kafka 4.0 and lets batches fill under load for at most 5 ms of added latency.
# A record is retried for at most 30 s (Kafka's default is 120 s) and then reported as failed:
# readers treat a storage topic as closed `topics.SEAL_GRACE_MS` (35 s) after produce moved off it,
# so nothing may land on it later than that.
KAFKA_DEFAULTS: dict[str, object] = {
    "acks": "all",
    "linger_ms": 5,
    "request_timeout_ms": 20_000,
    "delivery_timeout_ms": 30_000,
}


class SendFailed(VaradhiError):
    """Kafka did not take a message (or a `send_many` batch, which was then aborted).

    For `send` the message may still have been written (at-least-once: re-send with the same
    message id); for `send_many` nothing was committed, except when it is `CommitOutcomeUnknown`."""


class CommitOutcomeUnknown(SendFailed):
    """A `send_many` transaction's commit did not end in the producer's `max_block_ms` (the broker
    went away inside it): all of the batch may have been committed, or none. Sending it again with
    the same message ids is safe for a subscription with dedup; otherwise readers may see it twice."""


@dataclass(frozen=True)
class Message:
    value: bytes
    group_id: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    message_id: str | None = None


class Record(NamedTuple):
    """A validated message, ready for Kafka (except for its partition, see `plan`). A named
    tuple: it is built for every message sent, and that is cheaper than a frozen dataclass."""

    value: bytes
    key: bytes | None
    group_id: str | None
    message_id: str
    headers: tuple[tuple[str, bytes], ...]  # the caller's headers, encoded


# -- pure decisions ---------------------------------------------------------------------------


def plan(topic: topics.CompositeTopic, group_id: str | None, spread: int = 0) -> tuple[str, int]:
    """(storage topic name, partition) of a message on `topic`'s produce topic.

    Grouped: `routing.route_group` with the produce topic's partition count and K, so a group's
    shard never changes across storage topics of compatible K. Ungrouped: `spread` modulo the
    partition count (callers pass a running counter, which spreads evenly, round-robin).
    """
    st = topic.produce_topic
    if group_id is None:
        return st.name, spread % st.partitions
    return st.name, routing.route_group(group_id, st.partitions, st.k)


def validate(message: Message, max_message_bytes: int) -> Record:
    """Check `message` and encode it; raises `InvalidArgument` naming the bad field (see
    `encode`)."""
    return encode(
        message.value, message.group_id, message.headers, message.message_id, max_message_bytes
    )


def encode(
    value: bytes | str,
    group_id: str | None,
    headers: Mapping[str, str] | None,
    message_id: str | None,
    max_message_bytes: int,
) -> Record:
    """`validate` without building a `Message` first (the per-message path of `send`).

    Rules: the value is bytes or str (str is encoded as UTF-8) of at most `max_message_bytes`
    bytes; a group id, when given, is a non-empty string; header names are non-empty strings
    outside the reserved `varadhi-` namespace and header values are strings; a message id, when
    given, is a non-empty string (otherwise `new_message_id` makes one).
    """
    if not isinstance(value, bytes):
        if not isinstance(value, str):
            raise InvalidArgument(
                f"must be bytes or str, got {type(value).__name__}", field="value"
            )
        value = _utf8(value, "value")
    if len(value) > max_message_bytes:
        raise InvalidArgument(
            f"is {len(value)} bytes, more than the limit of {max_message_bytes}", field="value"
        )
    key = None
    if group_id is not None:
        if not isinstance(group_id, str) or not group_id:
            raise InvalidArgument(
                f"must be a non-empty string (or None for an ungrouped message), got {group_id!r}",
                field="group_id",
            )
        key = _utf8(group_id, "group_id")
    if message_id is None:
        message_id = new_message_id()
    elif not isinstance(message_id, str) or not message_id:
        raise InvalidArgument(f"must be a non-empty string, got {message_id!r}", field="message_id")
    return Record(value, key, group_id, message_id, _user_headers(headers) if headers else ())


# Message ids come from a private generator seeded from os.urandom, reseeded in a forked child so
# that parent and child never share a sequence, and never touched by user code (a global
# `random.seed(...)` in an application cannot make two processes generate the same ids).
# `uuid.uuid4()` makes a getrandom system call per id, which releases the GIL; while the Kafka
# client's sender thread is busy, cProfile measured ~90 us per call in the sending thread, against
# ~0.3 us for this.
_ids = random.Random()
os.register_at_fork(after_in_child=_ids.seed)


def new_message_id() -> str:
    """A fresh message id: 32 random hex digits (128 bits, like a uuid4's hex)."""
    return f"{_ids.getrandbits(128):032x}"


def _user_headers(headers: Mapping[str, str]) -> tuple[tuple[str, bytes], ...]:
    if not isinstance(headers, Mapping):
        raise InvalidArgument(f"must be a mapping, got {type(headers).__name__}", field="headers")
    out = []
    for name, value in headers.items():
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"header names must be non-empty strings: {name!r}", "headers")
        if name.startswith(RESERVED_HEADER_PREFIX):
            raise InvalidArgument(
                f"{name!r} is reserved: names starting with {RESERVED_HEADER_PREFIX!r} are set "
                "by varadhi",
                field="headers",
            )
        if not isinstance(value, str):
            raise InvalidArgument(f"value of {name!r} must be a string, got {value!r}", "headers")
        out.append((name, _utf8(value, "headers")))
    return tuple(out)


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(f"is not encodable as UTF-8: {e}", field=what) from None


def kafka_headers(record: Record, produced_ms: int) -> list[tuple[str, bytes]]:
    """The record's Kafka headers: the varadhi headers first, then the caller's."""
    headers = [(H_MSG_ID, record.message_id.encode()), (H_PRODUCED_MS, str(produced_ms).encode())]
    if record.key is not None:
        headers.append((H_GROUP_ID, record.key))
    headers.extend(record.headers)
    return headers


class RouteCache:
    """`plan` for grouped messages, memoised per group for one snapshot of the topic.

    Routing a group costs a murmur3 hash and some arithmetic; a dictionary hit costs a fraction
    of that, and producers usually see the same groups again and again. The producer replaces the
    whole cache when it reads a new snapshot of the topic (never mutates it for one), so a send
    never mixes two snapshots. Bounded: it starts over after `max_groups` distinct groups.
    """

    __slots__ = ("topic", "storage", "max_groups", "_partitions")

    def __init__(self, topic: topics.CompositeTopic, max_groups: int = 100_000):
        self.topic = topic
        self.storage = topic.produce_topic.name
        self.max_groups = max_groups
        self._partitions: dict[str, int] = {}

    def partition(self, group_id: str) -> int:
        partition = self._partitions.get(group_id)
        if partition is None:
            if len(self._partitions) >= self.max_groups:
                self._partitions.clear()
            partition = self._partitions[group_id] = plan(self.topic, group_id)[1]
        return partition


# -- I/O --------------------------------------------------------------------------------------


class SendResult:
    """Where a message was sent, and a handle on Kafka's acknowledgement.

    `topic` and `partition` are known at once (the producer chose them); `get` waits for the
    broker and returns Kafka's `RecordMetadata` (topic, partition, offset, ...)."""

    __slots__ = ("topic", "partition", "message_id", "group_id", "_future", "principal")

    def __init__(
        self,
        topic: str,
        partition: int,
        message_id: str,
        group_id: str | None,
        future: FutureRecordMetadata,
    ):
        self.topic = topic
        self.partition = partition
        self.message_id = message_id
        self.group_id = group_id
        self._future = future
        self.principal: str | None = None  # the SASL user, named when the ACLs refuse the write

    def get(self, timeout: float | None = None) -> RecordMetadata:
        """Wait up to `timeout` seconds for the acknowledgement; `SendFailed` if there is none."""
        try:
            return self._future.get(timeout)
        except AuthorizationError:
            raise NotAuthorized("Write", "Topic", self.topic, self.principal) from None
        except KafkaError as e:
            raise SendFailed(
                f"message {self.message_id} to {self.topic}[{self.partition}]: {e}"
            ) from e

    def done(self) -> bool:
        return self._future.is_done


class Producer:
    """Sends to composite topic `topic`. Thread-safe; use one per topic per process.

    `send` uses an idempotent producer. `send_many` uses a second, transactional producer
    (created on first use) with `transactional_id`, or a generated one. Give a stable
    `transactional_id` to an application that restarts: a new instance with the same id fences
    the old one and aborts its open transaction, which a generated id cannot do.

    `catalog` lets several producers share one catalog reader; the producer does not close it.
    `**kafka_config` is passed to both Kafka producers (for example `linger_ms`, `batch_size`).
    """

    def __init__(
        self,
        topic: str,
        settings: Settings | None = None,
        *,
        catalog: Catalog | None = None,
        transactional_id: str | None = None,
        refresh_interval_s: float = 1.0,
        max_message_bytes: int = 1_048_576,
        **kafka_config,
    ):
        if isinstance(topic, str) and names.INTERNAL_NAME_RE.fullmatch(topic):
            raise InvalidArgument(
                f"{topic} is a subscription's internal queue; it cannot be produced to",
                field="topic",
            )
        names.validate_name(topic)
        if refresh_interval_s <= 0:
            raise InvalidArgument(
                f"must be positive, got {refresh_interval_s}", field="refresh_interval_s"
            )
        if max_message_bytes < 1:
            raise InvalidArgument(
                f"must be positive, got {max_message_bytes}", field="max_message_bytes"
            )
        for reserved in ("enable_idempotence", "bootstrap_servers"):
            if reserved in kafka_config:
                raise InvalidArgument(
                    "is set by the producer (bootstrap servers come from the settings)",
                    field=reserved,
                )
        unknown = sorted(set(kafka_config) - set(KafkaProducer.DEFAULT_CONFIG))
        if unknown:
            raise InvalidArgument(
                f"not a kafka-python producer setting: {', '.join(unknown)}", field="kafka_config"
            )
        self.name = topic
        self.max_message_bytes = max_message_bytes
        self.refresh_interval_s = refresh_interval_s
        self._owns_catalog = catalog is None
        self.catalog = catalog or Catalog(settings)
        self.settings = settings or self.catalog.settings
        # The client's own request limit must not refuse a value this producer accepts: leave
        # room for the key, the headers and the batch framing (the broker may still refuse it:
        # its message.max.bytes is often about 1 MiB).
        request_size = max(1_048_576, max_message_bytes + 65_536)
        self._kafka_config = {**KAFKA_DEFAULTS, "max_request_size": request_size, **kafka_config}
        # How long a transaction's commit or abort may wait: `max_block_ms`, as Java's client.
        block_ms = self._kafka_config.get(
            "max_block_ms", KafkaProducer.DEFAULT_CONFIG["max_block_ms"]
        )
        self._block_s = int(block_ms) / 1000
        self._transactional_id = transactional_id
        # Ungrouped messages go round-robin from a random start, so that many short-lived
        # producers (one CLI call each) do not all start on partition 0.
        self._spread = itertools.count(random.randrange(1 << 16))
        self._lock = threading.Lock()  # creating the Kafka clients
        self._txn_lock = threading.Lock()  # one transaction at a time
        self._plain: KafkaProducer | None = None
        self._txn: KafkaProducer | None = None
        self._closed = threading.Event()
        try:
            self._routes = RouteCache(self._read_topic())
        except BaseException:
            self._close_catalog()
            raise
        self._refresher = threading.Thread(
            target=self._refresh_loop, name=f"varadhi-producer-refresh-{topic}", daemon=True
        )
        self._refresher.start()

    # -- public API --------------------------------------------------------------------------
    @property
    def topic(self) -> topics.CompositeTopic:
        """The composite topic as this producer last read it from the catalog."""
        return self._routes.topic

    def send(
        self,
        value: bytes | str,
        group_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
    ) -> SendResult:
        """Validate and hand one message to Kafka; returns at once (see `SendResult.get`)."""
        record = encode(value, group_id, headers, message_id, self.max_message_bytes)
        routes = self._routes
        if group_id is None:
            storage, partition = plan(routes.topic, None, next(self._spread))
        else:
            storage, partition = routes.storage, routes.partition(group_id)
        producer = self._plain or self._plain_producer()
        try:
            future = producer.send(
                storage,
                value=record.value,
                key=record.key,
                headers=kafka_headers(record, int(time.time() * 1000)),
                partition=partition,
            )
        except (KafkaError, ValueError) as e:
            raise SendFailed(f"message {record.message_id} to {storage}[{partition}]: {e}") from e
        result = SendResult(storage, partition, record.message_id, group_id, future)
        result.principal = kafka_clients.principal(self.settings)
        return result

    def send_many(self, messages: Iterable[Message]) -> list[RecordMetadata]:
        """Send `messages` in one Kafka transaction: all are committed, or none.

        Every message is validated first (`InvalidArgument` names its index; nothing is sent).
        All go to the produce topic as read when the call starts. Earlier `send`s are flushed
        first, so a group's order holds across the two paths. On any Kafka failure the
        transaction is aborted and `SendFailed` is raised.
        """
        batch = list(messages)
        records = []
        for i, message in enumerate(batch):
            if not isinstance(message, Message):
                raise InvalidArgument(f"must be a Message, got {type(message).__name__}", f"[{i}]")
            try:
                records.append(validate(message, self.max_message_bytes))
            except InvalidArgument as e:
                raise InvalidArgument(str(e), field=f"messages[{i}]") from None
        if not records:
            return []
        routes = self._routes
        if self._plain is not None:
            self._plain.flush()
        with self._txn_lock:
            producer = self._txn or self._transactional_producer()
            now_ms = int(time.time() * 1000)
            try:
                producer.begin_transaction()
            except KafkaError as e:
                self._discard_transactional()
                raise SendFailed(f"cannot begin a transaction: {e}") from e
            try:
                futures = []
                for record in records:
                    if record.group_id is None:
                        storage, partition = plan(routes.topic, None, next(self._spread))
                    else:
                        storage, partition = routes.storage, routes.partition(record.group_id)
                    futures.append(
                        producer.send(
                            storage,
                            value=record.value,
                            key=record.key,
                            headers=kafka_headers(record, now_ms),
                            partition=partition,
                        )
                    )
                producer.flush()
                metadata = [f.get() for f in futures]
            except (KafkaError, ValueError) as e:
                raise self._aborted(producer, len(records), e) from e
            except BaseException:  # e.g. KeyboardInterrupt: still leave no open transaction
                self._abort(producer)
                raise
            what = f"producer {self.name}: send_many of {len(records)} messages"
            try:
                kafka_clients.end_transaction(
                    producer, commit=True, timeout_s=self._block_s, what=what
                )
            except KafkaTimeoutError as e:
                self._discard_transactional()  # stuck in the commit; a new one awaits its verdict
                raise CommitOutcomeUnknown(str(e)) from e
            except KafkaError as e:
                raise self._aborted(producer, len(records), e) from e
            except BaseException:  # interrupted while the commit runs: its outcome is unknown
                self._discard_transactional()
                raise
        return metadata

    def _aborted(self, producer: KafkaProducer, count: int, error: Exception) -> SendFailed:
        """Abort `producer`'s transaction of `count` messages, failed with `error`."""
        self._abort(producer)
        return SendFailed(
            f"transaction of {count} messages aborted, nothing was committed: {error}"
        )

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every `send` so far is acknowledged or failed (see `SendResult.get`)."""
        if self._plain is not None:
            try:
                self._plain.flush(timeout)
            except KafkaError as e:
                raise SendFailed(f"flush did not finish: {e}") from e

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the catalog refresh and close the Kafka clients. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._refresher.join(timeout=self.refresh_interval_s + self.catalog.timeout_s)
        with self._lock:
            for client in (self._plain, self._txn):
                if client is not None:
                    client.close(timeout=timeout)
            self._plain = self._txn = None
        self._close_catalog()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- catalog refresh ---------------------------------------------------------------------
    def _read_topic(self) -> topics.CompositeTopic:
        topic = topics.from_snapshot(self.catalog.snapshot(), self.name)
        if topic.internal:
            raise InvalidArgument(f"{self.name} is an internal topic", field="topic")
        return topic

    def _refresh_loop(self) -> None:
        """Poll the catalog; swap in a new produce topic once Kafka knows its partitions.

        A failed read keeps the last known topic (a catalog outage must not stop producers) and
        is retried at the next interval: the product's errors and the Kafka client's alike (a
        broker restart raises kafka-python's own timeout; it once ended this thread for good).
        """
        while not self._closed.wait(self.refresh_interval_s):
            try:
                fresh = self._read_topic()
            except (VaradhiError, KafkaError) as e:
                log.warning("producer %s: cannot refresh the topic: %s", self.name, e)
                continue
            current = self._routes.topic
            if fresh == current:
                continue
            if fresh.produce_topic != current.produce_topic:
                self._warm(fresh.produce_topic.name)
                log.info(
                    "producer %s: produce topic %s -> %s",
                    self.name,
                    current.produce_topic.name,
                    fresh.produce_topic.name,
                )
            self._routes = RouteCache(fresh)

    def _warm(self, storage: str) -> None:
        """Fetch a storage topic's metadata here, so `send` never waits for it."""
        for client in (self._plain, self._txn):
            if client is not None:
                try:
                    client.partitions_for(storage)
                except KafkaError as e:
                    log.warning("producer %s: no metadata for %s yet: %s", self.name, storage, e)

    # -- Kafka clients -----------------------------------------------------------------------
    def _plain_producer(self) -> KafkaProducer:
        with self._lock:
            if self._closed.is_set():
                raise SendFailed(f"producer {self.name} is closed")
            if self._plain is None:
                self._plain = self._kafka(enable_idempotence=True)
            return self._plain

    def _transactional_producer(self) -> KafkaProducer:
        with self._lock:
            if self._closed.is_set():
                raise SendFailed(f"producer {self.name} is closed")
            if self._txn is None:
                tid = self._transactional_id or f"varadhi-producer-{self.name}-{uuid.uuid4().hex}"
                producer = self._kafka(transactional_id=tid)
                try:
                    producer.init_transactions()
                except KafkaError as e:
                    producer.close(timeout=1)
                    raise SendFailed(f"cannot initialise transactions as {tid!r}: {e}") from e
                self._txn = producer
            return self._txn

    def _kafka(self, **extra) -> KafkaProducer:
        try:
            return kafka_clients.producer(
                self.settings,
                client_id=f"varadhi-producer-{self.name}",
                **self._kafka_config,
                **extra,
            )
        except KafkaConfigurationError as e:
            raise InvalidArgument(str(e), field="kafka_config") from e
        except KafkaError as e:
            raise KafkaUnavailable(f"cannot reach Kafka at {self.settings.bootstrap}: {e}") from e

    def _abort(self, producer: KafkaProducer) -> None:
        """Abort the open transaction; a producer that cannot abort (fenced, or its broker gone:
        `max_block_ms`) is discarded."""
        try:
            kafka_clients.end_transaction(
                producer, commit=False, timeout_s=self._block_s, what=f"producer {self.name}"
            )
        except KafkaError as e:
            log.warning("producer %s: abort failed (%s); discarding the producer", self.name, e)
            self._discard_transactional()

    def _discard_transactional(self) -> None:
        with self._lock:
            if self._txn is not None:
                try:
                    self._txn.close(timeout=1)
                except KafkaError:
                    pass
                self._txn = None

    def _close_catalog(self) -> None:
        if self._owns_catalog:
            self.catalog.close()
