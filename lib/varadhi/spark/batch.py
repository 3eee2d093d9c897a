"""Executor side of a shard's micro-batch: turn records into group queues, deliver, report.

A micro-batch runs in one or two Spark jobs (their bodies are the functions here: phase 1 a
`mapInArrow` function, which reads the records' Arrow batches without pandas, phase 2 a
`mapInPandas` one):

1. `deliver_records` runs on the Kafka source's partitions, coalesced into the shard's
   `concurrency` tasks (no shuffle). A group's main-topic records all sit in one partition, in
   offset order, so a group with nothing pending (a *healthy* group, the common case) is
   delivered right there. When some groups have pending state, records that need more than
   their partition are *forwarded* instead (kind `fwd`: the record as a state row, with its
   body): retry-queue records and records of those groups. Ungrouped, a message is a group of
   its own: an RQ record whose entry just waits for it is merged with that entry right here
   (`ForwardRule.of`: the entries travel with the tasks), so a batch that reads retries is
   one job, unless it also needs parked bodies.
2. `process_partition` runs over the forwarded rows plus the parked bodies their groups need
   (`held` rows of the state table), repartitioned by group key, and merges them with the
   groups' pending state (`varadhi.core.group_state.merge`). The driver builds its input from what
   phase 1 returned, so it knows which parked bodies to send without a pass over the batch.

The driver plans the two jobs with `deliver_batch`: which records phase 1 forwards
(`ForwardRule`), which parked bodies travel with phase 1's tasks and which go to phase 2. It
reads the shard's state only through the `HeldState` port and runs the jobs on an `Executors`
port (Spark's executors in a shard: `varadhi.spark.shard.micro_batch.SparkExecutors`).

A batch that starts with no pending group, or an ungrouped one whose pending groups only wait
for their RQ records (no parked retry due, no main-topic record of a pending group), is phase 1
alone. In both phases a task journals the origins of the messages its endpoint accepted
(`BatchContext.journal`, `varadhi.spark.journal`), and in a batch run again after a crash it sends
none of those the crashed run journaled (`BatchContext.replayed`). Both phases yield rows of `state_rows.RESULT_SCHEMA` (the kinds and
columns are described in `varadhi.core.state_rows`):

- `pending` rows: the new state of every group touched;
- `touched` rows: one per touched group that had state, so the driver drops its old rows;
- `out` rows: records to write to the RQ or DLQ;
- `done` rows: delivered ids, for the de-duplication window;
- one `stat` row per task with its counters (`state_rows.TaskStats`, in `stat_*` columns), with
  what its endpoint answered (`http_counts`: responses per status, errors per kind, a latency
  histogram).

Input is binary-safe: keys and headers in any form are read through their text forms
(`varadhi.core.record_ids`); a record that cannot be delivered (no value, oversized value) never
raises: it becomes an entry that is dead-lettered at once with the reason, in its group's order.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Protocol

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from varadhi.core import messages as m
from varadhi.core.delivery import LATENCY_BOUNDS_MS, DeliveryStats, HttpDeliverer
from varadhi.core.group_state import Entry, GroupRun, RunCounts, merge
from varadhi.core.policies import SubscriptionSpec
from varadhi.core.rate_limit import TaskPace
from varadhi.core.retry import linger_ms
from varadhi.core.state_frames import frame_of, normalise, state_rows
from varadhi.core.state_rows import (
    RESULT_COLUMNS,
    Kind,
    StateRow,
    TaskStats,
    done_row,
    entry_of,
    retry_state,
    stat_row,
    state_row,
    touched_row,
)
from varadhi.core.trace import Tracer
from varadhi.kafka.trace import TraceTarget, TraceWriter
from varadhi.spark.journal import (
    LOOKBACK_MS,
    Accepted,
    JournalTarget,
    JournalWriter,
    joined,
    read_on_retry,
)
from varadhi.spark.zip_imports import keep_unchanged_zip_directories

# The column with the text form of a record's Kafka key (`varadhi.core.record_ids`), which the
# records carry only when the endpoint sends the key in a header (`varadhi.spark.records`,
# `varadhi.core.request_shaping`).
KEY_TEXT = "key_text"


@dataclass(frozen=True)
class BatchContext:
    """What executors need to know; pickled into the tasks' closures (no secrets: the auth
    header value is read from the environment by the delivery engine)."""

    spec: SubscriptionSpec
    mq_indexes: dict[str, int]  # main-topic storage name -> index
    now_ms: int
    seed: int
    dedup: bool = False  # report delivered ids (`Kind.DONE`) for the de-duplication window
    max_out_bytes: int | None = None  # the largest record the RQ takes (GroupRun.max_out_bytes)
    # Where the tasks journal accepted messages (`varadhi.spark.journal`); None: not journaled.
    journal: JournalTarget | None = None
    # A replayed batch: origins a crashed run of it already delivered (sent no more).
    replayed: Accepted | None = None
    # How fast each delivery task may send (`varadhi.core.rate_limit`); None: no limit.
    pace: TaskPace | None = None
    # Where the tasks write the delivery trace (`varadhi.kafka.trace`); None: not traced.
    trace: TraceTarget | None = None


def entry_from_record(row: dict, ctx: BatchContext) -> Entry:
    """A record row with its Kafka headers in column `kheaders` (Spark's header structs, as
    `mapInPandas` hands them) as an Entry (`record_entry`)."""
    pairs = () if row["kheaders"] is None else ((h["key"], h["value"]) for h in row["kheaders"])
    return record_entry(row, m.headers_to_dict(pairs), ctx)


def record_entry(row: dict, headers: dict[str, str], ctx: BatchContext) -> Entry:
    """An `mq` or `rq` record as an Entry; `headers` are its Kafka headers as
    `messages.headers_to_dict` makes them (the Entry takes the dict). The row's `group_id` and
    `msg_id` are the text forms of the record's ids (`varadhi.core.record_ids`, computed by Spark),
    so no key or header bytes can fail here: a non-UTF-8 key is a group like any other. A
    record that cannot be delivered (no value, a value over `max_message_bytes`) gets `invalid`
    set, so its run dead-letters it in order without calling the endpoint.

    A main-topic row with a `KEY_TEXT` (only while the endpoint has `key_header`) puts the key's
    text form into header `messages.H_KEY`, which the message's state rows and RQ/DLQ copies
    keep; a producer's own `varadhi-key` is dropped with the other control headers."""
    topic, partition, offset = row["topic"], int(row["partition"]), int(row["offset"])
    source = f"{topic}/{partition}/{offset}"
    msg_id = row["msg_id"]
    group_id = row["group_id"] if isinstance(row["group_id"], str) else None
    if row["kind"] == Kind.MQ:
        headers = m.control_free(headers)  # what only a shard writes is never a message's
        key_text = row.get(KEY_TEXT)
        if isinstance(key_text, str):  # null: the record has no key
            headers[m.H_KEY] = key_text
    # RQ and DLQ copies carry the ids' text forms, which read back to the same group key.
    if m.H_MSG_ID in headers:
        headers[m.H_MSG_ID] = msg_id
    if m.H_GROUP_ID in headers:
        headers[m.H_GROUP_ID] = group_id or ""
    value = None if row["value"] is None else bytes(row["value"])
    problem = None
    if value is None:
        problem = "malformed: no value"
    elif len(value) > ctx.spec.max_message_bytes:
        problem = f"malformed: value of {len(value)} bytes exceeds {ctx.spec.max_message_bytes}"

    entry = Entry(
        origin=m.Origin(ctx.mq_indexes.get(topic, -1), partition, offset),
        msg_id=msg_id,
        group_id=group_id,
        location="new",
        value=value,
        headers=headers,
        source=source,
        invalid=problem,
    )
    if row["kind"] == Kind.RQ:
        try:
            entry.origin, entry.attempts, entry.due_ms = retry_state(headers)
        except (KeyError, ValueError):
            # Not written by a shard (or damaged): it matches no pending entry, so `merge`
            # drops it as a stale duplicate instead of guessing where it belongs.
            entry.origin, entry.attempts = m.Origin(-1, partition, offset), -1
        entry.location = "rq"
        entry.invalid = None
    return entry


