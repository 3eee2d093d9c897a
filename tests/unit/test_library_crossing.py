"""The library runtime's decisions at a storage-topic boundary of the main topic
(`varadhi.library.crossing`) and the slot assignor's topics (pure, no services)."""

from __future__ import annotations

from types import SimpleNamespace

from kafka.cluster import ClusterMetadata

from varadhi.core import routing
from varadhi.kafka.topics import StorageTopic, add_storage, new_topic
from varadhi.library import crossing
from varadhi.library.assign import SlotAssignor


def _storage(partitions: int, *more: int) -> tuple[StorageTopic, ...]:
    topic = new_topic("t", partitions)
    for p in more:
        topic, _ = add_storage(topic, p)
    return topic.storage_topics


def test_a_k_above_one_boundary_keeps_groups_in_their_slots_a_k_of_one_moves_them():
    t0, t1, t2 = _storage(4, 8, 6)  # 4 -> 8 (K=2), then 6 (K=1: a new run)
    assert (t1.k, t2.k) == (2, 1)
    for slots in (1, 2, 4):
        assert not crossing.moves_groups(t0, t1, slots)
    assert crossing.moves_groups(t1, t2, 2)
    assert not crossing.moves_groups(t1, t2, 1)  # one slot reads everything
    # why: every group's partition on t1 lies in the slot of its partition on t0
    for h in range(0, 2**32, 2**32 // 997):
        before = routing.shard_of_partition(routing.route(h, 4, 1), 2, 4)
        assert routing.shard_of_partition(routing.route(h, 8, 2), 2, 8) == before


def test_read_to_end_needs_every_partition_at_its_end():
    assert crossing.read_to_end({0: 5, 1: 3}, {0: 5, 1: 3})
    assert crossing.read_to_end({0: 6}, {0: 5})  # past transaction markers
    assert not crossing.read_to_end({0: 5}, {0: 5, 1: 1})  # partition 1 not read
    assert crossing.read_to_end({}, {0: 0})  # an empty partition


def _view(**fields) -> crossing.GroupView:
    base = {
        "old_committed": {0: 10, 1: 4},
        "old_ends": {0: 10, 1: 4},
        "rq_committed": {"0": 2},
        "rq_ends": {"0": 2},
        "crossed": False,
        "blocked": 0,
    }
    return crossing.GroupView(**{**base, **fields})


def test_members_cross_a_boundary_that_moves_groups_once_nothing_is_pending():
    assert crossing.group_quiet(_view())
    behind = _view(old_committed={0: 9, 1: 4})  # a message of T_i not finished
    retry = _view(rq_ends={"0": 3})  # a retry pending
    blocked = _view(blocked=1)  # a key blocked behind a dead letter
    for view in (behind, retry, blocked):
        assert not crossing.group_quiet(view)
    assert (crossing.old_left(behind), crossing.rq_left(retry)) == (1, 1)
    # once a member crossed, later retries and blocks (of T_i+1's messages) hold nobody back
    assert crossing.group_quiet(_view(rq_ends={"0": 3}, blocked=2, crossed=True))
    text = crossing.waiting_text("t.1", "t.2", retry)
    assert text == (
        "waits at the end of t.1 before t.2 (groups move to other slots): until the group"
        " finished t.1 (0 left), the RQ (1 retries pending) and every blocked key (0 blocked)"
    )


def _member(member_id: str, topics: list[str]):
    return SimpleNamespace(member_id=member_id, metadata=SimpleNamespace(topics=topics))


def test_the_assignor_assigns_a_topic_only_once_every_member_reads_it():
    cluster = ClusterMetadata()
    cluster.partitions_for_topic = lambda t: {"t.0": {0, 1}, "t.1": {0, 1, 2, 3}, "rq": {0, 1}}[t]
    members = [_member("a", ["t.0", "rq"]), _member("b", ["t.0", "t.1", "rq"])]
    out = SlotAssignor(2).assign(cluster, members)
    assert dict(out["a"].assignment) == {"t.0": [0], "rq": [0]}
    assert dict(out["b"].assignment) == {"t.0": [1], "rq": [1]}
    members[0] = _member("a", ["t.0", "t.1", "rq"])
    out = SlotAssignor(2).assign(cluster, members)
    assert dict(out["a"].assignment) == {"t.0": [0], "t.1": [0, 1], "rq": [0]}
    assert dict(out["b"].assignment) == {"t.0": [1], "t.1": [2, 3], "rq": [1]}
