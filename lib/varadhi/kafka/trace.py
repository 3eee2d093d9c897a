"""The delivery trace's topic: writing events to it, reading a message's events back
(`varadhi.core.trace` says what an event is).

- `ensure_topic`: the subscription's trace topic (`<subscription>.trace`), created with the
  spec's retention (`trace.retention`), broker append times and the cluster configuration's
  `varadhi.topic.[trace.]*` settings; an existing topic whose retention differs from the spec's
  gets the spec's (so `subscription apply` of a new retention takes effect at the shards' next
  start).
- `TraceWriter`: a best-effort, batched writer. `add` is the hot path (a deque append); a
  thread packs the events by partition into records (`trace.encode`; not compressed: gzip in
  the producer nearly doubled the trace's CPU per event, and a topic `compression.type`, e.g.
  `varadhi.topic.trace.config.compression.type`, has the broker do it) and sends them every
  `FLUSH_INTERVAL_S` or `FLUSH_EVENTS` events; `close` sends the rest and waits for the broker
  for at most `CLOSE_TIMEOUT_S`. It never raises and never holds delivery back: while Kafka is
  away, events wait (at most `MAX_WAITING` of them; more are dropped and counted), and what is
  not acknowledged at `close` is counted in `dropped` and logged. A trace is a record of what
  happened, not a delivery guarantee.
- `read`: the events of one message, from the one partition its id maps to, between `since_ms`
  (Kafka's time index) and the partition's end.

Writers on executors reach Kafka with the cluster's client configuration, carried in
`TraceTarget` as the journal's target carries it. Producers are cached per process and cluster
(`_producer`), since a Spark worker runs many tasks one after another.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from kafka import KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import KafkaError

from varadhi.core import trace
from varadhi.core.errors import VaradhiError
from varadhi.core.trace import TraceEvent
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.config import PLAINTEXT, KafkaConfig
from varadhi.kafka.topic_settings import TopicSettings

log = logging.getLogger(__name__)

PARTITIONS = 6  # a new trace topic's partitions (one read by `varadhi trace`)
FLUSH_INTERVAL_S = 0.5
FLUSH_EVENTS = 2_000
MAX_WAITING = 200_000  # events held while Kafka is away; more are dropped (counted)
CLOSE_TIMEOUT_S = 10.0
SEND_BLOCK_MS = 5_000
READ_IDLE_S = 10.0  # `read` gives up when no record came for this long before the end


class TraceOff(VaradhiError):
    """A subscription has no trace topic (exit 2, as a missing subscription)."""

    exit_code = 2

    def __init__(self, subscription: str):
        super().__init__(
            f"subscription {subscription!r} has no delivery trace ({trace.topic_name(subscription)}"
            " does not exist): tracing is off, or no shard has run since it was turned on (give "
            "the spec a trace section, e.g. `trace: {retention: 7d}`, apply it and restart the "
            "shards)"
        )
        self.subscription = subscription


@dataclass(frozen=True)
class TraceTarget:
    """Where a task's or driver's events go (pickled into the tasks' closure)."""

    bootstrap: str
    topic: str
    partitions: int
    shard: int | None
    kafka: KafkaConfig = PLAINTEXT


def topic_settings(settings: kafka_clients.HasKafka, retention_ms: int) -> TopicSettings:
    """The trace topic's settings: the cluster configuration's `varadhi.topic.[trace.]*` ones,
    broker append times and daily (or shorter) segments unless configured, and the spec's
    retention whatever is configured (the spec owns it)."""
    ts = kafka_clients.config_of(settings).topics("trace")
    configs = ts.config(
        {
            "segment.ms": str(min(retention_ms // 6, 24 * 3600 * 1000)),
            "message.timestamp.type": "LogAppendTime",
        }
    )
    configs["retention.ms"] = str(retention_ms)
    return TopicSettings(ts.replication_factor, tuple(sorted(configs.items())))


def ensure_topic(settings: kafka_clients.HasKafka, topic: str, retention_ms: int) -> int:
    """The trace topic's partition count; the topic is made (or its retention set) as the module
    docstring says. Raises `KafkaUnavailable`, `KafkaError` or `InvalidArgument`."""
    from varadhi.kafka import topics  # driver only: keeps the executors' imports light

    wanted = topic_settings(settings, retention_ms)
    configs = dict(wanted.configs)
    admin = kafka_clients.admin(settings, client_id="varadhi-trace-admin")
    try:
        if topic not in admin.list_topics():
            topics.ensure_kafka_topic(
                admin,
                topic,
                PARTITIONS,
                wanted,
                what="the delivery trace topic",
            )
        else:
            found = kafka_clients.topic_configs(admin, settings, [topic], ["retention.ms"])
            if found[topic]["retention.ms"] != configs["retention.ms"]:
                _set_retention(admin, topic, configs["retention.ms"])
        described = admin.describe_topics([topic])[0]
        return len(described["partitions"]) or PARTITIONS
    finally:
        admin.close()


def _set_retention(admin, topic: str, retention_ms: str) -> None:
    """Give an existing trace topic the spec's retention (an incremental change: kafka-python
    uses IncrementalAlterConfigs where the broker has it). Refused (no AlterConfigs ACL, an
    optional grant), it is logged and the topic keeps its retention: tracing goes on."""
    try:
        answer = admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, topic, configs={"retention.ms": retention_ms}
                )
            ]
        )
        result = str(answer.get("topic", {}).get(topic))
    except KafkaError as e:
        result = str(e)
    if result == "OK":
        log.info("trace topic %s: retention.ms set to %s", topic, retention_ms)
    else:
        log.warning(
            "trace topic %s: could not set retention.ms to %s (%s); it keeps its retention",
            topic,
            retention_ms,
            result,
        )


