"""What a shard-count change does, decided without I/O (seed 000, ChangeShardCount).

`varadhi.ops.change_shards` executes a change of a subscription from its current shard count to
S; what it decides is decided here, by pure functions tested without Kafka, Spark or a
warehouse (`tests/unit/test_resharding.py`, `tests/unit/test_journal_handover.py`):

- the plan (`plan_change` -> `Plan`; `Plan.to_dict` and `text_plan` are the dry run): the steps
  (`STEPS`, `STEP_TEXT`), the old and new shards' main-topic partitions, the new RQ storage topic
  (2*S partitions) and DLQ storage topic (S partitions), always new (an old RQ partition's
  records were routed with `routing.internal_partition` over the OLD owner's partitions, so new
  shards cannot read it in place), one `Feeder` per old RQ/DLQ storage topic, and the new
  shards' reader layouts: the main topic from storage topic `mq_index` at each partition's old
  owner's position (`merge_positions`; -2 = earliest where unknown), the new RQ from its
  beginning;
- the refusals: `check_stopped` (`ShardsRunning` while any shard may still run) and
  `check_target` (below);
- where the new shards start reading the main topic (`first_unread`: past a sealed storage
  topic the old shards consumed, where they wait at a K=1 boundary) and their layouts' seq
  (`next_layout_seq`: never one an earlier era at the same count used);
- the operation document `operation/<sub>/change-shards` (`operation_name`,
  `Plan.operation_doc`, `require_op`, `touched`; `finished`: the same command again does
  nothing) and the subscription record after the `activate` step (`activated`: the state's
  shard count and queues, and the spec's with them);
- GroupState moved to the new shards (`reshard_tables`: every pending row to its group's new
  shard, the meta row not carried, so the new shards' first batch is not taken for a replay;
  the old tables' last-batch `out` rows, to be re-sent) and the hand-over of what old shards'
  uncommitted batches delivered (`drop_delivered`: only a group's leading entries;
  `carried`: what an earlier change handed an old shard and it has not read past);
- a group's new shard and its partition of a new RQ/DLQ storage topic (`new_shard_of`,
  `internal_target`), which the state step's re-send and the feeders (`varadhi.ops.feeders`)
  share.

Routing: a group's new shard is the one owning `routing.route(group_hash(group_key), P, K)` of
the first main-topic storage topic the new shards read, where the group's next messages are
(recorded in the operation as `route_by`, so the state step and the feeders agree even if a
storage topic is added meanwhile). S must divide the partition counts of the storage topics the
new shards read, and, for a grouped subscription, cross each boundary between them keeping
groups on their shards (`routing.keeps_groups`); `--allow-uneven` accepts that with a warning,
and the new shards then stop at such a boundary as any shards do (`varadhi.spark.layouts`). Old shards
waiting at the end of a storage topic before a K=1 one (seed 000 case 2: 7 partitions and
shards, then 10 partitions) are what a change to 10 expects: the new shards start on the new
storage topic and every pending group moves to the shard that reads its next messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd

from varadhi.core import names, routing
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument
from varadhi.core.messages import Origin
from varadhi.core.state_rows import Kind
from varadhi.kafka import topics
from varadhi.kafka.catalog import Snapshot
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.ops import status
from varadhi.spark import journal
from varadhi.spark.checkpoints import Offsets
from varadhi.spark.layouts import READER_KIND, Layout

OPERATION = DocKind.OPERATION
KIND = OpKind.CHANGE_SHARDS
STEPS = ("fence", "queues", "state", "layouts", "activate", "feed", "done")
FeederMode = Literal["in-process", "external"]
Queue = Literal["rq", "dlq"]


def operation_name(name: str) -> str:
    """The catalog name of a subscription's shard-count change: `<sub>/change-shards`."""
    return f"{name}/{KIND}"


