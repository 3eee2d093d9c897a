"""Replay: re-deliver a time range of a subscription's main topic, out of band, in group order.

`varadhi replay NAME --from T [--to T]` (or `./spark-submit.sh --job replay ...`) runs one
bounded Spark batch job that reads every storage topic of the subscription's main topic for the
range and delivers its messages again to the subscription's endpoint. It is not a rewind: the
subscription's own offsets (the shards' checkpoints), its GroupState and its RQ/DLQ are never
read or written, and the running shards go on delivering live traffic in its own order. For a
rewind, `varadhi offsets reset` exists.

Semantics (the contract; docs/replay.md explains it for users):

- **Range.** By Kafka record timestamp (the producer's create time; the broker's append time on
  a topic configured with `LogAppendTime`), `--from` inclusive, `--to` exclusive. `--to`
  defaults to *now*, read once when the replay starts, so the job is bounded; a `--to` in the
  future is clamped to that *now* (a replay never waits for messages yet to come). Times are
  ISO-8601 (UTC when no zone is given) or ms since the epoch (`varadhi.kafka.dlq.parse_time_ms`).
- **Offsets.** Per partition of every storage topic, the range is the offsets
  `[first offset stamped >= from, first offset stamped >= to)`, exactly as Kafka's
  `offsetsForTimes` defines them (the definition `kafka-consumer-groups --to-datetime` uses);
  where no record is stamped at or after a bound, the bound is the partition's end offset (last
  stable offset, read_committed) when the replay starts. Hazard: create times are producers'
  clocks and need not grow with offsets; a record with a skewed stamp that lies inside the
  offset range is replayed, one outside it is not.
- **Filter.** The subscription's `filter` in force when the replay runs applies: messages it
  does not match are not delivered, only counted (`counts.filtered`; `varadhi.core.filters`).
- **Order.** Per group, messages are delivered in produce order: sorted by origin (storage
  topic index, partition, offset; a group has one partition per storage topic), one request of
  a group in flight at a time. Groups are delivered concurrently. Ungrouped messages (and every
  message of an ungrouped subscription) have no order.
- **Failures.** A retryable outcome is retried in place, after the policy's backoff (and
  Retry-After where the policy honours it), up to `retry.max_attempts`; meanwhile the group
  answers the delivery engine `Wait` and other groups go on. A message that still fails, or
  fails fatally (or is malformed), stops its group's replay: its later messages are not
  delivered (whatever `on_dead_letter` says: a replay has no DLQ to park a message in, and
  going on would deliver the group out of order). Failures are reported, never written to the
  RQ/DLQ. Re-run a replay from the failed message once the endpoint is fixed.
- **Headers.** Every request carries the normal delivery headers (message id as idempotency
  key, group id, attempt, source position: `varadhi.core.group_state.http_headers`) plus
  `X-Varadhi-Replay: <replay id>`, so endpoints can tell replays from live traffic.
- **Refusals** (before any side effect, exit 2): unknown subscription, unparsable time, `--to`
  not after `--from`, `--from` in the future, an endpoint configured with a static
  `X-Varadhi-Replay` header, a range holding no message (`NothingToReplay`), and, for a
  `runtime: library` subscription, a library member that may still deliver
  (`status.ensure_members_idle`: the subscription must be paused and its members reported
  paused, or stopped). A replay orders by group id, whereas a member may order by another key
  (`--ordering-key`, a process option the catalog does not know): a replay next to running
  members could deliver a key's replayed and live messages at once, so the members must hand
  out nothing meanwhile.
- **Result.** The replay id, range, per-storage-topic offset ranges, counts and failed messages
  (with reasons) are returned, printed by the CLI, and recorded in the catalog under
  `operation/<subscription>/replay-<id>`.

Hazards: delivery is at-least-once like live delivery; if Spark re-runs a task (an executor was
lost), that task's groups are replayed again from their first message (the idempotency key is
the message id, as for every delivery). A replay and the live shards deliver concurrently: an
endpoint sees a group's replayed and live messages interleaved, each stream in its own order;
`X-Varadhi-Replay` tells them apart. Each delivery task holds its groups' messages in memory;
the job uses enough tasks to keep that near `consumption.max_messages_per_batch` messages each.
A retry that has come due takes the next connection slot that frees (any request's end), before
any group not yet started or going on, so it is sent about on time (the delivery engine's
`Wait`). A task ends only once each of its groups has delivered or failed, so it waits out every
retry's backoff (at most `retry.max_backoff`, or an hour of Retry-After).

Layout: pure planning (`resolve_range`, `plan_ranges`, `ReplayPlan`), the executor side
(`ReplayGroup`, `deliver_partition`), then the driver's thin I/O
(`resolve_offsets`, `prepare`, `execute`, `run_replay`).
"""

