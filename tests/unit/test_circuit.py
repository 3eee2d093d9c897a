"""The circuit breaker's transitions, with a fake clock (`varadhi.core.circuit`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from varadhi.core.circuit import CircuitBreaker, probe_retry, validate_circuit_policy
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import CircuitPolicy, RetryPolicy
from varadhi.core.retry import linger_ms, retries_in_place, waits_in_task
from varadhi.ops.status import circuit_text

POLICY = CircuitPolicy(
    failure_rate=0.5,
    min_requests=10,
    window_ms=2_000,
    open_for_ms=1_000,
    max_open_for_ms=3_000,
    probes=4,
)


class Clock:
    def __init__(self, ms: int = 1_000_000):
        self.ms = ms

    def __call__(self) -> int:
        return self.ms

    def advance(self, ms: int) -> None:
        self.ms += ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def breaker(clock) -> CircuitBreaker:
    return CircuitBreaker(POLICY, clock)


def opened(breaker: CircuitBreaker) -> CircuitBreaker:
    assert breaker.record(10, 10) == "open"
    return breaker


def test_it_starts_closed_and_reads_normally(breaker):
    assert breaker.poll() == "closed"
    assert breaker.read_limit(1_000) == 1_000
    assert breaker.due_limit() is None
    assert breaker.status()["consecutive_opens"] == 0


def test_closed_stays_closed_below_the_rate_or_below_min_requests(breaker, clock):
    assert breaker.record(100, 49) == "closed"  # 49% < 50%
    clock.advance(5_000)  # the window forgets that batch
    assert breaker.record(9, 9) == "closed"  # every attempt failed, but only 9 of them
    assert breaker.record(0, 0) == "closed"


def test_closed_opens_on_one_batch_at_the_rate_with_enough_attempts(breaker, clock):
    assert breaker.record(20, 10) == "open"  # exactly 50%
    status = breaker.status()
    assert (status["state"], status["since_ms"]) == ("open", clock.ms)
    assert status["open_until_ms"] == clock.ms + 1_000
    assert status["consecutive_opens"] == 1


def test_closed_sums_the_batches_of_the_window(breaker, clock):
    assert breaker.record(6, 6) == "closed"
    clock.advance(1_500)
    assert breaker.record(6, 1) == "open"  # 12 attempts, 7 failed, within 2 s


def test_batches_older_than_the_window_do_not_count(breaker, clock):
    assert breaker.record(6, 6) == "closed"
    clock.advance(2_001)
    assert breaker.record(6, 6) == "closed"  # the first batch left the window
    clock.advance(100)
    assert breaker.record(4, 4) == "open"


def test_open_reads_nothing_until_its_time_is_up_then_half_opens(breaker, clock):
    opened(breaker)
    assert breaker.read_limit(1_000) is None
    assert breaker.seconds_to_half_open() == pytest.approx(1.0)
    clock.advance(999)
    assert breaker.poll() == "open"
    assert breaker.record(50, 0) == "open"  # a straggling batch decides nothing while open
    clock.advance(1)
    assert breaker.poll() == "half_open"
    status = breaker.status()
    assert (status["since_ms"], status["open_until_ms"]) == (clock.ms, None)
    assert breaker.read_limit(1_000) == 4
    assert breaker.read_limit(3) == 3  # never more than the normal limit
    assert breaker.due_limit() == 4
    assert breaker.seconds_to_half_open() == 0.0


def test_half_open_closes_when_the_probe_succeeds(breaker, clock):
    opened(breaker)
    clock.advance(1_000)
    assert breaker.poll() == "half_open"
    assert breaker.record(4, 1) == "closed"  # 25% < 50%, however few attempts
    assert breaker.status()["consecutive_opens"] == 0
    assert breaker.read_limit(1_000) == 1_000
    # The failures before the open are forgotten: a new open needs a full window again.
    assert breaker.record(9, 9) == "closed"


def test_half_open_reopens_for_twice_as_long_up_to_the_cap(breaker, clock):
    opened(breaker)
    expected = [2_000, 3_000, 3_000]  # 1 s doubled, then capped at 3 s
    for n, duration in enumerate(expected, start=2):
        clock.advance(breaker.status()["open_until_ms"] - clock.ms)
        assert breaker.poll() == "half_open"
        assert breaker.record(4, 2) == "open"  # 50% is not below the rate
        status = breaker.status()
        assert status["consecutive_opens"] == n
        assert status["open_until_ms"] - clock.ms == duration
    # A success resets the doubling: the next open lasts open_for again.
    clock.advance(3_000)
    assert breaker.poll() == "half_open"
    assert breaker.record(1, 0) == "closed"
    assert breaker.record(10, 10) == "open"
    assert breaker.status()["open_until_ms"] - clock.ms == 1_000


def test_half_open_without_attempts_stays_half_open(breaker, clock):
    opened(breaker)
    clock.advance(60_000)
    assert breaker.poll() == "half_open"
    since = breaker.status()["since_ms"]
    clock.advance(10_000)
    assert breaker.record(0, 0) == "half_open"
    assert breaker.poll() == "half_open"
    assert breaker.status()["since_ms"] == since


def test_a_disabled_policy_never_opens_and_disabling_closes(breaker, clock):
    off = CircuitBreaker(CircuitPolicy(enabled=False), clock)
    assert off.record(1_000, 1_000) == "closed"
    assert off.status()["enabled"] is False
    opened(breaker)
    breaker.configure(CircuitPolicy(enabled=False))
    assert breaker.poll() == "closed"
    assert breaker.read_limit(7) == 7


def test_a_changed_policy_applies_to_the_next_decision(breaker, clock):
    breaker.configure(CircuitPolicy(min_requests=1, failure_rate=1.0, probes=2))
    assert breaker.record(2, 1) == "closed"
    assert breaker.record(1, 1) == "closed"  # 2 of 3 in the window
    breaker.configure(CircuitPolicy(min_requests=1, failure_rate=0.5, probes=2))
    assert breaker.record(1, 1) == "open"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"failure_rate": 0.0}, "circuit_breaker.failure_rate"),
        ({"failure_rate": 1.01}, "circuit_breaker.failure_rate"),
        ({"min_requests": 0}, "circuit_breaker.min_requests"),
        ({"probes": 0}, "circuit_breaker.probes"),
        ({"open_for_ms": 0}, "circuit_breaker.open_for_ms"),
        ({"window_ms": -1}, "circuit_breaker.window_ms"),
        ({"open_for_ms": 5_000, "max_open_for_ms": 4_000}, "circuit_breaker.max_open_for_ms"),
    ],
)
def test_invalid_policies_are_refused_by_field(change, field):
    from dataclasses import replace

    with pytest.raises(InvalidArgument) as e:
        validate_circuit_policy(replace(CircuitPolicy(), **change))
    assert e.value.field == field
    validate_circuit_policy(CircuitPolicy())


def test_status_shows_the_circuit_in_one_word():
    now = 1_000_000
    assert circuit_text(None, now) == "-"  # no report (an older shard, or none yet)
    assert circuit_text({"state": "closed", "enabled": True}, now) == "closed"
    assert circuit_text({"state": "closed", "enabled": False}, now) == "off"
    assert circuit_text({"state": "half_open"}, now) == "half-open"
    is_open = {"state": "open", "open_until_ms": now + 2_400, "consecutive_opens": 1}
    assert circuit_text(is_open, now) == "open 2s"
    assert circuit_text({**is_open, "consecutive_opens": 3}, now) == "open 2s x3"
    assert circuit_text(is_open, now + 10_000) == "open 0s"  # a stale report


def test_a_probe_batch_makes_no_retries_in_place_and_keeps_the_rest_of_the_policy():
    policy = RetryPolicy(max_attempts=7, min_backoff_ms=300, jitter=0.0)
    probe = probe_retry(policy)
    assert probe.in_place_window_ms == 0
    assert not retries_in_place(probe, first_failure_ms=0, due_ms=1)  # even a retry due at once
    assert not waits_in_task(probe, wait_ms=1)  # an RQ record read back early is parked
    assert linger_ms(probe) == 0
    assert (probe.max_attempts, probe.min_backoff_ms, probe.responses) == (7, 300, policy.responses)
    assert retries_in_place(policy, first_failure_ms=0, due_ms=1_000)  # the policy itself is kept


# -- endpoint health: sustained failure suspends the subscription --------------------------------


def test_sustained_failure_is_counted_from_the_first_batch_whose_attempts_all_failed(clock):
    breaker = CircuitBreaker(replace(POLICY, suspend_after_ms=60_000), clock)
    assert breaker.suspension_due() is None
    breaker.record(3, 2)  # a success among them: not failing
    assert breaker.failing_since_ms is None
    breaker.record(10, 10)  # every attempt failed: failing from now; the circuit opens
    since = clock.ms
    clock.advance(30_000)
    breaker.record(0, 0)  # no attempts (a tick) changes nothing
    breaker.poll()
    breaker.record(4, 4)  # a failed probe
    assert breaker.failing_since_ms == since and breaker.suspension_due() is None
    clock.advance(30_000)
    assert breaker.suspension_due() == "every attempt to the endpoint failed for 60 s"
    breaker.forget_failing()  # a suspension ended: count afresh
    assert breaker.suspension_due() is None
    breaker.record(2, 2)
    clock.advance(60_000)
    assert breaker.suspension_due() is not None
    breaker.poll()
    breaker.record(4, 1)  # a probe with a success ends it
    assert breaker.failing_since_ms is None and breaker.suspension_due() is None


def test_without_suspend_after_nothing_is_ever_due_and_a_disabled_breaker_still_counts(clock):
    never = CircuitBreaker(POLICY, clock)
    never.record(10, 10)
    clock.advance(10**9)
    assert never.suspension_due() is None
    off = replace(POLICY, enabled=False, suspend_after_ms=1_000, resume="operator")
    validate_circuit_policy(off)
    disabled = CircuitBreaker(off, clock)
    disabled.record(10, 10)
    clock.advance(1_000)
    assert disabled.state == "closed" and disabled.suspension_due() is not None


def test_suspension_settings_are_validated():
    with pytest.raises(InvalidArgument, match="circuit_breaker.suspend_after_ms"):
        validate_circuit_policy(replace(POLICY, suspend_after_ms=0))
    with pytest.raises(InvalidArgument, match="circuit_breaker.resume: probe needs"):
        validate_circuit_policy(replace(POLICY, enabled=False, suspend_after_ms=1_000))
    with pytest.raises(InvalidArgument, match="circuit_breaker.resume"):
        validate_circuit_policy(replace(POLICY, resume="later"))


def test_status_says_who_suspended_the_subscription_why_and_how_it_ends():
    from varadhi.cli.status import suspended_text

    probe = {"reason": "every attempt failed\x1b[2J", "since_ms": 1_000, "shard": 1}
    text = suspended_text({**probe, "resume": "probe"}, 13_000)
    assert text.startswith(" (suspended 12s ago by shard 1: every attempt failed")
    assert "\x1b" not in text and "a probe by shard 1" in text
    assert "`varadhi subscription resume`" in suspended_text({**probe, "resume": "operator"}, 0)
    member = {**probe, "shard": -1, "member": "vm-7-\x1b[2Jab", "resume": "probe"}
    text = suspended_text(member, 13_000)  # a library member's
    assert text.startswith(" (suspended 12s ago by member vm-7-") and "\x1b" not in text, text
    assert "a probe by a member finds the endpoint healthy" in text, text


def test_a_heal_elsewhere_closes_a_circuit_that_opened_before_it_and_is_passed_on_unchanged(
    breaker, clock
):
    assert not breaker.heal(clock.ms)  # closed: nothing to heal
    opened(breaker)
    opened_at = clock.ms
    assert not breaker.heal(opened_at - 1)  # a heal older than this open: stale evidence
    assert breaker.poll() == "open"
    clock.advance(1_000)
    assert breaker.poll() == "half_open"
    assert breaker.heal(opened_at + 500)  # another breaker's probe succeeded after the open
    status = breaker.status()
    assert (status["state"], status["consecutive_opens"]) == ("closed", 0)
    assert status["healed_ms"] == opened_at + 500  # its time, not now: never newer than the probe


def test_its_own_successful_probe_is_its_heal_and_a_failed_one_outranks_an_older_heal(
    breaker, clock
):
    opened(breaker)
    clock.advance(1_000)
    breaker.poll()
    assert breaker.record(4, 4) == "open"  # the probe failed: opened again, now
    assert not breaker.heal(clock.ms - 1)  # a heal from before that failed probe
    clock.advance(2_000)
    breaker.poll()
    assert breaker.record(4, 0) == "closed"
    assert breaker.status()["healed_ms"] == clock.ms
