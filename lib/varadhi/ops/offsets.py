"""Offset reset: move a stopped subscription's shards to other positions of MQ, RQ or DLQ.

The flags mirror `kafka-consumer-groups --reset-offsets`. The main queue can be rewound and
fast-forwarded; the RQ and DLQ only fast-forwarded (a rewind would re-deliver retries and
dead letters out of their groups' order). A rewind from T_n to T_k is refused when some storage
topic in T_k..T_n cannot be sharded evenly by the current shard count; the message names the
shard count that would allow it.

Executing a reset (shards stopped):
1. the plan is recorded in the catalog (`operation/<sub>/offset-reset`, step `advancing-state`)
   with absolute positions: every shard's new reader layout, the DLQ's new start, and every
   partition's move (from, to);
2. for RQ/DLQ, GroupState is advanced: entries that wait for a skipped RQ record, or that block
   their group on a skipped DLQ record, are removed, so no group stays blocked on a message that
   will never come back; so are, for the RQ, the retries a shard read back before they were due
   and holds (`held`, read from a record before the new position: `read_back_passed`), which
   the plan's moves do not count as skipped (the shard's position is past their records);
3. in one catalog write: the recorded generation (fresh checkpoints and Delta idempotency ids:
   DESIGN hazard 7), every shard's reader layout with explicit starting offsets, and for the DLQ
   the new start of what `dlq list`/`unsideline` consider parked; the operation is `done`.
The shards then start from there. The plan is computed once: re-running the same command after a
crash resumes the recorded plan (a relative `--shift-by` or a `--to-latest` is not evaluated
again), and once the reset is done, the same command changes nothing as long as no shard has
consumed since (`decide`). A different reset is refused while one is in progress.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kafka import TopicPartition

from varadhi.core import messages as m
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument, VaradhiError
from varadhi.core.faults import crash_point
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.ops import status
from varadhi.spark import checkpoints, layouts
from varadhi.spark.checkpoints import shard_position
from varadhi.spark.layouts import READER_KIND, Layout
from varadhi.spark.warehouse_fs import check_writable, for_path

Queue = Literal["main", "rq", "dlq"]
Mode = Literal["to-earliest", "to-latest", "to-datetime", "shift-by", "to-storage-topic"]
OPERATION = DocKind.OPERATION


@dataclass(frozen=True)
class Move:
    shard: int
    topic: str
    partition: int
    current: int | None  # None: not started on this storage topic
    new: int

    @property
    def delta(self) -> int:
        """Messages skipped (> 0) or re-read (< 0) on this partition."""
        return self.new - (self.current or 0)


@dataclass(frozen=True)
class Plan:
    queue: Queue
    mode: Mode
    value: Any
    moves: tuple[Move, ...]
    layouts: dict[int, Layout]  # new layout per shard (main/rq); empty for dlq
    dlq_start: dict[str, dict[str, int]]  # new DLQ start (dlq)
    # A library reset of the main topic: commits removed, each read from its log start (`new`)
    # after its storage topic's crossing (`varadhi.ops.library_offsets`); none for shards.
    dropped: tuple[Move, ...] = ()

    def summary(self) -> dict[str, Any]:
        every = (*self.moves, *self.dropped)
        return {
            "queue": self.queue,
            "mode": self.mode,
            "value": self.value,
            "skipped": sum(mv.delta for mv in every if mv.delta > 0),
            "replayed": -sum(mv.delta for mv in every if mv.delta < 0),
            "moves": [asdict(mv) | {"delta": mv.delta} for mv in self.moves]
            + [asdict(mv) | {"delta": mv.delta, "dropped": True} for mv in self.dropped],
        }

    def to_dict(self) -> dict[str, Any]:
        """The plan with absolute positions, as recorded in the operation document."""
        return {
            "queue": self.queue,
            "mode": self.mode,
            "value": self.value,
            "moves": [asdict(mv) for mv in self.moves],
            "layouts": {str(s): layout.to_dict() for s, layout in self.layouts.items()},
            "dlq_start": self.dlq_start,
            "dropped": [asdict(mv) for mv in self.dropped],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        def moves(raw: list[dict[str, Any]]) -> tuple[Move, ...]:
            return tuple(
                Move(
                    int(mv["shard"]),
                    mv["topic"],
                    int(mv["partition"]),
                    None if mv["current"] is None else int(mv["current"]),
                    int(mv["new"]),
                )
                for mv in raw
            )

        return cls(
            d["queue"],
            d["mode"],
            d.get("value"),
            moves(d["moves"]),
            {int(s): Layout.from_dict(layout) for s, layout in d["layouts"].items()},
            d.get("dlq_start") or {},
            moves(d.get("dropped") or []),
        )

    def request(self) -> dict[str, Any]:
        return {"queue": self.queue, "mode": self.mode, "value": self.value}


@dataclass(frozen=True)
class Offsets:
    """What Kafka says about the storage topics: beginning/end offsets and, for `to-datetime`,
    the first offset at or after the time (None: no such record)."""

    beginning: dict[str, list[int]]
    end: dict[str, list[int]]
    at_time: dict[str, list[int | None]]


def largest_even_shard_count(partition_counts: list[int]) -> int:
    return math.gcd(*partition_counts) if partition_counts else 1


def target_offset(
    mode: str, value: str | None, begin: int, end: int, at: int | None, current: int | None
) -> int:
    """Where a reset moves one partition (pure): its beginning (`to-earliest`, and
    `to-storage-topic` for the new storage topic), its end (`to-latest`), the first offset at
    the time asked (`to-datetime`: `at`, the end when none is that late), or `current` (the
    beginning when none) shifted by `value` and kept within [begin, end] (`shift-by`)."""
    if mode in ("to-earliest", "to-storage-topic"):
        return begin
    if mode == "to-latest":
        return end
    if mode == "to-datetime":
        return end if at is None else at
    return min(max((begin if current is None else current) + int(value), begin), end)


def plan_main(
    sub: subscriptions.Subscription,
    mq: topics.CompositeTopic,
    positions: dict[int, tuple[Layout, dict[str, dict[str, int]]]],
    kafka: Offsets,
    mode: Mode,
    value: Any,
) -> Plan:
    """Where each shard reads the main topic after the reset (pure)."""
    n = len(mq.storage_topics)
    if mode == "to-earliest":
        index = 0
    elif mode == "to-latest":
        index = mq.produce_pointer
    elif mode == "to-storage-topic":
        index = int(value)
        if not 0 <= index < n:
            raise InvalidArgument(
                f"storage topic index {index} is outside 0..{n - 1}", field="to_storage_topic"
            )
    elif mode == "to-datetime":
        index = next(
            (
                i
                for i, st in enumerate(mq.storage_topics)
                if any(o is not None for o in kafka.at_time[st.name])
            ),
            mq.produce_pointer,
        )
    else:  # shift-by: within each shard's current storage topic
        index = -1
    lowest_current = min(layout.mq_index for layout, _ in positions.values())
    if index >= 0 and index < lowest_current:
        counts = [st.partitions for st in mq.storage_topics[index:]]
        uneven = [st for st in mq.storage_topics[index:] if st.partitions % sub.shard_count]
        if uneven and not sub.spec.allow_uneven:
            raise InvalidArgument(
                f"cannot rewind to {mq.storage_topics[index].name}: {uneven[0].name} has "
                f"{uneven[0].partitions} partitions, which {sub.shard_count} shards cannot share evenly; "
                f"`varadhi subscription change-shards {sub.name} --to {largest_even_shard_count(counts)}` "
                "would allow it",
                field="queue",
            )
    moves: list[Move] = []
    new_layouts: dict[int, Layout] = {}
    for shard, (layout, consumed) in sorted(positions.items()):
        target = layout.mq_index if index < 0 else index
        st = mq.storage(target)
        owned = subscriptions.owned_partitions(sub, mq, target, shard)
        starting = {
            t: p for t, p in consumed.items() if t not in {s.name for s in mq.storage_topics}
        }
        new_offsets: dict[str, int] = {}
        for p in owned:
            begin, end = kafka.beginning[st.name][p], kafka.end[st.name][p]
            raw = consumed.get(st.name, {}).get(str(p)) if target == layout.mq_index else None
            current = None if raw is None or int(raw) < 0 else int(raw)
            at = kafka.at_time[st.name][p] if mode == "to-datetime" else None
            new = target_offset(mode, value, begin, end, at, current)
            new_offsets[str(p)] = new
            moves.append(Move(shard, st.name, p, current, new))
        starting[st.name] = new_offsets
        new_layouts[shard] = Layout(sub.generation + 1, 0, target, starting)
    return Plan("main", mode, value, tuple(moves), new_layouts, {})


def plan_internal(
    queue: Queue,
    sub: subscriptions.Subscription,
    internal: topics.CompositeTopic,
    current: dict[int, dict[str, dict[str, int]]],
    kafka: Offsets,
    mode: Mode,
    value: Any,
) -> dict[int, dict[str, dict[str, int]]] | tuple:
    """New positions on the RQ or DLQ (fast-forward only), per shard (pure).
    Returns (moves, new offsets per shard)."""
    if mode in ("to-earliest", "to-storage-topic") or (mode == "shift-by" and int(value) < 0):
        raise InvalidArgument(
            f"the {queue.upper()} can only be fast-forwarded (--to-latest, --to-datetime, a positive "
            "--shift-by): rewinding it would deliver retries and dead letters out of their groups' order",
            field="queue",
        )
    first = sub.rq_from if queue == "rq" else sub.dlq_from
    moves: list[Move] = []
    new_positions: dict[int, dict[str, dict[str, int]]] = {}
    for shard in range(sub.shard_count):
        positions: dict[str, dict[str, int]] = {}
        for i, st in enumerate(internal.storage_topics):
            if i < first:
                continue
            for p in subscriptions.internal_partitions(sub, internal, i, shard):
                begin, end = kafka.beginning[st.name][p], kafka.end[st.name][p]
                raw = current.get(shard, {}).get(st.name, {}).get(str(p))
                cur = begin if raw is None or int(raw) < 0 else int(raw)
                if mode == "to-latest":
                    new = end
                elif mode == "to-datetime":
                    at = kafka.at_time[st.name][p]
                    new = end if at is None else at
                else:
                    new = cur + int(value)
                new = max(cur, min(new, end))  # never backwards
                positions.setdefault(st.name, {})[str(p)] = new
                moves.append(Move(shard, st.name, p, cur, new))
        new_positions[shard] = positions
    return tuple(moves), new_positions


Positions = dict[str, dict[str, Any]]  # shard (as text) -> {"layout": ..., "consumed": ...}


def positions_doc(positions: dict[int, tuple[Layout, dict[str, dict[str, int]]]]) -> Positions:
    """Every shard's reader layout and consumed offsets, as recorded in an operation (pure)."""
    return {
        str(s): {"layout": layout.to_dict(), "consumed": consumed}
        for s, (layout, consumed) in sorted(positions.items())
    }


