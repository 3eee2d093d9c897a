"""The delivery journal: which messages of a micro-batch the endpoint has already accepted, so
that a batch run again after a crash sends only what was not.

Why. Spark runs a micro-batch again when the process that started it died before committing it
(`offsets/<N>` in the checkpoint, no `commits/<N>`). Without more, every delivery of that batch
is made twice, and a shard's first batch after a restart can be its whole backlog
(`max_messages_per_batch`).

What. While a batch is delivered, every delivery task (`varadhi.spark.batch._deliver`) hands the
origin (`messages.Origin`, the main-topic position) of each message its endpoint accepted to a
`JournalWriter`. A thread of the writer sends them to the subscription's journal topic
(`<subscription>.journal`, plain Kafka, not transactional, acks=1) every `interval_ms`
(`consumption.journal_interval`, default 250 ms) or every `FLUSH_MESSAGES` accepted messages,
whichever comes first, and once more, waiting for the broker, when the task's deliveries are
done. Records are keyed by `<app_id>/<batch_id>@<created_ms>` (the shard's idempotency id:
subscription, generation, shard count, shard, reader layout; the subscription's creation time)
and carry the origins as runs of offsets per storage topic and partition (a healthy batch's
accepted offsets are nearly contiguous, so a record stays small whatever the rate).

Only the first batch of a query can be one a crashed run had started (`checkpoints.
uncommitted_batch`). For that batch only, the driver reads the journal records of its key
(`read`: from the journal partition of its shard, starting at the batch's planning time minus
`LOOKBACK_MS`, Kafka's time index) and passes the set of accepted origins (`Accepted`) to the
tasks; a group run treats a message found there as delivered without sending it
(`GroupRun`, counted `skipped_replayed`). Journal entries are successes in the order each group
made them, so a group's order of first successes is unchanged.

A task that Spark runs again within its batch (an executor lost, say to a spot reclaim, or a
Python worker killed: `TaskContext.attemptNumber()` > 0) reads the journal itself, on its
executor, before it delivers (`read_on_retry`), and skips what the batch's earlier attempts
journaled by then, as a re-run batch does.

What is still delivered twice after a crash: the messages accepted within the last
`interval_ms` (or `FLUSH_MESSAGES`) of each task before it died, and the requests in flight
then (the endpoint may or may not have processed them). A crash after the deliveries (before
the state commit or Spark's commit) re-delivers nothing: each task waited for its last record.

The journal never fails a batch: a record that fails to reach Kafka (the broker down or
restarting) is logged, kept and sent again until the task ends (`JournalWriter`); what the broker
still has not acknowledged by then (`CLOSE_TIMEOUT_S`) is counted and logged, and may be
delivered twice, as without a journal. `interval_ms` 0 turns it off (no thread, no records, no
read).

The topic is created like the product's other topics (`varadhi.topic.[journal.]*` settings of the
cluster configuration, `varadhi.kafka.config`), and the tasks reach Kafka with the cluster's client
configuration, carried in `JournalTarget` as the Spark Kafka source's options carry it.

Across a shard-count change (`varadhi.ops.change_shards`). The new shards have new checkpoints and
app ids: none of them re-runs an old shard's uncommitted batch, so `read` above never finds its
records, while the new shards start from the old shards' committed positions and read that
batch's messages again. `subscription change-shards` therefore hands the journal over in its
`state` step, for every old shard whose checkpoint holds a batch planned and never committed
(`UncommittedBatch`: where it started, where its plan ends, what its journal holds):

- GroupState: in each old table, per group, the leading pending entries (origin order) that
  the journal names are dropped before the entries move (`change_shards_plan.drop_delivered`): retries
  and parked followers the crashed batch delivered (the state commit it never made). Their RQ
  records, copied by the feeders, then match no entry and are dropped as stale duplicates;
- main-topic messages: the accepted origins inside the ranges the batch read (`covered`, from
  its start to its planned end) go to the new shard that now reads each partition, as a
  `HandOver` document (`handover/<sub>/s<S>/<shard>` in the catalog, bound to the new reader
  layout's generation and seq). A new shard passes them to its tasks with every batch
  (`BatchContext.replayed`, the same skipping as above) until its positions (its layout's
  starting offsets and its committed offsets) reach the batch's planned end on every partition
  (`HandOver.accepted_below`). An offset reset starts a new generation, and with it layouts
  that no hand-over names: a rewind delivers those messages again.

Accepted origins of neither kind (none, in a consistent catalog) are left alone. A hand-over is
a subset of what the endpoint accepted, so any part of it lost (more than `MAX_HANDOVER_NUMBERS`
offsets for one new shard: the rest is delivered again) costs duplicates, never a message or
the order. A journal that cannot be read is never taken for an empty one (`read_shard` reads
to the partition's end or raises): the change refuses (`change_shards.HandOverUnreadable`).

Hazards. `read` finds a batch's records by time: records of a batch whose crashed run started
longer ago than the topic's retention (`RETENTION_MS`) are gone, and the batch is delivered
again whole. The checkpoint is read through the local file system (`varadhi.spark.checkpoints`); where
the driver cannot read it the journal is written but never read. Producers are cached per
Python worker process (`_producer`), since a Spark worker runs many tasks one after another.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kafka import KafkaProducer, TopicPartition
from kafka.errors import KafkaTimeoutError

from varadhi.core import messages as m
from varadhi.core.catalog_kinds import DocKind
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.config import PLAINTEXT, KafkaConfig

log = logging.getLogger(__name__)

# A task's writer sends as soon as this many accepted messages wait, even within the interval.
FLUSH_MESSAGES = 1_000
# Offsets (run starts and ends) per journal record, well under Kafka's default 1 MB per record.
MAX_NUMBERS_PER_RECORD = 40_000
# `read` starts this long before the batch's planning time: clocks of driver, executors and
# broker may differ (records carry the broker's append time).
LOOKBACK_MS = 10 * 60 * 1000
RETENTION_MS = 3 * 24 * 3600 * 1000
# How long a task waits, at most, for the broker to acknowledge its last journal records (a
# broker that died during the task and restarts), how long a send may block for the partition's
# metadata, and how long `read` reads the topic.
CLOSE_TIMEOUT_S = 60.0
SEND_BLOCK_MS = 10_000
READ_TIMEOUT_S = 30.0
# A journal read that fails is tried this many times, this far apart, before its caller gives
# up (`read_again`): a broker that just restarted answers within seconds.
READ_TRIES = 3
READ_RETRY_S = 5.0
# How long a task Spark runs again reads the journal of its batch (`read_on_retry`), at most.
RETRY_READ_TIMEOUT_S = 15.0
_T = TypeVar("_T")
# A task that has held back new requests for this long (`JournalWriter.behind`: accepted
# messages waited longer than `JournalTarget.max_lag_ms` for their journal record's
# acknowledgement) delivers on unjournaled (logged) rather than stall the batch for good.
LAG_GIVE_UP_S = 60.0


def topic_name(subscription: str) -> str:
    """The journal topic of a subscription (user names hold no dot: no clash with any topic)."""
    return f"{subscription}.journal"


def batch_key(app_id: str, batch_id: int, created_ms: int) -> str:
    """The journal key of a batch: the shard's idempotency id, the batch id, and the
    subscription's creation time, so that a subscription deleted and created again under its
    name (same app ids, batch ids from 0) never reads the records of the one before."""
    return f"{app_id}/{batch_id}@{created_ms}"


@dataclass(frozen=True)
class JournalTarget:
    """Where a batch's tasks write (pickled into the tasks' closure with `BatchContext`). It
    carries the cluster's client configuration (`kafka_clients.HasKafka`), as the Spark Kafka
    source's options carry it to the same executors."""

    bootstrap: str
    topic: str
    partition: int
    key: str  # batch_key(app_id, batch_id, created_ms)
    interval_ms: int
    max_lag_ms: int = 1_000  # `consumption.journal_max_lag`: `JournalWriter.behind`
    kafka: KafkaConfig = PLAINTEXT


