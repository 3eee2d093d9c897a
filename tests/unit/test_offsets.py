"""Offset-reset planning (pure): modes, fast-forward only on internal queues, uneven rewinds,
recorded plans resumed after a crash."""

import json

import pytest

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint, SubscriptionSpec
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import add_storage, new_topic
from varadhi.ops.offsets import (
    Offsets,
    Plan,
    decide,
    plan_internal,
    plan_main,
    positions_after,
    positions_doc,
    read_back_passed,
)
from varadhi.spark.layouts import Layout


def sub_of(shards: int, topic: str = "t", allow_uneven: bool = False) -> Subscription:
    spec = SubscriptionSpec(
        name="s",
        topic=topic,
        endpoint=Endpoint("http://127.0.0.1:9/"),
        shards=shards,
        rq_partitions=2 * shards,
        dlq_partitions=shards,
        allow_uneven=allow_uneven,
    )
    return Subscription(spec, shard_count=shards, created_ms=0, generation=3)


def offsets_for(topic, begin=0, end=100, at=None) -> Offsets:
    return Offsets(
        {st.name: [begin] * st.partitions for st in topic.storage_topics},
        {st.name: [end] * st.partitions for st in topic.storage_topics},
        {st.name: [at] * st.partitions for st in topic.storage_topics},
    )


def positions(shards, index, topic, consumed=50):
    st = topic.storage_topics[index]
    return {
        s: (Layout(3, 2, index, {}), {st.name: {str(p): consumed for p in range(st.partitions)}})
        for s in range(shards)
    }


def test_shift_back_replays_and_starts_a_new_generation():
    mq = new_topic("t", 4)
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), offsets_for(mq), "shift-by", -10)
    assert {(mv.shard, mv.partition, mv.current, mv.new) for mv in plan.moves} == {
        (0, 0, 50, 40),
        (0, 1, 50, 40),
        (1, 2, 50, 40),
        (1, 3, 50, 40),
    }
    assert plan.summary()["replayed"] == 40 and plan.summary()["skipped"] == 0
    assert all(layout.generation == 4 and layout.seq == 0 for layout in plan.layouts.values())
    assert plan.layouts[1].starting_offsets["t.0"] == {"2": 40, "3": 40}


def test_shift_is_clamped_to_the_log():
    mq = new_topic("t", 2)
    plan = plan_main(
        sub_of(1), mq, positions(1, 0, mq), offsets_for(mq, begin=45), "shift-by", -100
    )
    assert [mv.new for mv in plan.moves] == [45, 45]
    plan = plan_main(sub_of(1), mq, positions(1, 0, mq), offsets_for(mq, end=60), "shift-by", 100)
    assert [mv.new for mv in plan.moves] == [60, 60]


def test_to_latest_goes_to_the_produce_topic_and_to_datetime_finds_the_first_topic():
    mq, _ = add_storage(new_topic("t", 2), 4)
    mq = mq.__class__(**{**mq.__dict__, "produce_pointer": 1})
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), offsets_for(mq), "to-latest", None)
    assert {mv.topic for mv in plan.moves} == {"t.1"} and {mv.new for mv in plan.moves} == {100}
    kafka = offsets_for(mq)
    kafka.at_time["t.0"][:] = [None, None]
    kafka.at_time["t.1"][:] = [7, None, 9, None]
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), kafka, "to-datetime", 123)
    assert {(mv.partition, mv.new) for mv in plan.moves} == {(0, 7), (1, 100), (2, 9), (3, 100)}
    assert plan.layouts[0].mq_index == 1


def test_rewind_across_an_uneven_storage_topic_is_refused_with_the_shard_count_that_fits():
    mq, _ = add_storage(new_topic("t", 4), 6)  # K resets to 1: 4 shards cannot share 6 partitions
    sub = sub_of(4)
    with pytest.raises(InvalidArgument, match=r"cannot rewind.*change-shards s --to 2"):
        plan_main(sub, mq, positions(4, 1, mq), offsets_for(mq), "to-earliest", None)
    plan = plan_main(sub_of(2), mq, positions(2, 1, mq), offsets_for(mq), "to-earliest", None)
    assert {mv.topic for mv in plan.moves} == {"t.0"} and {mv.new for mv in plan.moves} == {0}