def record_rows(batch: pa.RecordBatch) -> Iterator[tuple[dict, dict[str, str]]]:
    """A `mapInArrow` batch of records (`varadhi.spark.records.DELIVERY_COLUMNS`) as (row, headers) pairs,
    in order: the row's values as Python objects (`column_values`) and its Kafka headers (column
    `kheaders`) as `messages.headers_to_dict` makes them (`header_dicts`). Converts column by
    column: several times cheaper than pandas' or Arrow's value-by-value conversion."""
    names = [name for name in batch.schema.names if name != "kheaders"]
    columns = [column_values(batch.column(name)) for name in names]
    headers = header_dicts(batch.column("kheaders"))
    for values, record_headers in zip(zip(*columns, strict=True), headers, strict=True):
        yield dict(zip(names, values, strict=True)), record_headers


def column_values(array: pa.Array) -> list:
    """An Arrow column as Python values (str, bytes, int; None for null), converted in bulk.
    Hazard: a null in an integer column would come back as NaN (the record columns it is used
    on have none)."""
    return array.to_numpy(zero_copy_only=False).tolist()


def header_dicts(column: pa.ListArray) -> list[dict[str, str]]:
    """Each record's Kafka headers (a list<struct<key: string, value: binary>> column) as
    `messages.headers_to_dict` makes them: a null value is "", a repeated name keeps its first
    value, a value that is not UTF-8 is `b64:` + base64. The values of the batch are decoded
    at once; a record with a repeated name, or every record of a batch with a value that is
    not UTF-8 (rare), goes through `headers_to_dict` itself."""
    offsets = column.offsets.to_numpy().tolist()  # positions in `column.values`, slice or not
    entries = column.values
    names = column_values(entries.field("key"))
    raw = entries.field("value")
    try:
        texts = column_values(pc.cast(pc.fill_null(raw, b""), pa.string()))
    except pa.ArrowInvalid:  # some value is not UTF-8
        texts = None
    nulls = column.is_null().to_numpy(zero_copy_only=False).tolist() if column.null_count else None
    raw_values: list | None = None
    out: list[dict[str, str]] = []
    for i, (start, end) in enumerate(pairwise(offsets)):
        if nulls is not None and nulls[i]:
            out.append({})
            continue
        if texts is not None:
            headers = dict(zip(names[start:end], texts[start:end], strict=True))
            if len(headers) == end - start:
                out.append(headers)
                continue
        if raw_values is None:
            raw_values = column_values(raw)
        out.append(m.headers_to_dict(zip(names[start:end], raw_values[start:end], strict=True)))
    return out