# -- the set of accepted origins ------------------------------------------------------------


@dataclass
class Accepted:
    """A set of origins kept as sorted, disjoint, inclusive offset runs per (storage topic
    index, partition): small to pickle into tasks, `in` by binary search (pure)."""

    _starts: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    _ends: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    @classmethod
    def of_runs(cls, runs: Iterable[tuple[int, int, int, int]]) -> Accepted:
        """From (index, partition, first offset, last offset) runs, in any order, overlapping
        or not."""
        by_part: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for index, partition, start, end in runs:
            if start <= end:
                by_part[(index, partition)].append((start, end))
        out = cls()
        for part, spans in by_part.items():
            spans.sort()
            starts, ends = [spans[0][0]], [spans[0][1]]
            for start, end in spans[1:]:
                if start <= ends[-1] + 1:
                    ends[-1] = max(ends[-1], end)
                else:
                    starts.append(start)
                    ends.append(end)
            out._starts[part], out._ends[part] = starts, ends
        return out

    @classmethod
    def of(cls, origins: Iterable[m.Origin]) -> Accepted:
        return cls.of_runs(runs_of(origins))

    def __contains__(self, origin: object) -> bool:
        if not isinstance(origin, m.Origin):
            return False
        starts = self._starts.get((origin.index, origin.partition))
        if not starts:
            return False
        i = bisect.bisect_right(starts, origin.offset) - 1
        return i >= 0 and origin.offset <= self._ends[(origin.index, origin.partition)][i]

    def __len__(self) -> int:
        return sum(
            e - s + 1
            for part, starts in self._starts.items()
            for s, e in zip(starts, self._ends[part], strict=True)
        )

    def __bool__(self) -> bool:
        return bool(self._starts)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """The set as sorted (index, partition, first offset, last offset) runs."""
        return [
            (index, partition, s, e)
            for (index, partition), starts in sorted(self._starts.items())
            for s, e in zip(starts, self._ends[(index, partition)], strict=True)
        ]

    def within(self, ranges: Iterable[tuple[int, int, int, int]]) -> Accepted:
        """The origins of this set that lie in `ranges`, (index, partition, first, last)."""
        out = []
        for index, partition, first, last in ranges:
            starts = self._starts.get((index, partition), [])
            ends = self._ends.get((index, partition), [])
            i = bisect.bisect_left(ends, first)  # the first run that ends at or after `first`
            while i < len(starts) and starts[i] <= last:
                out.append((index, partition, max(starts[i], first), min(ends[i], last)))
                i += 1
        return Accepted.of_runs(out)

    def __or__(self, other: Accepted) -> Accepted:
        return Accepted.of_runs(self.runs() + other.runs())