def _producer(target: TraceTarget) -> KafkaProducer:
    """The process's trace producer (`kafka_clients.process_producer`)."""
    return kafka_clients.process_producer(
        target, "varadhi-trace", acks=1, linger_ms=20, max_block_ms=SEND_BLOCK_MS
    )


class TraceWriter:
    """Sends a task's (or driver's) trace events (see the module docstring). `add` may be
    called from one thread at a time; `close` once, at the end. `producer_factory` is for
    tests."""

    def __init__(
        self,
        target: TraceTarget,
        producer_factory: Callable[[TraceTarget], KafkaProducer] | None = None,
    ):
        self.target = target
        self._factory = producer_factory or _producer
        self._events: deque[TraceEvent] = deque()
        self._lock = threading.Lock()  # the counters (the producer's callback thread)
        self._sending = threading.Lock()  # one `_flush` at a time
        self._wake = threading.Event()
        self._closing = False
        self._in_flight = 0  # events sent, not answered
        self.added = 0
        self.sent = 0  # acknowledged by the broker
        self.dropped = 0
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name="varadhi-trace", daemon=True)
        self._thread.start()

    def add(self, event: TraceEvent) -> None:
        self.added += 1
        if len(self._events) >= MAX_WAITING:
            self.dropped += 1
            return
        self._events.append(event)
        if len(self._events) >= FLUSH_EVENTS:
            self._wake.set()

    def close(self) -> None:
        """Send what is left; wait for the broker for at most `CLOSE_TIMEOUT_S`."""
        self._closing = True
        self._wake.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._flush()
        producer = self._made()
        while producer is not None and self._in_flight and time.monotonic() < deadline:
            try:
                producer.flush(timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - counted below: never fail a task
                self._warn(e)
                break
        with self._lock:
            lost = self._in_flight + len(self._events)
            self._in_flight = 0
            self.dropped += lost
        self._events.clear()
        if self.dropped:
            log.warning(
                "delivery trace %s: %d of %d events not written (Kafka did not take them)",
                self.target.topic,
                self.dropped,
                self.added,
            )

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _made(self) -> KafkaProducer | None:
        try:
            return self._factory(self.target)
        except Exception as e:  # noqa: BLE001 - Kafka away: the events wait
            self._warn(e)
            return None

    def _loop(self) -> None:
        while not self._closing:
            self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            if not self._closing:
                self._flush()

    def _flush(self) -> None:
        with self._sending:
            if not self._events:
                return
            producer = self._made()
            if producer is None:
                return  # kept for the next flush
            taken = [self._events.popleft() for _ in range(len(self._events))]
            by_partition: dict[int, list[TraceEvent]] = defaultdict(list)
            for event in taken:
                by_partition[trace.partition_of(event.msg_id, self.target.partitions)].append(event)
            for partition, events in by_partition.items():
                for value, n in trace.encode(events):
                    try:
                        future = producer.send(self.target.topic, value=value, partition=partition)
                    except Exception as e:  # noqa: BLE001 - counted: never fail a task
                        with self._lock:
                            self.dropped += n
                        self._warn(e)
                        continue
                    with self._lock:
                        self._in_flight += n
                    future.add_callback(self._acked, n)
                    future.add_errback(self._failed, n)

    def _acked(self, n: int, _metadata: object) -> None:
        with self._lock:
            self._in_flight -= n
            self.sent += n

    def _failed(self, n: int, error: BaseException) -> None:
        with self._lock:
            self._in_flight -= n
            self.dropped += n
        self._warn(error)

    def _warn(self, error: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("delivery trace %s: Kafka refused events: %s", self.target.topic, error)


def read(
    settings: kafka_clients.HasKafka,
    subscription: str,
    msg_id: str,
    since_ms: int | None = None,
    idle_s: float = READ_IDLE_S,
) -> list[TraceEvent]:
    """The trace events of message `msg_id` of `subscription`, oldest first, from `since_ms`
    (None: the topic's start, its retention) to the partition's end when the read started.
    Raises NotFound when the subscription has no trace topic (its spec has no `trace`), and
    TimeoutError when no record arrives for `idle_s` before the end."""
    topic = trace.topic_name(subscription)
    consumer = kafka_clients.consumer(
        settings, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise TraceOff(subscription)
        tp = TopicPartition(topic, trace.partition_of(msg_id, len(partitions)))
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        start = None
        if since_ms is not None:
            found = consumer.offsets_for_times({tp: since_ms})[tp]
            start = end if found is None else found.offset
        if start is None:
            consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, start)
        events: list[TraceEvent] = []
        deadline = time.monotonic() + idle_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out reading the delivery trace {topic}")
            for records in consumer.poll(timeout_ms=200).values():
                deadline = time.monotonic() + idle_s
                for r in records:
                    if r.offset < end:
                        events.extend(trace.of_message(trace.decode(r.value), msg_id))
        return trace.of_message(events, msg_id)
    finally:
        consumer.close()