def deliver_records(
    batches: Iterator[pa.RecordBatch],
    ctx: BatchContext,
    forward: ForwardRule,
    local: dict[str, list[StateRow]] | None = None,
    parked: dict[str, list[StateRow]] | None = None,
    first_task: bool | None = None,
) -> Iterator[pa.RecordBatch]:
    """Phase 1 (a `mapInArrow` function) over one task's records (whole Kafka partitions, or a
    repartition of them by group key: either way all of a group's records; the columns of
    `varadhi.spark.records.DELIVERY_COLUMNS`): deliver the groups that need nothing else, forward the
    rest (see the module docstring). Retry-queue ticks are dropped here.

    Ungrouped only (`ForwardRule.local`, `ForwardRule.parked`): `local` holds the pending rows
    of the groups whose RQ records this task merges itself, and of the `parked` groups;
    `parked` the parked bodies (`held` rows) of those, which the job's first task (partition
    0; `first_task` overrides, for tests) delivers with their state, every other task
    forwarding their records. A main-topic record of a group this task merges is a replay when
    its origin is pending (dropped here, as `merge` would) and is forwarded otherwise."""
    keep_unchanged_zip_directories()  # before the clock: a worker's first task reads them once
    started = time.monotonic()
    counts = RunCounts()
    records = routed = forwarded = 0
    rows: list[StateRow | dict] = []
    candidates: dict[str, list[Entry]] = defaultdict(list)
    if parked and (_partition_id() == 0 if first_task is None else first_task):
        forward = forward.taking_parked()
        for key, held in parked.items():
            candidates[key].extend(entry_of(r) for r in held)
    here = forward.local
    local = {k: v for k, v in (local or {}).items() if k in here}
    pending_at = {k: {r.origin for r in v} for k, v in local.items()}
    for batch in batches:
        for row, headers in record_rows(batch):
            records += 1
            routed += row["kind"] == Kind.MQ
            if row["kind"] == Kind.RQ and m.H_TICK in headers:
                continue
            e = record_entry(row, headers, ctx)
            key = row["group_key"]
            if key in pending_at and row["kind"] == Kind.MQ and e.origin in pending_at[key]:
                counts.duplicates += 1
            elif forward.applies(row["kind"], key):
                rows.append(state_row(Kind.FWD, key, e))
                forwarded += 1
            else:
                candidates[key].append(e)
    groups, handed, http = _deliver(candidates, local, ctx, counts, rows, forward.hand_over)
    stats = TaskStats.of(
        counts,
        time.monotonic() - started,
        http,
        records=records,
        routed=routed,
        forwarded=forwarded + handed,
        groups=groups,
    )
    rows.append(stat_row(stats))
    yield arrow_batch(rows, RESULT_COLUMNS)