from __future__ import annotations

import json
import math
import random
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pandas as pd
from kafka import TopicPartition
from kafka.errors import KafkaError

from varadhi.core import messages
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.delivery import HttpDeliverer, Outcome, Request, Wait
from varadhi.core.errors import InvalidArgument, KafkaUnavailable, VaradhiError
from varadhi.core.group_state import Entry, request_of
from varadhi.core.policies import RequestShaping, RetryPolicy, SubscriptionSpec
from varadhi.core.retry import decide
from varadhi.core.state_frames import frame_of, nullable_ints
from varadhi.core.state_rows import Kind
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import dlq, subscriptions, topics
from varadhi.kafka.catalog import Catalog, key
from varadhi.kafka.topics import CompositeTopic
from varadhi.spark.batch import BatchContext, entry_from_record
from varadhi.spark.zip_imports import keep_unchanged_zip_directories

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HTTP_REPLAY = messages.HTTP_REPLAY
OPERATION = DocKind.OPERATION
MAX_REPORTED_FAILURES = 100
"""Failed messages listed in a result (all are counted): the result is one catalog record."""


class NothingToReplay(VaradhiError):
    """The range holds no message of the topic. Nothing was delivered or recorded."""

    exit_code = 2

    def __init__(self, topic: str, from_ms: int, to_ms: int):
        super().__init__(
            f"no messages between {format_ms(from_ms)} and {format_ms(to_ms)} on topic {topic}"
        )
        self.topic = topic
        self.from_ms = from_ms
        self.to_ms = to_ms


# -- planning (pure) --------------------------------------------------------------------------


