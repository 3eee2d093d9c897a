"""Changing a subscription's shard count (seed 000, ChangeShardCount), and the feeders.

`varadhi subscription change-shards NAME --to S` moves a subscription from its current shard
count to S while its shards are stopped (or the subscription is paused). The decision is a pure
function (`plan_change`); executing it (`ChangeShards.execute`) takes these steps, each recorded
in the catalog under `operation/<sub>/change-shards` *before* it is taken, so a re-run after a
crash resumes at the recorded step (every step is idempotent):

1. `fence`:    take the old shards' leases, so an old instance still alive (paused) stops;
2. `queues`:   add a new RQ storage topic (2*S partitions) and DLQ storage topic (S partitions)
               and switch their produce pointers to them. They are always added: an old RQ
               partition's records were routed with `routing.internal_partition` over the OLD
               owner's partitions, so new shards cannot read it in place;
3. `state`:    reshard GroupState: every old shard's pending rows go to the table of the group's
               new shard (plain Delta overwrite: nobody else writes now; the meta row is not
               carried, so the new shards' first batch is not taken for a replay). The `out`
               rows of each old table's last batch are re-sent to the new queues (a shard that
               crashed between its commit and its send never sent them), in one Kafka
               transaction, skipped when the new queues already hold a committed record.
               An old shard's batch planned and never committed (it died or was fenced in
               it) has its delivery journal handed over (`varadhi.spark.journal`): the pending
               entries it delivered are dropped (`drop_delivered`), and the main-topic
               messages it delivered go to the new shards as `HandOver` documents, with
               what an earlier change handed an old shard and it has not yet read past
               (two changes in a row: its messages must not be delivered again either).
               A journal that cannot be read stops the change (`HandOverUnreadable`), here
               before the step writes anything and, before the `fence` step, in `execute`;
4. `layouts`:  the new shards' reader layouts: the lowest main-topic storage topic any old shard
               still reads, or past it when they consumed it and it is sealed (`first_unread`:
               old shards waiting at a K=1 boundary), starting where the old shards stopped
               (`checkpoints.shard_position`, per partition from its old owner; -2 = earliest
               where unknown), the new RQ storage topic from its beginning;
5. `activate`: the subscription's record, in place: `shard_count` = S, `rq_from`/`dlq_from` = the
               new storage topics (the shards read and browse those on), and the spec's
               `shards`/`rq_partitions`/`dlq_partitions` to match (`activated`);
6. `feed`:     the feeders copy every record of the old RQ/DLQ storage topics (read_committed,
               ticks skipped) to the new ones, into the partitions of the group's new shard,
               each distinct record once: what the target already holds (an earlier run's
               copy, a re-sent `out` row) is not written again. They never call the endpoint
               and never touch GroupState;
7. `done`:     the same command run again then does nothing (`finished`).

A crash after any step, then the same command again, ends where one clean run does (the
subscription, operation, reader-layout and hand-over documents, the new GroupState tables and the
records of the new RQ/DLQ storage topics: `tests/integration/test_change_shards_crash.py`).

Why new shards may read the new RQ while feeders still run (seed 000 lets them wait): here an RQ
record is matched to its GroupState entry by (origin, attempts) and a group's delivery order
comes from `origin` (its main-topic position), never from RQ positions (see
`varadhi.core.group_state`). A record that arrives late only fills in the body of an entry that kept
its place; its group waits for it meanwhile. A record that matches no `rq` entry (already
consumed by an old shard, superseded by a later attempt, or a duplicate of a re-sent `out` row)
is dropped as a stale duplicate. So order holds without a barrier, and a feeder that copied a
record twice (two feeders of one source at once) does no harm.

Routing: a group's new shard is the one owning `routing.route(group_hash(group_key), P, K)` of
the first main-topic storage topic the new shards read, where the group's next messages are
(recorded in the operation as `route_by`, so the state step and the feeders agree even if a
storage topic is added meanwhile). S must divide the partition counts of the storage topics the
new shards read, and, for a grouped subscription, cross each boundary between them keeping
groups on their shards (`layouts.keeps_groups`); `--allow-uneven` accepts that with a warning,
and the new shards then stop at such a boundary as any shards do (`varadhi.spark.layouts`). Old shards
waiting at the end of a storage topic before a K=1 one (seed 000 case 2: 7 partitions and
shards, then 10 partitions) are what a change to 10 expects: the new shards start on the new
storage topic and every pending group moves to the shard that reads its next messages.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import pandas as pd
from kafka import TopicPartition

from varadhi.core import names, routing
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument, NotFound, VaradhiError
from varadhi.core.messages import Origin
from varadhi.core.state_rows import Kind
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import progress, subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.leases import Lease
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.ops import status
from varadhi.spark import checkpoints, journal, layouts
from varadhi.spark.checkpoints import Offsets, shard_position
from varadhi.spark.layouts import READER_KIND, Layout
from varadhi.spark.warehouse_fs import check_writable, for_path

OPERATION = DocKind.OPERATION
KIND = OpKind.CHANGE_SHARDS
STEPS = ("fence", "queues", "state", "layouts", "activate", "feed", "done")
FeederMode = Literal["in-process", "external"]
Queue = Literal["rq", "dlq"]

log = logging.getLogger(__name__)


def operation_name(name: str) -> str:
    """The catalog name of a subscription's shard-count change: `<sub>/change-shards`."""
    return f"{name}/{KIND}"


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


