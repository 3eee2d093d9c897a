"""Offset reset of a `runtime: library` subscription: move its consumer group's offsets.

The position of such a subscription is the consumer group `varadhi-library.<subscription>`'s
committed offsets on the main topic's storage topic and the RQ, each with the library's commit
metadata (`varadhi.library.offsets`: which records above the offset finished already). A reset
commits new offsets with empty metadata, so everything from the new offset is read and delivered
again. What maps from the shards' reset (`varadhi.ops.offsets`), with the same plan and output
(`Plan`, `Move`; a move's `shard` is the slot):

- main: every option. The members' progress across the main topic's storage topics is their
  commits (`varadhi.library.crossing`: a slot crosses from T_i to T_i+1 once T_i is sealed and
  read to its end, and at a boundary that moves groups a commit on T_i+1 says a member crossed
  already), so a reset into storage topic T_k (`target_index`, picked as the shards' reset
  picks it) commits T_k at the offsets asked for, every earlier storage topic at its end
  offsets, and removes the group's commits on every later one (`plan_main`);
- rq: fast-forward only (`--to-latest`, `--to-datetime`, a positive `--shift-by`), as for
  shards: the retries skipped are dropped (a key never waits for them: no GroupState);
- dlq: fast-forward of where `dlq list` and `unsideline` start (`state.dlq_start`), as for shards;
  the group is not involved. Refused in block mode while a key is blocked (the GroupState topic,
  `varadhi.library.group_state_topic`): the members do not release a key whose dead letter a
  reset skips yet, so it would stay blocked with nothing left to re-drive.

Executing is refused, before any side effect, while a member may deliver (`status.ensure_members_idle`:
each must be stopped, or paused and reported paused while the subscription is paused). Then:
1. the plan, with absolute offsets, is recorded (`varadhi.library.position`, step
   `waiting-for-members`): members see it within 5 s and stop (paused ones too: a paused member
   stays in the group, and Kafka takes offsets committed from outside a group only while it has
   no member), and members being started refuse to (crash point
   `library_offset_reset_recorded`);
2. once the group has no member (waited for up to `EMPTY_WAIT_S`; else it fails and the plan
   stays recorded), the offsets are committed from outside the group (refused by Kafka if a
   member joined meanwhile; crash point `library_offset_reset_committed`), then the commits
   the plan drops are removed;
3. the operation is marked `done`: start the members, then resume the subscription.
A DLQ reset is steps 1 and 3 with the new start, no waiting. After a crash, the same command
resumes the recorded plan (a `--shift-by` or `--to-latest` is not evaluated again); once done,
it changes nothing while the offsets are where it left them (`decide`). Hazard: a member that
hung (`silent` in status, so not refused) and comes back after the reset while its session
lasted may commit its old positions; kill hung members first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from kafka import TopicPartition
from kafka.errors import KafkaError, NoError
from kafka.structs import OffsetAndMetadata

from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument, VaradhiError
from varadhi.core.faults import crash_point
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.library import group_state_topic
from varadhi.library.assign import slot_of
from varadhi.library.position import describe, reset_key
from varadhi.library.runtime import group_id
from varadhi.ops import status
from varadhi.ops.offsets import (
    Mode,
    Move,
    Offsets,
    Plan,
    Queue,
    kafka_offsets,
    plan_internal,
    target_offset,
)

OPERATION = DocKind.OPERATION
#: How long an execution waits for the members to leave the consumer group.
EMPTY_WAIT_S = 60.0
Committed = Mapping[TopicPartition, int]


def plan_main(
    sub: subscriptions.Subscription,
    main: topics.CompositeTopic,
    committed: Committed,
    kafka: Offsets,
    mode: Mode,
    value: Any,
) -> Plan:
    """Where the group reads the main topic after the reset (pure): the target storage topic
    T_k (`target_index`) at the offsets the mode asks for (`target_offset`; a partition without
    a commit counts from its log start), every earlier one at its end offsets, so the members
    cross past it (`varadhi.library.crossing`), and every later one with its commits removed
    (`Plan.dropped`): read from its log start once the members cross to it. A later storage
    topic keeps no commit, not even at its log start, because a commit there tells the members
    that one of them crossed already (`GroupView.crossed`), and at a boundary that moves groups
    they would then cross before the group finished T_k."""
    k = target_index(main, committed, kafka, mode, value)
    moves, dropped = [], []
    for i, st in enumerate(main.storage_topics):
        for p in range(st.partitions):
            begin, end = kafka.beginning[st.name][p], kafka.end[st.name][p]
            current = committed.get(TopicPartition(st.name, p))
            slot = slot_of(p, st.partitions, sub.shard_count)
            if i > k:
                if current is not None:
                    dropped.append(Move(slot, st.name, p, current, begin))
                continue
            if i < k:
                new = end
            else:
                at = kafka.at_time[st.name][p] if mode == "to-datetime" else None
                new = target_offset(mode, value, begin, end, at, current)
            moves.append(Move(slot, st.name, p, current, new))
    return Plan("main", mode, value, tuple(moves), {}, {}, tuple(dropped))


def target_index(
    main: topics.CompositeTopic, committed: Committed, kafka: Offsets, mode: Mode, value: Any
) -> int:
    """The storage topic of the main topic a reset moves the group into (pure), as the
    shards' reset picks it: the first (`to-earliest`); the one produce goes to (`to-latest`);
    the first with a record at or after the time, else the one produce goes to
    (`to-datetime`); storage topic `value` (`to-storage-topic`; refused after the one produce
    goes to: the members would read what is produced to that one meanwhile, and commits on the
    next would let them cross it before it is finished); for `shift-by`, the last one the group
    has a commit on (the first if none), refused while the group has not finished an earlier
    one (its slots read different storage topics: a shift within one would skip the rest of
    the other)."""
    n, pp = len(main.storage_topics), main.produce_pointer
    if mode == "to-earliest":
        return 0
    if mode == "to-latest":
        return pp
    if mode == "to-datetime":
        return next(
            (
                i
                for i, st in enumerate(main.storage_topics)
                if any(o is not None for o in kafka.at_time[st.name])
            ),
            pp,
        )
    if mode == "to-storage-topic":
        index = int(value)
        if not 0 <= index < n:
            raise InvalidArgument(
                f"storage topic index {index} is outside 0..{n - 1}", field="to_storage_topic"
            )
        if index > pp:
            raise InvalidArgument(
                f"{main.storage_topics[index].name} is not produced to yet (produce goes to "
                f"{main.produce_topic.name}): library members would read what is produced to "
                "that one meanwhile; use --to-latest, or switch produce first",
                field="to_storage_topic",
            )
        return index
    on = [
        i
        for i, st in enumerate(main.storage_topics)
        if any(tp.topic == st.name for tp in committed)
    ]
    k = max(on, default=0)
    for st in main.storage_topics[:k]:
        left = sum(
            max(0, end - committed.get(TopicPartition(st.name, p), kafka.beginning[st.name][p]))
            for p, end in enumerate(kafka.end[st.name])
        )
        if left:
            raise InvalidArgument(
                f"--shift-by moves the group within one storage topic, and its commits are on "
                f"{main.storage_topics[k].name} while {left} messages of {st.name} are not "
                "finished (its slots read different storage topics): wait until they are, or "
                "use --to-datetime or --to-storage-topic",
                field="queue",
            )
    return k


def plan_rq(
    sub: subscriptions.Subscription,
    rq: topics.CompositeTopic,
    committed: Committed,
    kafka: Offsets,
    mode: Mode,
    value: Any,
) -> Plan:
    """Where the group reads the RQ after a fast-forward (pure; `plan_internal`'s refusals)."""
    st = one_storage_topic(rq)
    consumed = {
        st.name: {str(tp.partition): o for tp, o in committed.items() if tp.topic == st.name}
    }
    current = dict.fromkeys(range(sub.shard_count), consumed)
    moves, _ = plan_internal("rq", sub, rq, current, kafka, mode, value)
    return Plan("rq", mode, value, tuple(moves), {}, {})


def plan_dlq(
    sub: subscriptions.Subscription,
    dlq: topics.CompositeTopic,
    start: Mapping[str, Mapping[str, int]],
    kafka: Offsets,
    mode: Mode,
    value: Any,
) -> Plan:
    """The DLQ's new start after a fast-forward (pure; as for shards)."""
    current = dict.fromkeys(range(sub.shard_count), dict(start))
    moves, new_positions = plan_internal("dlq", sub, dlq, current, kafka, mode, value)
    new_start: dict[str, dict[str, int]] = {}
    for per_slot in new_positions.values():
        new_start = dlq_ops.merged_scanned(new_start, per_slot)
    return Plan("dlq", mode, value, tuple(moves), {}, new_start)


def one_storage_topic(topic: topics.CompositeTopic) -> topics.StorageTopic:
    """The storage topic library members read of the RQ `topic`; refuses one with more (pure)."""
    if len(topic.storage_topics) != 1:
        raise InvalidArgument(
            f"{topic.name} has {len(topic.storage_topics)} storage topics: an RQ offset reset of "
            "a library subscription moves the commits of an RQ with one only (docs/library.md)",
            field="queue",
        )
    return topic.storage_topics[0]


def positions_now(
    plan: Plan, committed: Committed, dlq_start: Mapping[str, Mapping[str, int]]
) -> dict[str, int | None]:
    """Where the partitions `plan` moves or drops are now, `topic/partition` -> offset (None: no
    commit) (pure): the group's commits (main, RQ) or the DLQ's start."""
    out: dict[str, int | None] = {}
    for mv in (*plan.moves, *plan.dropped):
        if plan.queue == "dlq":
            raw = dlq_start.get(mv.topic, {}).get(str(mv.partition))
            out[f"{mv.topic}/{mv.partition}"] = None if raw is None else int(raw)
        else:
            out[f"{mv.topic}/{mv.partition}"] = committed.get(
                TopicPartition(mv.topic, mv.partition)
            )
    return out


def decide(
    op: Mapping[str, Any] | None, request: Mapping[str, Any], now: Mapping[str, int | None]
) -> str:
    """What executing `request` does given the recorded reset `op` (pure): `new` (plan now),
    `resume` (finish the recorded plan of the same request), or `done` (the same reset is done
    and the partitions it moved are still where it left them, those it dropped still without a
    commit: `now`, `positions_now` of the recorded plan). Raises InvalidArgument while a
    different reset is under way."""
    if not op:
        return "new"
    recorded = {k: op["plan"].get(k) for k in ("queue", "mode", "value")}
    same = recorded == dict(request)
    if op.get("step") != "done":
        if not same:
            raise InvalidArgument(
                f"an offset reset ({describe(recorded)}) is under way; run that command again "
                "to finish it first",
                field="queue",
            )
        return "resume"
    moved: dict[str, int | None] = {
        f"{mv['topic']}/{mv['partition']}": int(mv["new"]) for mv in op["plan"]["moves"]
    }
    moved |= {f"{mv['topic']}/{mv['partition']}": None for mv in op["plan"].get("dropped") or []}
    if same and all(now.get(k) == v for k, v in moved.items()):
        return "done"
    return "new"


# -- I/O ----------------------------------------------------------------------------------


def prepare(
    catalog: Catalog, name: str, queue: Queue, mode: Mode, value: Any = None
) -> tuple[Plan, str]:
    """The plan executing this request would carry out, and `decide`'s outcome."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    committed = status.group_committed(catalog, group_id(name))
    op = snap.get(OPERATION, reset_key(name))
    outcome = _decide(snap, name, op, {"queue": queue, "mode": mode, "value": value}, committed)
    if outcome != "new":
        assert op is not None
        return Plan.from_dict(op["plan"]), outcome
    at_ms = int(value) if mode == "to-datetime" else None
    topic = {"main": sub.spec.topic, "rq": sub.spec.rq_topic, "dlq": sub.spec.dlq_topic}[queue]
    composite = topics.from_snapshot(snap, topic)
    kafka = kafka_offsets(catalog, list(composite.storage_topics), at_ms)
    if queue == "main":
        return plan_main(sub, composite, committed, kafka, mode, value), outcome
    if queue == "rq":
        return plan_rq(sub, composite, committed, kafka, mode, value), outcome
    return plan_dlq(sub, composite, dlq_ops.dlq_start(snap, name), kafka, mode, value), outcome


def execute(catalog: Catalog, name: str, plan: Plan) -> tuple[Plan, str]:
    """Carry out `plan`, or the recorded plan of the same request (the module docstring);
    returns the plan carried out and the outcome (`new`, `resume`, or `done`: nothing to do)."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    status.ensure_members_idle(catalog, sub, "reset the offsets of")
    group = group_id(name)
    op = snap.get(OPERATION, reset_key(name))
    committed = status.group_committed(catalog, group)
    outcome = _decide(snap, name, op, plan.request(), committed)
    if outcome == "done":
        assert op is not None
        return Plan.from_dict(op["plan"]), outcome
    if outcome == "resume":
        assert op is not None
        plan, op_id = Plan.from_dict(op["plan"]), op["id"]
    else:
        if plan.queue == "dlq" and sub.spec.on_dead_letter == "block":
            held = group_state_topic.blocked_count(catalog.settings, name)
            if held:
                raise InvalidArgument(
                    f"{held} keys of {name} are blocked behind dead letters, and the library"
                    " runtime does not release a key whose dead letter a DLQ reset skips yet:"
                    " re-drive them first (varadhi dlq unsideline --group-ids ...)",
                    field="queue",
                )
        op_id = _record(catalog, name, plan)
        crash_point("library_offset_reset_recorded")
    if plan.queue != "dlq":
        wait_until_empty(catalog.settings, group, EMPTY_WAIT_S)
        commit(catalog.settings, group, plan.moves)
        crash_point("library_offset_reset_committed")
        drop(catalog.settings, group, plan.dropped)
    _finish(catalog, name, plan, op_id)
    return plan, outcome


def _decide(snap: Snapshot, name: str, op, request: Mapping[str, Any], committed: Committed) -> str:
    now = {}
    if op and "plan" in op:
        now = positions_now(Plan.from_dict(op["plan"]), committed, dlq_ops.dlq_start(snap, name))
    return decide(op, request, now)


def wait_until_empty(settings, group: str, timeout_s: float) -> None:
    """Wait until consumer group `group` has no member; VaradhiError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        members = status.group_members(settings, group)
        if not members:
            return
        if time.monotonic() > deadline:
            raise VaradhiError(
                f"consumer group {group} still has members after {timeout_s:g} s "
                f"({', '.join(members)}): stop them, then run the same command again to finish "
                "the reset"
            )
        time.sleep(0.5)


def commit(settings, group: str, moves: tuple[Move, ...]) -> None:
    """Commit each move's new offset for `group`, with no metadata (nothing finished above it).
    Kafka refuses it while the group has a member."""
    offsets = {
        TopicPartition(mv.topic, mv.partition): OffsetAndMetadata(mv.new, "", -1) for mv in moves
    }
    if not offsets:
        return
    admin = kafka_clients.admin(settings, client_id="varadhi-offset-reset")
    try:
        answers = admin.alter_group_offsets(group, offsets)
    finally:
        admin.close()
    _refused(group, "the new offsets", answers)


def drop(settings, group: str, moves: tuple[Move, ...]) -> None:
    """Remove `group`'s commits on each move's partition (nothing there is left as it is).
    Kafka refuses it while the group has a member."""
    if not moves:
        return
    admin = kafka_clients.admin(settings, client_id="varadhi-offset-reset")
    try:
        partitions = [TopicPartition(mv.topic, mv.partition) for mv in moves]
        answers = admin.delete_group_offsets(group, partitions)
    except KafkaError as e:  # the whole request refused: the group is not empty
        answers = {TopicPartition(mv.topic, mv.partition): type(e) for mv in moves}
    finally:
        admin.close()
    _refused(group, "the removal of the commits", answers)


def _refused(group: str, what: str, answers: Mapping[TopicPartition, type]) -> None:
    refused = sorted(
        f"{tp.topic}/{tp.partition}: {e.__name__}" for tp, e in answers.items() if e is not NoError
    )
    if refused:
        raise VaradhiError(
            f"Kafka refused {what} of {group} ({'; '.join(refused[:3])}): a member may "
            "have joined; stop it, then run the same command again to finish the reset"
        )


def _record(catalog: Catalog, name: str, plan: Plan) -> str:
    """Step 1: record the plan, with absolute offsets, before anything changes."""
    op_id = uuid.uuid4().hex
    doc = {
        "kind": OpKind.OFFSET_RESET,
        "runtime": "library",
        "step": "waiting-for-members",
        **plan.summary(),
        "id": op_id,
        "started_ms": int(time.time() * 1000),
        "plan": plan.to_dict(),
    }

    def change(snap: Snapshot):
        current = snap.get(OPERATION, reset_key(name))
        if current and current.get("step") != "done":
            raise InvalidArgument(
                f"another offset reset of {name} started meanwhile; run the command again",
                field="subscription",
            )
        return {key(OPERATION, reset_key(name)): doc}

    catalog.mutate(change)
    return op_id


def _finish(catalog: Catalog, name: str, plan: Plan, op_id: str) -> None:
    """Step 3, one catalog write: the DLQ's new start (a DLQ reset); the reset is done."""

    def change(snap: Snapshot):
        op = snap.get(OPERATION, reset_key(name)) or {}
        if op.get("id") != op_id:
            raise VaradhiError(f"the offset reset of {name} was replaced during the reset")
        if op.get("step") == "done":
            return {}
        out: dict[str, Any] = {
            key(OPERATION, reset_key(name)): dict(
                op, step="done", finished_ms=int(time.time() * 1000)
            )
        }
        if plan.dlq_start:
            doc = snap.get(subscriptions.KIND, name)
            if doc is None:
                raise VaradhiError(f"subscription {name} disappeared during the reset")
            state = dict(doc["state"], dlq_start=plan.dlq_start)
            out[key(subscriptions.KIND, name)] = dict(doc, state=state)
        return out

    catalog.mutate(change)