def process_partition(
    frames: Iterator[pd.DataFrame], ctx: BatchContext, pending: dict[str, list[StateRow]]
) -> Iterator[pd.DataFrame]:
    """Phase 2 over forwarded (`fwd`) and parked (`held`) rows brought together by group key.
    `pending` maps group key -> that group's pending state rows (no bodies)."""
    keep_unchanged_zip_directories()
    started = time.monotonic()
    counts = RunCounts()
    rows: list[StateRow | dict] = []
    candidates: dict[str, list[Entry]] = defaultdict(list)
    for frame in frames:
        for row in state_rows(frame):
            candidates[row.group_key].append(entry_of(row))
    groups, _, http = _deliver(candidates, pending, ctx, counts, rows)
    rows.append(stat_row(TaskStats.of(counts, time.monotonic() - started, http, groups=groups)))
    yield frame_of(rows, RESULT_COLUMNS)


# The most pending entries phase 1's tasks get for ungrouped RQ records (`ForwardRule.of`):
# each task unpickles them, about 0.3 KiB each.
MAX_LOCAL_ENTRIES = 10_000
# The most bytes of parked bodies they get (`parked_within`).
MAX_PARKED_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class ForwardRule:
    """Which records phase 1 forwards to phase 2: retry-queue records (`rq`) and records of the
    `blocked` groups (those with pending state), but not the RQ records of the `local` groups,
    which phase 1 merges with their pending state itself (their main-topic records are
    forwarded)."""

    rq: bool = False
    blocked: frozenset[str] = frozenset()
    local: frozenset[str] = frozenset()
    parked: frozenset[str] = frozenset()  # of `blocked`: merged by the job's first task
    # Phase 2 runs anyway: phase 1 forwards the groups still waiting for a retry in place once
    # its task has nothing else to send, instead of lingering for them (`_deliver`).
    hand_over: bool = False

    @classmethod
    def of(
        cls,
        pending: dict[str, list[StateRow]],
        grouped: bool,
        due: Iterable[str] = (),
        max_local: int = MAX_LOCAL_ENTRIES,
    ) -> ForwardRule:
        """The rule for a batch that starts with `pending` (pure); `due`: the groups whose
        parked head is due (`varadhi.spark.shard.stats.due_heads`).

        Grouped: every RQ record and every record of a pending group is forwarded (a group's RQ
        record and its main-topic records sit in different partitions, so in different tasks).
        Phase 2 runs for what phase 1 forwards, so phase 1 also hands over (`hand_over`) the
        groups still waiting for a retry in place when its task runs out of work, instead of
        lingering for them: phase 2 goes on waiting, and a batch lingers once, not in both.

        Ungrouped, a message is a group of its own (its key is its id), so its RQ record needs
        nothing but its own pending entries: a group whose entries all wait for their RQ records
        (`rq`) is `local`, and phase 1 merges its RQ record wherever it is read, with those
        entries shipped to the tasks (all of a key's RQ records sit in one RQ partition, so in
        one task). An RQ record of no pending group is a stale duplicate that phase 1 drops
        itself. A group whose parked head is due and that holds no dead letter is `parked`:
        its bodies travel with the tasks and the job's first task delivers it (the others
        forward its records). Other groups with parked bodies (`held`) or dead letters are
        forwarded as grouped ones are. A main-topic record of a local group is forwarded: it
        may sit in another task than the group's RQ record, and phase 2 goes on from phase
        1's result (`chained`).

        Every task gets the local entries, so they are bounded: beyond `max_local` entries
        (an endpoint outage sends every message to the RQ), the groups due first are local
        (RQ records come back about in the order they were written) and the others are
        forwarded, as before."""
        if not pending:
            return cls()
        if grouped:
            return cls(rq=True, blocked=frozenset(pending), hand_over=True)
        waiting = [
            (min(r.due_ms or 0 for r in rows), k, len(rows))
            for k, rows in pending.items()
            if rows and all(r.location == "rq" for r in rows)
        ]
        if sum(n for *_, n in waiting) > max_local:
            waiting.sort()
            kept = 0
            while kept < len(waiting) and max_local >= waiting[kept][2]:
                max_local -= waiting[kept][2]
                kept += 1
            waiting = waiting[:kept]
        local = frozenset(k for _, k, _ in waiting)
        parked = frozenset(
            k for k in due if k in pending and all(r.location != "dlq" for r in pending[k])
        )
        return cls(blocked=frozenset(pending) - local, local=local, parked=parked)

    def taking_parked(self) -> ForwardRule:
        """The rule of the task that delivers the `parked` groups: they are local to it."""
        return replace(
            self,
            blocked=self.blocked - self.parked,
            local=self.local | self.parked,
            parked=frozenset(),
        )

    def applies(self, kind: str, group_key: str) -> bool:
        if group_key in self.local:
            return kind != Kind.RQ
        return (self.rq and kind == Kind.RQ) or group_key in self.blocked


