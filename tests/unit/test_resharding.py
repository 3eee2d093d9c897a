"""Shard-count change plans, refusals, GroupState resharding and feeder routing (pure)."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from varadhi.core import routing
from varadhi.core.errors import InvalidArgument
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.catalog import Snapshot
from varadhi.kafka.subscriptions import Subscription, changed_fields
from varadhi.kafka.topics import StorageTopic, add_storage, new_topic, switch_produce
from varadhi.ops import change_shards_plan as rs
from varadhi.ops.feeders import feeder_source
from varadhi.ops.status import SILENT_MS
from varadhi.spark.layouts import Layout

KEYS = [f"group-{i}" for i in range(400)] + [f"~msg-{i}" for i in range(100)]


def subscription(shards: int, grouped: bool = True, **state) -> Subscription:
    spec = parse_spec(
        {
            "name": "orders-http",
            "topic": "orders",
            "endpoint": {"url": "http://127.0.0.1:9/"},
            "shards": shards,
            "grouped": grouped,
            "allow_uneven": True,
        }
    )
    return Subscription(spec, shard_count=shards, created_ms=0, **state)


def queues(shards: int, rq_storage: int = 1, dlq_storage: int = 1):
    rq = new_topic("orders-http.rq", 2 * shards, allow_uneven=True, internal=True)
    dlq = new_topic("orders-http.dlq", shards, allow_uneven=True, internal=True)
    for _ in range(rq_storage - 1):
        rq, _ = add_storage(rq, 2 * shards, allow_uneven=True)
    for _ in range(dlq_storage - 1):
        dlq, _ = add_storage(dlq, shards, allow_uneven=True)
    return rq, dlq


def positions(sub: Subscription, mq, mq_index: int = 0, base: int = 100):
    """Every old shard at `mq_index`, having read `base + partition` of its partitions."""
    out = {}
    for shard in range(sub.shard_count):
        offsets = {}
        for st in mq.storage_topics[mq_index:]:
            owned = routing.shard_partitions(shard, sub.shard_count, st.partitions)
            offsets[st.name] = {str(p): base + p for p in owned}
        out[shard] = (Layout(0, 0, mq_index, {}), offsets)
    return out


def test_two_to_four_on_twelve_partitions():
    sub, mq = subscription(2), new_topic("orders", 12)
    rq, dlq = queues(2)
    plan = rs.plan_change(sub, mq, rq, dlq, positions(sub, mq), 4)

    assert plan.before == ({"orders.0": list(range(6))}, {"orders.0": list(range(6, 12))})
    assert [a["orders.0"] for a in plan.after] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert (plan.rq_target, plan.dlq_target) == (
        StorageTopic("orders-http.rq.1", 8, 1),
        StorageTopic("orders-http.dlq.1", 4, 1),
    )
    assert [(f.queue, f.source, f.target) for f in plan.feeders] == [
        ("rq", "orders-http.rq.0", "orders-http.rq.1"),
        ("dlq", "orders-http.dlq.0", "orders-http.dlq.1"),
    ]
    # Each new shard starts its main partitions where their old owner stopped, its new RQ
    # partitions from the beginning, and nothing of the old RQ (feeders drain it).
    assert plan.layouts[2] == Layout(
        0,
        0,
        0,
        {"orders.0": {"6": 106, "7": 107, "8": 108}, "orders-http.rq.1": {"4": -2, "5": -2}},
    )
    assert all(lay.mq_index == 0 and lay.generation == 0 for lay in plan.layouts)
    assert plan.warnings == ()


def test_four_to_three_merges_four_owners_into_three():
    sub, mq = subscription(4, rq_from=1, dlq_from=1), new_topic("orders", 12)
    rq, dlq = queues(4, rq_storage=2, dlq_storage=2)
    pos = positions(sub, mq)
    pos[1] = (Layout(0, 0, 0, {}), {"orders.0": {"3": 7, "5": 9}})  # 4 unknown: never read
    plan = rs.plan_change(sub, mq, rq, dlq, pos, 3, layout_seq=2)

    assert [a["orders.0"] for a in plan.after] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert plan.layouts[1].starting_offsets["orders.0"] == {"4": -2, "5": 9, "6": 106, "7": 107}
    assert plan.layouts[1].seq == 2
    assert plan.rq_target == StorageTopic("orders-http.rq.2", 6, 1)
    assert plan.dlq_target == StorageTopic("orders-http.dlq.2", 3, 1)
    # rq.0/dlq.0 were drained by the previous change's feeders: only .1 is fed.
    assert [f.source for f in plan.feeders] == ["orders-http.rq.1", "orders-http.dlq.1"]


def test_seven_to_ten_after_k1_growth_once_shards_read_the_new_storage_topic():
    mq = new_topic("orders", 7, allow_uneven=True)
    mq, report = add_storage(mq, 10, allow_uneven=True)
    assert (report.storage.k, report.compatible) == (1, False)
    sub = subscription(7)
    rq, dlq = queues(7)

    # Every old shard has moved on to orders.1: 10 shards own it evenly.
    plan = rs.plan_change(sub, mq, rq, dlq, positions(sub, mq, mq_index=1), 10)
    assert plan.mq_index == 1
    assert [a["orders.1"] for a in plan.after] == [[j] for j in range(10)]
    assert plan.layouts[9].starting_offsets["orders.1"] == {"9": 109}
    assert (plan.rq_target.partitions, plan.dlq_target.partitions) == (20, 10)

    # One old shard still reads orders.0 (7 partitions): refused, with the reasons.
    pos = positions(sub, mq, mq_index=1)
    pos[3] = (Layout(0, 0, 0, {}), {"orders.0": {"3": 50}})
    with pytest.raises(InvalidArgument) as e:
        rs.plan_change(sub, mq, rq, dlq, pos, 10)
    text = str(e.value)
    assert "10 does not divide the 7 partitions of orders.0" in text
    assert "orders.1 starts a new routing run (K=1 after orders.0)" in text
    assert "--allow-uneven" in text and "let the shards drain orders.0 first" in text

    uneven = rs.plan_change(sub, mq, rq, dlq, pos, 10, allow_uneven=True)
    assert uneven.mq_index == 0 and len(uneven.warnings) == 2
    assert "would stop at the end of orders.0" in uneven.warnings[1]
    # Groups go to the shard that reads their next messages, on orders.0.
    assert uneven.route_by == mq.storage(0)
    # Partition 3 of orders.0 goes to new shard 5, from where its old owner (3) stopped.
    assert uneven.layouts[5].starting_offsets["orders.0"] == {"3": 50}
    # Partitions of orders.1 whose old owners had not reached it start at their beginning.
    assert all(v >= 100 or v == -2 for v in uneven.layouts[4].starting_offsets["orders.1"].values())


def test_seven_to_ten_when_the_old_shards_wait_at_the_end_of_the_old_storage_topic():
    """Seed 000 case 2: 7 shards on 7 partitions, then a 10-partition storage topic (K=1). The
    old shards drain orders.0 and stop at its end; the new shards start on orders.1 and the
    groups' pending entries go to the shards that read their orders.1 partitions."""
    mq = new_topic("orders", 7, allow_uneven=True)
    mq, _ = add_storage(mq, 10, allow_uneven=True)
    mq = switch_produce(mq, 1_000)
    sub = subscription(7)
    rq, dlq = queues(7)
    ends = {"orders.0": [100 + p for p in range(7)], "orders.1": [5] * 10}
    # Every old shard at the end of its orders.0 partitions; none has read orders.1.
    waiting = {
        i: (Layout(0, 0, 0, {}), {"orders.0": {str(i): 100 + i}}) for i in range(sub.shard_count)
    }
    later = 1_000 + 35_000

    start = rs.first_unread(mq, 7, waiting, ends, later, 35_000)
    assert start == 1
    plan = rs.plan_change(sub, mq, rq, dlq, waiting, 10, mq_index=start)
    assert (plan.mq_index, plan.route_by, plan.warnings) == (1, mq.storage(1), ())
    assert [a["orders.1"] for a in plan.after] == [[j] for j in range(10)]
    assert plan.layouts[9].starting_offsets == {
        "orders.1": {"9": -2},
        "orders-http.rq.1": {
            "18": -2,
            "19": -2,
        },
    }
    group = "group-7"
    partition = routing.route_group(group, 10, 1)
    assert plan.new_shard_of(group) == partition  # one partition per new shard

    # Not before produce moved off orders.0 the grace period ago, nor before it is drained.
    assert rs.first_unread(mq, 7, waiting, ends, later - 1, 35_000) == 0
    short = dict(waiting)
    short[3] = (Layout(0, 0, 0, {}), {"orders.0": {"3": 102}})
    assert rs.first_unread(mq, 7, short, ends, later, 35_000) == 0
    # An empty partition never read (-2) counts as drained.
    empty = dict(ends, **{"orders.0": [100 + p for p in range(6)] + [0]})
    unread = dict(waiting)
    unread[6] = (Layout(0, 0, 0, {}), {"orders.0": {"6": -2}})
    assert rs.first_unread(mq, 7, unread, empty, later, 35_000) == 1
    # The last storage topic is never skipped.
    assert rs.first_unread(mq, 7, positions(sub, mq, mq_index=1, base=5), ends, later, 35_000) == 1


