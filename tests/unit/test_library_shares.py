"""A library member's shares of its subscription's rate and concurrency limits
(`varadhi.library.shares`): what a rebalance sets and what the engine's thread takes up (pure,
no services)."""

from __future__ import annotations

from varadhi.library.shares import Limits, Shares


def _limits(**fields) -> Limits:
    base = {"slots": 4, "in_flight": 10, "cap": 10, "max_rate": 100.0, "http": True}
    return Limits(**{**base, **fields})


def test_before_the_first_assignment_the_pacer_paces_at_one_slots_share_and_nothing_is_held():
    shares = Shares(_limits())
    assert shares.pacer is not None and shares.pacer.rate == 25.0
    assert (shares.rate, shares.in_flight) == (0.0, 0)
    assert shares.apply() is None  # nothing for the engine yet


def test_a_rebalance_sets_the_held_slots_parts_and_the_engine_takes_them_once():
    shares = Shares(_limits())
    shares.rebalanced({0, 1})
    assert (shares.rate, shares.in_flight) == (50.0, 5)
    assert shares.apply() == 5
    assert shares.pacer is not None and shares.pacer.rate <= 50.0
    assert shares.apply() is None  # taken up already


def test_the_in_flight_share_is_capped_by_the_process_and_at_least_one_for_the_engine():
    shares = Shares(_limits(cap=3))
    shares.rebalanced({0, 1, 2, 3})
    assert shares.in_flight == 3 and shares.apply() == 3
    shares.rebalanced(set())  # no slot: a share of 0, the engine keeps one request
    assert (shares.rate, shares.in_flight) == (0.0, 0)
    assert shares.apply() == 1
    assert shares.pacer is not None and shares.pacer.rate > 0  # no slot: nothing to pace


def test_without_a_rate_limit_or_with_a_handler_nothing_is_paced_and_the_engine_is_not_told():
    unpaced = Shares(_limits(max_rate=None))
    unpaced.rebalanced({1})
    assert unpaced.pacer is None and unpaced.rate is None and unpaced.apply() == 3
    handler = Shares(_limits(http=False))  # handler threads take `in_flight` themselves
    handler.rebalanced({1})
    assert handler.pacer is None and handler.rate is None
    assert handler.in_flight == 3 and handler.apply() is None