def touched(op: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    return {**op, **changes, "updated_ms": int(time.time() * 1000)}


def require_op(snap: Snapshot, name: str) -> dict[str, Any]:
    op = snap.get(OPERATION, operation_name(name))
    if op is None:
        raise InvalidArgument(f"no shard-count change of {name} is recorded")
    return op


class ShardsRunning(InvalidArgument):
    """Some shards of the subscription are not stopped; `shards` maps shard -> reported state."""

    def __init__(self, name: str, shards: Mapping[int, str]):
        listed = ", ".join(f"{s} ({state})" for s, state in sorted(shards.items()))
        super().__init__(
            f"shards of {name} are still running: {listed}; stop them, or pause the "
            f"subscription (`varadhi subscription pause {name}`) and wait until they report "
            "paused, then run change-shards again"
        )
        self.shards = dict(shards)


@dataclass(frozen=True)
class Feeder:
    queue: Queue
    source: str
    target: str
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "source": self.source,
            "target": self.target,
            "done": self.done,
        }


@dataclass(frozen=True)
class Plan:
    """What a change from `from_shards` to `to_shards` does; `Plan.to_dict()` is the dry run."""

    name: str
    from_shards: int
    to_shards: int
    generation: int
    mq_index: int  # lowest main-topic storage topic an old shard still reads
    route_by: StorageTopic  # the main topic's last storage topic: decides a group's new shard
    rq_target: StorageTopic
    dlq_target: StorageTopic
    rq_target_index: int
    dlq_target_index: int
    layout_seq: int
    feeders: tuple[Feeder, ...]
    before: tuple[dict[str, list[int]], ...]  # per old shard: storage topic -> partitions
    after: tuple[dict[str, list[int]], ...]  # per new shard
    layouts: tuple[Layout, ...]  # per new shard
    warnings: tuple[str, ...] = ()
    steps: tuple[str, ...] = field(default=STEPS)

    def new_shard_of(self, group_key: str) -> int:
        return new_shard_of(group_key, self.route_by, self.to_shards)

    def operation_doc(self, step: str, mode: FeederMode) -> dict[str, Any]:
        """The catalog document `operation/<sub>/change-shards` for `step`."""
        return {
            "kind": KIND,
            "from": self.from_shards,
            "to": self.to_shards,
            "step": step,
            "feeders": [f.to_dict() for f in self.feeders],
            "feeders_mode": mode,
            "generation": self.generation,
            "mq_index": self.mq_index,
            "route_by": self.route_by.to_dict(),
            "rq_target": self.rq_target.name,
            "rq_target_index": self.rq_target_index,
            "dlq_target": self.dlq_target.name,
            "dlq_target_index": self.dlq_target_index,
            "layout_seq": self.layout_seq,
            "warnings": list(self.warnings),
            "updated_ms": int(time.time() * 1000),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "subscription": self.name,
            "from": self.from_shards,
            "to": self.to_shards,
            "steps": [{"step": s, "does": STEP_TEXT[s]} for s in self.steps],
            "mq_index": self.mq_index,
            "route_by": self.route_by.to_dict(),
            "assignment_before": [{"shard": i, "mq": parts} for i, parts in enumerate(self.before)],
            "assignment_after": [
                {
                    "shard": j,
                    "mq": parts,
                    "rq": {self.rq_target.name: _owned(j, self.to_shards, self.rq_target)},
                    "dlq": {self.dlq_target.name: _owned(j, self.to_shards, self.dlq_target)},
                }
                for j, parts in enumerate(self.after)
            ],
            "new_queues": {
                "rq": self.rq_target.to_dict() | {"index": self.rq_target_index},
                "dlq": self.dlq_target.to_dict() | {"index": self.dlq_target_index},
            },
            "feeders": [f.to_dict() for f in self.feeders],
            "layouts": [lay.to_dict() for lay in self.layouts],
            "warnings": list(self.warnings),
        }


STEP_TEXT = {
    "fence": "take the old shards' leases (an old instance still alive stops)",
    "queues": "add the new RQ and DLQ storage topics and switch their produce pointers",
    "state": "reshard GroupState to the new shards' tables; re-send last-batch RQ/DLQ records; "
    "hand over what uncommitted batches delivered (journal)",
    "layouts": "write the new shards' reader layouts (positions carried over)",
    "activate": "set the shard count (state and spec), rq_from and dlq_from of the subscription",
    "feed": "copy the old RQ/DLQ storage topics into the new ones (feeders)",
    "done": "finished",
}


