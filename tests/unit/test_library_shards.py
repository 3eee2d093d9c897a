"""`change-shards` of a `runtime: library` subscription (`varadhi.ops.library_shards`), its pure
parts: in place, refused before any side effect unless paused with no member in the consumer
group and nothing in progress, on counts every slot owns as many RQ/DLQ partitions of; a merge
keeps each key's partitions in one slot, a split needs no retry pending and no dead letter left
to re-drive."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kafka import TopicPartition

from varadhi.core import routing
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint, SubscriptionSpec
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import add_storage, new_topic
from varadhi.ops import library_shards as ls

MAIN, RQ, DLQ = new_topic("t", 12), new_topic("s.rq", 4, internal=True), new_topic("s.dlq", 4, internal=True)  # fmt: skip


def sub(shards: int = 2, paused: bool = True) -> Subscription:
    spec = SubscriptionSpec(
        name="s",
        topic="t",
        endpoint=Endpoint("http://127.0.0.1:9/"),
        shards=shards,
        rq_partitions=4,
        dlq_partitions=4,
        runtime="library",
    )
    return Subscription(spec, shard_count=shards, created_ms=0, paused=paused)


def decide(to, s=None, members=None, busy=None, rq=0, dlq=0, allow_uneven=False, **topics):
    return ls.decide(
        s or sub(),
        topics.get("main", MAIN),
        topics.get("rq_topic", RQ),
        topics.get("dlq_topic", DLQ),
        to,
        allow_uneven,
        members,
        busy or {},
        rq,
        dlq,
    )


def test_a_merge_keeps_the_topics_and_each_keys_partitions_in_one_slot():
    plan = decide(1)
    assert (plan.from_shards, plan.to_shards, plan.merge) == (2, 1, True)
    assert plan.slots == (
        {"t.0": list(range(12)), "s.rq.0": [0, 1, 2, 3], "s.dlq.0": [0, 1, 2, 3]},
    )
    # pending retries and dead letters do not hold a merge back
    assert decide(1, rq=5, dlq=3).merge
    # nesting: every old slot's partitions of every topic are in one new slot, for even and
    # uneven counts alike
    for old, new, partitions in ((4, 2, 12), (6, 3, 12), (6, 2, 10), (4, 1, 7)):
        for s in range(old):
            owners = {
                routing.shard_of_partition(p, new, partitions)
                for p in routing.shard_partitions(s, old, partitions)
            }
            assert owners <= {s * new // old}, (old, new, partitions, s)
    text = ls.text_plan(plan)
    assert "2 -> 1 slots, a merge" in text and "slot 0: t.0 [0..11]" in text
    doc = plan.to_dict()
    assert (doc["runtime"], doc["from"], doc["to"], doc["merge"]) == ("library", 2, 1, True)


def test_refused_unless_paused_with_no_member_in_the_group_and_nothing_in_progress():
    with pytest.raises(InvalidArgument, match="must be paused") as e:
        decide(1, s=sub(paused=False))
    assert e.value.exit_code == 2
    refused = r"consumer group varadhi-library\.s has members: h-1-a@/10\.0\.0\.1; .* stop them"
    with pytest.raises(InvalidArgument, match=refused):
        decide(1, members=["h-1-a@/10.0.0.1"])
    decide(1, members=[])  # an empty group, and None: no group
    with pytest.raises(InvalidArgument, match=r"operation is in progress: operation/s/x \(y\)"):
        decide(1, busy={"operation/s/x": "y"})
    with pytest.raises(InvalidArgument, match="already has 2 shards"):
        decide(2)
    for bad in (0, -1, True, "2"):
        with pytest.raises(InvalidArgument, match="positive integer"):
            decide(bad)


def test_the_count_must_divide_the_queues_and_the_main_topic_unless_uneven():
    with pytest.raises(InvalidArgument, match=r"3 does not divide s\.rq\.0 \(4 partitions\) and s\.dlq\.0 .*counts that do: 1, 4"):  # fmt: skip
        decide(3)
    with pytest.raises(InvalidArgument, match=r"8 does not divide"):
        decide(8)
    main = new_topic("t", 10, allow_uneven=True)
    with pytest.raises(InvalidArgument, match="--allow-uneven"):
        decide(4, main=main)
    assert decide(4, main=main, allow_uneven=True).warnings
    rq2, _ = add_storage(RQ, 8, allow_uneven=True)
    with pytest.raises(InvalidArgument, match=r"s\.rq has 2 storage topics"):
        decide(1, rq_topic=rq2)


def test_a_split_needs_no_pending_retry_and_no_dead_letter_left_to_redrive():
    plan = decide(4)
    assert not plan.merge and [s["s.rq.0"] for s in plan.slots] == [[0], [1], [2], [3]]
    with pytest.raises(InvalidArgument, match=r"cannot split s from 2 to 4 shards.*5 records in the RQ.*--queue rq --to-latest"):  # fmt: skip
        decide(4, rq=5)
    with pytest.raises(InvalidArgument, match=r"3 dead letters .*--queue dlq --to-latest"):
        decide(4, dlq=3)
    # from 4 slots to 2 is a merge: pending retries and dead letters do not hold it back
    assert decide(2, s=replace(sub(4), shard_count=4), rq=5, dlq=3).merge


def test_pending_records_count_past_a_start_or_from_the_log_start():
    start = {TopicPartition("q", 0): 7}
    assert ls.pending_records(start, [0, 3], [10, 5], "q") == 3 + 2
    assert ls.pending_records({TopicPartition("q", 0): 10}, [0], [10], "q") == 0
    assert ls.pending_records({TopicPartition("q", 0): 2}, [4], [10], "q") == 6  # retention


def test_the_record_changes_the_count_only():
    doc = sub().to_dict()
    plan = decide(1)
    new = ls.changed(doc, plan)
    assert new["state"]["shard_count"] == 1 and new["spec"]["shards"] == 1
    assert new["spec"]["rq_partitions"] == doc["spec"]["rq_partitions"]
    assert {k: v for k, v in new["state"].items() if k != "shard_count"} == {
        k: v for k, v in doc["state"].items() if k != "shard_count"
    }
    assert Subscription.from_dict(new).shard_count == 1