def positions_after(plan: Plan, before: Positions) -> Positions:
    """Where the shards are once `plan` is carried out and before any of them consumes (pure):
    at their new layouts' starting offsets (main, RQ), or where they were (DLQ)."""
    if not plan.layouts:
        return before
    return {
        str(s): {"layout": layout.to_dict(), "consumed": layout.starting_offsets}
        for s, layout in sorted(plan.layouts.items())
    }


def decide(
    op: dict[str, Any] | None,
    request: dict[str, Any],
    generation: int,
    shard_count: int,
    positions: Positions,
) -> str:
    """What `--execute` of `request` does given the recorded reset `op` (pure):

    - `new`: plan now and carry it out (no reset recorded, the last one is done, or it was
      recorded before plans were);
    - `resume`: carry out the recorded plan of the same request, which did not finish;
    - `done`: nothing; the same reset finished and no shard has consumed since (the subscription
      is at the generation and positions it left), so this is a re-run of it.

    Raises InvalidArgument while a different reset is in progress, or when the subscription
    changed under an unfinished one."""
    if not op or "plan" not in op:
        return "new"
    recorded = {k: op["plan"].get(k) for k in ("queue", "mode", "value")}
    same = recorded == request
    if op.get("step") != "done":
        if not same:
            raise InvalidArgument(
                f"an offset reset ({_describe(recorded)}) is in progress; run that command again to "
                "finish it first",
                field="queue",
            )
        if op["from_generation"] != generation or op["shard_count"] != shard_count:
            raise InvalidArgument(
                f"the unfinished offset reset ({_describe(recorded)}) was planned at generation "
                f"{op['from_generation']} with {op['shard_count']} shards; the subscription is now "
                f"at generation {generation} with {shard_count}",
                field="queue",
            )
        return "resume"
    if (
        same
        and op["to_generation"] == generation
        and op["shard_count"] == shard_count
        and op["after"] == positions
    ):
        return "done"
    return "new"