def _owned(shard: int, shard_count: int, st: StorageTopic) -> list[int]:
    return routing.shard_partitions(shard, shard_count, st.partitions)


def new_shard_of(group_key: str, route_by: StorageTopic, shard_count: int) -> int:
    """The new shard of a group: the one owning the group's partition of `route_by`."""
    partition = routing.route(routing.group_hash(group_key), route_by.partitions, route_by.k)
    return routing.shard_of_partition(partition, shard_count, route_by.partitions)


def internal_target(
    group_key: str, route_by: StorageTopic, shard_count: int, target_partitions: int
) -> int:
    """The partition of a new RQ/DLQ storage topic (`target_partitions` partitions) for a group:
    among its new shard's partitions, as `routing.internal_partition` (what the shard does)."""
    shard = new_shard_of(group_key, route_by, shard_count)
    owned = routing.shard_partitions(shard, shard_count, target_partitions)
    return routing.internal_partition(routing.group_hash(group_key), owned)


def finished(op: Mapping[str, Any] | None, sub: Subscription, to: int) -> bool:
    """Whether the last change of `sub` was to `to` shards, is done, and nothing has changed the
    count since (pure): the same command run again then does nothing (a crash may have come
    after the last step and before the operator saw the command finish)."""
    return (
        op is not None
        and op.get("step") == "done"
        and int(op.get("to", -1)) == to
        and sub.shard_count == to
    )


def check_stopped(
    sub: Subscription,
    progress: Mapping[int, Mapping[str, Any]],
    now_ms: int,
    leases: Mapping[int, dict[str, Any] | None] | None = None,
) -> None:
    """Refuse (`ShardsRunning`) while any shard may still be running (`status.running_shards`:
    shards that stopped, were fenced, never started, are dead by their lease or silent, or are
    paused while the subscription is paused, do not count)."""
    running = status.running_shards(sub, progress, leases or {}, now_ms)
    if running:
        raise ShardsRunning(sub.name, running)


def check_count(sub: Subscription, to: Any) -> None:
    """Refuse (`InvalidArgument`, field `to`) a new shard count that is not a positive integer,
    is above `names.MAX_PARTITIONS`, or is `sub`'s current one (both runtimes' change)."""
    if not isinstance(to, int) or isinstance(to, bool) or to < 1:
        raise InvalidArgument(f"must be a positive integer, got {to!r}", field="to")
    if to > names.MAX_PARTITIONS:
        raise InvalidArgument(f"must be at most {names.MAX_PARTITIONS}, got {to}", field="to")
    if to == sub.shard_count:
        raise InvalidArgument(
            f"subscription {sub.name} already has {sub.shard_count} shards", field="to"
        )


def check_target(
    mq: CompositeTopic, mq_index: int, to: int, allow_uneven: bool, grouped: bool = True
) -> list[str]:
    """Why `to` shards cannot own main-topic storage topics `mq_index..` evenly and
    consistently. Refuses (`InvalidArgument`) unless `allow_uneven`; returns the warnings.

    A boundary the new shards cannot cross keeping groups on their shards (`routing.keeps_groups`:
    a K=1 storage topic, for a grouped subscription) is a problem too: they would stop at it
    until none of them has a pending group (`layouts.may_cross`)."""
    problems = []
    read = mq.storage_topics[mq_index:]
    for st in read:
        if st.partitions % to:
            problems.append(f"{to} does not divide the {st.partitions} partitions of {st.name}")
    stops = []
    for prev, nxt in zip(read, read[1:], strict=False):
        if not grouped or routing.keeps_groups(prev, nxt, to):
            continue
        stops.append(prev)
        if prev.partitions / prev.k != nxt.partitions / nxt.k:
            why = f"{nxt.name} starts a new routing run (K=1 after {prev.name})"
        else:
            why = f"{to} shards do not split {prev.name} and {nxt.name} along their base partitions"
        problems.append(
            f"{why}: a group's messages in {prev.name} and {nxt.name} belong to different "
            f"shards, so the new shards would stop at the end of {prev.name} until none of "
            "them has a pending group"
        )
    if problems and not allow_uneven:
        if stops:
            hint = (
                f"let the shards drain {stops[0].name} first (they stop at its end; `varadhi "
                "status` says so), then stop or pause them and change"
            )
        else:
            common = [
                d
                for d in range(1, read[0].partitions + 1)
                if all(st.partitions % d == 0 for st in read)
            ]
            hint = f"shard counts that divide them all: {', '.join(map(str, common))}"
        raise InvalidArgument(
            f"cannot change to {to} shards: {'; '.join(problems)} (the shards still read "
            f"{', '.join(st.name for st in read)}); {hint}, or pass --allow-uneven to accept "
            "uneven shards",
            field="to",
        )
    return problems