def joined(*sets: Accepted | None) -> Accepted | None:
    """The union of the sets given (None: none, or all empty)."""
    out = Accepted()
    for one in sets:
        if one:
            out = out | one
    return out or None


def runs_of(origins: Iterable[m.Origin]) -> list[tuple[int, int, int, int]]:
    """Origins as (index, partition, first, last) runs of consecutive offsets (pure)."""
    by_part: dict[tuple[int, int], list[int]] = defaultdict(list)
    for o in origins:
        by_part[(o.index, o.partition)].append(o.offset)
    runs = []
    for (index, partition), offsets in sorted(by_part.items()):
        offsets.sort()
        start = prev = offsets[0]
        for offset in offsets[1:]:
            if offset > prev + 1:
                runs.append((index, partition, start, prev))
                start = offset
            prev = offset
        runs.append((index, partition, start, prev))
    return runs


def encode(origins: Iterable[m.Origin]) -> list[bytes]:
    """Journal record values for `origins` (pure): JSON `{"v": 1, "runs": [[index, partition,
    first, last, first, last, ...], ...]}`, split so that no record holds more than
    `MAX_NUMBERS_PER_RECORD` offsets."""
    values: list[bytes] = []
    current: dict[tuple[int, int], list[int]] = {}
    numbers = 0
    for index, partition, start, end in runs_of(origins):
        if numbers + 2 > MAX_NUMBERS_PER_RECORD:
            values.append(_value(current))
            current, numbers = {}, 0
        current.setdefault((index, partition), []).extend((start, end))
        numbers += 2
    if current:
        values.append(_value(current))
    return values


