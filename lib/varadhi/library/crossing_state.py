"""The crossing state of a library member: which storage topics of the main topic each slot it
holds reads, and the walk that moves a slot over a boundary (the rules: `crossing`).

`CrossingState` holds the main topic as last seen, its storage topics' indexes by name, per
slot held its *frontier* (the last storage topic it reads; a new slot starts at 0), what its
slots wait for at a boundary that moves groups (for status), and when it looks next. `cross`
walks each slot's frontier over every boundary it may cross, asking Kafka only through a
`Boundary` (`KafkaBoundary`: the member's consumer, its offsets client).

Threads. The member's Kafka thread owns it: it follows the catalog (`follow`), crosses, and
opens and forgets slots (`open`, `forget`: the caller holds the member's lock, as health and the
engine's thread read `frontiers` and `is_main` under it). `follow` replaces the index mapping
as a whole, so a reader on another thread sees the old one or the new one, never a mix.

Hazards. A slot is held past its frontier only for a grouped subscription (`past_frontier`:
an ungrouped one has no order to keep and reads every storage topic at once). The walk stops at
a slot's partition that is no longer assigned (revoked meanwhile: its next owner crosses), and
looks at a boundary's group view at most once per walk (it is read from Kafka: commits, ends,
the GroupState topic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kafka import TopicPartition

from varadhi.core import routing
from varadhi.kafka import topics
from varadhi.library import crossing
from varadhi.library.assign import slot_of


def past_frontier(index: int, frontier: int | None) -> bool:
    """Whether a partition of storage topic `index` of the main topic is past its slot's
    `frontier` (None: the slot is not held, so nothing of it is held back): not read yet."""
    return frontier is not None and index > frontier


class Boundary(Protocol):
    """What a walk over the boundaries asks of Kafka (one look: `CrossingState.cross`)."""

    def read_to_end(self, slot: int, old: topics.StorageTopic) -> bool:
        """Whether the member read `slot`'s partitions of `old` to their end offsets (False
        too when one of them is no longer assigned to it)."""
        ...

    def group_view(
        self, old: topics.StorageTopic, nxt: topics.StorageTopic
    ) -> crossing.GroupView: ...


class CrossingState:
    """See the module docstring. `slots`: the subscription's slot count; `grouped`: whether it
    keeps an order (else no slot is ever held)."""

    def __init__(self, main: topics.CompositeTopic, slots: int, grouped: bool):
        self.slots = slots
        self.grouped = grouped
        self.follow(main)
        self._frontier: dict[int, int] = {}
        self.waiting: str | None = None  # what a slot waits for at a K=1 boundary (status)
        self._next_look = 0.0  # monotonic

    def follow(self, main: topics.CompositeTopic) -> None:
        """Read the storage topics of `main` (its record as now in the catalog)."""
        self.main = main
        self._index = {st.name: i for i, st in enumerate(main.storage_topics)}

    def names(self) -> list[str]:
        """The storage topics' names, in order."""
        return list(self._index)

    def is_main(self, topic: str) -> bool:
        """Whether `topic` is a storage topic of the main topic."""
        return topic in self._index

    def index_of(self, topic: str) -> int:
        """The index of storage topic `topic` (KeyError: not one of the main topic's)."""
        return self._index[topic]

    def slot(self, topic: str, partition: int) -> int:
        """The slot of a partition of a storage topic of the main topic."""
        return slot_of(partition, self.main.storage(self._index[topic]).partitions, self.slots)

    def held(self, tp: TopicPartition) -> bool:
        """Whether `tp` is a main-topic partition past its slot's frontier (`past_frontier`).
        Never for an ungrouped subscription (no order to keep)."""
        index = self._index.get(tp.topic)
        if index is None or not self.grouped:
            return False
        return past_frontier(index, self._frontier.get(self.slot(tp.topic, tp.partition)))

    def frontiers(self) -> dict[int, int]:
        """Per slot held, its frontier (sorted by slot)."""
        return dict(sorted(self._frontier.items()))

    def open(self, slots: set[int]) -> None:
        """New slots start at the first storage topic (slots held already keep theirs)."""
        for slot in slots:
            self._frontier.setdefault(slot, 0)

    def forget(self, slots: set[int]) -> None:
        for slot in slots:
            self._frontier.pop(slot, None)

    def look_now(self) -> None:
        """The next `due` says yes (new slots look at their boundaries at once)."""
        self._next_look = 0.0

    def due(self, now: float, every_s: float) -> bool:
        """Whether to look at the boundaries now (monotonic `now`); if so the next look is
        `every_s` later."""
        if now < self._next_look:
            return False
        self._next_look = now + every_s
        return True

    def crossed_all(self) -> bool:
        """Whether there is nothing to cross: ungrouped, or every slot reads the last storage
        topic."""
        last = len(self.main.storage_topics) - 1
        return not self.grouped or all(f >= last for f in self._frontier.values())

    def note_waiting(self, waiting: str | None) -> bool:
        """Set what the slots wait for; whether it changed (status shows it at once)."""
        if waiting == self.waiting:
            return False
        self.waiting = waiting
        return True

    def cross(
        self, mq: topics.CompositeTopic, now_ms: int, boundary: Boundary
    ) -> tuple[list[tuple[int, str]], str | None]:
        """Move each slot's frontier over every boundary it may cross (`mq`: the main topic as
        now in the catalog, `now_ms` the time its seals are judged at): the slots moved with the
        storage topic each now reads, and what a slot waits for at a boundary that moves groups
        (None: nothing; the caller notes it)."""
        last = len(self.main.storage_topics) - 1
        views: dict[int, crossing.GroupView] = {}
        waiting = None
        moved = []
        for slot, frontier in sorted(self._frontier.items()):
            f = frontier
            while f < last and topics.sealed(mq, f, now_ms, topics.SEAL_GRACE_MS):
                old, nxt = mq.storage(f), mq.storage(f + 1)
                if not boundary.read_to_end(slot, old):
                    break
                if crossing.moves_groups(old, nxt, self.slots):
                    if f not in views:
                        views[f] = boundary.group_view(old, nxt)
                    if not crossing.group_quiet(views[f]):
                        waiting = crossing.waiting_text(old.name, nxt.name, views[f])
                        break
                f += 1
            if f != frontier:
                self._frontier[slot] = f
                moved.append((slot, mq.storage(f).name))
        return moved, waiting


