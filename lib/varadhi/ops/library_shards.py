"""Changing the shard count of a `runtime: library` subscription (`subscription change-shards`).

Library members are given slots, slot s being every partition shard s would own of the main
topic's storage topics, the RQ and the DLQ (`varadhi.library.assign`); each member reads the
shard count from the catalog when it starts. The shards' change makes new RQ/DLQ storage topics,
feeders, GroupState and reader layouts (`varadhi.ops.change_shards`), none of which the members
need: the library's change is in place: the
topics stay and one catalog transaction sets the new count in the subscription's record (the
state's `shard_count`, the spec's `shards`) and records the operation, done
(`operation/<sub>/change-shards`, `runtime: library`). Members started afterwards read it.

Order. A key's main-topic partition, its RQ partition and its DLQ partition lie in one slot
(`routing.internal_partition` over the slot's range). When the new count divides the old one (a
merge) the slots nest: every partition of old slot s is in new slot s * to // from (the
ranges' bounds of the new count are bounds of the old one), so each key's partitions stay
together, retries pending in the RQ and dead letters included. Otherwise (a split) a key's
main-topic partition may go to another slot than its RQ copy or its dead letter, whose later
re-drive goes to the RQ partitions of the slot that reads the DLQ partition: that slot's member
would deliver them while another member delivers the key's later messages. So a split is
refused while the RQ holds records past the group's commits (`pending_records`) or the DLQ
holds dead letters past its start (which `dlq unsideline` could re-drive).

Refusals, all before any side effect (exit 2; `decide`): a count that is not a positive integer
or is the current one; a subscription that is not paused; a consumer group with a member (a
member reads the count once, at start; paused members stay in the group: stop them); an
operation of the subscription in progress; a main topic, RQ or DLQ with more than one storage
topic; a count that does not divide the RQ's or the DLQ's partitions (the spec's rule: every
slot owns as many), or the main topic's unless `allow_uneven`; a split with pending retries or
re-drivable dead letters. Paused because of the one race left: a member started after the
check and before the write reads the old count; paused, it hands out nothing, and it stops
(exit 1) when it sees the edit within 5 s, before the subscription can be resumed.

Hazard: the shards' checkpoints and reader layouts are not touched. A subscription moved back to
Spark afterwards has shards of a count they never ran at: set their position with `offsets
reset` before starting them (docs/library.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import TopicPartition

from varadhi.core import routing
from varadhi.core.catalog_kinds import OpKind
from varadhi.core.errors import InvalidArgument
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.library.runtime import group_id
from varadhi.ops import status
from varadhi.ops.change_shards_plan import (
    OPERATION,
    check_count,
    check_target,
    finished,
    operation_name,
)
from varadhi.ops.lifecycle import busy_refusal, operations_in_progress
from varadhi.ops.offsets import kafka_offsets


@dataclass(frozen=True)
class Plan:
    """A library subscription's change from `from_shards` to `to_shards` slots, in place.
    `slots`: per new slot, the partitions it owns of each storage topic (main, RQ, DLQ)."""

    name: str
    from_shards: int
    to_shards: int
    merge: bool  # the new count divides the old: slots nest
    slots: tuple[dict[str, list[int]], ...]
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "subscription": self.name,
            "runtime": "library",
            "from": self.from_shards,
            "to": self.to_shards,
            "merge": self.merge,
            "slots": [dict(s) for s in self.slots],
            "warnings": list(self.warnings),
        }


def pending_records(
    start: Mapping[TopicPartition, int], begin: Sequence[int], end: Sequence[int], topic: str
) -> int:
    """Records of storage topic `topic` past `start` (a partition without one: from its log
    start) up to its end (pure): the RQ's past the group's commits, the DLQ's past its start."""
    return sum(
        max(0, e - max(b, start.get(TopicPartition(topic, p), b)))
        for p, (b, e) in enumerate(zip(begin, end, strict=True))
    )