def _describe(request: dict[str, Any]) -> str:
    value = "" if request.get("value") is None else f" {request['value']}"
    return f"--queue {request['queue']} --{request['mode']}{value}"


# -- I/O ----------------------------------------------------------------------------------


def kafka_offsets(
    catalog: Catalog, storages: list[topics.StorageTopic], at_ms: int | None
) -> Offsets:
    consumer = kafka_clients.consumer(catalog.settings, isolation_level="read_committed")
    try:
        tps = [TopicPartition(st.name, p) for st in storages for p in range(st.partitions)]
        begin = consumer.beginning_offsets(tps)
        end = consumer.end_offsets(tps)
        times = consumer.offsets_for_times({tp: at_ms for tp in tps}) if at_ms is not None else {}

        def per(d, st, f=lambda x: x):
            return [f(d.get(TopicPartition(st.name, p))) for p in range(st.partitions)]

        return Offsets(
            {st.name: per(begin, st) for st in storages},
            {st.name: per(end, st) for st in storages},
            {st.name: per(times, st, lambda x: None if x is None else x.offset) for st in storages},
        )
    finally:
        consumer.close()


def skipped_records(catalog: Catalog, moves: tuple[Move, ...]) -> list[tuple[int, m.Origin, int]]:
    """(shard, origin, attempts) of every RQ/DLQ record a fast-forward skips."""
    ranges = {
        (mv.topic, mv.partition): (mv.shard, mv.current or 0, mv.new)
        for mv in moves
        if mv.delta > 0
    }
    if not ranges:
        return []
    consumer = kafka_clients.consumer(
        catalog.settings,
        isolation_level="read_committed",
        enable_auto_commit=False,
    )
    out = []
    try:
        tps = [TopicPartition(t, p) for t, p in ranges]
        consumer.assign(tps)
        for tp in tps:
            consumer.seek(tp, ranges[(tp.topic, tp.partition)][1])
        deadline = time.monotonic() + 60
        while any(consumer.position(tp) < ranges[(tp.topic, tp.partition)][2] for tp in tps):
            if time.monotonic() > deadline:
                raise VaradhiError("timed out reading the records to skip")
            for tp, records in consumer.poll(timeout_ms=200).items():
                shard, _, stop = ranges[(tp.topic, tp.partition)]
                for r in records:
                    if r.offset >= stop:
                        continue
                    h = m.headers_to_dict(r.headers)
                    if m.H_ORIGIN in h:
                        out.append(
                            (shard, m.Origin.decode(h[m.H_ORIGIN]), int(h.get(m.H_ATTEMPTS, "0")))
                        )
        return out
    finally:
        consumer.close()