def test_an_ungrouped_subscription_crosses_any_boundary():
    mq = new_topic("orders", 6)
    mq, _ = add_storage(mq, 12)  # K=2: one run, 2 shards keep every group
    mq, _ = add_storage(mq, 4)  # K=1: a new run
    rq, dlq = queues(3)
    with pytest.raises(InvalidArgument, match="orders.2 starts a new routing run"):
        rs.plan_change(subscription(3), mq, rq, dlq, positions(subscription(3), mq), 2)
    ungrouped = subscription(3, grouped=False)
    plan = rs.plan_change(ungrouped, mq, rq, dlq, positions(ungrouped, mq), 2)
    assert plan.warnings == ()


@pytest.mark.parametrize(
    ("to", "needle"),
    [
        (2, "already has 2 shards"),
        (0, "must be a positive integer"),
        (5, "5 does not divide the 12 partitions of orders.0"),
        (24, "24 does not divide the 12 partitions"),
    ],
)
def test_refusals_say_why(to, needle):
    sub, mq = subscription(2), new_topic("orders", 12)
    rq, dlq = queues(2)
    with pytest.raises(InvalidArgument) as e:
        rs.plan_change(sub, mq, rq, dlq, positions(sub, mq), to)
    assert needle in str(e.value)
    if to == 5:
        assert "shard counts that divide them all: 1, 2, 3, 4, 6, 12" in str(e.value)