class HandOverUnreadable(VaradhiError):
    """What an old shard's uncommitted batch delivered cannot be found out (its checkpoint or
    its delivery journal cannot be read, e.g. Kafka just restarted): handing over nothing would
    make the new shards deliver that batch's messages again, so the change stops and says so.
    Exit code 2 when raised before the change's first step (nothing changed), 1 when raised at
    its `state` step (the operation resumes there when the same command runs again)."""

    def __init__(self, name: str, shard: int, error: BaseException, started: bool):
        where = (
            "the change stopped before its state step; run the same command again once it "
            "can be read (it resumes there)"
            if started
            else "nothing was changed; run the same command again once it can be read"
        )
        super().__init__(
            f"change-shards {name}: what old shard {shard}'s uncommitted batch delivered cannot "
            f"be read ({type(error).__name__}: {error}); the new shards would deliver it again: "
            f"{where}"
        )
        self.exit_code = 1 if started else 2
        self.shard = shard


# -- pure decisions ---------------------------------------------------------------------------


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


def check_target(
    mq: CompositeTopic, mq_index: int, to: int, allow_uneven: bool, grouped: bool = True
) -> list[str]:
    """Why `to` shards cannot own main-topic storage topics `mq_index..` evenly and
    consistently. Refuses (`InvalidArgument`) unless `allow_uneven`; returns the warnings.

    A boundary the new shards cannot cross keeping groups on their shards (`layouts.keeps_groups`:
    a K=1 storage topic, for a grouped subscription) is a problem too: they would stop at it
    until none of them has a pending group (`layouts.may_cross`)."""
    problems = []
    read = mq.storage_topics[mq_index:]
    for st in read:
        if st.partitions % to:
            problems.append(f"{to} does not divide the {st.partitions} partitions of {st.name}")
    stops = []
    for prev, nxt in zip(read, read[1:], strict=False):
        if not grouped or layouts.keeps_groups(prev, nxt, to):
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
    if not isinstance(to, int) or isinstance(to, bool) or to < 1:
        raise InvalidArgument(f"must be a positive integer, got {to!r}", field="to")
    if to > names.MAX_PARTITIONS:
        raise InvalidArgument(f"must be at most {names.MAX_PARTITIONS}, got {to}", field="to")
    old = sub.shard_count
    if to == old:
        raise InvalidArgument(f"subscription {sub.name} already has {old} shards", field="to")
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


def journaled_plan(
    settings: Settings,
    name: str,
    count: int,
    shard: int,
    layout: Layout,
    created_ms: int,
    fs,
) -> tuple[int, Any, journal.Accepted] | None:
    """Shard `shard` of `count`'s newest batch in its `layout`'s checkpoint if it is planned and
    not committed (`checkpoints.uncommitted_plan`, through `fs`): its id, its planned end, and
    what its journal names as accepted (`journal.read_shard`, under the batch's key, from its
    planning time minus `journal.LOOKBACK_MS`; possibly empty). None when there is no such
    batch. Raises what reading Kafka raises."""
    path = layouts.checkpoint_path(settings.warehouse, name, count, shard, layout)
    planned = checkpoints.uncommitted_plan(path, fs)
    if planned is None:
        return None
    batch_id, planned_ms, end = planned
    app_id = layouts.app_id(name, count, shard, layout)
    accepted = journal.read_shard(
        settings,
        name,
        shard,
        journal.batch_key(app_id, batch_id, created_ms),
        since_ms=planned_ms - journal.LOOKBACK_MS,
    )
    return batch_id, end, accepted


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


# -- I/O ------------------------------------------------------------------------------------


def _load(snap: Snapshot, name: str):
    sub = subscriptions.from_snapshot(snap, name)
    return (
        sub,
        topics.from_snapshot(snap, sub.spec.topic),
        topics.from_snapshot(snap, sub.spec.rq_topic),
        topics.from_snapshot(snap, sub.spec.dlq_topic),
    )