def by_group(frame: pd.DataFrame) -> dict[str, list[StateRow]]:
    """A frame's rows as `StateRow`s by group key, in order (pure)."""
    out: dict[str, list[StateRow]] = {}
    for row in state_rows(frame):
        out.setdefault(row.group_key, []).append(row)
    return out


def parked_within(
    bodies: dict[str, list[StateRow]], forward: ForwardRule, max_bytes: int = MAX_PARKED_BYTES
) -> tuple[dict[str, list[StateRow]], ForwardRule]:
    """The parked groups' bodies that phase 1's tasks get, at most `max_bytes` of them in the
    order of `bodies` (every task unpickles them), and the rule with only those `parked` (pure).
    The others stay blocked and due, so phase 2 delivers them as before."""
    kept: dict[str, list[StateRow]] = {}
    size = 0
    for key, rows in bodies.items():
        size += sum(len(r.value or b"") for r in rows)
        if size > max_bytes:
            break
        kept[key] = rows
    return kept, replace(forward, parked=frozenset(kept) & forward.parked)


def ran_parked(first: pd.DataFrame, forward: ForwardRule) -> set[str]:
    """The `parked` groups phase 1 delivered (pure): those it left a `touched` row for. The
    others (no task computed partition 0) go to phase 2 as any parked group does."""
    return set(forward.parked) & set(first.loc[first["kind"] == Kind.TOUCHED, "group_key"])


def chained(
    first: pd.DataFrame, keys: set[str], pending: dict[str, list[StateRow]]
) -> tuple[pd.DataFrame, dict[str, list[StateRow]]]:
    """Phase 2's state of the groups `keys` (those of its input) and phase 1's result (without
    forwarded rows) minus what phase 2 replaces (pure). A group phase 1 already ran (a `local`
    group: it left a `touched` row) goes on from phase 1's result: its `pending` rows there
    (bodies included) are its state in phase 2 and leave phase 1's result, whose `touched` row
    stays (the group's old rows go). Any other group's state is its `pending` one."""
    ran = keys & set(first.loc[first["kind"] == Kind.TOUCHED, "group_key"])
    state = {k: pending[k] for k in keys - ran if k in pending}
    if not ran:
        return first, state
    again = (first["kind"] == Kind.PENDING) & first["group_key"].isin(ran)
    for key, rows in by_group(first[again]).items():
        state.setdefault(key, []).extend(rows)
    return first[~again], state


# -- the plan of one micro-batch's jobs (driver side) ----------------------------------------


class HeldState(Protocol):
    """What the plan reads of the shard's GroupState copy (`varadhi.spark.state_store.StateStore`,
    the batch-commit protocol's state port): which groups have parked bodies, and those rows."""

    def held_groups(self) -> set[str]: ...

    def held_rows(self, keys: Iterable[str]) -> pd.DataFrame: ...


