"""Operations on a `runtime: library` subscription, their pure parts: the RQ record a re-drive
writes for a dead letter, and where; an offset reset's plan of the consumer group, its
refusals, its outcome on a re-run, and the members' stop while it is under way."""

from __future__ import annotations

import pytest
from kafka import TopicPartition

from varadhi.core import messages as m
from varadhi.core import routing
from varadhi.core.catalog_kinds import DocKind
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint, SubscriptionSpec
from varadhi.core.state_rows import retry_state
from varadhi.kafka.dlq import Parked, parked_from_record
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import add_storage, new_topic, switch_produce
from varadhi.library.position import reset_key, reset_under_way
from varadhi.library.redrive import (
    covers,
    later,
    redrivable_once,
    redrive_record,
    rq_partition,
    slot_part,
)
from varadhi.ops.library_offsets import (
    decide,
    plan_dlq,
    plan_main,
    plan_rq,
    positions_now,
)
from varadhi.ops.offsets import Offsets, Plan


def parked(offset: int, origin: str = "0:3:17", **headers: str) -> Parked:
    h = {
        m.H_MSG_ID: "m-1",
        m.H_GROUP_ID: "g-1",
        m.H_ORIGIN: origin,
        m.H_ATTEMPTS: "5",
        m.H_DUE_MS: "123",
        m.H_FIRST_FAILURE_MS: "100",
        m.H_LAST_FAILURE_MS: "200",
        m.H_REASON: "fatal response 400",
        m.H_STATUS: "400",
        "traceparent": "00-abc",
        **headers,
    }
    return parked_from_record("s.dlq.0", 1, offset, b"g-1", b"body", m.dict_to_headers(h))


def test_a_redriven_dead_letter_is_a_retry_due_now_with_no_attempts_marked_with_the_redrive():
    record = redrive_record(parked(4), "redrive-1-abc", True, 5_000, 1_000_000)
    headers = m.headers_to_dict(record.headers)
    assert retry_state(headers) == (m.Origin.decode("0:3:17"), 0, 5_000)
    assert headers[m.H_REDRIVEN] == "redrive-1-abc"
    assert headers[m.H_MSG_ID] == "m-1" and headers["traceparent"] == "00-abc"
    for gone in (m.H_REASON, m.H_STATUS, m.H_FIRST_FAILURE_MS, m.H_LAST_FAILURE_MS):
        assert gone not in headers
    assert (record.key, record.value) == (b"g-1", b"body")


def test_a_redrive_goes_to_an_rq_partition_of_its_slot():
    for key in ("g-1", "g-2", "~m-9"):
        for slot in range(3):
            p = rq_partition(key, slot, 3, 12)
            assert p in routing.shard_partitions(slot, 3, 12)


def test_one_copy_per_origin_and_nothing_that_cannot_go_back():
    twice = [("op", parked(1)), ("op", parked(2)), ("op", parked(3, origin="0:3:18"))]
    truncated = ("op", parked(4, origin="0:3:19", **{m.H_TRUNCATED: "99"}))
    no_origin = ("op", parked(5, origin="junk"))
    kept = redrivable_once([*twice, truncated, no_origin])
    assert [p.offset for p in kept] == [1, 3]


def test_a_slot_takes_its_part_of_a_rate_capped_redrives_recorded_offsets():
    # a later holder of the slot goes on from what the operation document says of its partitions
    recorded = {"s.dlq.0": {"0": 5, "1": 7, "2": 9}}
    mine = {"s.dlq.0": [2, 3]}
    assert slot_part(recorded, mine) == {"s.dlq.0": {"2": 9}}
    assert not covers(slot_part(recorded, mine), mine)  # partition 3 not reported: scan anew
    assert covers(recorded, {"s.dlq.0": [0, 1]})
    start = {"s.dlq.0": {"2": 12}}
    assert later(start, {"s.dlq.0": {"2": 9, "3": 4}}) == {"s.dlq.0": {"2": 12, "3": 4}}


# -- offset reset of the consumer group ---------------------------------------------------------