def format_ms(ms: int) -> str:
    """`2026-11-25T10:00:00.000Z`: epoch ms as ISO-8601 UTC."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


@dataclass(frozen=True)
class TimeRange:
    """`[from_ms, to_ms)` by record timestamp; `from_ms < to_ms <= now` when it was resolved."""

    from_ms: int
    to_ms: int

    def describe(self) -> str:
        return f"{format_ms(self.from_ms)} .. {format_ms(self.to_ms)}"


def resolve_range(from_text: str, to_text: str | None, now_ms: int) -> TimeRange:
    """The range `--from`/`--to` ask for, read at `now_ms`, or `InvalidArgument`.

    `--to` defaults to `now_ms` and is clamped to it (a replay is bounded by what exists when it
    starts). Refused: an unparsable time (field `from`/`to`), `--from` after `now_ms` (field
    `from`), and `--to` not after `--from` (field `to`; an empty range is never what was meant).
    A `--from` before the epoch means the epoch (Kafka has no earlier timestamps).
    """
    from_ms = max(dlq.parse_time_ms(from_text, "from"), 0)
    to_ms = now_ms if to_text is None else dlq.parse_time_ms(to_text, "to")
    if from_ms > now_ms:
        raise InvalidArgument(
            f"{format_ms(from_ms)} is in the future (now is {format_ms(now_ms)}); a replay "
            "re-delivers messages that exist",
            field="from",
        )
    if to_ms <= from_ms:
        given = "now" if to_text is None else format_ms(to_ms)
        raise InvalidArgument(
            f"{given} is not after --from {format_ms(from_ms)} (the range is from inclusive, "
            "to exclusive)",
            field="to",
        )
    return TimeRange(from_ms, min(to_ms, now_ms))


@dataclass(frozen=True, order=True)
class PartitionRange:
    """Offsets `[start, end)` of partition `partition` of storage topic `storage_index`."""

    storage_index: int
    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        """Offsets in the range: an upper bound on its messages (transaction markers and
        aborted records also take offsets)."""
        return self.end - self.start


TP = tuple[str, int]  # (storage topic name, partition)


def plan_ranges(
    topic: CompositeTopic,
    starts: Mapping[TP, int | None],
    ends: Mapping[TP, int | None],
    log_ends: Mapping[TP, int],
) -> list[PartitionRange]:
    """Offset ranges of every partition of every storage topic of `topic`, in origin order.

    `starts`/`ends` are Kafka's answers for `from`/`to` (`offsetsForTimes`: the first offset
    stamped at or after the time, None when there is none); None, or an answer beyond the
    partition's end (`log_ends`, the last stable offset), means the partition's end. A missing
    partition in `starts`/`ends` is None too. Empty ranges are kept (`start == end`), so the
    plan names every partition it looked at.
    """
    ranges = []
    for index, st in enumerate(topic.storage_topics):
        for p in range(st.partitions):
            log_end = log_ends[(st.name, p)]
            start = min(_or(starts.get((st.name, p)), log_end), log_end)
            end = min(_or(ends.get((st.name, p)), log_end), log_end)
            ranges.append(PartitionRange(index, st.name, p, start, max(start, end)))
    return ranges


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


@dataclass(frozen=True)
class ReplayPlan:
    """Everything a replay does, decided before it delivers anything."""

    replay_id: str
    subscription: str
    topic: str
    window: TimeRange
    ranges: tuple[PartitionRange, ...]
    tasks: int  # delivery tasks (Spark partitions of the repartition by group)

    @property
    def to_read(self) -> list[PartitionRange]:
        return [r for r in self.ranges if r.size > 0]

    @property
    def empty(self) -> bool:
        return not self.to_read

    @property
    def max_messages(self) -> int:
        return sum(r.size for r in self.ranges)

    def offsets(self) -> dict[str, dict[str, list[int]]]:
        """Per storage topic, the non-empty partitions' `[start, end)`: `{"t.0": {"1": [4, 9]}}`.
        Every storage topic is present, with `{}` when the range has nothing of it."""
        out: dict[str, dict[str, list[int]]] = {}
        for r in self.ranges:
            parts = out.setdefault(r.topic, {})
            if r.size:
                parts[str(r.partition)] = [r.start, r.end]
        return out

    def kafka_options(self) -> dict[str, str]:
        """Options of Spark's Kafka batch source reading exactly the plan's non-empty ranges.

        `assign`, `startingOffsets` and `endingOffsets` name the same partitions (the source
        requires specific offsets for every assigned partition). read_committed: records of
        aborted or still open producer transactions are not replayed, as they are not delivered.
        """
        assign: dict[str, list[int]] = defaultdict(list)
        starting: dict[str, dict[str, int]] = defaultdict(dict)
        ending: dict[str, dict[str, int]] = defaultdict(dict)
        for r in self.to_read:
            assign[r.topic].append(r.partition)
            starting[r.topic][str(r.partition)] = r.start
            ending[r.topic][str(r.partition)] = r.end
        return {
            "assign": json.dumps(assign, sort_keys=True),
            "startingOffsets": json.dumps(starting, sort_keys=True),
            "endingOffsets": json.dumps(ending, sort_keys=True),
            "includeHeaders": "true",
            "kafka.isolation.level": "read_committed",
            "failOnDataLoss": "true",
        }


def delivery_tasks(max_messages: int, parallelism: int, per_task: int) -> int:
    """Tasks for a replay of up to `max_messages`: at least `parallelism`, and enough that a task
    holds about `per_task` messages (a task keeps its groups' messages in memory)."""
    return max(parallelism, math.ceil(max_messages / max(per_task, 1)), 1)


def new_replay_id(now_ms: int) -> str:
    """`<epoch seconds>-<6 hex>`: sortable by start time, unique enough for concurrent runs."""
    return f"{now_ms // 1000}-{uuid.uuid4().hex[:6]}"


def check_endpoint(spec: SubscriptionSpec) -> None:
    """Refuse an endpoint whose static headers set `X-Varadhi-Replay`: static headers win over
    per-request ones, so replays would carry the configured value and live traffic would look
    like a replay."""
    for name, _ in spec.endpoint.headers:
        if name.lower() == HTTP_REPLAY.lower():
            raise InvalidArgument(
                f"subscription {spec.name} sets {name} as a static endpoint header; replays "
                "could not be told from live traffic. Remove it (`subscription apply`) first",
                field="endpoint.headers",
            )


# -- executor side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A message that failed its replay; `not_delivered` later messages of its group stopped."""

    group_id: str | None
    msg_id: str
    origin: str
    source: str
    attempts: int
    status: int | None
    reason: str
    not_delivered: int


class ReplayGroup:
    """Replays one group's messages in origin order (a `varadhi.core.delivery.Stream`).

    Unlike a shard's `GroupRun` it has no queue to park a failure in: a retryable outcome is
    retried in place once `retry.decide`'s due time (`due_ms`) has come. Until then
    `next_request` answers `Wait` with the time left; the engine asks again then and delivers
    other groups meanwhile. A fatal or exhausted outcome (or a malformed message) ends the group
    with a `Failure`; `next_request` then returns None, as it does once every message is
    delivered. `clock` returns ms since the epoch (injectable for tests, like `rng`).
    """

    def __init__(
        self,
        entries: Iterable[Entry],
        policy: RetryPolicy,
        replay_id: str,
        clock: Callable[[], int],
        rng: random.Random,
        shaping: RequestShaping | None = None,
    ):
        self.entries = sorted(entries, key=lambda e: e.origin)
        self.shaping = shaping
        self.policy = policy
        self.replay_id = replay_id
        self.clock = clock
        self.rng = rng
        self.due_ms = 0
        self.delivered = 0
        self.attempts = 0
        self.failure: Failure | None = None

    @property
    def done(self) -> bool:
        return self.failure is not None or not self.entries

    def next_request(self) -> Request | Wait | None:
        while not self.done:
            head = self.entries[0]
            if head.invalid:
                self._fail(head, head.invalid, None)
                return None
            wait_ms = self.due_ms - self.clock()
            if wait_ms > 0:
                return Wait(wait_ms / 1000)
            try:
                request = request_of(head, self.shaping)
                headers = {**request.headers, HTTP_REPLAY: self.replay_id}
                return Request(body=request.body, headers=headers, path=request.path)
            except InvalidArgument as e:  # an id with CR/LF in it, a path not to be built
                head.invalid = f"malformed: {e}"
        return None

    def on_outcome(self, outcome: Outcome) -> None:
        head = self.entries[0]
        head.attempts += 1
        self.attempts += 1
        now = self.clock()
        decision = decide(
            self.policy,
            head.attempts,
            outcome.status,
            outcome.error,
            outcome.retry_after,
            now,
            self.rng,
        )
        if decision.action == "success":
            self.entries.pop(0)
            self.delivered += 1
        elif decision.action == "retry":
            self.due_ms = decision.due_ms if decision.due_ms is not None else now
        else:
            self._fail(head, decision.reason, outcome.status)

    def _fail(self, head: Entry, reason: str, status: int | None) -> None:
        self.failure = Failure(
            group_id=head.group_id,
            msg_id=head.msg_id,
            origin=head.origin.encode(),
            source=head.source,
            attempts=head.attempts,
            status=status,
            reason=reason,
            not_delivered=len(self.entries) - 1,
        )


@dataclass(frozen=True)
class ReplayContext:
    """What executors need: pickled into the mapInPandas closure (no secrets: the delivery
    engine reads the auth header value from the environment)."""

    replay_id: str
    spec: SubscriptionSpec
    mq_indexes: dict[str, int]  # storage topic name -> index
    seed: int


# A replay task's counters: its `stat` row's `stat_<name>` columns.
TASK_COUNTS = ("records", "groups", "delivered", "failed", "not_delivered", "attempts")
RESULT_COLUMNS = [
    ("kind", "string"),  # `Kind.FAILURE` (one per failed group) or `Kind.STAT` (one per task)
    ("group_id", "string"),  # a failure's columns: `Failure`'s fields
    ("msg_id", "string"),
    ("origin", "string"),
    ("source", "string"),
    ("attempts", "int"),
    ("status", "int"),
    ("reason", "string"),
    ("not_delivered", "int"),
    *[(f"stat_{name}", "bigint") for name in TASK_COUNTS],
]
RESULT_SCHEMA = ", ".join(f"{name} {kind}" for name, kind in RESULT_COLUMNS)


def deliver_partition(
    frames: Iterator[pd.DataFrame],
    ctx: ReplayContext,
    engine_factory: Callable[..., Any] = HttpDeliverer,
    clock: Callable[[], int] | None = None,
) -> Iterator[pd.DataFrame]:
    """mapInPandas body over the range's records repartitioned by `group_key` (the rows of
    `varadhi.spark.records.batch_records`). Builds one `ReplayGroup` per group key, delivers them all in one
    `run` of one `HttpDeliverer` (`engine_factory(endpoint, max_in_flight)`), which returns once
    every group has delivered its messages or failed, and yields `RESULT_SCHEMA` rows:
    a `failure` row per failed group and one `stat` row with the task's counts."""
    keep_unchanged_zip_directories()
    clock = clock or _now_ms
    batch_ctx = BatchContext(ctx.spec, ctx.mq_indexes, clock(), ctx.seed)
    by_group: dict[str, list[Entry]] = defaultdict(list)
    records = 0
    for frame in frames:
        for row in frame.to_dict("records"):
            records += 1
            by_group[row["group_key"]].append(entry_from_record(row, batch_ctx))
    rng = random.Random(ctx.seed)
    groups = [
        ReplayGroup(entries, ctx.spec.retry, ctx.replay_id, clock, rng, ctx.spec.endpoint.shaping)
        for entries in by_group.values()
    ]
    if groups:
        with engine_factory(ctx.spec.endpoint, ctx.spec.consumption.max_in_flight) as engine:
            engine.run(groups)
    failures = [g.failure for g in groups if g.failure is not None]
    stat = {
        "records": records,
        "groups": len(groups),
        "delivered": sum(g.delivered for g in groups),
        "failed": len(failures),
        "not_delivered": sum(f.not_delivered for f in failures),
        "attempts": sum(g.attempts for g in groups),
    }
    rows: list[dict[str, Any]] = [{"kind": Kind.FAILURE, **asdict(f)} for f in failures]
    rows.append({"kind": Kind.STAT, **{f"stat_{k}": stat[k] for k in TASK_COUNTS}})
    yield nullable_ints(frame_of(rows, RESULT_COLUMNS), RESULT_COLUMNS)


def _now_ms() -> int:
    return int(time.time() * 1000)


# -- results ----------------------------------------------------------------------------------


# `records` are the messages delivery saw; `filtered` those the subscription's filter dropped.
COUNTS = ("records", "groups", "delivered", "failed", "not_delivered", "attempts", "filtered")


@dataclass
class ReplayResult:
    """What a replay did; `to_dict` is the catalog record and the CLI's JSON output."""

    plan: ReplayPlan
    started_ms: int
    finished_ms: int
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # first MAX_REPORTED_FAILURES
    state: str = "done"  # "done" or "failed" (the job itself failed; `error` says why)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "done" and not self.counts.get("failed")

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        return {
            "kind": OpKind.REPLAY,
            "step": self.state,
            "replay_id": p.replay_id,
            "subscription": p.subscription,
            "topic": p.topic,
            "from_ms": p.window.from_ms,
            "to_ms": p.window.to_ms,
            "from": format_ms(p.window.from_ms),
            "to": format_ms(p.window.to_ms),
            "offsets": p.offsets(),
            "counts": {k: int(self.counts.get(k, 0)) for k in COUNTS},
            "failures": self.failures,
            "failures_not_listed": max(int(self.counts.get("failed", 0)) - len(self.failures), 0),
            "started_ms": self.started_ms,
            "finished_ms": self.finished_ms,
            "error": self.error,
        }


def summarize(rows: pd.DataFrame) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Totals over the tasks' `stat` rows and the failures in origin order, at most
    `MAX_REPORTED_FAILURES` of them (pure)."""
    counts = dict.fromkeys(COUNTS, 0)
    stats = rows[rows["kind"] == Kind.STAT]
    for name in TASK_COUNTS:
        counts[name] += int(stats[f"stat_{name}"].fillna(0).sum())
    failures = []
    for r in rows[rows["kind"] == Kind.FAILURE].to_dict("records"):
        failures.append(
            {
                "group_id": r["group_id"],
                "msg_id": r["msg_id"],
                "origin": r["origin"],
                "source": r["source"],
                "attempts": int(r["attempts"]),
                "status": None if pd.isna(r["status"]) else int(r["status"]),
                "reason": r["reason"],
                "not_delivered": int(r["not_delivered"]),
            }
        )
    failures.sort(key=lambda f: tuple(int(x) for x in f["origin"].split(":")))
    return counts, failures[:MAX_REPORTED_FAILURES]


def render_text(doc: Mapping[str, Any]) -> str:
    """A result document (`ReplayResult.to_dict`) as lines for a terminal (pure)."""
    c = doc["counts"]
    lines = [
        f"replay {doc['replay_id']} of {doc['subscription']} (topic {doc['topic']}): "
        f"{doc['from']} (inclusive) .. {doc['to']} (exclusive)"
    ]
    for storage, parts in doc["offsets"].items():
        shown = ", ".join(f"p{p} {a}..{b}" for p, (a, b) in sorted(parts.items(), key=_by_int))
        lines.append(f"  {storage}: {shown or 'nothing in range'}")
    lines.append(
        f"delivered {c['delivered']} of {c['records']} messages in {c['groups']} groups "
        f"({c['attempts']} attempts); failed {c['failed']}, not delivered behind a failure "
        f"{c['not_delivered']}" + (f"; filtered out {c['filtered']}" if c.get("filtered") else "")
    )
    for f in doc["failures"]:
        lines.append(
            f"  failed: message {f['msg_id']} of group {f['group_id']} at {f['origin']} "
            f"({f['source']}) after {f['attempts']} attempt(s): {f['reason']}; "
            f"{f['not_delivered']} later message(s) of its group not delivered"
        )
    if doc.get("failures_not_listed"):
        lines.append(f"  ... and {doc['failures_not_listed']} more failed groups")
    if doc.get("error"):
        lines.append(f"replay failed: {doc['error']}")
    return "\n".join(lines)


def _by_int(item: tuple[str, Any]) -> int:
    return int(item[0])


# -- driver I/O -------------------------------------------------------------------------------


def resolve_offsets(
    settings, topic: CompositeTopic, window: TimeRange, timeout_s: float = 30
) -> list[PartitionRange]:
    """Ask Kafka (kafka-python, read_committed) for the window's offsets and plan them."""
    try:
        consumer = kafka_clients.consumer(
            settings,
            client_id="varadhi-replay",
            isolation_level="read_committed",
            enable_auto_commit=False,
            request_timeout_ms=int(timeout_s * 1000) + 5000,
        )
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot reach Kafka at {settings.bootstrap}: {e}") from e
    try:
        tps = [
            TopicPartition(st.name, p) for st in topic.storage_topics for p in range(st.partitions)
        ]
        timeout_ms = int(timeout_s * 1000)

        def lookup(ms: int) -> dict[TP, int | None]:
            found = consumer.offsets_for_times(dict.fromkeys(tps, ms), timeout_ms=timeout_ms)
            return {(tp.topic, tp.partition): (o.offset if o else None) for tp, o in found.items()}

        starts, ends = lookup(window.from_ms), lookup(window.to_ms)
        log_ends = {(tp.topic, tp.partition): o for tp, o in consumer.end_offsets(tps).items()}
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot read offsets of {topic.name}: {e}") from e
    finally:
        consumer.close()
    return plan_ranges(topic, starts, ends, log_ends)


def prepare(
    catalog: Catalog,
    name: str,
    from_text: str,
    to_text: str | None = None,
    now_ms: int | None = None,
    parallelism: int | None = None,
) -> ReplayPlan:
    """Check the request and plan it; raises (exit 2) before any side effect: no Spark, no
    delivery, no catalog write. Only reads the catalog and Kafka's offsets."""
    now_ms = _now_ms() if now_ms is None else now_ms
    window = resolve_range(from_text, to_text, now_ms)
    if parallelism is not None and (isinstance(parallelism, bool) or parallelism < 1):
        raise InvalidArgument(f"must be at least 1, got {parallelism}", field="parallelism")
    snapshot = catalog.snapshot()
    sub = subscriptions.from_snapshot(snapshot, name)
    if sub.spec.runtime == "library":
        from varadhi.ops import status  # the driver's check; executors import this module too

        status.ensure_members_idle(catalog, sub, "replay")
    check_endpoint(sub.spec)
    HttpDeliverer(sub.spec.endpoint, 1).close()  # validates the endpoint and its auth_env here
    topic = topics.from_snapshot(snapshot, sub.spec.topic)
    ranges = resolve_offsets(catalog.settings, topic, window)
    consumption = sub.spec.consumption
    plan = ReplayPlan(
        replay_id=new_replay_id(now_ms),
        subscription=name,
        topic=topic.name,
        window=window,
        ranges=tuple(ranges),
        tasks=delivery_tasks(
            sum(r.size for r in ranges),
            parallelism if parallelism is not None else sub.shard_count * consumption.concurrency,
            consumption.max_messages_per_batch,
        ),
    )
    if plan.empty:
        raise NothingToReplay(topic.name, window.from_ms, window.to_ms)
    return plan


def execute(spark: SparkSession, catalog: Catalog, plan: ReplayPlan) -> ReplayResult:
    """Read the plan's ranges with Spark, deliver on executors, record the result in the catalog
    (`operation/<subscription>/replay-<id>`) and return it.

    The subscription is read again so that the endpoint, retry policy and filter are the current
    ones: messages the filter does not match are not delivered, only counted (`filtered`).
    If the Spark job fails, the result is recorded with state `failed` and a `VaradhiError`
    raised (some messages may have been delivered). If the range's offsets held only aborted or
    open transactional records, nothing was read: `NothingToReplay`, nothing recorded.
    """
    from varadhi.spark.records import (  # the shard's records and filter
        batch_records,
        filter_records,
    )

    started = _now_ms()
    snapshot = catalog.snapshot()
    sub = subscriptions.from_snapshot(snapshot, plan.subscription)
    check_endpoint(sub.spec)
    mq = topics.from_snapshot(snapshot, plan.topic)
    ctx = ReplayContext(
        replay_id=plan.replay_id,
        spec=sub.spec,
        mq_indexes={st.name: i for i, st in enumerate(mq.storage_topics)},
        seed=zlib.crc32(plan.replay_id.encode()),
    )
    reader = spark.read.format("kafka").options(
        **kafka_clients.spark_source_options(catalog.settings)
    )
    for option, value in plan.kafka_options().items():
        reader = reader.option(option, value)
    result = ReplayResult(plan, started, started)
    try:
        records, filtered = filter_records(batch_records(reader.load(), sub, mq), sub.spec.filter)
        rows = (
            records.repartition(plan.tasks, "group_key")
            .mapInPandas(lambda frames: deliver_partition(frames, ctx), RESULT_SCHEMA)
            .toPandas()
        )
    except Exception as e:  # Spark, Py4J or Kafka: record what happened, then fail
        error = catalog.settings.kafka.redact(f"{type(e).__name__}: {e}")
        result.state, result.error = "failed", error[:2000]
        result.finished_ms = _now_ms()
        record(catalog, result)
        raise VaradhiError(f"replay {plan.replay_id} failed: {result.error}") from e
    result.counts, result.failures = summarize(rows)
    if filtered is not None:  # computed by the job above, which succeeded
        result.counts["filtered"] = int(filtered.get["filtered"])
    result.finished_ms = _now_ms()
    if result.counts["records"] == 0 and result.counts["filtered"] == 0:
        raise NothingToReplay(plan.topic, plan.window.from_ms, plan.window.to_ms)
    record(catalog, result)
    return result


def record(catalog: Catalog, result: ReplayResult) -> None:
    """Write the result under `operation/<subscription>/replay-<id>`."""
    doc = result.to_dict()
    name = key(OPERATION, f"{result.plan.subscription}/replay-{result.plan.replay_id}")
    catalog.mutate(lambda _snapshot: {name: doc})


def replays(snapshot, name: str) -> dict[str, dict[str, Any]]:
    """The subscription's recorded replays: `replay-<id>` -> result document."""
    prefix = f"{name}/replay-"
    return {
        k[len(name) + 1 :]: v for k, v in snapshot.items(OPERATION).items() if k.startswith(prefix)
    }


def run_replay(
    catalog: Catalog,
    name: str,
    from_text: str,
    to_text: str | None = None,
    spark: SparkSession | Callable[[], SparkSession] | None = None,
    parallelism: int | None = None,
    on_plan: Callable[[ReplayPlan], None] | None = None,
) -> ReplayResult:
    """`prepare` then `execute`. `spark` is a session or a factory called only once the request
    passed every check (default: `varadhi.spark.session.get_spark`, the active session or a local one),
    so a refused replay never starts Spark. `on_plan` is called with the accepted plan before
    that (the replay job starts its metrics there)."""
    plan = prepare(catalog, name, from_text, to_text, parallelism=parallelism)
    if on_plan is not None:
        on_plan(plan)
    if spark is None:
        from varadhi.spark.session import get_spark

        session = get_spark(f"varadhi-replay-{name}")
    elif hasattr(spark, "read"):  # a session (SparkSession is not callable, but be explicit)
        session = spark
    else:
        session = spark()
    return execute(session, catalog, plan)
