"""bench/outage.py's judge (pure: no service) and the test endpoint's outage it runs against."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from varadhi.core.policies import RetryPolicy
from varadhi.testing.endpoint import Record, TestEndpoint

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def outage():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("outage_under_test", BENCH / "outage.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def rec(seq, i, attempt, status, at_ms):
    return Record(
        seq=seq,
        connection=1,
        method="POST",
        path="/",
        message_id=f"m{i}",
        group_id=f"group-{i % 2}",
        attempt=attempt,
        body_bytes=4,
        received_ms=float(at_ms),
        status=status,
        delay_ms=0,
    )


POLICY = RetryPolicy()  # 1 s, exponential x2, 20% jitter, at most 60 s


def test_a_retry_is_early_only_before_the_least_backoff_or_retry_after(outage):
    """Attempt 2 after a 500 owes 0.8 s (1 s less 20% jitter), after a 503 the endpoint's
    Retry-After when longer (3 s here); attempt 3 owes 1.6 s; a request after a 2xx is a
    duplicate, never early."""
    records = [
        rec(0, 1, 1, 500, 0),
        rec(1, 1, 2, 500, 798),  # early: 0.8 s owed (1 ms of slack)
        rec(2, 1, 3, 200, 798 + 1600),  # on time: 1.6 s after attempt 2
        rec(3, 2, 1, 503, 0),
        rec(4, 2, 2, 200, 2_000),  # early: Retry-After 3 s honoured for 503
        rec(5, 3, 1, 503, 0),
        rec(6, 3, 2, 200, 3_000),
        rec(7, 4, 1, 200, 0),
        rec(8, 4, 2, 200, 10),  # a duplicate of a success
    ]
    early = outage.early_sends(records, POLICY, retry_after_ms=3_000)
    assert [(e["message"], e["attempt"], e["need_ms"]) for e in early] == [
        ("m1", 2, 800),
        ("m2", 2, 3_000),
    ]
    assert outage.early_sends(records[:3], POLICY, retry_after_ms=0) == [early[0]]
    assert outage.least_wait_ms(POLICY, 10, 500, 0) == 48_000  # capped at 60 s, less 20%


def test_lag_drain_and_steady_lag_come_from_the_two_curves(outage):
    """10 msg/s produced for 60 s; delivered at once until 20 s, nothing from 20 s to 30 s,
    then 30 msg/s until the backlog is gone: the lag is 100 at 30 s, drains at 20 msg/s net, and
    is back at the steady lag (0 here) at 35 s."""
    produced = outage.Counts([t * 100.0 for t in range(601)], list(range(601)))
    ok = [t * 100.0 for t in range(200)]  # m0..m199 at once
    ok += [30_000 + k * 1000 / 30 for k in range(1, 151)]  # 150 in 5 s, from 30 s
    ok += [35_000 + k * 100.0 for k in range(1, 251)]
    delivered = outage.Counts(sorted(ok))
    threshold = outage.steady_lag(produced, delivered, 0, 19_000)
    assert threshold <= 1
    d = outage.drain(produced, delivered, 30_000, threshold, 60_000)
    assert d["backlog"] == 100
    assert d["first_ok_s"] == pytest.approx(0.03, abs=0.01)
    assert d["caught_up_s"] == 5.0
    assert d["msg_s"] == 30
    never = outage.drain(produced, outage.Counts(ok[:200]), 30_000, threshold, 60_000)
    assert (never["caught_up_s"], never["msg_s"]) == (None, None)


def test_order_violations_count_requests_that_overtook_an_undelivered_message(outage):
    """Groups of 2 (m0, m2, m4 in group 0): m2 sent while m0 still failed is a violation; a
    retry of m0 and later successes in order are not; group 1 stays in order."""
    records = [
        rec(0, 0, 1, 503, 0),
        rec(1, 1, 1, 200, 1),
        rec(2, 2, 1, 200, 2),  # overtook m0
        rec(3, 0, 2, 200, 1_000),
        rec(4, 3, 1, 200, 1_001),
        rec(5, 4, 1, 200, 1_002),
    ]
    v = outage.order_violations(records, produced=5, groups=2)
    assert (v["requests"], v["groups"], v["examples"]) == (1, 1, [0])
    in_order = [r for r in records if r.seq != 2] + [rec(6, 2, 1, 200, 1_001.5)]
    assert outage.order_violations(in_order, produced=5, groups=2)["requests"] == 0


def test_requests_inside_an_open_period_and_each_probe_are_counted(outage):
    """Open periods come from status samples, each once; a request strictly inside one was
    sent while open; a half-open probe is what arrived from an open period's end to the next
    change the samples saw (opened again, closed; none: the run's end)."""
    samples = [
        {"circuit": {"state": "closed", "since_ms": 0}},
        {"circuit": {"state": "open", "since_ms": 1_000, "open_until_ms": 6_000}},
        {"circuit": {"state": "open", "since_ms": 1_000, "open_until_ms": 6_000}},
        {"circuit": {"state": "open", "since_ms": 7_000, "open_until_ms": 17_000}},
        {"error": "timeout"},
        {"circuit": {"state": "closed", "since_ms": 17_500}},
    ]
    intervals = outage.open_intervals(samples)
    assert intervals == [(1_000, 6_000), (7_000, 17_000)]
    records = [
        rec(0, 1, 1, 503, 1_000),  # the opening batch's last request: not inside
        rec(1, 2, 1, 503, 3_000),  # inside
        rec(2, 3, 1, 503, 6_100),  # probe 1
        rec(3, 4, 1, 503, 6_200),  # probe 1
        rec(4, 5, 1, 200, 17_100),  # probe 2
        rec(5, 6, 1, 200, 17_200),  # probe 2: closed at 17.5 s
        rec(6, 7, 1, 200, 17_600),
    ]
    assert outage.sent_while_open(records, intervals) == [1]
    periods = outage.half_open_periods(samples, end_ms=20_000)
    assert periods == [(6_000, 7_000), (17_000, 17_500)]
    assert outage.probe_requests(records, periods) == [2, 2]
    assert outage.half_open_periods(samples[:4], end_ms=20_000)[-1] == (17_000, 20_000)
    timeline = outage.circuit_timeline(samples, t0_ms=0)
    assert [(t["t_s"], t["state"]) for t in timeline] == [
        (0.0, "closed"),
        (1.0, "open"),
        (7.0, "open"),
        (17.5, "closed"),
    ]
    assert timeline[2]["open_s"] == 10.0
    run = {
        "mode": "grouped",
        "circuit": timeline,
        "events_s": {"outage_from": 0.5, "outage_to": 30},
    }
    assert outage.circuit_line(run) == (
        "grouped: outage 0.5-30 s; circuit closed at 0, open 5 s at 1, open 10 s at 7, "
        "closed at 17.5"
    )


def test_the_judge_composes_one_modes_figures(outage):
    """A whole (tiny) run: 2 msg/s for 40 s; healthy at once; a pause 10-15 s drained by 17 s;
    an outage 25-30 s (503s, a retry 1.2 s later), drained by 33 s."""
    produced_log = [(t * 500.0, t + 1) for t in range(80)]
    records, seq = [], 0
    for i in range(80):
        made = i * 500.0
        if made < 10_000 or made >= 33_000:
            at = made + 10
        elif made < 15_000:
            at = 15_000 + (made - 10_000) / 5  # drained by 17 s
        elif made < 25_000:
            at = made + 10
        else:
            records.append(rec(seq, i, 1, 503, made + 10))
            seq += 1
            at = max(made + 10 + 1_200, 30_000 + (made - 25_000) / 2)
        records.append(rec(seq, i, 2 if 25_000 <= made < 33_000 else 1, 200, at))
        seq += 1
    events = {
        "healthy_from": 0,
        "healthy_to": 10_000,
        "pause_from": 10_000,
        "pause_to": 15_000,
        "outage_from": 25_000,
        "outage_to": 30_000,
        "end": 40_000,
    }
    # ungrouped: every message's first attempt fails during the outage, nothing is held
    v = outage.judge(records, produced_log, events, [], POLICY, 1_000, groups=2, grouped=False)
    assert (v["produced"], v["delivered"], v["lost"], v["duplicates"]) == (80, 80, 0, 0)
    assert v["healthy_msg_s"] == 2
    assert v["control"]["backlog"] >= 9 and v["control"]["caught_up_s"] is not None
    assert v["outage"]["backlog"] >= 9 and v["outage"]["caught_up_s"] is not None
    assert v["ratio"] == round(v["outage"]["msg_s"] / v["control"]["msg_s"], 2)
    assert (v["early_sends"], v["sent_while_open"], v["order_violations"]) == (0, 0, None)
    assert (v["requests_during_outage"], v["retries"]) == (10, 16)
    row = outage.table_row("ungrouped", v)
    assert (row["lost"], row["order_violations"]) == ("0", "-")
    assert row["ratio"] == format(v["ratio"], ".2f")


def test_the_endpoint_answers_503_to_everything_during_an_outage():
    """`outage(s)`: every delivery, scripted or not, gets 503 until it ends; `outage(0)` ends
    it at once, and the script goes on from where its deliveries left it."""
    ep = TestEndpoint(script={"m1": [500, 200]})
    start, until = ep.outage(3_600)
    assert until - start == pytest.approx(3_600_000)
    assert [ep._answer("m1", 0, 0), ep._answer("m2", 1, 0), ep._answer(None, 2, 0)] == [503] * 3
    ep.outage(0)
    assert [ep._answer("m1", 0, 1), ep._answer("m2", 1, 0)] == [200, 200]
    with pytest.raises(ValueError):
        ep.outage(-1)