def lib_sub(shards: int = 2) -> Subscription:
    spec = SubscriptionSpec(
        name="s",
        topic="t",
        endpoint=Endpoint("http://127.0.0.1:9/"),
        shards=shards,
        runtime="library",
    )
    return Subscription(spec, shard_count=shards, created_ms=0)


def kafka_of(topic, begin=0, end=100, at=None) -> Offsets:
    return Offsets(
        {st.name: [begin] * st.partitions for st in topic.storage_topics},
        {st.name: [end] * st.partitions for st in topic.storage_topics},
        {st.name: [at] * st.partitions for st in topic.storage_topics},
    )


def test_the_main_topic_moves_each_partition_by_its_commit_a_partition_without_one_from_its_start():
    mq = new_topic("t", 4)
    committed = {TopicPartition("t.0", 0): 50, TopicPartition("t.0", 3): 95}
    kafka = kafka_of(mq, begin=10)
    shifted = plan_main(lib_sub(), mq, committed, kafka, "shift-by", 10)
    assert [(mv.shard, mv.partition, mv.current, mv.new) for mv in shifted.moves] == [
        (0, 0, 50, 60),
        (0, 1, None, 20),
        (1, 2, None, 20),
        (1, 3, 95, 100),  # clamped to the log
    ]
    back = plan_main(lib_sub(), mq, committed, kafka, "shift-by", -60)
    assert [mv.new for mv in back.moves] == [10, 10, 10, 35]
    assert [
        mv.new for mv in plan_main(lib_sub(), mq, committed, kafka, "to-earliest", None).moves
    ] == [10] * 4
    assert [
        mv.new for mv in plan_main(lib_sub(), mq, committed, kafka, "to-latest", None).moves
    ] == [100] * 4
    kafka.at_time["t.0"][:] = [12, None, 30, 99]
    dated = plan_main(lib_sub(), mq, committed, kafka, "to-datetime", 1)
    assert [mv.new for mv in dated.moves] == [12, 100, 30, 99]
    assert (dated.summary()["skipped"], dated.summary()["replayed"]) == (100 + 30 + 4, 50 - 12)


def three_storage_topics():
    """t.0 (2 partitions), t.1 (K=1: 3) and t.2 (K=2: 6), produce on t.2; each partition's log
    from 10 to 100."""
    mq = new_topic("t", 2)
    for partitions in (3, 6):
        mq, _ = add_storage(mq, partitions)
        mq = switch_produce(mq, 0)
    return mq, kafka_of(mq, begin=10)