def test_a_k1_boundary_between_evenly_divided_topics_is_refused():
    mq = new_topic("orders", 4)
    mq, _ = add_storage(mq, 6)  # 6 is no multiple of 4: K=1, groups change partition families
    sub = subscription(1)
    rq, dlq = queues(1)
    with pytest.raises(InvalidArgument, match="orders.1 starts a new routing run"):
        rs.plan_change(sub, mq, rq, dlq, positions(sub, mq), 2)


def test_groups_keep_one_shard_across_compatible_storage_topics():
    mq = new_topic("orders", 12)
    mq, report = add_storage(mq, 24)
    assert report.storage.k == 2
    for key in KEYS:
        h = routing.group_hash(key)
        shards = {
            routing.shard_of_partition(routing.route(h, st.partitions, st.k), 4, st.partitions)
            for st in mq.storage_topics
        }
        assert shards == {rs.new_shard_of(key, mq.storage_topics[-1], 4)}


def test_internal_target_is_in_the_new_shards_partitions():
    route_by = StorageTopic("orders.0", 12, 1)
    for key in KEYS:
        shard = rs.new_shard_of(key, route_by, 3)
        owned = routing.shard_partitions(shard, 3, 6)
        p = rs.internal_target(key, route_by, 3, 6)
        assert p in owned
        assert p == routing.internal_partition(routing.group_hash(key), owned)  # as shards do


def _row(kind, group_key, offset=0, **kw):
    return {
        "kind": kind,
        "group_key": group_key,
        "origin_offset": offset,
        "app_id": kw.get("app_id"),
        "batch_id": kw.get("batch_id"),
        "target": kw.get("target"),
    }