def test_internal_queues_only_fast_forward():
    rq = new_topic("s.rq", 4, internal=True)
    sub = sub_of(2)
    for mode, value in (("to-earliest", None), ("shift-by", -1), ("to-storage-topic", 0)):
        with pytest.raises(InvalidArgument, match="can only be fast-forwarded"):
            plan_internal("rq", sub, rq, {}, offsets_for(rq), mode, value)
    current = {0: {"s.rq.0": {"0": 10, "1": 20}}, 1: {"s.rq.0": {"2": 30, "3": 40}}}
    moves, new = plan_internal("rq", sub, rq, current, offsets_for(rq, end=35), "shift-by", 10)
    assert {(mv.partition, mv.current, mv.new) for mv in moves} == {
        (0, 10, 20),
        (1, 20, 30),
        (2, 30, 35),
        (3, 40, 40),
    }
    assert new[0] == {"s.rq.0": {"0": 20, "1": 30}}
    kafka = offsets_for(rq)
    kafka.at_time["s.rq.0"][:] = [5, 25, None, 41]
    moves, _ = plan_internal("rq", sub, rq, current, kafka, "to-datetime", 1)
    assert {(mv.partition, mv.new) for mv in moves} == {(0, 10), (1, 25), (2, 100), (3, 41)}

    # The retries shards read back before they were due and hold: skipped where a move's new
    # position passes their records (every RQ partition moved, even by nothing).
    plan = Plan("rq", "to-datetime", 1, moves, {}, {})
    assert read_back_passed(plan) == {
        0: {("s.rq.0", 0): 10, ("s.rq.0", 1): 25},
        1: {("s.rq.0", 2): 100, ("s.rq.0", 3): 41},
    }
    assert read_back_passed(Plan("dlq", "to-datetime", 1, moves, {}, {})) == {}


def recorded(plan: Plan, before, step="advancing-state", generation=3, shards=2):
    """An operation document as `OffsetReset._record` writes it."""
    return {
        "kind": "offset-reset",
        "step": step,
        "id": "x",
        "from_generation": generation,
        "to_generation": generation + 1 if plan.layouts else generation,
        "shard_count": shards,
        "plan": plan.to_dict(),
        "after": positions_after(plan, before),
    }


def test_a_plan_is_recorded_with_absolute_positions_and_read_back_the_same():
    mq = new_topic("t", 4)
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), offsets_for(mq), "shift-by", -10)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_an_unfinished_reset_is_resumed_with_its_recorded_plan_and_others_are_refused():
    mq = new_topic("t", 4)
    before = positions_doc(positions(2, 0, mq))
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), offsets_for(mq), "shift-by", -10)
    op = recorded(plan, before)
    same = {"queue": "main", "mode": "shift-by", "value": -10}
    assert decide(None, same, 3, 2, before) == "new"
    assert decide(op, same, 3, 2, before) == "resume"
    with pytest.raises(InvalidArgument, match=r"\(--queue main --shift-by -10\) is in progress"):
        decide(op, same | {"value": -5}, 3, 2, before)
    with pytest.raises(InvalidArgument, match="planned at generation 3 with 2 shards"):
        decide(op, same, 3, 4, before)
    legacy = {"kind": "offset-reset", "step": "advancing-state", **plan.summary()}
    assert decide(legacy, same, 3, 2, before) == "new"  # recorded before plans were


def test_a_finished_reset_run_again_changes_nothing_until_a_shard_consumed():
    mq = new_topic("t", 4)
    before = positions_doc(positions(2, 0, mq))
    plan = plan_main(sub_of(2), mq, positions(2, 0, mq), offsets_for(mq), "shift-by", -10)
    op = recorded(plan, before, step="done")
    same = {"queue": "main", "mode": "shift-by", "value": -10}
    after = op["after"]  # what the shards' positions are right after the reset
    assert after["1"]["layout"]["generation"] == 4
    assert after["1"]["consumed"]["t.0"] == {"2": 40, "3": 40}
    assert decide(op, same, 4, 2, after) == "done"
    consumed = json.loads(json.dumps(after))
    consumed["1"]["consumed"]["t.0"]["2"] = 41  # shard 1 consumed a message since
    assert decide(op, same, 4, 2, consumed) == "new"
    assert decide(op, same | {"value": -3}, 4, 2, after) == "new"
    # a DLQ reset leaves the shards where they were
    dlq_plan = Plan("dlq", "shift-by", 1, (), {}, {"s.dlq.0": {"0": 5}})
    dlq_op = recorded(dlq_plan, before, step="done")
    assert dlq_op["after"] == before and dlq_op["to_generation"] == 3
    assert decide(dlq_op, {"queue": "dlq", "mode": "shift-by", "value": 1}, 3, 2, before) == "done"