class ChangeShards:
    """Plans and executes shard-count changes against the catalog, Kafka and Delta.

    `spark` is a factory, called only when a step needs Spark (the state step and in-process
    feeders), so a dry run needs none. `log` receives one line per step taken.
    """

    def __init__(
        self,
        catalog: Catalog,
        spark: Callable[[], Any] | None = None,
        log: Callable[[str], None] = lambda _line: None,
    ):
        self.catalog = catalog
        self._spark_factory = spark
        self._spark = None
        self.log = log

    @property
    def spark(self):
        if self._spark is None:
            if self._spark_factory is None:
                from varadhi.spark.session import get_spark

                self._spark = get_spark("varadhi-change-shards")
            else:
                self._spark = self._spark_factory()
        return self._spark

    def operation(self, name: str) -> dict[str, Any] | None:
        return self.catalog.get(OPERATION, operation_name(name))

    def plan(self, name: str, to: int, allow_uneven: bool = False) -> Plan:
        """The plan a fresh change would follow (refusing what it would refuse); no effects."""
        snap = self.catalog.snapshot()
        sub, mq, rq, dlq = _load(snap, name)
        op = snap.get(OPERATION, operation_name(name))
        wh = self.catalog.settings.warehouse
        check_writable(for_path(wh, lambda: self.spark), wh)  # state moves: refuse first
        if op is not None and op.get("step") != "done":
            self._check_resumable(op, name, to)
            if STEPS.index(op["step"]) > STEPS.index("activate"):
                raise InvalidArgument(
                    f"the change of {name} to {to} shards is active and waits for its feeders "
                    f"({', '.join(f['source'] for f in op['feeders'] if not f['done'])}); run "
                    "it again without --dry-run, or run the feeders, to finish it"
                )
            return self._resumed_plan(snap, name, op)
        self._check_no_pending_feeders(op, name)
        now = int(time.time() * 1000)
        check_stopped(sub, _progress(self.catalog, name), now, status.leases_of(snap, sub, now))
        seq = next_layout_seq(snap, name, to, sub.generation)
        positions = self._positions(sub)
        ends = topics.end_offsets(self.catalog, mq.storage_topics)
        now = int(time.time() * 1000)
        start = first_unread(mq, sub.shard_count, positions, ends, now, topics.SEAL_GRACE_MS)
        return plan_change(
            sub, mq, rq, dlq, positions, to, allow_uneven, layout_seq=seq, mq_index=start
        )

    def execute(
        self, name: str, to: int, allow_uneven: bool = False, feeders: FeederMode = "in-process"
    ) -> dict[str, Any]:
        """Run (or resume) the change; returns the final operation document."""
        snap = self.catalog.snapshot()
        op = snap.get(OPERATION, operation_name(name))
        if finished(op, subscriptions.from_snapshot(snap, name), to):
            assert op is not None
            self.log(f"the change of {name} to {to} shards is done; nothing to do")
            return op
        wh = self.catalog.settings.warehouse
        check_writable(for_path(wh, lambda: self.spark), wh)  # state moves: refuse first
        if op is not None and op.get("step") != "done":
            self._check_resumable(op, name, to)
            op = dict(op, feeders_mode=feeders)
            self.log(f"resuming the change {op['from']} -> {op['to']} at step {op['step']}")
        else:
            plan = self.plan(name, to, allow_uneven)
            # Refuse before the first step if an uncommitted batch's journal cannot be read
            # (the state step reads it again once the old shards are fenced).
            self._uncommitted_batches(plan, started=False)
            op = plan.operation_doc("fence", feeders)
            self._write_op(name, op)
            for w in plan.warnings:
                self.log(f"warning: {w}")
        step = op["step"]
        if STEPS.index(step) <= STEPS.index("activate"):
            snap = self.catalog.snapshot()
            plan = self._resumed_plan(snap, name, op)
            if step != "fence":  # fenced old shards report "fenced"; anything else is new
                now = int(time.time() * 1000)
                current = subscriptions.from_snapshot(snap, name)
                check_stopped(
                    current,
                    _progress(self.catalog, name),
                    now,
                    status.leases_of(snap, current, now),
                )
            for s in STEPS[STEPS.index(step) : STEPS.index("feed")]:
                report = getattr(self, f"_step_{s}")(plan)
                op = dict(op, step=STEPS[STEPS.index(s) + 1], **(report or {}))
                if s not in ("layouts", "activate"):  # those two record it in their own write
                    self._write_op(name, op)
        return self._feed_all(name, op["feeders_mode"])

    # -- steps ----------------------------------------------------------------------------
    def _step_fence(self, plan: Plan) -> None:
        for shard in range(plan.from_shards):
            Lease(self.catalog, layouts.owner(plan.name, plan.from_shards, shard)).acquire()
        self.log(f"fence: took the leases of shards 0..{plan.from_shards - 1}")

    def _step_queues(self, plan: Plan) -> None:
        sub = subscriptions.from_snapshot(self.catalog.snapshot(), plan.name)
        service = topics.TopicService(self.catalog)
        for composite, target, index in (
            (sub.spec.rq_topic, plan.rq_target, plan.rq_target_index),
            (sub.spec.dlq_topic, plan.dlq_target, plan.dlq_target_index),
        ):
            topic = service.get(composite)
            if len(topic.storage_topics) == index:
                service.add_storage(composite, target.partitions, allow_uneven=True)
            elif (
                len(topic.storage_topics) < index
                or topic.storage(index).partitions != target.partitions
            ):
                raise VaradhiError(
                    f"{composite} does not have the expected storage topic {target.name} with "
                    f"{target.partitions} partitions; it was changed during the shard-count change"
                )
            while service.get(composite).produce_pointer < index:
                service.switch_produce(composite)
        self.log(
            f"queues: {plan.rq_target.name} ({plan.rq_target.partitions} partitions) and "
            f"{plan.dlq_target.name} ({plan.dlq_target.partitions}) take new failures"
        )

    def _step_state(self, plan: Plan) -> dict[str, Any]:
        from varadhi.core.state_rows import STATE_SCHEMA, normalise
        from varadhi.spark.state_store import StateStore

        wh = self.catalog.settings.warehouse
        # The hand-over (`varadhi.spark.journal`): what old shards' uncommitted batches delivered,
        # read first: a journal that cannot be read stops the step before it writes anything.
        batches = self._uncommitted_batches(plan, started=True)
        old = [
            StateStore(
                self.spark, layouts.state_path(wh, plan.name, plan.from_shards, i), "-"
            ).frame
            for i in range(plan.from_shards)
        ]
        accepted: dict[int, journal.Accepted] = defaultdict(journal.Accepted)
        for b in batches:
            accepted[b.shard] = accepted[b.shard] | b.accepted
        kept = [drop_delivered(t, accepted[i]) for i, t in enumerate(old)]
        dropped = sum(len(t) - len(k) for t, k in zip(old, kept, strict=True))
        snap = self.catalog.snapshot()
        mq = topics.from_snapshot(snap, subscriptions.from_snapshot(snap, plan.name).spec.topic)
        handed, left_out = journal.hand_over(
            batches,
            [st.name for st in mq.storage_topics],
            plan.after,
            plan.generation,
            plan.layout_seq,
        )
        new, outs = reshard_tables(kept, plan.new_shard_of, plan.to_shards)
        for j, frame in enumerate(new):
            (
                self.spark.createDataFrame(normalise(frame), STATE_SCHEMA)
                .write.format("delta")
                .mode("overwrite")
                .option("userMetadata", f"change-shards {plan.from_shards}->{plan.to_shards}")
                .save(layouts.state_path(wh, plan.name, plan.to_shards, j))
            )
        self._resend(plan, outs)
        self._write_handover(plan, handed)
        moved = {
            "pending": sum(len(f) for f in new),
            "groups": sum(f["group_key"].nunique() for f in new),
            "resent": len(outs),
        }
        self.log(
            f"state: {moved['pending']} pending entries of {moved['groups']} groups moved to "
            f"{plan.to_shards} shards; {moved['resent']} last-batch records re-sent"
        )
        if batches:
            over = {j: len(journal.Accepted.of_runs(h.runs)) for j, h in handed.items()}
            moved["handover"] = {
                "batches": [
                    {"shard": b.shard, "batch": b.batch_id, "accepted": len(b.accepted)}
                    for b in batches
                ],
                "pending_dropped": dropped,
                "handed_over": {str(j): n for j, n in over.items()},
                "left_out": left_out,
            }
            self.log(
                f"state: hand-over of {len(batches)} uncommitted batches: "
                f"{sum(len(b.accepted) for b in batches)} messages their journals name as "
                f"accepted; {dropped} of them dropped from GroupState, {sum(over.values())} "
                f"handed to the new shards"
                + (f", {left_out} left out (to be delivered again)" if left_out else "")
            )
        return {"state": moved}

    def _uncommitted_batches(
        self, plan: Plan, started: bool = True
    ) -> list[journal.UncommittedBatch]:
        """Every old shard's batch planned and never committed, with the origins its journal
        names as accepted (`varadhi.spark.journal`: the hand-over); batches with none are left out.
        Also, as a batch of its own (`batch_id` -1), what an earlier change handed an old
        shard that it has not committed past yet (`carried`). Nothing reads them while the
        journal is off. A checkpoint or journal that cannot be read (after `journal.READ_TRIES`
        tries, `journal.read_again`) raises `HandOverUnreadable` (`started`: whether the change's steps began): the
        command refuses rather than hand over nothing, which would deliver that batch again."""
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, plan.name)
        if sub.spec.consumption.journal_interval_ms <= 0:
            return []
        settings = self.catalog.settings
        fs = for_path(settings.warehouse, lambda: self.spark)
        out = []
        for shard in range(plan.from_shards):
            try:  # OSError, Py4J, Kafka errors
                found = journal.read_again(
                    partial(self._uncommitted_of, plan, sub, snap, shard, fs),
                    (Exception,),
                    partial(self._cannot_read, plan.name, shard),
                )
            except Exception as e:  # noqa: BLE001 - the last try's error, whatever it is
                raise HandOverUnreadable(plan.name, shard, e, started) from e
            out.extend(found)
        return out

    @staticmethod
    def _cannot_read(name: str, shard: int, error: Exception) -> None:
        log.warning(
            "%s: reading old shard %d's uncommitted batch failed (%s); again", name, shard, error
        )

    def _uncommitted_of(
        self, plan: Plan, sub: Subscription, snap: Snapshot, shard: int, fs
    ) -> list[journal.UncommittedBatch]:
        """Old shard `shard`'s part of `_uncommitted_batches`; raises what reading raises."""
        settings = self.catalog.settings
        out = []
        layout, start = shard_position(self.catalog, sub, shard, fs)
        doc = snap.get(journal.HANDOVER_KIND, layouts.owner(plan.name, plan.from_shards, shard))
        earlier = carried(shard, layout, start, doc)
        if earlier is not None:
            out.append(earlier)
        found = journaled_plan(
            settings, plan.name, plan.from_shards, shard, layout, sub.created_ms, fs
        )
        if found is not None and found[2]:
            batch_id, end, accepted = found
            out.append(journal.UncommittedBatch(shard, batch_id, start, end, accepted))
        return out

    def _write_handover(self, plan: Plan, handed: Mapping[int, journal.HandOver]) -> None:
        """One catalog write: every new shard's hand-over document (`handover/<sub>/s<S>/<j>`),
        deleting one left by an earlier change for a shard that gets none now. The old shards'
        documents stay (their shards are retired; a later change to their shard count replaces
        or deletes them): a re-run of this step after a crash reads them again (`carried`).
        Idempotent: a re-run writes the same."""
        name = plan.name
        kind = journal.HANDOVER_KIND

        def change(snap: Snapshot):
            new = [layouts.owner(name, plan.to_shards, j) for j in range(plan.to_shards)]
            writes: dict[str, Any] = {
                key(kind, owner): None for owner in new if snap.get(kind, owner) is not None
            }
            for j, handover in handed.items():
                writes[key(kind, new[j])] = handover.to_dict()
            return writes

        self.catalog.mutate(change)

    def _resend(self, plan: Plan, outs: pd.DataFrame) -> None:
        """Send the old tables' last-batch records to the new queues, once: in one Kafka
        transaction (transactional id per subscription's change, so a re-run aborts what a
        crashed run left open), and not at all when the new queues already hold a committed
        record. Until `activate` nothing else writes to them (the old shards are fenced and
        write to the old queues, the new shards do not run yet), so a committed record there
        is this step's earlier, complete send."""
        if not len(outs):
            return

        from varadhi.core.queue_records import MAX_REQUEST_BYTES, out_record
        from varadhi.core.state_rows import out_rows

        targets = {"rq": plan.rq_target, "dlq": plan.dlq_target}
        limits = topics.max_message_bytes(self.catalog, [st.name for st in targets.values()])
        producer = kafka_clients.producer(
            self.catalog.settings,
            acks="all",
            max_request_size=MAX_REQUEST_BYTES,
            transactional_id=f"varadhi.{plan.name}.change-shards",
        )
        try:
            producer.init_transactions()
            if _holds_committed(self.catalog.settings, list(targets.values())):
                self.log("state: the last-batch records were re-sent by an earlier run")
                return
            producer.begin_transaction()
            futures = []
            for row in out_rows(outs):
                st = targets[row.target]
                record = out_record(row, min(limits[st.name], MAX_REQUEST_BYTES))
                futures.append(
                    producer.send(
                        st.name,
                        key=record.key,
                        value=record.value,
                        partition=internal_target(
                            row.group_key, plan.route_by, plan.to_shards, st.partitions
                        ),
                        headers=record.headers,
                    )
                )
            for f in futures:
                f.get(timeout=30)
            producer.commit_transaction()
        finally:
            producer.close(timeout=5)

    def _step_layouts(self, plan: Plan) -> None:
        name = plan.name

        def change(snap: Snapshot):
            op = _require_op(snap, name)
            writes: dict[str, Any] = {
                key(READER_KIND, layouts.owner(name, plan.to_shards, j)): lay.to_dict()
                for j, lay in enumerate(plan.layouts)
            }
            writes[key(OPERATION, operation_name(name))] = _touch(op, step="activate")
            return writes

        self.catalog.mutate(change)
        self.log(
            f"layouts: {plan.to_shards} reader layouts, reading the main topic from its "
            f"storage topic {plan.mq_index}"
        )

    def _step_activate(self, plan: Plan) -> None:
        name = plan.name
        # The retired shards are stopped: their last progress holds their final counts.
        final = progress.latest_progress(self.catalog.settings, name)

        def change(snap: Snapshot):
            doc = snap.get(subscriptions.KIND, name)
            if doc is None:
                raise NotFound("subscription", name)
            before = doc["state"].get("carried_totals", {})
            carried = status.carry_totals(before, final, plan.from_shards)
            return {
                key(subscriptions.KIND, name): activated(doc, plan, carried),
                key(OPERATION, operation_name(name)): _touch(_require_op(snap, name), step="feed"),
            }

        self.catalog.mutate(change)
        self.log(f"activate: {name} now has {plan.to_shards} shards")

    def _feed_all(self, name: str, mode: FeederMode) -> dict[str, Any]:
        op = _require_op(self.catalog.snapshot(), name)
        if mode == "in-process":
            for f in op["feeders"]:
                if not f["done"]:
                    n = feed(self.spark, self.catalog, name, f["source"])
                    self.log(f"feed: {f['source']} -> {f['target']}: {n} records")
        op = _require_op(self.catalog.snapshot(), name)
        if all(f["done"] for f in op["feeders"]) and op["step"] != "done":
            self._write_op(name, dict(op, step="done"))
            op = _require_op(self.catalog.snapshot(), name)
        return op

    # -- helpers --------------------------------------------------------------------------
    def _positions(self, sub: Subscription) -> dict[int, tuple[Layout, Offsets]]:
        """The old shards' positions from their checkpoints: through Spark's Hadoop FileSystem
        when a session runs or the warehouse is not local (this starts one), else locally."""
        fs = for_path(self.catalog.settings.warehouse, lambda: self.spark)
        return {i: shard_position(self.catalog, sub, i, fs) for i in range(sub.shard_count)}

    def _resumed_plan(self, snap: Snapshot, name: str, op: Mapping[str, Any]) -> Plan:
        """The recorded operation's plan, recomputed from the old shards' positions (frozen:
        they are fenced and stopped)."""
        sub, mq, rq, dlq = _load(snap, name)
        if sub.shard_count != op["from"]:
            raise VaradhiError(
                f"subscription {sub.name} has {sub.shard_count} shards, but the change in "
                f"progress is from {op['from']}; the catalog was changed by something else"
            )
        return plan_change(
            sub,
            mq,
            rq,
            dlq,
            self._positions(sub),
            int(op["to"]),
            allow_uneven=True,  # checked when the operation was recorded
            layout_seq=int(op["layout_seq"]),
            rq_target_index=int(op["rq_target_index"]),
            dlq_target_index=int(op["dlq_target_index"]),
            route_by=StorageTopic.from_dict(op["route_by"]),
            mq_index=int(op["mq_index"]),
        )

    @staticmethod
    def _check_resumable(op: Mapping[str, Any], name: str, to: int) -> None:
        if int(op["to"]) != to:
            raise InvalidArgument(
                f"a change of {name} from {op['from']} to {op['to']} shards is in progress "
                f"(step {op['step']}); run `varadhi subscription change-shards {name} "
                f"--to {op['to']}` to finish it first",
                field="to",
            )

    @staticmethod
    def _check_no_pending_feeders(op: Mapping[str, Any] | None, name: str) -> None:
        if op is not None and not all(f.get("done") for f in op.get("feeders", [])):
            raise InvalidArgument(
                f"the previous change of {name} still has feeders to run: "
                + ", ".join(f["source"] for f in op["feeders"] if not f.get("done"))
            )

    def _write_op(self, name: str, op: dict[str, Any]) -> None:
        doc = dict(op, subscription=name, updated_ms=int(time.time() * 1000))
        self.catalog.mutate(lambda _snap: {key(OPERATION, operation_name(name)): doc})


