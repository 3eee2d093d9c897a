"""Crossing a main-topic storage-topic boundary: which crossings keep groups on their shards, and
when shards waiting at a boundary may move on (pure)."""

from __future__ import annotations

import itertools

import pytest

from varadhi.core import routing
from varadhi.kafka.topics import StorageTopic, add_storage, new_topic
from varadhi.spark import layouts
from varadhi.spark.layouts import Layout


def shard_of(group: str, st: StorageTopic, shard_count: int) -> int:
    p = routing.route_group(group, st.partitions, st.k)
    return routing.shard_of_partition(p, shard_count, st.partitions)


GROUPS = [f"g{i}" for i in range(3000)]


def moves_no_group(prev: StorageTopic, nxt: StorageTopic, shard_count: int) -> bool:
    return all(shard_of(g, prev, shard_count) == shard_of(g, nxt, shard_count) for g in GROUPS)


@pytest.mark.parametrize(
    ("counts", "shards", "keeps"),
    [
        ((2, 4), 2, True),  # K=2: each partition maps onto two of the next
        ((12, 24), 4, True),
        ((7, 10), 7, False),  # seed 000 case 2: K=1, a new run
        ((7, 10), 1, True),  # one shard reads everything
        ((2, 3), 2, False),
        ((6, 4), 2, False),  # K=1, even though 2 divides both
        ((4, 6), 2, False),
        ((3, 6, 12), 3, True),
    ],
)
def test_keeps_groups_matches_the_router(counts, shards, keeps):
    topic = new_topic("orders", counts[0], allow_uneven=True)
    for c in counts[1:]:
        topic, _ = add_storage(topic, c, allow_uneven=True)
    for prev, nxt in itertools.pairwise(topic.storage_topics):
        assert routing.keeps_groups(prev, nxt, shards) is keeps, (prev, nxt)
        assert moves_no_group(prev, nxt, shards) is keeps, (prev, nxt)


def test_keeps_groups_within_a_run_needs_the_base_split():
    # Base 3, K=2 then K=4: 2 shards cut a base block in two, so the K digit (which differs
    # between the two topics) picks the shard.
    prev, nxt = StorageTopic("t.1", 6, 2), StorageTopic("t.2", 12, 4)
    assert not routing.keeps_groups(prev, nxt, 2) and not moves_no_group(prev, nxt, 2)
    assert routing.keeps_groups(prev, nxt, 3) and moves_no_group(prev, nxt, 3)


def test_keeps_groups_agrees_with_the_router_everywhere_small():
    for p1, p2, shards in itertools.product(range(1, 9), range(1, 9), range(1, 5)):
        topic = new_topic("t", p1, allow_uneven=True)
        topic, _ = add_storage(topic, p2, allow_uneven=True)
        prev, nxt = topic.storage_topics
        assert routing.keeps_groups(prev, nxt, shards) == moves_no_group(prev, nxt, shards), (
            p1,
            p2,
            shards,
        )


def doc(mq_index: int, waiting: dict | None = None, generation: int = 0) -> dict:
    d = Layout(generation, 1, mq_index, {}).to_dict()
    if waiting is not None:
        d["waiting"] = waiting
    return d


def test_may_cross_when_every_shard_waits_quiet_or_has_moved_on():
    quiet, busy = {"index": 0, "quiet": True}, {"index": 0, "quiet": False}
    assert layouts.may_cross({0: doc(0, quiet), 1: doc(0, quiet)}, 2, 0, 0)
    assert layouts.may_cross({0: doc(1), 1: doc(0, quiet)}, 2, 0, 0)  # shard 0 went first
    assert not layouts.may_cross({0: doc(0, quiet), 1: doc(0, busy)}, 2, 0, 0)  # a pending group
    assert not layouts.may_cross({0: doc(0, quiet), 1: doc(0)}, 2, 0, 0)  # still reading
    assert not layouts.may_cross({0: doc(0, quiet)}, 2, 0, 0)  # shard 1 never started
    assert not layouts.may_cross({0: doc(0, quiet), 1: doc(0, quiet, generation=1)}, 2, 0, 0)
    stale = {"index": 1, "quiet": True}  # a marker of another boundary
    assert not layouts.may_cross({0: doc(0, stale), 1: doc(0, quiet)}, 2, 0, 0)


def test_waiting_marker_belongs_to_its_layout():
    layout = Layout(0, 1, 0, {})
    mark = {"index": 0, "quiet": False}
    assert layouts.waiting(doc(0, mark), layout) == mark
    assert layouts.waiting(doc(0, mark), Layout(0, 2, 0, {})) is None
    assert layouts.waiting(doc(0), layout) is None and layouts.waiting(None, layout) is None


def test_shard_counts_for_a_storage_topic():
    assert layouts.shard_counts_for(10) == [1, 2, 5, 10]
    assert layouts.shard_counts_for(7) == [1, 7]
    assert layouts.shard_counts_for(720, limit=4) == [1, 2, 3, 720]