def new_offsets(plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for mv in plan.moves:
        out.setdefault(mv.topic, []).append(mv.new)
    return out


def test_a_reset_into_a_storage_topic_ends_the_earlier_ones_and_drops_the_later_commits():
    mq, kafka = three_storage_topics()
    # the group read all of t.0 and part of t.1, and has a commit on one partition of t.2
    committed = {
        TopicPartition("t.0", 0): 100,
        TopicPartition("t.0", 1): 100,
        TopicPartition("t.1", 0): 40,
        TopicPartition("t.2", 4): 55,
    }
    kafka.at_time["t.1"][:] = [None, 20, 30]  # the first storage topic with records that late
    kafka.at_time["t.2"][:] = [10] * 6
    dated = plan_main(lib_sub(), mq, committed, kafka, "to-datetime", 1)
    assert new_offsets(dated) == {"t.0": [100, 100], "t.1": [100, 20, 30]}
    # t.2 is read from its log start once the members cross to it, and keeps no commit, not
    # even there: a commit on it would tell the members that one of them crossed already
    assert [(mv.topic, mv.partition, mv.current, mv.new) for mv in dated.dropped] == [
        ("t.2", 4, 55, 10)
    ]
    assert [mv.shard for mv in dated.moves] == [0, 1, 0, 1, 1]  # each storage topic's slots
    summary = dated.summary()
    assert (summary["skipped"], summary["replayed"]) == (60 + 20 + 30, 45)
    assert [mv["dropped"] for mv in summary["moves"] if "dropped" in mv] == [True]

    to_t1 = plan_main(lib_sub(), mq, committed, kafka, "to-storage-topic", 1)
    assert new_offsets(to_t1) == {"t.0": [100, 100], "t.1": [10, 10, 10]}
    assert len(to_t1.dropped) == 1
    earliest = plan_main(lib_sub(), mq, committed, kafka, "to-earliest", None)
    assert new_offsets(earliest) == {"t.0": [10, 10]}
    assert [(mv.topic, mv.partition) for mv in earliest.dropped] == [("t.1", 0), ("t.2", 4)]
    latest = plan_main(lib_sub(), mq, committed, kafka, "to-latest", None)
    assert new_offsets(latest) == {"t.0": [100] * 2, "t.1": [100] * 3, "t.2": [100] * 6}
    assert latest.dropped == ()
    kafka.at_time.update({st.name: [None] * st.partitions for st in mq.storage_topics})
    too_late = plan_main(lib_sub(), mq, committed, kafka, "to-datetime", 1)
    assert new_offsets(too_late) == new_offsets(latest)  # the ends of all, as --to-latest


def test_a_reset_is_planned_once_and_the_plan_with_its_dropped_commits_is_recorded_as_is():
    mq, kafka = three_storage_topics()
    committed = {TopicPartition("t.2", 0): 50}
    plan = plan_main(lib_sub(), mq, committed, kafka, "to-storage-topic", 1)
    assert Plan.from_dict(plan.to_dict()) == plan
    request = plan.request()
    done = {"step": "done", "plan": plan.to_dict(), "id": "x"}
    after = {TopicPartition(mv.topic, mv.partition): mv.new for mv in plan.moves}
    assert decide(done, request, positions_now(plan, after, {})) == "done"
    # a commit left on a partition the reset dropped (a member read it since): not done
    not_dropped = positions_now(plan, after | committed, {})
    assert decide(done, request, not_dropped) == "new"
    # a plan recorded before plans dropped commits reads as one that drops none
    old = {k: v for k, v in plan.to_dict().items() if k != "dropped"}
    assert Plan.from_dict(old).dropped == ()


def test_a_shift_moves_within_the_storage_topic_the_group_is_on():
    mq, kafka = three_storage_topics()
    on_t1 = {TopicPartition("t.0", 0): 100, TopicPartition("t.1", 1): 50}
    kafka.beginning["t.0"][1] = 100  # nothing left in t.0 partition 1: its log start is its end
    plan = plan_main(lib_sub(), mq, on_t1, kafka, "shift-by", -45)
    assert new_offsets(plan) == {"t.0": [100, 100], "t.1": [10, 10, 10]}  # clamped to t.1
    plan = plan_main(lib_sub(), mq, on_t1, kafka, "shift-by", 5)
    assert new_offsets(plan) == {"t.0": [100, 100], "t.1": [15, 55, 15]}
    assert plan_main(lib_sub(), mq, {}, kafka, "shift-by", 5).moves[0].new == 15  # t.0: none yet
    # one slot still on t.0 while another crossed to t.1 (a K>1 switch crosses per slot)
    behind = dict(on_t1) | {TopicPartition("t.0", 0): 90}
    with pytest.raises(InvalidArgument, match="10 messages of t.0 are not finished"):
        plan_main(lib_sub(), mq, behind, kafka, "shift-by", 5)


def test_what_does_not_map_to_the_library_is_refused():
    mq, kafka = three_storage_topics()
    with pytest.raises(InvalidArgument, match="outside 0..2"):
        plan_main(lib_sub(), mq, {}, kafka, "to-storage-topic", 3)
    added, _ = add_storage(mq, 6)  # t.3: not produced to yet
    with pytest.raises(InvalidArgument, match="t.3 is not produced to yet"):
        plan_main(lib_sub(), added, {}, kafka_of(added), "to-storage-topic", 3)
    rq = new_topic("s.rq", 4, internal=True)
    with pytest.raises(InvalidArgument, match="can only be fast-forwarded"):
        plan_rq(lib_sub(), rq, {}, kafka_of(rq), "to-earliest", None)


def test_the_rq_only_fast_forwards_from_the_groups_commits_and_the_dlq_moves_its_start():
    rq = new_topic("s.rq", 4, internal=True)
    committed = {TopicPartition("s.rq.0", 0): 10, TopicPartition("s.rq.0", 2): 50}
    plan = plan_rq(lib_sub(), rq, committed, kafka_of(rq, end=40), "shift-by", 20)
    assert [(mv.shard, mv.partition, mv.current, mv.new) for mv in plan.moves] == [
        (0, 0, 10, 30),
        (0, 1, 0, 20),
        (1, 2, 50, 50),  # never backwards
        (1, 3, 0, 20),
    ]
    dlq = new_topic("s.dlq", 2, internal=True)
    plan = plan_dlq(lib_sub(), dlq, {"s.dlq.0": {"0": 5}}, kafka_of(dlq, end=9), "to-latest", None)
    assert plan.dlq_start == {"s.dlq.0": {"0": 9, "1": 9}}


def test_a_reset_is_new_resumed_or_done_and_another_is_refused_while_one_is_under_way():
    mq = new_topic("t", 2)
    plan = plan_main(lib_sub(), mq, {}, kafka_of(mq), "to-earliest", None)
    request = plan.request()
    op = {"step": "waiting-for-members", "plan": plan.to_dict(), "id": "x"}
    assert decide(None, request, {}) == "new"
    assert decide(op, request, {}) == "resume"
    with pytest.raises(InvalidArgument, match="--queue main --to-earliest"):
        decide(op, {"queue": "main", "mode": "to-latest", "value": None}, {})
    done = dict(op, step="done")
    there = positions_now(plan, {TopicPartition("t.0", 0): 0, TopicPartition("t.0", 1): 0}, {})
    assert decide(done, request, there) == "done"
    moved_on = positions_now(plan, {TopicPartition("t.0", 0): 7, TopicPartition("t.0", 1): 0}, {})
    assert decide(done, request, moved_on) == "new"  # a member consumed since
    assert decide(done, {"queue": "main", "mode": "to-latest", "value": None}, there) == "new"


def test_members_stop_while_a_reset_is_under_way():
    class Snap:
        def __init__(self, doc):
            self.doc = doc

        def get(self, kind, name):
            return self.doc if (kind, name) == (DocKind.OPERATION, reset_key("s")) else None

    plan = {"queue": "rq", "mode": "shift-by", "value": 5}
    assert reset_under_way(Snap(None), "s") is None
    assert reset_under_way(Snap({"step": "done", "plan": plan}), "s") is None
    why = reset_under_way(Snap({"step": "waiting-for-members", "plan": plan}), "s")
    assert why is not None and "(--queue rq --shift-by 5) is under way" in why


def test_a_group_request_waits_out_a_coordinator_not_available_yet(monkeypatch):
    """A cluster's first consumer-group lookup makes its offsets topic: until then Kafka answers
    that the coordinator is not available (seen on a fresh broker whose only clients had been
    Spark shards). Such an answer is tried again; a missing ACL is named; a coordinator still
    unavailable after the wait is `KafkaUnavailable`."""
    from kafka.errors import CoordinatorNotAvailableError, GroupAuthorizationFailedError

    from varadhi.core.errors import KafkaUnavailable, NotAuthorized
    from varadhi.kafka import clients
    from varadhi.kafka.settings import Settings
    from varadhi.ops import status

    class Admin:
        def close(self):
            pass

    monkeypatch.setattr(clients, "admin", lambda *_a, **_k: Admin())
    monkeypatch.setattr(status.time, "sleep", lambda _s: None)
    answers = [CoordinatorNotAvailableError(), CoordinatorNotAvailableError(), "found"]

    def call(_admin):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    settings = Settings(bootstrap="127.0.0.1:9")
    assert status.group_request(settings, "g", "Describe", call) == "found"

    def refused(_admin):
        raise GroupAuthorizationFailedError()

    with pytest.raises(NotAuthorized, match="lacks Delete on Group g"):
        status.group_request(settings, "g", "Delete", refused)

    def unavailable(_admin):
        raise CoordinatorNotAvailableError()

    with pytest.raises(KafkaUnavailable, match="coordinator of consumer group g is not available"):
        status.group_request(settings, "g", "Describe", unavailable, wait_s=-1)