def first_unread(
    mq: CompositeTopic,
    from_shards: int,
    positions: Mapping[int, tuple[Layout, Offsets]],
    ends: Mapping[str, Sequence[int]],
    now_ms: int,
    grace_ms: int,
) -> int:
    """The lowest main-topic storage topic the new shards must read (pure): the lowest one an
    old shard reads, past every one that is sealed (`topics.sealed`) and that the old shards
    consumed to its end (`ends`: log-end offsets per storage topic). Shards waiting at the end
    of a storage topic (a boundary they may not cross) have not moved on, but the new shards
    start after it."""
    index = min((lay.mq_index for lay, _ in positions.values()), default=0)
    last = len(mq.storage_topics) - 1
    while index < last and topics.sealed(mq, index, now_ms, grace_ms):
        st = mq.storage(index)
        at = merge_positions(mq, from_shards, index, {s: o for s, (_, o) in positions.items()})
        if any(max(at[st.name][str(p)], 0) < ends[st.name][p] for p in range(st.partitions)):
            break
        index += 1
    return index


def merge_positions(
    mq: CompositeTopic, from_shards: int, mq_index: int, positions: Mapping[int, Offsets]
) -> Offsets:
    """Every main-topic partition of storage topics `mq_index..` at its old owner's position
    (-2, earliest, where the owner has none: it never read that storage topic)."""
    out: Offsets = {}
    for st in mq.storage_topics[mq_index:]:
        out[st.name] = {}
        for p in range(st.partitions):
            owner = routing.shard_of_partition(p, from_shards, st.partitions)
            out[st.name][str(p)] = int(positions.get(owner, {}).get(st.name, {}).get(str(p), -2))
    return out


def next_layout_seq(snapshot: Snapshot, name: str, to: int, generation: int) -> int:
    """The layout seq for new shards at `to`: 0, or past the layouts a previous era at the same
    shard count left (their checkpoints and Delta idempotency ids must not be reused)."""
    seqs = [
        int(doc["seq"])
        for owner, doc in snapshot.items(READER_KIND).items()
        if owner.startswith(f"{name}/s{to}/") and int(doc.get("generation", -1)) == generation
    ]
    return max(seqs) + 1 if seqs else 0