class KafkaBoundary:
    """`Boundary` from Kafka, for one look: `consumer` (the member's: its assignment, as at
    this look, and positions), `offsets` (a consumer of the group that never joins it: end
    offsets and the group's commits), `rq` (the RQ's storage topic), `slots` (the slot count),
    `blocked_count` (block mode: how many keys the GroupState topic holds blocked; None
    otherwise)."""

    def __init__(
        self,
        consumer,
        offsets,
        rq: topics.StorageTopic,
        slots: int,
        blocked_count: Callable[[], int] | None,
    ):
        self.consumer = consumer
        self.offsets = offsets
        self.rq = rq
        self.slots = slots
        self.blocked_count = blocked_count
        self.owned = consumer.assignment()

    def read_to_end(self, slot: int, old: topics.StorageTopic) -> bool:
        tps = [
            TopicPartition(old.name, p)
            for p in routing.shard_partitions(slot, self.slots, old.partitions)
        ]
        if not all(tp in self.owned for tp in tps):  # revoked meanwhile
            return False
        ends = self.offsets.end_offsets(tps) if tps else {}
        positions = {tp.partition: self.consumer.position(tp) for tp in tps}
        return crossing.read_to_end(positions, {tp.partition: ends[tp] for tp in tps})

    def group_view(self, old: topics.StorageTopic, nxt: topics.StorageTopic) -> crossing.GroupView:
        """What the group's commits, the end offsets and the GroupState topic say of the
        boundary from `old` to `nxt` (`crossing.GroupView`). The commits are read before the
        end offsets: a retry written after its message's commit is then within the ends read."""
        offsets = self.offsets
        old_tps = [TopicPartition(old.name, p) for p in range(old.partitions)]
        rq_tps = [TopicPartition(self.rq.name, p) for p in range(self.rq.partitions)]
        nxt_tps = [TopicPartition(nxt.name, p) for p in range(nxt.partitions)]
        crossed = any(offsets.committed(tp) is not None for tp in nxt_tps)
        committed = {tp: offsets.committed(tp) for tp in [*old_tps, *rq_tps]}
        unset = [tp for tp, c in committed.items() if c is None]
        starts = offsets.beginning_offsets(unset) if unset else {}
        position = {tp: starts[tp] if c is None else c for tp, c in committed.items()}
        ends = offsets.end_offsets([*old_tps, *rq_tps])
        blocked = 0
        if self.blocked_count is not None and not crossed:
            blocked = self.blocked_count()
        return crossing.GroupView(
            old_committed={tp.partition: position[tp] for tp in old_tps},
            old_ends={tp.partition: ends[tp] for tp in old_tps},
            rq_committed={str(tp.partition): position[tp] for tp in rq_tps},
            rq_ends={str(tp.partition): ends[tp] for tp in rq_tps},
            crossed=crossed,
            blocked=blocked,
        )