def decide(
    sub: Subscription,
    main: CompositeTopic,
    rq: CompositeTopic,
    dlq: CompositeTopic,
    to: Any,
    allow_uneven: bool,
    members: Sequence[str] | None,
    busy: Mapping[str, str],
    pending_rq: int,
    redrivable_dlq: int,
) -> Plan:
    """The plan, or the refusal (`InvalidArgument`) of changing `sub` to `to` slots (pure; the
    module docstring). `members`: the consumer group's (`status.group_members`); `busy`: the
    operations in progress (`lifecycle.operations_in_progress`); `pending_rq`, `redrivable_dlq`:
    `pending_records` of the RQ and the DLQ."""
    check_count(sub, to)
    old = sub.shard_count
    if not sub.paused:
        raise InvalidArgument(
            f"subscription {sub.name} (runtime: library) must be paused to change its shard "
            f"count: `varadhi subscription pause {sub.name}`, stop its members, then run "
            "change-shards again",
            field="subscription",
        )
    if members:
        raise InvalidArgument(
            f"cannot change the shard count of {sub.name} while its consumer group "
            f"{group_id(sub.name)} has members: {', '.join(members)}; each reads the count when "
            "it starts: stop them (SIGTERM to `varadhi-consumer`, `Consumer.stop()`; a killed "
            "one leaves the group after its session timeout, 45 s by default), then run "
            "change-shards again and start them",
            field="subscription",
        )
    if busy:
        raise busy_refusal(f"change the shard count of {sub.name}", busy)
    for topic in (main, rq, dlq):
        if len(topic.storage_topics) != 1:
            # the members' progress across the main topic's switches is only their commits, and
            # a new count changes which switches keep groups in their slots (`crossing`)
            raise InvalidArgument(
                f"{topic.name} has {len(topic.storage_topics)} storage topics: the library "
                "runtime changes the shard count of a subscription whose topics have one only "
                "(docs/library.md)",
                field="subscription",
            )
    queues = rq.storage_topics[0], dlq.storage_topics[0]
    uneven = [f"{q.name} ({q.partitions} partitions)" for q in queues if q.partitions % to]
    if uneven:
        most = min(q.partitions for q in queues)
        counts = [
            d for d in range(1, most + 1) if d != old and all(q.partitions % d == 0 for q in queues)
        ]
        raise InvalidArgument(
            f"cannot change {sub.name} to {to} shards: {to} does not divide "
            f"{' and '.join(uneven)}, and every slot must own as many RQ and DLQ partitions; "
            f"counts that do: {', '.join(map(str, counts)) or 'none'} (the library's change "
            "keeps its queues)",
            field="to",
        )
    warnings = check_target(main, 0, to, allow_uneven, sub.spec.grouped)
    merge = old % to == 0
    if not merge and (pending_rq or redrivable_dlq):
        waiting = []
        if pending_rq:
            waiting.append(
                f"{pending_rq} records in the RQ past the group's commits (retries not yet "
                "delivered or dead-lettered: start the members and let them finish, or drop them "
                f"with `varadhi offsets reset {sub.name} --queue rq --to-latest --execute`)"
            )
        if redrivable_dlq:
            waiting.append(
                f"{redrivable_dlq} dead letters that `dlq unsideline` could re-drive (re-drive "
                "them first, or give them up with `varadhi offsets reset "
                f"{sub.name} --queue dlq --to-latest --execute`)"
            )
        raise InvalidArgument(
            f"cannot split {sub.name} from {old} to {to} shards while a key's RQ copy or dead "
            f"letter would be read by another slot than its later messages: {'; '.join(waiting)}"
            f"; a count that divides {old} has no such condition",
            field="to",
        )
    storages = (main.storage_topics[0], *queues)
    slots = tuple(
        {st.name: routing.shard_partitions(s, to, st.partitions) for st in storages}
        for s in range(to)
    )
    return Plan(sub.name, old, to, merge, slots, tuple(warnings))


