"""The chaos checks of `varadhi.testing.library` on hand-made endpoint records: what each
counts as lost, out of order, early, or an unexplained duplicate."""

from __future__ import annotations

from varadhi.core import messages as m
from varadhi.testing import library as lib
from varadhi.testing.endpoint import Record


def rec(seq: int, msg_id: str, status: int = 200, attempt: int = 1, at: float = 0.0) -> Record:
    return Record(seq, 1, "POST", "/", msg_id, msg_id.split("-")[0], attempt, 1, at, status, 0)


def test_lost_counts_neither_delivered_nor_dead_lettered():
    records = [rec(0, "g-0"), rec(1, "g-1", 500)]
    assert lib.lost(["g-0", "g-1", "g-2"], records, dead=["g-2"]) == {"g-1"}


def test_order_is_judged_on_first_successes_leaving_out_the_unordered():
    keys = {"g": ["g-0", "g-1", "g-2"]}
    in_order = [rec(0, "g-0"), rec(1, "g-1"), rec(2, "g-0"), rec(3, "g-2")]  # a duplicate
    assert lib.order_violations(in_order, keys) == []
    swapped = [rec(0, "g-1"), rec(1, "g-0"), rec(2, "g-2")]
    assert lib.order_violations(swapped, keys) == ["g: g-1 first delivered (#0) after g-0"]
    assert lib.order_violations(swapped, keys, unordered=["g-1"]) == []


def test_a_retry_must_not_arrive_before_its_copys_due_time():
    rq = [{"headers": {m.H_MSG_ID: "g-0", m.H_ATTEMPTS: "1", m.H_DUE_MS: "1000"}}]
    assert lib.early_retries([rec(0, "g-0", 500, 1, 10), rec(1, "g-0", 200, 2, 1000)], rq) == []
    assert lib.early_retries([rec(1, "g-0", 200, 2, 999)], rq) == ["g-0 attempt 2: 1 ms early"]
    assert lib.early_retries([rec(1, "g-0", 200, 3, 2000)], rq) == [
        "g-0 attempt 3: no RQ copy of attempt 2"
    ]


def test_a_duplicate_needs_a_disruption_between_or_shortly_after_its_first_delivery():
    records = [rec(0, "g-0", at=100), rec(1, "g-0", at=5_000)]
    assert len(lib.duplicates(records)) == 1
    assert lib.unexplained_duplicates(records, [(2_000, 3_000)], in_flight_ms=0) == []
    # in flight when its member gave the slot up: received up to a request timeout after
    assert lib.unexplained_duplicates(records, [(0, 50)], in_flight_ms=100) == []
    assert len(lib.unexplained_duplicates(records, [(0, 50)], in_flight_ms=0)) == 1
    assert len(lib.unexplained_duplicates(records, [(6_000, 7_000)], in_flight_ms=0)) == 1


def test_a_duplicate_is_put_down_to_the_last_disruption_that_explains_it():
    records = [
        rec(0, "g-0", at=100),  # finished before the kill, delivered again after it
        rec(1, "g-1", at=1_050),  # in flight at it
        rec(2, "g-0", at=3_000),
        rec(3, "g-1", at=3_000),
        rec(4, "g-2", at=3_000),
        rec(5, "g-2", at=9_000),  # far from any disruption
    ]
    spans = [("kill", 1_000, 2_000), ("start", 0, 50)]
    assert lib.duplicate_causes(records, spans, in_flight_ms=100) == {
        "kill: during": 1,
        "kill: finished before": 1,
        "unexplained": 1,
    }