def plan_change(
    sub: Subscription,
    mq: CompositeTopic,
    rq: CompositeTopic,
    dlq: CompositeTopic,
    positions: Mapping[int, tuple[Layout, Offsets]],
    to: int,
    allow_uneven: bool = False,
    layout_seq: int = 0,
    rq_target_index: int | None = None,
    dlq_target_index: int | None = None,
    route_by: StorageTopic | None = None,
    mq_index: int | None = None,
) -> Plan:
    """The plan for changing `sub` (still at its old shard count) to `to` shards (pure).

    `positions` is every old shard's reader layout and consumed offsets. The new shards read
    the main topic from storage topic `mq_index` (`first_unread`; by default the lowest one an
    old shard reads), and a group's new shard is the one owning its partition of that storage
    topic (`route_by`), where its next messages are: its pending entries wait there, ahead of
    them. A fresh plan puts the new queues after the current storage topics; a resumed one
    passes the recorded indexes, `mq_index` and `route_by`.
    """
    check_count(sub, to)
    old = sub.shard_count
    if mq_index is None:
        mq_index = min((lay.mq_index for lay, _ in positions.values()), default=0)
    warnings = check_target(mq, mq_index, to, allow_uneven, sub.spec.grouped)
    route_by = route_by or mq.storage(mq_index)
    rq_idx = len(rq.storage_topics) if rq_target_index is None else rq_target_index
    dlq_idx = len(dlq.storage_topics) if dlq_target_index is None else dlq_target_index
    rq_target = StorageTopic(topics.storage_name(rq.name, rq_idx), 2 * to, 1)
    dlq_target = StorageTopic(topics.storage_name(dlq.name, dlq_idx), to, 1)
    feeders = tuple(
        Feeder("rq", rq.storage(i).name, rq_target.name) for i in range(sub.rq_from, rq_idx)
    ) + tuple(
        Feeder("dlq", dlq.storage(i).name, dlq_target.name) for i in range(sub.dlq_from, dlq_idx)
    )
    read = mq.storage_topics[mq_index:]
    merged = merge_positions(mq, old, mq_index, {s: off for s, (_, off) in positions.items()})
    new_layouts = []
    for j in range(to):
        starting = {
            st.name: {str(p): merged[st.name][str(p)] for p in _owned(j, to, st)} for st in read
        }
        starting[rq_target.name] = {str(p): -2 for p in _owned(j, to, rq_target)}
        new_layouts.append(Layout(sub.generation, layout_seq, mq_index, starting))
    return Plan(
        name=sub.name,
        from_shards=old,
        to_shards=to,
        generation=sub.generation,
        mq_index=mq_index,
        route_by=route_by,
        rq_target=rq_target,
        dlq_target=dlq_target,
        rq_target_index=rq_idx,
        dlq_target_index=dlq_idx,
        layout_seq=layout_seq,
        feeders=feeders,
        before=tuple({st.name: _owned(i, old, st) for st in read} for i in range(old)),
        after=tuple({st.name: _owned(j, to, st) for st in read} for j in range(to)),
        layouts=tuple(new_layouts),
        warnings=tuple(warnings),
    )