def changed(doc: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """The subscription's record with the plan's count (pure): the state's `shard_count` and the
    spec's `shards` (the RQ/DLQ and their partition counts stay)."""
    state = dict(doc["state"], shard_count=plan.to_shards)
    return {**doc, "spec": dict(doc["spec"], shards=plan.to_shards), "state": state}


def text_plan(plan: Plan) -> str:
    """The dry run as text."""
    kind = "a merge: slots nest" if plan.merge else "a split"
    lines = [
        f"change-shards {plan.name} (runtime: library): {plan.from_shards} -> "
        f"{plan.to_shards} slots, {kind}; in place: one catalog write (the same topics; "
        "members read the new count when they start)",
        "slots after:",
    ]
    for s, owned in enumerate(plan.slots):
        parts = "  ".join(f"{t} {_span(p)}" for t, p in owned.items())
        lines.append(f"  slot {s}: {parts}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _span(partitions: Sequence[int]) -> str:
    if not partitions:
        return "-"
    return f"[{partitions[0]}..{partitions[-1]}]" if len(partitions) > 1 else f"[{partitions[0]}]"


# -- I/O ----------------------------------------------------------------------------------


def plan(catalog: Catalog, name: str, to: Any, allow_uneven: bool = False) -> Plan:
    """`decide` on what the catalog and Kafka say now; reads only."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    spec = sub.spec
    main, rq, dlq = (
        topics.from_snapshot(snap, t) for t in (spec.topic, spec.rq_topic, spec.dlq_topic)
    )
    members = status.group_members(catalog.settings, group_id(name))
    busy = operations_in_progress(snap, name, sub.shard_count)
    pending_rq = redrivable = 0
    if len(rq.storage_topics) == 1 and len(dlq.storage_topics) == 1:
        rq_st, dlq_st = rq.storage_topics[0], dlq.storage_topics[0]
        kafka = kafka_offsets(catalog, [rq_st, dlq_st], None)
        committed = status.group_committed(catalog, group_id(name))
        pending_rq = pending_records(committed, *_range(kafka, rq_st), rq_st.name)
        start = {
            TopicPartition(t, int(p)): o
            for t, parts in dlq_ops.dlq_start(snap, name).items()
            for p, o in parts.items()
        }
        redrivable = pending_records(start, *_range(kafka, dlq_st), dlq_st.name)
    return decide(sub, main, rq, dlq, to, allow_uneven, members, busy, pending_rq, redrivable)


def _range(kafka, st: StorageTopic) -> tuple[list[int], list[int]]:
    return kafka.beginning[st.name], kafka.end[st.name]


def execute(
    catalog: Catalog,
    name: str,
    to: Any,
    allow_uneven: bool = False,
    log: Callable[[str], None] = lambda _line: None,
) -> dict[str, Any]:
    """Plan, then the one catalog transaction (which checks again that the record is the one
    planned from: still paused, at the old count, no operation started meanwhile). Returns the
    operation document; the same command after it did its change does nothing."""
    snap = catalog.snapshot()
    op = snap.get(OPERATION, operation_name(name))
    if finished(op, subscriptions.from_snapshot(snap, name), to):
        assert op is not None
        log(f"the change of {name} to {to} shards is done; nothing to do")
        return op
    planned = plan(catalog, name, to, allow_uneven)
    for w in planned.warnings:
        log(f"warning: {w}")
    now = int(time.time() * 1000)
    doc = {
        "kind": OpKind.CHANGE_SHARDS,
        "runtime": "library",
        "from": planned.from_shards,
        "to": planned.to_shards,
        "step": "done",
        "started_ms": now,
        "finished_ms": now,
    }

    def change(current: Snapshot):
        record = current.get(subscriptions.KIND, name)
        sub = subscriptions.from_snapshot(current, name)
        if sub.shard_count != planned.from_shards or not sub.paused:
            raise InvalidArgument(
                f"subscription {name} changed meanwhile; run change-shards again",
                field="subscription",
            )
        if operations_in_progress(current, name, sub.shard_count):
            raise InvalidArgument(
                f"an operation of {name} started meanwhile; run change-shards again",
                field="subscription",
            )
        return {
            key(subscriptions.KIND, name): changed(record, planned),
            key(OPERATION, operation_name(name)): doc,
        }

    catalog.mutate(change)
    log(f"subscription {name} now has {planned.to_shards} slots")
    return doc