def test_reshard_tables_moves_pending_rows_and_keeps_last_batch_outs():
    old0 = pd.DataFrame(
        [
            _row("pending", "a", 1),
            _row("pending", "a", 2),
            _row("pending", "~m9", 3),
            _row("out", "a", 1, app_id="x.L0", batch_id=7, target="rq"),
            _row("out", "b", 5, app_id="x.L0", batch_id=6, target="rq"),  # an older batch
            _row("meta", None, app_id="x.L0", batch_id=7),
        ]
    )
    old1 = pd.DataFrame([_row("pending", "c", 4), _row("pending", "d", 8)])
    shard_of = {"a": 1, "~m9": 0, "c": 1, "d": 2}.__getitem__
    new, outs = rs.reshard_tables([old0, old1], shard_of, 3)
    assert [sorted(zip(t["group_key"], t["origin_offset"], strict=True)) for t in new] == [
        [("~m9", 3)],
        [("a", 1), ("a", 2), ("c", 4)],
        [("d", 8)],
    ]
    assert all(set(t["kind"]) <= {"pending"} for t in new)
    assert list(zip(outs["group_key"], outs["batch_id"], strict=True)) == [("a", 7)]

    empty, none = rs.reshard_tables([pd.DataFrame(columns=list(old0.columns))], shard_of, 2)
    assert [len(t) for t in empty] == [0, 0] and len(none) == 0


def test_check_stopped():
    now = 1_000_000
    sub = subscription(3)
    fresh = now - 1_000
    rs.check_stopped(
        sub,
        {0: {"state": "stopped", "updated_ms": fresh}, 1: {"state": "fenced", "updated_ms": fresh}},
        now,
    )
    rs.check_stopped(sub, {0: {"state": "running", "updated_ms": now - SILENT_MS}}, now)
    with pytest.raises(rs.ShardsRunning) as e:
        rs.check_stopped(
            sub,
            {
                0: {"state": "running", "updated_ms": fresh},
                2: {"state": "paused", "updated_ms": fresh},
            },
            now,
        )
    assert e.value.shards == {0: "running", 2: "paused"}
    assert "subscription pause orders-http" in str(e.value) and e.value.exit_code == 2
    paused = replace(sub, paused=True)
    rs.check_stopped(paused, {2: {"state": "paused", "updated_ms": fresh}}, now)
    with pytest.raises(rs.ShardsRunning):
        rs.check_stopped(paused, {1: {"state": "running", "updated_ms": fresh}}, now)


def test_a_shard_dead_by_its_lease_does_not_hold_an_operation_back():
    now = 1_000_000
    sub = subscription(3)
    quiet = {"state": "running", "updated_ms": now - 20_000}  # not yet silent (60 s)
    expired = {"expired": True, "ttl_ms": 15_000, "renewed_age_ms": 20_000}
    rs.check_stopped(sub, {0: quiet}, now, {0: expired})
    with pytest.raises(rs.ShardsRunning):
        rs.check_stopped(sub, {0: quiet}, now, {0: dict(expired, expired=False)})


def test_a_shard_of_an_earlier_shard_count_does_not_hold_an_operation_back():
    # 1 -> 2 ran after shard 0 (of 1) died saying "running"; nothing runs at 2 shards yet, so
    # 2 -> 3 goes ahead at once: shard 0's progress document is the old count's (it held the
    # second change back until the old document went silent, 60 s).
    now = 1_000_000
    sub = subscription(2)
    dead = {"state": "running", "updated_ms": now - 5_000, "shard_count": 1}
    rs.check_stopped(sub, {0: dead}, now)
    with pytest.raises(rs.ShardsRunning):
        rs.check_stopped(sub, {0: dict(dead, shard_count=2)}, now)