def _touch(op: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    return {**op, **changes, "updated_ms": int(time.time() * 1000)}


def _require_op(snap: Snapshot, name: str) -> dict[str, Any]:
    op = snap.get(OPERATION, operation_name(name))
    if op is None:
        raise InvalidArgument(f"no shard-count change of {name} is recorded")
    return op


def _holds_committed(settings: kafka_clients.HasKafka, storages: Sequence[StorageTopic]) -> bool:
    """Whether any of the Kafka topics `storages` holds a committed record."""
    from kafka import TopicPartition

    consumer = kafka_clients.consumer(
        settings, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(st.name, p) for st in storages for p in range(st.partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)  # the last stable offsets: nothing open is waited for
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if any(consumer.poll(timeout_ms=200).values()):
                return True
            if time.monotonic() > deadline:
                raise VaradhiError(
                    "timed out reading the new RQ/DLQ storage topics "
                    f"{', '.join(st.name for st in storages)}"
                )
        return False
    finally:
        consumer.close()


def _progress(catalog: Catalog, name: str) -> dict[int, dict[str, Any]]:
    return progress.latest_progress(catalog.settings, name)


# -- feeders ------------------------------------------------------------------------------


def feeder_source(op: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The recorded feeder for `source`, if the operation has reached its feed step (pure)."""
    match = [f for f in op.get("feeders", []) if f["source"] == source]
    if not match:
        listed = ", ".join(f["source"] for f in op.get("feeders", [])) or "none"
        raise InvalidArgument(
            f"{source} is not a feeder source of this change (sources: {listed})", field="source"
        )
    if op["step"] not in ("feed", "done"):
        raise InvalidArgument(
            f"the change is at step {op['step']}; feeders run once it reaches `feed`",
            field="source",
        )
    return match[0]


def check_feeder(catalog: Catalog, name: str, source: str) -> dict[str, Any]:
    """The recorded feeder of `name` for `source`, or `InvalidArgument` (before any Spark)."""
    snap = catalog.snapshot()
    subscriptions.from_snapshot(snap, name)  # must exist
    return feeder_source(_require_op(snap, name), source)


def feed_if_empty(catalog: Catalog, name: str, source: str) -> bool:
    """Mark the feeder of `source` done, with 0 records, when old storage topic `source` holds
    no record at all (every partition's log start offset equals its high watermark, so aborted
    and tick records count as records here), and return True; otherwise change nothing and
    return False (`feed` copies). A feeder of an empty RQ or DLQ, the common case for a
    healthy subscription, then starts no Spark session and runs no Spark job.

    Safe like `feed` reading up to the end it finds: from the change's fence on, nothing writes
    to the old storage topics, so an empty source stays empty. Raises `InvalidArgument` as
    `check_feeder` does."""
    snap = catalog.snapshot()
    f = feeder_source(_require_op(snap, name), source)
    sub = subscriptions.from_snapshot(snap, name)
    queue = topics.from_snapshot(
        snap, sub.spec.rq_topic if f["queue"] == "rq" else sub.spec.dlq_topic
    )
    partitions = queue.storage(queue.index_of(source)).partitions
    parts = [TopicPartition(source, p) for p in range(partitions)]
    consumer = kafka_clients.consumer(catalog.settings, enable_auto_commit=False)
    try:
        first, ends = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
    finally:
        consumer.close()
    if any(ends[tp] > first[tp] for tp in parts):
        return False
    _mark_fed(catalog, name, source, 0)
    return True


def feed(spark, catalog: Catalog, name: str, source: str) -> int:
    """Copy every record of old RQ/DLQ storage topic `source` to the new one; returns how many
    distinct records `source` holds (all of them are in the new one afterwards).

    A bounded Spark batch: read `source` from its start (for a DLQ, from the offset reset's
    `dlq_start` where there is one) to its end, read_committed, skip tick records, and write
    each record (key, value and headers kept) to the partition of the new storage topic that
    its group's new shard owns (`internal_target` of `group_key_column`, the shard's own rule).
    Idempotent: a record is written only if the target partition does not already hold one
    with the same key, value and headers (compared by `_fingerprint`), so a re-run after a crash
    (before or after part of the write, or before the feeder was marked done) adds nothing
    twice. Identical records are the same retry or dead letter by the shards' own rule (origin
    and attempts), so one copy of each is enough. Marks the feeder done.

    Both topics are read (and cached) before the write, so a Kafka authorization failure in the
    write is the sink's: `NotAuthorized` Write on the new topic (Kafka's Java client names only
    the topic, not the operation). One in the reads is left to the caller to name
    (`kafka_clients.refusal`: Describe or Read).
    """
    import json

    from pyspark.sql import functions as F

    from varadhi.spark.batch import TICK_HEADER
    from varadhi.spark.columns import group_key_column

    snap = catalog.snapshot()
    op = _require_op(snap, name)
    f = feeder_source(op, source)
    sub = subscriptions.from_snapshot(snap, name)
    route_by = StorageTopic.from_dict(op["route_by"])
    to = int(op["to"])
    queue = topics.from_snapshot(
        snap, sub.spec.rq_topic if f["queue"] == "rq" else sub.spec.dlq_topic
    )
    target = queue.storage(int(op[f"{f['queue']}_target_index"]))
    src_parts = queue.storage(queue.index_of(source)).partitions
    start: dict[str, int] = {}
    if f["queue"] == "dlq":  # an offset reset may have fast-forwarded the DLQ past some records
        doc = snap.get(subscriptions.KIND, name) or {}
        start = doc.get("state", {}).get("dlq_start", {}).get(source, {})
    starting = {source: {str(p): int(start.get(str(p), -2)) for p in range(src_parts)}}

    @F.pandas_udf("int")
    def partition_of(keys: pd.Series) -> pd.Series:
        return keys.map(lambda k: internal_target(k, route_by, to, target.partitions))

    kafka = kafka_clients.spark_options(catalog.settings)
    reading = kafka_clients.spark_source_options(catalog.settings)
    records = (
        spark.read.format("kafka")
        .options(**reading)
        .option("assign", json.dumps({source: list(range(src_parts))}))
        .option("startingOffsets", json.dumps(starting))
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    is_tick = F.coalesce(F.exists("headers", lambda h: h["key"] == TICK_HEADER), F.lit(False))
    copies = (
        records.where(~is_tick)
        .select("key", "value", "headers", group_key_column(sub.spec.grouped).alias("group_key"))
        .select("key", "value", "headers", partition_of("group_key").alias("partition"))
        .withColumn("fingerprint", _fingerprint())
        .dropDuplicates(["fingerprint"])
        .persist()
    )
    there = (
        spark.read.format("kafka")
        .options(**reading)
        .option("subscribe", target.name)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .option("kafka.isolation.level", "read_committed")
        .load()
        .select(_fingerprint().alias("fingerprint"))
        .persist()
    )
    try:
        n = copies.count()
        there.count()  # read here, so that the write below reads no Kafka topic
        missing = copies.join(there, "fingerprint", "left_anti").drop("fingerprint")
        try:
            (
                missing.write.format("kafka")
                .options(**kafka)
                .option("kafka.acks", "all")
                .option("topic", target.name)
                .save()
            )
        except Exception as e:  # Kafka's Java producer names only the topic: the feeder knows
            refused = kafka_clients.refusal(catalog.settings, e, writes={target.name})
            if refused is None:
                raise
            raise refused from e
    finally:
        copies.unpersist()
        there.unpersist()
    _mark_fed(catalog, name, source, n)
    return n


def _fingerprint():
    """A Kafka record's identity for the feeders: SHA-256 over its partition, key, value and
    headers (as JSON with base64 bytes, so no two different records share the input)."""
    from pyspark.sql import functions as F

    headers = F.transform(
        "headers", lambda h: F.struct(h["key"].alias("k"), F.base64(h["value"]).alias("v"))
    )
    doc = F.struct(
        F.col("partition").alias("p"),
        F.base64("key").alias("k"),
        F.base64("value").alias("v"),
        headers.alias("h"),
    )
    return F.sha2(F.to_json(doc).cast("binary"), 256)


def _mark_fed(catalog: Catalog, name: str, source: str, records: int) -> None:
    def change(snap: Snapshot):
        op = _require_op(snap, name)
        feeders = [
            dict(f, done=True, records=records, done_ms=int(time.time() * 1000))
            if f["source"] == source
            else f
            for f in op["feeders"]
        ]
        step = "done" if op["step"] == "feed" and all(f["done"] for f in feeders) else op["step"]
        return {key(OPERATION, operation_name(name)): _touch(op, feeders=feeders, step=step)}

    catalog.mutate(change)


__all__ = [
    "ChangeShards",
    "Feeder",
    "Plan",
    "ShardsRunning",
    "activated",
    "check_stopped",
    "check_target",
    "feed",
    "internal_target",
    "merge_positions",
    "new_shard_of",
    "plan_change",
    "reshard_tables",
    "text_plan",
]