def read_back_passed(plan: Plan) -> dict[int, dict[tuple[str, int], int]]:
    """Per shard, every RQ partition an RQ fast-forward moves and its new position (pure). A
    shard reads an RQ record back before it is due and holds the retry (`held`, the record's
    position as its `source`): the fast-forward skips such retries too, as it skips the records
    it passes, so none of them waits for its due time with its group behind it."""
    out: dict[int, dict[tuple[str, int], int]] = {}
    if plan.queue == "rq":
        for mv in plan.moves:
            out.setdefault(mv.shard, {})[(mv.topic, mv.partition)] = mv.new
    return out


def ensure_stopped(catalog: Catalog, name: str) -> None:
    """Refuse while any shard of `name` may still be running (`status.running_shards`)."""
    running = status.shards_running(catalog, name)
    if running:
        raise InvalidArgument(
            f"shards {sorted(running)} of {name} are running; stop them (SIGTERM) or "
            f"`varadhi subscription pause {name}` first",
            field="subscription",
        )


class OffsetReset:
    """Plans and executes resets for one subscription."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def plan(self, name: str, queue: Queue, mode: Mode, value: Any = None) -> Plan:
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, name)
        at_ms = int(value) if mode == "to-datetime" else None
        if queue == "main":
            mq = topics.from_snapshot(snap, sub.spec.topic)
            positions = self._positions(sub)
            kafka = kafka_offsets(self.catalog, list(mq.storage_topics), at_ms)
            return plan_main(sub, mq, positions, kafka, mode, value)
        internal = topics.from_snapshot(
            snap, sub.spec.rq_topic if queue == "rq" else sub.spec.dlq_topic
        )
        kafka = kafka_offsets(self.catalog, list(internal.storage_topics), at_ms)
        if queue == "rq":
            positions = self._positions(sub)
            current = {s: consumed for s, (_, consumed) in positions.items()}
        else:
            start = dlq_ops.dlq_start(snap, name)
            current = dict.fromkeys(range(sub.shard_count), start)
        moves, new_positions = plan_internal(queue, sub, internal, current, kafka, mode, value)
        if queue == "rq":
            new_layouts = {
                s: Layout(
                    sub.generation + 1,
                    0,
                    layout.mq_index,
                    layouts.merged(consumed, new_positions[s]),
                )
                for s, (layout, consumed) in positions.items()
            }
            return Plan(queue, mode, value, moves, new_layouts, {})
        dlq_start: dict[str, dict[str, int]] = {}
        for per_shard in new_positions.values():
            dlq_start = layouts.merged(dlq_start, per_shard)
        return Plan(queue, mode, value, moves, {}, dlq_start)

    def _positions(
        self, sub: subscriptions.Subscription
    ) -> dict[int, tuple[Layout, checkpoints.Offsets]]:
        """Every shard's layout and consumed offsets, from its checkpoint in the warehouse (a
        warehouse on an object store is read through Spark: `warehouse_fs.for_path`)."""
        fs = for_path(self.catalog.settings.warehouse, purpose=f"varadhi-offset-reset-{sub.name}")
        return {s: shard_position(self.catalog, sub, s, fs) for s in range(sub.shard_count)}

    def positions(self, sub: subscriptions.Subscription) -> Positions:
        return positions_doc(self._positions(sub))

    def prepare(self, name: str, queue: Queue, mode: Mode, value: Any = None) -> tuple[Plan, str]:
        """The plan `execute` would carry out for this request, and `decide`'s outcome."""
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, name)
        op = snap.get(OPERATION, f"{name}/offset-reset")
        request = {"queue": queue, "mode": mode, "value": value}
        outcome = decide(op, request, sub.generation, sub.shard_count, self.positions(sub))
        if outcome == "new":
            return self.plan(name, queue, mode, value), outcome
        assert op is not None
        return Plan.from_dict(op["plan"]), outcome

    def execute(self, name: str, plan: Plan, spark=None) -> tuple[Plan, str]:
        """Carry out `plan`, or the recorded plan of the same request (see `decide`); returns the
        plan carried out and the outcome (`new`, `resume` or `done`: nothing to do)."""
        ensure_stopped(self.catalog, name)
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, name)
        op = snap.get(OPERATION, f"{name}/offset-reset")
        before = self.positions(sub)
        outcome = decide(op, plan.request(), sub.generation, sub.shard_count, before)
        if outcome == "done":
            return Plan.from_dict(op["plan"]), outcome
        if plan.queue in ("rq", "dlq"):  # such a reset rewrites GroupState: refuse first
            wh = self.catalog.settings.warehouse
            check_writable(for_path(wh, spark, purpose=f"varadhi-offset-reset-{name}"), wh)
        if outcome == "resume":
            plan, op_id = Plan.from_dict(op["plan"]), op["id"]
        else:
            if any(layout.generation != sub.generation + 1 for layout in plan.layouts.values()):
                raise InvalidArgument(
                    f"{name} changed since this plan was made; plan the reset again",
                    field="subscription",
                )
            op_id = self._record(name, sub, plan, before)
            crash_point("offset_reset_recorded")
        self._advance_state(sub, plan, spark)
        crash_point("offset_reset_state_advanced")
        self._finish(name, sub, plan, op_id)
        crash_point("offset_reset_done")
        return plan, outcome

    def _record(self, name: str, sub, plan: Plan, before: Positions) -> str:
        """Step 1: record the plan, with absolute positions, before anything changes."""
        op_key = key(OPERATION, f"{name}/offset-reset")
        op_id = uuid.uuid4().hex
        doc = {
            "kind": OpKind.OFFSET_RESET,
            "step": "advancing-state",
            **plan.summary(),
            "id": op_id,
            "started_ms": int(time.time() * 1000),
            "from_generation": sub.generation,
            "to_generation": sub.generation + 1 if plan.layouts else sub.generation,
            "shard_count": sub.shard_count,
            "plan": plan.to_dict(),
            "after": positions_after(plan, before),
        }

        def change(snap: Snapshot):
            current = snap.get(OPERATION, f"{name}/offset-reset")
            if current and "plan" in current and current.get("step") != "done":
                raise InvalidArgument(
                    f"another offset reset of {name} started meanwhile; run the command again",
                    field="subscription",
                )
            return {op_key: doc}

        self.catalog.mutate(change)
        return op_id

    def _finish(self, name: str, sub, plan: Plan, op_id: str) -> None:
        """Step 3, one catalog write: the recorded generation and positions; the reset is done.
        Does nothing if the recorded reset `op_id` is done already."""
        op_key = key(OPERATION, f"{name}/offset-reset")

        def change(snap: Snapshot):
            op = snap.get(OPERATION, f"{name}/offset-reset") or {}
            if op.get("id") != op_id:
                raise VaradhiError(f"the offset reset of {name} was replaced during the reset")
            if op.get("step") == "done":
                return {}
            doc = snap.get(subscriptions.KIND, name)
            if doc is None:
                raise VaradhiError(f"subscription {name} disappeared during the reset")
            state = dict(doc["state"])
            out: dict[str, Any] = {}
            if plan.layouts:
                state["generation"] = int(op["to_generation"])
                for shard, layout in plan.layouts.items():
                    out[key(READER_KIND, layouts.owner(name, sub.shard_count, shard))] = (
                        layout.to_dict()
                    )
            if plan.dlq_start:
                state["dlq_start"] = plan.dlq_start
            out[key(subscriptions.KIND, name)] = dict(doc, state=state)
            out[op_key] = dict(op, step="done", finished_ms=int(time.time() * 1000))
            return out

        self.catalog.mutate(change)

    def _advance_state(self, sub: subscriptions.Subscription, plan: Plan, spark) -> None:
        """Drop GroupState entries that wait for, or are blocked by, a skipped record, and (RQ)
        the retries read back before they were due whose records the new positions pass."""
        from varadhi.spark.session import get_spark
        from varadhi.spark.state_store import StateStore

        if plan.queue not in ("rq", "dlq"):
            return
        location = "rq" if plan.queue == "rq" else "dlq"
        by_shard: dict[int, set[tuple[int, int, int, int]]] = {}
        for shard, origin, attempts in skipped_records(self.catalog, plan.moves):
            by_shard.setdefault(shard, set()).add(
                (origin.index, origin.partition, origin.offset, attempts)
            )
        passed = read_back_passed(plan) if plan.queue == "rq" else {}
        wh = self.catalog.settings.warehouse
        paths = {
            shard: layouts.state_path(wh, sub.name, sub.shard_count, shard)
            for shard in {*by_shard, *passed}
        }
        fs = for_path(wh, spark, purpose=f"varadhi-offset-reset-{sub.name}")
        paths = {s: p for s, p in paths.items() if fs.exists(f"{p}/_delta_log")}
        if not paths:  # no shard has state to advance: no Spark
            return
        spark = spark or get_spark("varadhi-offset-reset")
        for shard, path in sorted(paths.items()):
            store = StateStore(spark, path, "offset-reset")
            if by_shard.get(shard):
                store.drop_entries(location, by_shard[shard])
            if passed.get(shard):
                store.drop_held_read_before(passed[shard])