def test_next_layout_seq_skips_a_previous_era_at_the_same_count():
    snap = Snapshot(
        {
            "reader/orders-http/s4/0": {"generation": 0, "seq": 3, "mq_index": 0},
            "reader/orders-http/s4/1": {"generation": 0, "seq": 1, "mq_index": 0},
            "reader/orders-http/s2/0": {"generation": 0, "seq": 9, "mq_index": 0},
            "reader/other/s4/0": {"generation": 0, "seq": 9, "mq_index": 0},
        }
    )
    assert rs.next_layout_seq(snap, "orders-http", 4, 0) == 4
    assert rs.next_layout_seq(snap, "orders-http", 4, 1) == 0
    assert rs.next_layout_seq(snap, "orders-http", 3, 0) == 0


def test_dry_run_output_and_operation_document():
    sub, mq = subscription(2), new_topic("orders", 12)
    rq, dlq = queues(2)
    plan = rs.plan_change(sub, mq, rq, dlq, positions(sub, mq), 4)
    text = rs.text_plan(plan)
    assert "change-shards orders-http: 2 -> 4 shards" in text
    assert "  shard 1: orders.0[6, 7, 8, 9, 10, 11]" in text
    assert "  shard 3: orders.0[9, 10, 11]" in text
    assert "new RQ storage topic orders-http.rq.1 (8 partitions)" in text
    assert "  shard 3: RQ [6, 7] DLQ [3]" in text
    assert "  rq: orders-http.rq.0 -> orders-http.rq.1" in text
    for step in ("fence", "queues", "state", "layouts", "activate", "feed"):
        assert f" {step} " in text

    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["assignment_after"][0] == {
        "shard": 0,
        "mq": {"orders.0": [0, 1, 2]},
        "rq": {"orders-http.rq.1": [0, 1]},
        "dlq": {"orders-http.dlq.1": [0]},
    }
    op = plan.operation_doc("fence", "in-process")
    assert {k: op[k] for k in ("kind", "from", "to", "step")} == {
        "kind": "change-shards",
        "from": 2,
        "to": 4,
        "step": "fence",
    }
    assert op["feeders"] == [
        {"queue": "rq", "source": "orders-http.rq.0", "target": "orders-http.rq.1", "done": False},
        {
            "queue": "dlq",
            "source": "orders-http.dlq.0",
            "target": "orders-http.dlq.1",
            "done": False,
        },
    ]


def test_feeder_source_checks_the_operation():
    op = {"step": "state", "feeders": [{"queue": "rq", "source": "s.rq.0", "done": False}]}
    with pytest.raises(InvalidArgument, match="feeders run once it reaches `feed`"):
        feeder_source(op, "s.rq.0")
    with pytest.raises(InvalidArgument, match="not a feeder source"):
        feeder_source(dict(op, step="feed"), "s.rq.9")
    assert feeder_source(dict(op, step="feed"), "s.rq.0")["queue"] == "rq"


def test_activate_sets_the_spec_shard_count_with_the_state():
    sub, mq = subscription(2), new_topic("orders", 12)
    rq, dlq = queues(2)
    plan = rs.plan_change(sub, mq, rq, dlq, positions(sub, mq), 3)
    doc = sub.to_dict()
    doc["state"]["dlq_start"] = {"orders-http.dlq.0": {"0": 5}}  # another component's key
    new = rs.activated(doc, plan)
    assert new["state"]["dlq_start"] == doc["state"]["dlq_start"]
    assert doc["spec"]["shards"] == doc["state"]["shard_count"] == 2  # not changed in place
    after = Subscription.from_dict(new)
    assert (after.shard_count, after.rq_from, after.dlq_from) == (3, 1, 1)
    assert (after.spec.shards, after.spec.rq_partitions, after.spec.dlq_partitions) == (3, 6, 3)
    # what pause/resume and an apply of the spec check: no shard-count change left over
    assert changed_fields(after, after.spec) == []


def test_a_finished_change_run_again_does_nothing():
    op = {"kind": "change-shards", "from": 2, "to": 4, "step": "done"}
    assert rs.finished(op, subscription(4), 4)
    assert not rs.finished(op, subscription(4), 3)  # another change: planned afresh
    assert not rs.finished(dict(op, step="feed"), subscription(4), 4)  # resumed instead
    assert not rs.finished(op, subscription(2), 4)  # the count changed since
    assert not rs.finished(None, subscription(4), 4)