class Executors(Protocol):
    """Where a micro-batch's tasks run: Spark's executors (`varadhi.spark.shard.micro_batch.
    SparkExecutors`) or, for a test, this process. Both return every result row
    (`state_rows.RESULT_SCHEMA`) as one frame."""

    def first(
        self,
        ctx: BatchContext,
        forward: ForwardRule,
        local: dict[str, list[StateRow]],
        parked: dict[str, list[StateRow]] | None,
    ) -> pd.DataFrame:
        """Phase 1: `deliver_records` over the batch's records, in `concurrency` tasks."""
        ...

    def second(
        self, rows: pd.DataFrame, ctx: BatchContext, involved: dict[str, list[StateRow]]
    ) -> pd.DataFrame:
        """Phase 2: `process_partition` over `rows` (`STATE_SCHEMA`), by group key."""
        ...


def deliver_batch(
    ctx: BatchContext,
    state: HeldState,
    pending: dict[str, list[StateRow]],
    due_groups: list[str],
    executors: Executors,
) -> pd.DataFrame:
    """Deliver one micro-batch in one or two jobs (module docstring) and return every result
    row. Phase 1 runs over the batch's records; when groups have pending state, its forwarded
    rows come back here, are joined by the parked bodies their groups (and groups whose parked
    head is due) need, and go to phase 2. Reads the state only through `state`."""
    # Ungrouped: RQ records and due parked retries are merged in phase 1 (`ForwardRule.of`).
    forward = ForwardRule.of(pending, ctx.spec.grouped, due_groups)
    parked = None
    if forward.parked:
        parked, forward = parked_within(by_group(state.held_rows(forward.parked)), forward)
    local = {k: pending[k] for k in forward.local | forward.parked}
    first = executors.first(ctx, forward, local, parked)
    if not pending:
        return first
    is_fwd = first["kind"] == Kind.FWD
    forwarded = first[is_fwd]
    held = state.held_rows(
        (set(due_groups) - ran_parked(first, forward))
        | (set(forwarded["group_key"]) & state.held_groups())
    )
    if not len(forwarded) and not len(held):
        return first
    rows = normalise(pd.concat([normalise(forwarded), held]))  # in the state's column types
    # Only the state of the groups that take part travels with the tasks; a group phase 1 ran
    # already goes on from its result there (`chained`).
    first, involved = chained(first[~is_fwd], set(rows["group_key"]), pending)
    return pd.concat([first, executors.second(rows, ctx, involved)], ignore_index=True)


def _attempt() -> int:
    """This task's attempt number within its batch (0 outside Spark, and on a first attempt)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return 0 if context is None else context.attemptNumber()


def _partition_id() -> int:
    """The Spark partition this task computes (0 outside Spark)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return 0 if context is None else context.partitionId()


