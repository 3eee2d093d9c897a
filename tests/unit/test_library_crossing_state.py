"""A library member's crossing state (`varadhi.library.crossing_state`): which partitions it holds
back, and the walk that moves a slot's frontier over storage-topic boundaries (pure, no
services: the walk's Kafka look-ups are a table here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kafka import TopicPartition

from varadhi.kafka.topics import CompositeTopic, add_storage, new_topic, switch_produce
from varadhi.library import crossing
from varadhi.library.crossing_state import CrossingState, past_frontier

NOW = 10_000_000


def _main(*partitions: int, switched: int = 0) -> CompositeTopic:
    """A main topic with storage topics of `partitions`, produce moved `switched` times, long
    ago (those are sealed)."""
    topic = new_topic("t", partitions[0])
    for p in partitions[1:]:
        topic, _ = add_storage(topic, p)
    for _ in range(switched):
        topic = switch_produce(topic, 0)
    return topic


@dataclass
class _Boundary:
    """The walk's look-ups as tables: slots not read to the end of a storage topic (by name),
    and the group view of each boundary (by the old topic's name; quiet when absent)."""

    unread: set[tuple[int, str]] = field(default_factory=set)
    views: dict[str, crossing.GroupView] = field(default_factory=dict)
    asked: list[str] = field(default_factory=list)

    def read_to_end(self, slot, old):
        return (slot, old.name) not in self.unread

    def group_view(self, old, nxt):
        self.asked.append(old.name)
        quiet = crossing.GroupView({}, {}, {}, {}, crossed=False, blocked=0)
        return self.views.get(old.name, quiet)


def test_a_partition_is_past_its_frontier_only_when_its_slot_is_held_behind_it():
    assert past_frontier(2, 1)
    assert not past_frontier(1, 1)
    assert not past_frontier(0, 1)
    assert not past_frontier(3, None)  # the slot is not held: nothing to hold back


def test_a_new_slot_reads_the_first_storage_topic_and_holds_the_later_ones_back():
    main = _main(2, 4)  # t.000 -> t.001 (K=2)
    state = CrossingState(main, slots=2, grouped=True)
    t0, t1 = (st.name for st in main.storage_topics)
    state.open({0})
    assert state.frontiers() == {0: 0}
    assert not state.held(TopicPartition(t0, 0))
    assert state.held(TopicPartition(t1, 0))  # slot 0's partition of t.001
    assert not state.held(TopicPartition(t1, 2))  # slot 1's: not held by this member
    assert not state.held(TopicPartition("t.rq", 0))  # not the main topic's
    ungrouped = CrossingState(main, slots=2, grouped=False)
    ungrouped.open({0})
    assert not ungrouped.held(TopicPartition(t1, 0)) and ungrouped.crossed_all()
    state.forget({0})
    assert state.frontiers() == {} and not state.held(TopicPartition(t1, 0))


def test_a_slot_crosses_sealed_boundaries_it_read_to_the_end_one_at_a_time():
    main = _main(2, 4, 8, switched=1)  # t.000 sealed; t.001 takes writes; t.002 after it
    state = CrossingState(main, slots=2, grouped=True)
    state.open({0, 1})
    names = [st.name for st in main.storage_topics]
    look = _Boundary(unread={(1, names[0])})
    moved, waiting = state.cross(main, NOW, look)
    assert moved == [(0, names[1])] and waiting is None  # not past t.001: not sealed
    assert state.frontiers() == {0: 1, 1: 0}
    assert not look.asked  # K=2 and K=2: groups stay in their slots
    assert not state.crossed_all()


def test_at_a_boundary_that_moves_groups_slots_wait_for_the_group_and_look_once():
    main = _main(4, 3, switched=1)  # 4 -> 3: K=1, groups move to other slots
    state = CrossingState(main, slots=2, grouped=True)
    state.open({0, 1})
    t0, t1 = (st.name for st in main.storage_topics)
    behind = crossing.GroupView({0: 1}, {0: 2}, {}, {}, crossed=False, blocked=0)
    look = _Boundary(views={t0: behind})
    moved, waiting = state.cross(main, NOW, look)
    assert moved == [] and waiting == crossing.waiting_text(t0, t1, behind)
    assert look.asked == [t0]  # one look for both slots
    assert state.note_waiting(waiting) and not state.note_waiting(waiting)
    moved, waiting = state.cross(main, NOW, _Boundary())
    assert moved == [(0, t1), (1, t1)] and waiting is None
    assert state.crossed_all() and state.note_waiting(None)


def test_an_unsealed_boundary_is_not_crossed_and_looks_are_paced():
    main = _main(2, 4, switched=1)
    recent = switch_produce(_main(2, 4), NOW - 1)  # switched within the producers' grace
    state = CrossingState(main, slots=1, grouped=True)
    state.open({0})
    assert state.cross(recent, NOW, _Boundary()) == ([], None)
    assert state.due(100.0, 1.0) and not state.due(100.5, 1.0) and state.due(101.0, 1.0)
    state.look_now()
    assert state.due(101.1, 1.0)