def activated(
    doc: Mapping[str, Any], plan: Plan, carried_totals: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The subscription record after the `activate` step (pure), changed in place: the state's
    `shard_count`, `rq_from` and `dlq_from`, and the spec's `shards`, `rq_partitions` and
    `dlq_partitions` with them (the new storage topics' counts), so the spec still describes
    the subscription as it runs. A spec left at the old count made every later edit of the
    record, `pause` and `resume` included, fail as a shard-count change by `apply`.
    `carried_totals` (`status.carry_totals`: the retired shards' counters) replaces the
    state's, when given."""
    state = dict(
        doc["state"],
        shard_count=plan.to_shards,
        rq_from=plan.rq_target_index,
        dlq_from=plan.dlq_target_index,
    )
    if carried_totals is not None:
        state["carried_totals"] = dict(carried_totals)
    spec = dict(
        doc["spec"],
        shards=plan.to_shards,
        rq_partitions=plan.rq_target.partitions,
        dlq_partitions=plan.dlq_target.partitions,
    )
    return {**doc, "spec": spec, "state": state}


def reshard_tables(
    tables: Sequence[pd.DataFrame], shard_of: Callable[[str], int], to: int
) -> tuple[list[pd.DataFrame], pd.DataFrame]:
    """Old shards' state tables -> (the new shards' tables, the old tables' last-batch outs).

    Only `pending` rows move (each to `shard_of(group_key)`); the meta row is dropped. `out`
    rows are kept only when they belong to the batch the table's meta row names (pure).
    """
    pending, outs = [], []
    for t in tables:
        if not len(t):
            continue
        pending.append(t[t["kind"] == Kind.PENDING])
        meta = t[t["kind"] == Kind.META]
        if len(meta):
            app_id, batch_id = meta.iloc[0]["app_id"], meta.iloc[0]["batch_id"]
            outs.append(
                t[(t["kind"] == Kind.OUT) & (t["app_id"] == app_id) & (t["batch_id"] == batch_id)]
            )
    columns = list(tables[0].columns) if tables else []
    rows = pd.concat(pending, ignore_index=True) if pending else pd.DataFrame(columns=columns)
    target = rows["group_key"].map(shard_of) if len(rows) else pd.Series(dtype=int)
    new = [rows[target == j].reset_index(drop=True) for j in range(to)]
    out = pd.concat(outs, ignore_index=True) if outs else pd.DataFrame(columns=columns)
    return new, out


def carried(
    shard: int, layout: Layout, position: Offsets, doc: Mapping[str, Any] | None
) -> journal.UncommittedBatch | None:
    """What an earlier change handed old shard `shard` (its hand-over document `doc`) that it
    has not committed past yet, as an uncommitted batch of its own (`batch_id` -1) from its
    `position` (layout starting offsets merged with its committed ones) to the hand-over's
    planned ends, so that this change hands it on; None when there is none or it is spent
    (pure). Without it, two changes in a row before the shards read past an old crash deliver
    that crash's messages again."""
    handover = journal.HandOver.of_layout(doc, layout.generation, layout.seq)
    live = handover.accepted_below(position) if handover else None
    if handover is None or live is None:
        return None
    return journal.UncommittedBatch(shard, -1, position, handover.until, live)


def drop_delivered(table: pd.DataFrame, accepted: Container[Origin]) -> pd.DataFrame:
    """An old shard's state table without the pending entries its uncommitted batch delivered
    (pure): per group, the leading entries in origin order whose origin is in `accepted` (what
    the batch's journal names). Only a leading run is dropped, so a group never loses an entry
    while one before it stays pending; every other row is kept."""
    if not len(table) or not accepted:
        return table
    columns = ["group_key", "origin_index", "origin_partition", "origin_offset"]
    pending = table.loc[table["kind"] == Kind.PENDING, columns].sort_values(columns)
    drop, blocked = [], set()
    for row in pending.itertuples():
        if row.group_key in blocked:
            continue
        origin = Origin(int(row.origin_index), int(row.origin_partition), int(row.origin_offset))
        if origin in accepted:
            drop.append(row.Index)
        else:
            blocked.add(row.group_key)
    return table.drop(index=drop)


def text_plan(plan: Plan) -> str:
    """The dry run as text."""
    lines = [
        f"change-shards {plan.name}: {plan.from_shards} -> {plan.to_shards} shards "
        f"(groups routed by {plan.route_by.name}: {plan.route_by.partitions} partitions, "
        f"K={plan.route_by.k})",
        "steps:",
    ]
    lines += [f"  {i + 1}. {s:<9} {STEP_TEXT[s]}" for i, s in enumerate(plan.steps[:-1])]
    lines.append("main-topic partitions, before:")
    lines += [f"  shard {i}: {_parts(a)}" for i, a in enumerate(plan.before)]
    lines.append("after:")
    lines += [f"  shard {j}: {_parts(a)}" for j, a in enumerate(plan.after)]
    lines.append(
        f"new RQ storage topic {plan.rq_target.name} ({plan.rq_target.partitions} partitions), "
        f"new DLQ storage topic {plan.dlq_target.name} ({plan.dlq_target.partitions} partitions):"
    )
    for j in range(plan.to_shards):
        lines.append(
            f"  shard {j}: RQ {_owned(j, plan.to_shards, plan.rq_target)} "
            f"DLQ {_owned(j, plan.to_shards, plan.dlq_target)}"
        )
    lines.append("feeders:" if plan.feeders else "feeders: none")
    lines += [f"  {f.queue}: {f.source} -> {f.target}" for f in plan.feeders]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _parts(assignment: Mapping[str, list[int]]) -> str:
    return "  ".join(f"{t}{p}" for t, p in assignment.items())


__all__ = [
    "Feeder",
    "Plan",
    "ShardsRunning",
    "activated",
    "check_stopped",
    "check_target",
    "internal_target",
    "merge_positions",
    "new_shard_of",
    "plan_change",
    "reshard_tables",
    "text_plan",
]
