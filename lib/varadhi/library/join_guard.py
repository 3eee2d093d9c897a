"""A guard against a lost group join in kafka-python 3.0.x (the library runtime's only use of
its internals).

The bug. A consumer joins its group again when its subscription changes, when the broker asks
(a member came or went), and, on the group's leader, when the topic metadata it assigned with is
no longer the metadata it has (`_assignment_snapshot != _metadata_snapshot`). Only the last
cause is not remembered in the `rejoin_needed` flag: it is recomputed at each `poll`. A join is
one task (JoinGroup, the leader's assignment, SyncGroup) that a `poll` awaits for at most its
timeout; a poll that gives up leaves the task in flight for the next poll to await. But the
leader sets its assignment snapshot to the current metadata when it assigns, in the middle of
that task; a poll made after that and before the SyncGroup answer sees no reason to join,
never awaits the task, and the member holds nothing (its assignment is never applied, its
heartbeat stays off) until something else makes it join again: for good, on a quiet group.
It happens when the metadata comes after a join's assignment: a member started before its
client knew the topics' partitions (a topic just created, a loaded broker), or a subscribed
topic whose partitions changed.

The guard: while a join task exists (in flight, or finished and not taken), the member needs a
join, so each poll awaits that task (or, when it finished unawaited, joins once more).
`guard(consumer)` installs it on one consumer (its coordinator only: other consumers of the
process are untouched) and raises `VaradhiError` before anything starts when the installed
kafka-python has not the internals it relies on, rather than run unguarded.
"""

from __future__ import annotations

from types import MethodType

from kafka import KafkaConsumer

from varadhi.core.errors import VaradhiError


def guard(consumer: KafkaConsumer) -> None:
    """Make `consumer`'s group coordinator await every join it started (see the module)."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is None or not hasattr(coordinator, "_join_task"):
        import kafka

        raise VaradhiError(
            f"kafka-python {kafka.__version__} is not supported by the library runtime: its"
            " group coordinator has no join task to guard (varadhi.library.join_guard);"
            " install kafka-python 3.0.x"
        )
    unguarded = coordinator.need_rejoin

    def need_rejoin(self) -> bool:
        return self._join_task is not None or unguarded()

    coordinator.need_rejoin = MethodType(need_rejoin, coordinator)


def joining(consumer: KafkaConsumer) -> bool:
    """Whether `consumer` (guarded) needs a join or has one under way. Its polls must then
    wait: a join's task finished while no poll awaited it is done again (kafka-python drops a
    finished task's answer), so a member that only ever polls without a timeout joins again
    and again, for good (seen: every poll of 0 or 5 ms while the member read on)."""
    return consumer._coordinator.need_rejoin()


def subscribe(consumer: KafkaConsumer, topics: list[str], listener) -> None:
    """Subscribe `consumer` to `topics` so that its first join assigns with their partitions
    known and is its only one: a join made before the coordinator's metadata snapshot of the
    subscription is set assigns with an empty snapshot, and the next metadata update (within a
    second or so) makes the member join again at once, a rebalance on every member start that
    takes back what it handed out meanwhile (seen: one start in three on a loaded machine). The
    snapshot is set by a metadata update that comes after the subscription, so the metadata is
    fetched here, after subscribing and before the first poll (a fresh consumer has none
    cached, so its first look fetches)."""
    consumer.subscribe(topics=topics, listener=listener)
    for name in topics:
        consumer.partitions_for_topic(name)
