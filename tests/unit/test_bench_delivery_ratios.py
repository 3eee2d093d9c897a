"""bench/delivery.py's ratios between rows: each consumer's no-failure twin, the baseline, the peer
and the ceiling, and the targets' failure ratio with peer rows present (no service)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def delivery():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("delivery_under_test", BENCH / "delivery.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("delivery_under_test", None)
        sys.path.remove(str(BENCH))


def shard(shards, grouped, fail, steady, journal=250):
    return {
        "run": f"{shards} shards, {'grouped' if grouped else 'ungrouped'}, {fail:.0%} fail",
        "shards": shards,
        "grouped": grouped,
        "fail_rate": fail,
        "journal_interval_ms": journal,
        "steady_msg_s": steady,
        "delivering_msg_s": steady,
        "overall_msg_s": steady,
    }


def peer(fail, steady):
    return {
        "run": f"peer, {fail:.0%} fail",
        "peer": "parallel-consumer-vertx 0.5.3.3",
        "fail_rate": fail,
        "steady_msg_s": steady,
    }


ROWS = [
    {"run": "ceiling: wrk", "steady_msg_s": 100_000},
    {"run": "baseline: poll 500", "steady_msg_s": 20_000, "overall_msg_s": 20_000},
    {"run": "baseline: poll 5000", "steady_msg_s": 25_000, "overall_msg_s": 25_000},
    peer(0.0, 20_000),
    peer(0.1, 10_000),
    shard(1, True, 0.0, 20_000),
    shard(1, False, 0.0, 16_000),
    shard(1, True, 0.1, 5_000),
    shard(1, False, 0.1, 8_000),
    {"run": "latency: 1 shard", "latency": {"p50_ms": 400, "p99_ms": 700}},
]


def test_each_row_over_its_own_no_failure_run_the_best_baseline_the_peer_and_the_ceiling(
    delivery,
):
    r = delivery.ratios(ROWS)
    assert r["peer, 10% fail"] == {
        "no_failures": 0.5,
        "baseline": 0.4,
        "ceiling": 0.1,
    }
    assert r["1 shards, grouped, 10% fail"] == {
        "no_failures": 0.25,
        "baseline": 0.2,
        "peer": 0.5,
        "ceiling": 0.05,
    }
    # ungrouped is judged against ungrouped without failures, not the first shard row
    assert r["1 shards, ungrouped, 10% fail"]["no_failures"] == 0.5
    # rows without failures: no twin; the peer at 0%
    assert r["1 shards, ungrouped, 0% fail"] == {"baseline": 0.64, "peer": 0.8, "ceiling": 0.16}
    # the baseline against the best baseline and the healthy peer; the best not against itself
    assert r["baseline: poll 500"] == {"baseline": 0.8, "peer": 1.0, "ceiling": 0.2}
    assert "baseline" not in r["baseline: poll 5000"]
    assert "peer" not in r["peer, 0% fail"]
    assert "ceiling: wrk" not in r and "latency: 1 shard" not in r


def test_a_twin_is_the_same_consumer_and_settings_without_failures(delivery):
    other_journal = shard(1, True, 0.1, 5_000, journal=0)
    assert delivery.no_failure_twin(other_journal, ROWS) is None
    assert delivery.no_failure_twin(peer(0.1, 1), ROWS)["run"] == "peer, 0% fail"
    assert delivery.no_failure_twin(ROWS[1], ROWS) is None  # a baseline has none


def test_without_references_a_row_has_no_ratios(delivery):
    assert delivery.ratios([shard(1, True, 0.0, 20_000)]) == {}


def test_the_failure_target_judges_shards_only_with_peer_rows_present(delivery):
    t = delivery.targets(ROWS)["10% failures >= 0.8x"]
    assert t["verdict"] == "NOT met"
    assert "1 shard grouped 0.25" in t["detail"] and "1 shard ungrouped 0.50" in t["detail"]
    assert "peer" not in t["detail"]


def test_the_failure_target_is_issue_13s_four_fifths_of_the_healthy_rate(delivery):
    def verdict(with_failures):
        rows = [shard(1, True, 0.0, 10_000), shard(1, True, 0.1, with_failures)]
        return delivery.targets(rows)["10% failures >= 0.8x"]["verdict"]

    assert verdict(7_999) == "NOT met"  # half or more is no longer enough
    assert verdict(8_000) == "met"


def test_a_run_with_a_linger_other_than_the_default_is_shown_not_judged(delivery):
    no_linger = {**shard(1, True, 0.1, 9_000), "in_place_linger_ms": 0}
    rows = [shard(1, True, 0.0, 10_000), shard(1, True, 0.1, 7_000), no_linger]
    t = delivery.targets(rows)["10% failures >= 0.8x"]
    assert t["verdict"] == "NOT met"  # 0.70 with the default policy; no linger's 0.90 aside
    assert "not judged (policy not the default): 1 shard grouped linger 0 s 0.90" in t["detail"]


def test_the_latency_targets_name_the_rate_the_run_offered(delivery):
    row = {
        "run": "latency: 1 shard",
        "offered_msg_s": 20,
        "latency": {"p50_ms": 345, "p99_ms": 596},
    }
    t = delivery.targets([row])
    assert t["p99 < 1,000 ms at 20 msg/s"]["verdict"] == "met"
    assert t["p99 < 500 ms at 20 msg/s"]["verdict"] == "NOT met"
    assert not any("1,000 msg/s" in key for key in t)


def test_the_runs_with_failures_read_the_same_backlog_unless_told_otherwise(delivery):
    """`--fail-messages` defaults to `--messages`: a warm run (`--messages 1000000`) used to
    give its failure rows a 200,000-message backlog of their own."""
    assert delivery.parse_args(["--messages", "1000000"]).fail_messages == 1_000_000
    assert delivery.parse_args([]).fail_messages == 200_000
    args = delivery.parse_args(["--messages", "1000000", "--fail-messages", "300000"])
    assert args.fail_messages == 300_000


def _library(fail, steady, window=2000):
    return {
        "run": f"library: 1 member, {fail}",
        "library_members": 1,
        "fail_rate": fail,
        "in_place_window_ms": window,
        "steady_msg_s": steady,
        "delivering_msg_s": steady,
    }


def test_each_retry_schedule_of_the_library_is_judged_against_the_healthy_run(delivery):
    """A run with retries in place (the default window) and one with every retry through the
    RQ (`--in-place-windows 2000 0`) each get their own verdict, saying which schedule."""
    rows = [_library(0.0, 10_000), _library(0.1, 8_500), _library(0.1, 6_000, window=0)]
    targets = delivery.library_targets(rows)
    in_place = targets["library 10% failures >= 0.8x"]
    through_rq = targets["library 10% failures >= 0.8x (in place 0 s)"]
    assert in_place["verdict"] == "met" and "steady 0.85" in in_place["detail"]
    assert "within 2 s of the first failure wait in the member" in in_place["detail"]
    assert through_rq["verdict"] == "NOT met" and "steady 0.60" in through_rq["detail"]
    assert "every retry goes through the RQ" in through_rq["detail"]