def _value(current: dict[tuple[int, int], list[int]]) -> bytes:
    runs = [[index, partition, *offsets] for (index, partition), offsets in current.items()]
    return json.dumps({"v": 1, "runs": runs}, separators=(",", ":")).encode()


def decode(value: bytes | None) -> list[tuple[int, int, int, int]]:
    """The runs of one journal record value; [] (with a warning) for anything else (pure)."""
    try:
        doc = json.loads(value or b"")
        runs = []
        for item in doc["runs"]:
            index, partition, *offsets = (int(x) for x in item)
            if len(offsets) % 2:
                raise ValueError("odd number of offsets")
            runs.extend(
                (index, partition, offsets[i], offsets[i + 1]) for i in range(0, len(offsets), 2)
            )
        return runs
    except (ValueError, TypeError, KeyError) as e:
        log.warning("skipping a journal record that is not one: %s", e)
        return []


# -- writing (executors) --------------------------------------------------------------------


def _producer(target: JournalTarget) -> KafkaProducer:
    """The process's journal producer (`kafka_clients.process_producer`)."""
    return kafka_clients.process_producer(
        target, "varadhi-journal", acks=1, linger_ms=0, max_block_ms=SEND_BLOCK_MS
    )


class JournalWriter:
    """Records a task's accepted origins under `target.key` (see the module docstring).

    `accepted` is the hot path (one deque append); a daemon thread sends every `interval_ms`,
    or sooner when `FLUSH_MESSAGES` wait. Nothing is given up while the task runs: a record
    Kafka did not take (no producer yet because the broker is down, a send that raised, a send
    the broker never acknowledged) is kept and sent again at the next interval, so a broker
    that dies and comes back during the task costs no journal entry. `close` sends what is left
    and waits until the broker acknowledged every record, re-sending failures, for at most
    `CLOSE_TIMEOUT_S`; what is still not acknowledged then is counted in `unjournaled` and
    logged (a crash before the batch commits delivers those messages again). Never raises for
    Kafka's sake. While messages wait longer than `target.max_lag_ms` for their record's
    acknowledgement, `behind` tells the task's delivery engine to send no new request (for at
    most `LAG_GIVE_UP_S`), so a crash while Kafka is away re-delivers about `max_lag_ms` of
    deliveries, not everything since it went away. `producer_factory` (target -> producer) is
    for tests."""

    def __init__(
        self,
        target: JournalTarget,
        producer_factory: Callable[[JournalTarget], KafkaProducer] | None = None,
    ):
        self.target = target
        self._factory = producer_factory or _producer
        self._producer: KafkaProducer | None = None
        self._queue: deque[m.Origin] = deque()
        # Record values to send (again): Kafka did not take them. Appended from the producer's
        # thread too (a failed future), hence a deque.
        # Each with when its oldest origin was accepted (monotonic), for `behind`.
        self._unsent: deque[tuple[bytes, float]] = deque()
        self._in_flight: dict[int, tuple[bytes, float]] = {}  # sent, not answered, by token
        self._queued_since: float | None = None  # when the oldest origin in `_queue` came
        self._behind = False
        self._behind_from: float | None = None  # since when it has been behind
        self._gave_up = False  # behind for `LAG_GIVE_UP_S`: delivering on unjournaled
        # While a flush runs: when the oldest origin it sends was accepted (a flush blocks
        # while Kafka is away: no producer can be made, no metadata comes).
        self._flushing_since: float | None = None
        self._tokens = itertools.count()
        self._lock = threading.Lock()  # `_in_flight` and the counters (the producer's thread)
        self._sending = threading.Lock()  # one `_flush` at a time
        self._wake = threading.Event()
        self._closing = False
        self._warned = False
        self.accepted_origins = 0  # handed to `accepted` (the task's thread)
        self.sent_records = 0  # acknowledged by the broker
        self.sent_origins = 0
        self.unjournaled = 0  # origins still not acknowledged when `close` gave up
        self._thread = threading.Thread(target=self._loop, name="varadhi-journal", daemon=True)
        self._thread.start()

    def accepted(self, origin: m.Origin) -> None:
        self.accepted_origins += 1
        self._queue.append(origin)
        if self._queued_since is None:
            self._queued_since = time.monotonic()
        if len(self._queue) >= FLUSH_MESSAGES:
            self._wake.set()

    def behind(self) -> bool:
        """Whether the task should send no new request for now: a message it accepted more
        than `target.max_lag_ms` ago is not journaled yet (the broker is down, restarting or
        slow), for less than `LAG_GIVE_UP_S` so far. Kept by the writer's thread every interval, and
        seen here while that thread is stuck in a flush; called before every request, so it
        costs an attribute read or two."""
        if self._behind:
            return True
        since = self._flushing_since
        return since is not None and not self._gave_up and time.monotonic() - since > self._limit()

    def _limit(self) -> float:
        return self.target.max_lag_ms / 1000

    def _update_behind(self) -> None:
        now = time.monotonic()
        with self._lock:
            times = [t for _, t in self._unsent] + [t for _, t in self._in_flight.values()]
        if self._queued_since is not None:
            times.append(self._queued_since)
        if not times or now - min(times) <= self._limit():
            self._behind, self._behind_from, self._gave_up = False, None, False
            return
        if self._behind_from is None:
            self._behind_from = min(times) + self._limit()
            log.warning(
                "delivery journal %s: not acknowledged for %.0f s; no new request until it is",
                self.target.topic,
                now - min(times),
            )
        was = not self._gave_up
        self._gave_up = now - self._behind_from >= LAG_GIVE_UP_S
        self._behind = not self._gave_up
        if was and self._gave_up:
            log.warning(
                "delivery journal %s: still not acknowledged after %.0f s more; delivering on "
                "unjournaled (a crash before this batch commits delivers those messages again)",
                self.target.topic,
                LAG_GIVE_UP_S,
            )

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        self._thread.join(CLOSE_TIMEOUT_S)
        while True:
            self._flush()  # what the thread left, and records that failed since
            if self._producer is not None:  # waits for the broker's answers
                try:
                    self._producer.flush(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
                except Exception as e:  # noqa: BLE001 - timed out: try again until the deadline
                    self._warn(e)
            if self._done() or time.monotonic() >= deadline:
                break
            # a failed send or no producer: Kafka is away, try again shortly; else the producer's
            # thread is still calling back
            pause = 0.5 if self._unsent or self._producer is None else 0.01
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        if not self._done():
            self.unjournaled = self.unacknowledged()
            log.warning(
                "delivery journal %s: %d accepted messages not journaled after %.0f s (Kafka "
                "did not acknowledge them); a crash before this batch commits delivers them again",
                self.target.topic,
                self.unjournaled,
                CLOSE_TIMEOUT_S,
            )

    def unacknowledged(self) -> int:
        """The accepted origins whose record the broker has not acknowledged yet (queued,
        being sent, unsent or in flight): what a crash now would deliver again, besides the
        requests in flight. Each counter has one writer (the task's thread, the producer's)."""
        return self.accepted_origins - self.sent_origins

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _done(self) -> bool:
        with self._lock:
            return not self._queue and not self._unsent and not self._in_flight

    def _loop(self) -> None:
        interval_s = self.target.interval_ms / 1000
        while True:
            self._wake.wait(interval_s)
            self._wake.clear()
            closing = self._closing  # read before the flush: what came before close is sent
            self._update_behind()  # before a flush that may block while Kafka is away
            self._flush()
            self._update_behind()
            if closing:
                self._behind = False
                return

    def _flush(self) -> None:
        with self._sending:  # the thread and `close` may both flush
            values = [self._unsent.popleft() for _ in range(len(self._unsent))]
            since, self._queued_since = self._queued_since, None
            n = len(self._queue)
            if n:
                since = since if since is not None else time.monotonic()
                values += [(v, since) for v in encode([self._queue.popleft() for _ in range(n)])]
            self._flushing_since = min((t for _, t in values), default=None)
            try:
                self._send(values)
            finally:
                self._flushing_since = None

    def _send(self, values: list[tuple[bytes, float]]) -> None:
        """Send each (record value, oldest origin's time); on a failure keep the rest."""
        for i, (value, since) in enumerate(values):
            try:
                if self._producer is None:
                    self._producer = self._factory(self.target)
                future = self._producer.send(
                    self.target.topic,
                    key=self.target.key.encode(),
                    value=value,
                    partition=self.target.partition,
                )
            except Exception as e:  # noqa: BLE001 - kept and sent again: never fail a task
                self._unsent.extend(values[i:])
                self._warn(e)
                return
            token = next(self._tokens)
            with self._lock:
                self._in_flight[token] = (value, since)
            # An answered future calls back at once (on this thread): the lock is not held.
            future.add_callback(self._acknowledged, token)
            future.add_errback(self._not_acknowledged, token)

    def _acknowledged(self, token: int, _metadata: object) -> None:
        with self._lock:
            sent = self._in_flight.pop(token, None)
            if sent is not None:
                self.sent_records += 1
                self.sent_origins += _count(sent[0])

    def _not_acknowledged(self, token: int, error: Exception) -> None:
        with self._lock:
            sent = self._in_flight.pop(token, None)
        if sent is not None:
            self._unsent.append(sent)
            self._warn(error)

    def _warn(self, error: Exception) -> None:
        if not self._warned:
            log.warning(
                "delivery journal %s: %s; keeping this task's entries and sending them again",
                self.target.topic,
                error,
            )
        self._warned = True


def _count(value: bytes) -> int:
    """How many origins one journal record value names (pure)."""
    return sum(end - start + 1 for _, _, start, end in decode(value))


# -- topic and reading (driver) -------------------------------------------------------------


def ensure_topic(settings: kafka_clients.HasKafka, topic: str, partitions: int) -> int:
    """The journal topic's partition count; the topic is created with `partitions` if it does
    not exist (retention `RETENTION_MS`, broker append times, and the cluster configuration's
    `varadhi.topic.[journal.]*` settings). An existing topic is used with whatever partition
    count it has (it was created under an earlier shard count). Raises `KafkaUnavailable`,
    `KafkaError` or `InvalidArgument` (a pre-created topic that does not fit)."""
    from varadhi.kafka import topics  # driver only: keeps the executors' imports light

    ts = kafka_clients.config_of(settings).topics("journal")
    admin = kafka_clients.admin(settings, client_id="varadhi-journal-admin")
    try:
        if topic not in admin.list_topics():
            topics.ensure_kafka_topic(
                admin,
                topic,
                partitions,
                ts.with_defaults(
                    {
                        "retention.ms": str(RETENTION_MS),
                        "segment.ms": str(RETENTION_MS // 6),
                        "message.timestamp.type": "LogAppendTime",
                    }
                ),
                what="the delivery journal topic",
            )
        found = admin.describe_topics([topic])[0]
        return len(found["partitions"]) or partitions
    finally:
        admin.close()


def partition_of(shard: int, partitions: int) -> int:
    return shard % max(partitions, 1)


def read_again(
    read: Callable[[], _T],
    errors: tuple[type[Exception], ...],
    warn: Callable[[Exception], None],
) -> _T:
    """`read()`, called again `READ_RETRY_S` apart while it raises one of `errors`, at most
    `READ_TRIES` times in all; `warn(error)` after each failure but the last, whose error is
    raised. The one retry of a journal read, for a re-run batch (`ShardJournal.replayed`) and
    change-shards' hand-over."""
    for _ in range(READ_TRIES - 1):
        try:
            return read()
        except errors as e:
            warn(e)
            time.sleep(READ_RETRY_S)
    return read()  # the last try: its error is the caller's


def read(
    settings: kafka_clients.HasKafka,
    topic: str,
    partition: int,
    key: str,
    since_ms: int,
    timeout_s: float = READ_TIMEOUT_S,
    whole: bool = False,
) -> Accepted:
    """The origins journaled under `key` in records appended to `topic`/`partition` at or after
    `since_ms` (broker time). What was read by `timeout_s` if the partition cannot be read to
    its end by then (a partial set is still correct: every entry is a success); with `whole`,
    `KafkaTimeoutError` instead (the hand-over, which must not hand over a part silently)."""
    want = key.encode()
    runs: list[tuple[int, int, int, int]] = []
    consumer = kafka_clients.consumer(
        settings, enable_auto_commit=False, client_id="varadhi-journal-read"
    )
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        start = consumer.offsets_for_times({tp: max(since_ms, 0)}).get(tp)
        if start is None:  # nothing appended since then
            return Accepted()
        end = consumer.end_offsets([tp])[tp]
        consumer.seek(tp, start.offset)
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                if whole:
                    raise KafkaTimeoutError(
                        f"journal {topic}/{partition} not read to its end in {timeout_s:.0f} s"
                    )
                log.warning("journal %s/%d: read timed out; using what was read", topic, partition)
                break
            for batch in consumer.poll(timeout_ms=500).values():
                for record in batch:
                    if record.key == want:
                        runs.extend(decode(record.value))
    finally:
        consumer.close()
    return Accepted.of_runs(runs)


def read_shard(
    settings: kafka_clients.HasKafka, subscription: str, shard: int, key: str, since_ms: int
) -> Accepted:
    """Every origin journaled under `key` in the journal partition shard `shard` writes to
    (`partition_of` the topic's partition count), read to the partition's end (`read` with
    `whole`); empty when the subscription has no journal topic (nothing was ever journaled).
    Raises `KafkaError` or `KafkaUnavailable` when the topic's metadata or the partition cannot
    be read: a cluster that cannot answer is never taken for an empty journal."""
    topic = topic_name(subscription)
    admin = kafka_clients.admin(settings, client_id="varadhi-journal-read")
    try:
        if topic not in admin.list_topics():
            return Accepted()
        found = admin.describe_topics([topic])[0]
    finally:
        admin.close()
    partitions = found.get("partitions") or []
    if found.get("error_code") or not partitions:
        raise KafkaTimeoutError(f"the metadata of {topic} cannot be read: {found}")
    return read(settings, topic, partition_of(shard, len(partitions)), key, since_ms, whole=True)


def read_on_retry(target: JournalTarget, since_ms: int) -> Accepted | None:
    """On an executor, in a task Spark runs again within its batch (`TaskContext.attemptNumber()`
    > 0: the earlier attempt's executor or Python worker died): the origins the batch's tasks
    journaled under `target.key` by now, read from `target`'s partition from `since_ms` (the
    batch's planning time minus `LOOKBACK_MS`), so that the retry does not send again what the
    earlier attempt delivered. Other tasks' origins in the set change nothing: a task looks up
    only its own records' origins.

    Never fails the task: a read that raises is logged and gives None, one that outlasts
    `RETRY_READ_TIMEOUT_S` gives what it read by then; the retry then delivers the rest again,
    as it would without a journal."""
    try:
        accepted = read(
            target,
            target.topic,
            target.partition,
            target.key,
            since_ms,
            timeout_s=RETRY_READ_TIMEOUT_S,
        )
    except Exception as e:  # noqa: BLE001 - any failure to read: deliver again, never fail the task
        log.warning(
            "journal %s: a retried task cannot read it (%s); its batch's deliveries may be "
            "sent again",
            target.key,
            e,
        )
        return None
    log.info(
        "journal %s: a retried task found %d messages accepted by earlier attempts",
        target.key,
        len(accepted),
    )
    return accepted or None


# -- the hand-over across a shard-count change (see the module docstring) ----------------------

HANDOVER_KIND = DocKind.HANDOVER
# Offsets (run starts and ends) in one new shard's hand-over document: about 150 KB of JSON in
# the catalog at most. Runs past it are left out (their messages are delivered again).
MAX_HANDOVER_NUMBERS = 20_000

Run = tuple[int, int, int, int]  # (storage topic index, partition, first offset, last offset)
Positions = dict[str, dict[str, int]]  # storage topic -> partition (as text) -> offset


@dataclass(frozen=True)
class UncommittedBatch:
    """An old shard's batch that was planned and never committed when its shard count changed:
    where it started (`start`: the shard's committed position, or its layout's starting offsets;
    negative: from the beginning), where its plan ends (`end`, exclusive, as Spark planned it,
    RQ partitions included), and the origins its journal names as accepted."""

    shard: int
    batch_id: int
    start: Positions
    end: Positions
    accepted: Accepted

    def covered(self, names: Sequence[str]) -> list[Run]:
        """The main-topic ranges the batch read, as runs (pure). `names`: the main topic's
        storage topics by index; other topics of the plan (the RQ's) are left out."""
        index = {name: i for i, name in enumerate(names)}
        out = []
        for topic, parts in self.end.items():
            if topic not in index:
                continue
            for partition, end in parts.items():
                first = max(int(self.start.get(topic, {}).get(str(partition), -2)), 0)
                if int(end) > first:
                    out.append((index[topic], int(partition), first, int(end) - 1))
        return sorted(out)


@dataclass(frozen=True)
class HandOver:
    """What a shard-count change hands one new shard: main-topic origins an old shard's
    uncommitted batch delivered (`runs`), to be taken as delivered while the shard reads below
    `until` (storage topic -> partition -> the old batch's planned end) on any partition named
    there. It belongs to the new shard's reader layout (`generation`, `seq`) and the layouts
    after it in that generation."""

    generation: int
    seq: int
    runs: tuple[Run, ...]
    until: Positions

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "seq": self.seq,
            "runs": [list(r) for r in self.runs],
            "until": self.until,
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HandOver:
        return cls(
            int(doc["generation"]),
            int(doc["seq"]),
            tuple(tuple(int(x) for x in r) for r in doc["runs"]),  # type: ignore[misc]
            {t: {str(p): int(o) for p, o in parts.items()} for t, parts in doc["until"].items()},
        )

    @classmethod
    def of_layout(cls, doc: Mapping[str, Any] | None, generation: int, seq: int) -> HandOver | None:
        """The hand-over in catalog document `doc` if it applies to the reader layout
        (`generation`, `seq`): same generation, at or after its layout. None otherwise, also
        for a document that is not one (logged): it is best-effort (pure)."""
        if not doc:
            return None
        try:
            handover = cls.from_dict(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring a hand-over document that is not one: %s", e)
            return None
        if handover.generation != generation or seq < handover.seq:
            return None
        return handover

    def accepted_below(self, positions: Positions) -> Accepted | None:
        """The handed-over origins while the shard's `positions` (its layout's starting offsets
        merged with its committed ones; negative: from the beginning) are below `until` on
        some partition, else None: the shard has committed past every message of it (pure)."""
        below = any(
            int(positions.get(topic, {}).get(p, -2)) < end
            for topic, parts in self.until.items()
            for p, end in parts.items()
        )
        return Accepted.of_runs(self.runs) if below and self.runs else None


def hand_over(
    batches: Sequence[UncommittedBatch],
    names: Sequence[str],
    after: Sequence[Mapping[str, Sequence[int]]],
    generation: int,
    seq: int,
) -> tuple[dict[int, HandOver], int]:
    """The hand-over documents of the new shards (pure): per new shard `j` (reading partitions
    `after[j]`: storage topic -> partitions), the accepted origins of `batches` inside the
    ranges they covered on its partitions, with their planned ends; only shards that get some.
    Also how many accepted offsets were left out over `MAX_HANDOVER_NUMBERS`."""
    index = {name: i for i, name in enumerate(names)}
    owner = {
        (index[topic], p): j
        for j, parts in enumerate(after)
        for topic, partitions in parts.items()
        if topic in index
        for p in partitions
    }
    runs: dict[int, list[Run]] = defaultdict(list)
    for batch in batches:
        for run in batch.accepted.within(batch.covered(names)).runs():
            j = owner.get(run[:2])
            if j is not None:
                runs[j].append(run)
    out, left_out = {}, 0
    for j, found in sorted(runs.items()):
        kept = Accepted.of_runs(found).runs()
        left_out += sum(e - s + 1 for _, _, s, e in kept[MAX_HANDOVER_NUMBERS // 2 :])
        kept = kept[: MAX_HANDOVER_NUMBERS // 2]
        read = {run[:2] for run in kept}
        until: Positions = defaultdict(dict)
        for batch in batches:
            for topic, parts in batch.end.items():
                for p, end in parts.items():
                    if (index.get(topic), int(p)) in read:  # the furthest plan of any batch
                        until[topic][str(p)] = max(int(end), until[topic].get(str(p), 0))
        out[j] = HandOver(generation, seq, tuple(kept), dict(until))
    return out, left_out