def _deliver(
    candidates: dict[str, list[Entry]],
    pending: dict[str, list[StateRow]],
    ctx: BatchContext,
    counts: RunCounts,
    rows: list[StateRow | dict],
    hand_over: bool = False,
) -> tuple[int, int, dict[str, int]]:
    """Merge each group's candidates with its pending state, deliver all groups concurrently
    (in order within each), and append the result rows to `rows`. Returns how many groups ran,
    how many entries it handed over (below) and what the endpoint answered (`http_counts`).

    `hand_over` (phase 1 of a batch whose second job runs anyway, `ForwardRule.hand_over`): the
    task does not linger for its last retries in place; a group still waiting for one once the
    task has nothing else to send is forwarded as it is (`fwd` rows: the head with its attempts
    and due time, and the messages behind it, with their bodies), and phase 2 goes on waiting
    (`group_state.in_place_retry`)."""
    rng = random.Random(ctx.seed)
    journal = JournalWriter(ctx.journal) if ctx.journal is not None and candidates else None
    replayed = ctx.replayed
    if journal is not None and _attempt() > 0:  # an earlier attempt of this task died
        retried = read_on_retry(ctx.journal, ctx.now_ms - LOOKBACK_MS)
        replayed = joined(ctx.replayed, retried)
    traces = TraceWriter(ctx.trace) if ctx.trace is not None and candidates else None
    tracer = None if traces is None else Tracer(traces.add, ctx.trace.shard, _now_ms)
    runs: list[tuple[str, GroupRun]] = []
    answered: DeliveryStats | None = None
    for key, found in candidates.items():
        state = pending.get(key)
        old = [entry_of(r) for r in state] if state else []
        queue = merge(old, found, counts)
        run = GroupRun(
            queue,
            ctx.spec.retry,
            ctx.spec.on_dead_letter,
            _now_ms,
            rng,
            counts,
            ctx.max_out_bytes,
            replayed=replayed,
            journal=journal,
            blocked=ctx.spec.blocked,
            hand_over=hand_over,
            shaping=ctx.spec.endpoint.shaping,
            tracer=tracer,
        )
        runs.append((key, run))
    try:
        if runs:
            with HttpDeliverer(
                ctx.spec.endpoint, ctx.spec.consumption.max_in_flight, ctx.spec.delivery
            ) as http:
                answered = http.run(
                    (run for _, run in runs),
                    linger_s=0.0 if hand_over else linger_ms(ctx.spec.retry) / 1000,
                    # Kafka away or slow: no delivery the journal could not record
                    hold=journal.behind if journal is not None else None,
                    pacer=ctx.pace.pacer() if ctx.pace is not None else None,
                )
        for _, run in runs:  # a blocked group over its limit spills now, traced with the rest
            if not run.handed_over:
                run.remaining()
    finally:
        if journal is not None:  # the last accepted messages, waiting for the broker
            journal.close()
        if traces is not None:
            traces.close()

    handed = 0
    for key, run in runs:
        if key in pending:
            rows.append(touched_row(key))
        if run.handed_over:  # its queue as it is, bodies included (`hand_over`)
            rows.extend(state_row(Kind.FWD, key, e) for e in run.entries)
            handed += len(run.entries)
        else:
            for e in run.remaining():
                if e.location == "held" and e.value is None and e.invalid is None:
                    raise AssertionError(f"group {key}: held entry {e.msg_id} has no body")
                rows.append(state_row(Kind.PENDING, key, e))
        for out in run.outs:
            rows.append(state_row(Kind.OUT, key, out.entry, target=out.target))
        if ctx.dedup:
            now = _now_ms()
            rows.extend(done_row(dedup_id(e), now) for e in run.delivered)
    return len(runs), handed, http_counts(answered)


def http_counts(stats: DeliveryStats | None) -> dict[str, int]:
    """A task's endpoint answers as flat integer counters (pure; `TaskStats.http`), so the
    driver's sum of the tasks' counters adds them up: `status_<code>` (responses per HTTP status),
    `error_<kind>` (requests without a response per error kind), `latency_le_<ms>` and
    `latency_le_inf` (requests per latency bucket of `LATENCY_BOUNDS_MS`, not cumulative, empty
    buckets left out) and `latency_sum_us` (their total time). Empty without a run."""
    if stats is None:
        return {}
    bounds = [f"latency_le_{b}" for b in LATENCY_BOUNDS_MS] + ["latency_le_inf"]
    return {
        **{f"status_{k}": v for k, v in stats.by_status.items()},
        **{f"error_{k}": v for k, v in stats.errors.items()},
        **{b: n for b, n in zip(bounds, stats.latency_ms, strict=True) if n},
        "latency_sum_us": round(stats.latency_sum_ms * 1000),
    }


# Spark's Arrow type of each column type the executors return (`pyspark.sql.pandas.types`, with
# `spark.sql.execution.arrow.useLargeVarTypes` off, its default).
_ARROW_TYPES = {
    "string": pa.string(),
    "binary": pa.binary(),
    "int": pa.int32(),
    "bigint": pa.int64(),
    "double": pa.float64(),
    "map<string,bigint>": pa.map_(pa.string(), pa.int64()),
}


def arrow_batch(rows: list, columns: list[tuple[str, str]]) -> pa.RecordBatch:
    """Rows (`StateRow`s, or dicts of column values: a column a dict lacks is null) as the
    Arrow batch a `mapInArrow` function returns for Spark schema `columns`. Hazard: Spark reads
    the batch by these exact types, so a column type missing from `_ARROW_TYPES` is a KeyError
    here, not a wrong read there."""
    schema = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in columns])
    return pa.RecordBatch.from_pylist(
        [r._asdict() if isinstance(r, tuple) else r for r in rows], schema=schema
    )


def dedup_id(e: Entry) -> str:
    """The producer's message id, else the payload's SHA-256 (as `varadhi.spark.dedup.dedup_id`)."""
    if e.headers.get(m.H_MSG_ID):
        return e.headers[m.H_MSG_ID]
    return hashlib.sha256(e.value or b"").hexdigest()


def _now_ms() -> int:
    return int(time.time() * 1000)
