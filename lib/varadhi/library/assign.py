"""Which member of a subscription's consumer group reads which partitions.

A message that fails goes to the retry queue (RQ) on a partition chosen from its ordering key,
and its key's later messages wait until that copy is delivered. Retries are not in the
GroupState topic (only blocked keys are: `group_state_topic`), so the member that waits must be
the member that reads the copy back.
So members are given whole *slots*: slot s is every partition the subscription's shard s owns
(`routing.shard_partitions` over the subscription's shard count: its ranges of each storage
topic of the main topic, the RQ and the DLQ), and a failed message goes to an RQ partition of its own
slot (`routing.internal_partition`), exactly where a shard would write it. A subscription's
records therefore have one layout under either runtime; more members than slots leave the
extra members idle (docs/library.md).

`spread` is the pure decision; `SlotAssignor` is kafka-python's assignor around it (every member
is built with the same shard count, read from the catalog).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from kafka.coordinator.assignors.abstract import (
    AbstractPartitionAssignor,
    ConsumerProtocolAssignment,
    ConsumerProtocolSubscription,
)

from varadhi.core import routing

NAME = "varadhi-slots"


def spread(members: Sequence[str], slots: int) -> dict[str, list[int]]:
    """Slots per member: sorted members, each a contiguous run, the first ones one more when
    they do not divide evenly; a member beyond `slots` gets none."""
    ordered = sorted(members)
    out: dict[str, list[int]] = {}
    for i, member in enumerate(ordered):
        start = i * slots // len(ordered)
        end = (i + 1) * slots // len(ordered)
        out[member] = list(range(start, end))
    return out


def in_flight_share(limit: int, held: Iterable[int], slots: int) -> int:
    """Requests a member holding the slots `held` of `slots` may have in flight: its slots'
    parts of the subscription's `limit` (slot s has `limit * (s + 1) // slots - limit * s //
    slots`, so the parts of all slots sum to `limit` exactly), and at least 1 while it holds a
    slot, so that every member goes on: with fewer requests allowed than members holding slots,
    the members' sum exceeds `limit` by those whose part is 0. 0 when it holds none."""
    if slots < 1 or limit < 1:
        raise ValueError(f"a limit and a slot count of at least 1, not {limit} and {slots}")
    held = set(held)
    if not held <= set(range(slots)):
        raise ValueError(f"slots are 0 to {slots - 1}, not {sorted(held)}")
    if not held:
        return 0
    part = sum(limit * (s + 1) // slots - limit * s // slots for s in held)
    return max(part, 1)


def slot_of(partition: int, partitions: int, slots: int) -> int:
    """The slot (shard) that owns `partition` of a topic with `partitions` partitions."""
    return routing.shard_of_partition(partition, slots, partitions)


class SlotAssignor(AbstractPartitionAssignor):
    """Assigns by slot (`spread`, `slot_of`) the partitions of every topic all members
    subscribe to."""

    name = NAME
    version = 0

    def __init__(self, slots: int):
        self.slots = slots

    def assign(self, cluster, members):
        by_member = spread([member.member_id for member in members], self.slots)
        owner = {s: member for member, ss in by_member.items() for s in ss}
        # a topic only once every member reads it: a member that has not yet subscribed to a
        # storage topic just added rejects an assignment with its partitions (kafka-python
        # 3.0.12 then holds nothing of it and joins again: one more rebalance)
        topics = sorted(set.intersection(*(set(member.metadata.topics) for member in members)))
        assignment: dict[str, dict[str, list[int]]] = defaultdict(dict)
        for topic in topics:
            partitions = sorted(cluster.partitions_for_topic(topic) or ())
            for p in partitions:
                member = owner[slot_of(p, len(partitions), self.slots)]
                assignment[member].setdefault(topic, []).append(p)
        return {
            member.member_id: ConsumerProtocolAssignment(
                self.version, sorted(assignment[member.member_id].items()), b""
            )
            for member in members
        }

    def metadata(self, topics):
        return ConsumerProtocolSubscription(self.version, list(topics), b"")

    def on_assignment(self, assignment, generation=None):
        pass
