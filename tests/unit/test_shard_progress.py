"""What a shard reports to status (pure): its GroupState summarised, counters resumed."""

from __future__ import annotations

import pandas as pd

from varadhi.core.state_frames import state_rows
from varadhi.core.state_rows import Kind, StateRow
from varadhi.spark.shard.stats import LISTED_BLOCKED_GROUPS, ShardStats, summarize


def row(offset: int, location: str, reason: str | None = None, msg_id: str | None = None):
    return StateRow(
        Kind.PENDING,
        origin_index=0,
        origin_partition=1,
        origin_offset=offset,
        msg_id=msg_id or f"m{offset}",
        location=location,
        reason=reason,
    )


def test_summary_counts_and_names_blocked_groups_by_their_head():
    pending = {
        "b": [row(7, "held"), row(3, "dlq", "fatal response 404"), row(9, "held")],
        "a": [row(2, "rq", "HTTP 503; retry in 1000 ms")],
    }
    summary = summarize(pending)
    assert (summary["blocked_groups"], summary["held"], summary["rq_pending"]) == (2, 2, 1)
    assert summary["dlq_pending"] == 1
    assert summary["blocked"] == [
        {
            "group": "a",
            "head": "m2",
            "where": "rq",
            "reason": "HTTP 503; retry in 1000 ms",
            "waiting": 1,
        },
        {"group": "b", "head": "m3", "where": "dlq", "reason": "fatal response 404", "waiting": 3},
    ]


def test_the_list_of_blocked_groups_is_bounded_but_the_count_is_not():
    # As the state table reads them: a missing reason read from Delta is NaN in the frame.
    frame = pd.DataFrame([row(i, "rq")._asdict() for i in range(LISTED_BLOCKED_GROUPS + 5)])
    frame["reason"] = float("nan")
    pending = {f"g{r.origin_offset:04d}": [r] for r in state_rows(frame)}
    summary = summarize(pending)
    assert summary["blocked_groups"] == LISTED_BLOCKED_GROUPS + 5
    assert len(summary["blocked"]) == LISTED_BLOCKED_GROUPS
    assert summary["blocked"][0]["reason"] is None  # a missing reason read from Delta is NaN


def test_counters_go_on_from_the_last_progress_of_the_same_shard_count():
    doc = {"shard_count": 2, "totals": {"delivered": 10, "routed": 12, "unknown": 3}}
    stats = ShardStats.resumed(doc, 2)
    assert (stats.delivered, stats.routed, stats.batches) == (10, 12, 0)
    assert ShardStats.resumed(doc, 3) == ShardStats()  # another shard count: its own counts
    assert ShardStats.resumed(None, 2) == ShardStats()


def test_a_restarted_query_reports_what_the_last_one_consumed_on_the_same_layout():
    from varadhi.spark.layouts import Layout
    from varadhi.spark.shard.stats import where_reading

    layout = Layout(generation=1, seq=2, mq_index=0, starting_offsets={})
    before = {"generation": 1, "shard_count": 2, "layout": 2, "consumed": {"t.0": {"0": 40}}}
    where = where_reading(before, 2, layout, {"t.0": [0]})
    assert where["consumed"] == {"t.0": {"0": 40}} and where["reading"] == {"t.0": [0]}
    assert "consumed" not in where_reading(dict(before, layout=1), 2, layout, {"t.0": [0]})
    assert "consumed" not in where_reading(before, 3, layout, {"t.0": [0]})


def test_a_shard_count_change_carries_the_retired_shards_counts():
    from varadhi.ops.status import carry_totals

    progress = {
        0: {"shard_count": 2, "totals": {"delivered": 5, "routed": 6}},
        1: {"shard_count": 2, "totals": {"delivered": 7, "routed": 7, "last": "x"}},
        2: {"shard_count": 3, "totals": {"delivered": 100}},  # not one of the two retired
    }
    assert carry_totals({"delivered": 1}, progress, 2) == {"delivered": 13, "routed": 13}
    assert carry_totals({}, {}, 2) == {}


def test_a_batch_adds_its_counters_and_becomes_the_last_batch():
    from varadhi.spark.shard.stats import ShardStats

    s = ShardStats(delivered=5, replays=1)
    counts = {"delivered": 3, "failures": 2, "records": 4, "http": {"200": 3}}
    s.add_batch(7, 4, counts, 1.23456, {"deliver_s": 0.98765})
    assert (s.batches, s.records, s.delivered, s.failures, s.replays) == (1, 4, 8, 2, 1)
    assert s.last_batch == {
        "batch_id": 7,
        "records": 4,
        "seconds": 1.235,
        "deliver_s": 0.988,
        **counts,
    }
    assert s.totals()["delivered"] == 8 and "last_batch" not in s.totals()


def test_rates_are_over_the_last_minute_and_zero_for_the_first_second():
    from varadhi.spark.shard.stats import Rates

    r = Rates()
    assert r.update(100.0, 0, 0) == {"delivered_per_s": 0.0, "failures_per_s": 0.0}
    assert r.update(100.5, 50, 1) == {"delivered_per_s": 0.0, "failures_per_s": 0.0}
    assert r.update(110.0, 100, 10) == {"delivered_per_s": 10.0, "failures_per_s": 1.0}
    # Later than 60 s, the first records have left the window: rates since t=110.
    assert r.update(169.0, 159, 10) == {"delivered_per_s": 1.0, "failures_per_s": 0.0}
