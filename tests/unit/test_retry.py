import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import DEFAULT_RESPONSES, ResponseRule, RetryPolicy
from varadhi.core.retry import (
    MAX_RETRY_AFTER_MS,
    UNMATCHED,
    Decision,
    backoff_ms,
    classify,
    decide,
    linger_ms,
    parse_retry_after,
    retries_in_place,
    validate_retry_policy,
    waits_in_task,
)

NOW = 1_700_000_000_000  # 2023-11-14T22:13:20Z
NO_JITTER = RetryPolicy(jitter=0.0)


def rng() -> random.Random:
    return random.Random(42)


# -- classification -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "status,error,action,honours",
    [
        (200, None, "success", False),
        (201, None, "success", False),
        (204, None, "success", False),
        (299, None, "success", False),
        (429, None, "retry", True),
        (503, None, "retry", True),
        (500, None, "retry", False),
        (502, None, "retry", False),
        (504, None, "retry", False),
        (None, "timeout", "retry", False),
        (None, "connection_error", "retry", False),
        (400, None, "dead_letter", False),
        (401, None, "dead_letter", False),
        (404, None, "dead_letter", False),
        (409, None, "dead_letter", False),
        (422, None, "dead_letter", False),
        (301, None, "dead_letter", False),
        (304, None, "dead_letter", False),
    ],
)
def test_default_table(status, error, action, honours):
    rule = classify(status, error, DEFAULT_RESPONSES)
    assert rule.action == action
    assert rule.honour_retry_after is honours


def test_unmatched_outcome_dead_letters_with_reason():
    assert classify(102, None, DEFAULT_RESPONSES) is UNMATCHED
    d = decide(NO_JITTER, 1, 102, None, None, NOW, rng())
    assert d == Decision("dead_letter", None, "no response rule matches HTTP 102", 102)
    assert classify(None, "timeout", [ResponseRule("2xx", "success")]) is UNMATCHED


def test_first_matching_rule_wins():
    specific_first = [ResponseRule("404", "retry"), ResponseRule("4xx", "dead_letter")]
    assert classify(404, None, specific_first).action == "retry"
    assert classify(400, None, specific_first).action == "dead_letter"
    class_first = list(reversed(specific_first))
    assert classify(404, None, class_first).action == "dead_letter"


def test_status_class_does_not_match_error_pseudo_codes():
    rules = [ResponseRule("5xx", "retry"), ResponseRule("timeout", "dead_letter")]
    assert classify(None, "timeout", rules).action == "dead_letter"
    assert classify(None, "connection_error", rules) is UNMATCHED


@pytest.mark.parametrize(
    "status,error",
    [(None, None), (200, "timeout"), (None, "boom"), (42, None), (True, None), ("200", None)],
)
def test_impossible_outcomes_are_rejected(status, error):
    with pytest.raises(ValueError):
        classify(status, error, DEFAULT_RESPONSES)


# -- Retry-After --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("120", 120_000),
        (" 5 ", 5_000),
        ("0", 0),
        ("Tue, 14 Nov 2023 22:13:50 GMT", 30_000),  # IMF-fixdate, 30 s after NOW
        ("Tuesday, 14-Nov-23 22:13:50 GMT", 30_000),  # RFC 850
        ("Tue Nov 14 22:13:50 2023", 30_000),  # asctime, no zone: GMT
        ("Tue, 14 Nov 2023 22:00:00 GMT", 0),  # in the past
        ("999999999999999999999999", MAX_RETRY_AFTER_MS),
        ("Fri, 01 Jan 2100 00:00:00 GMT", MAX_RETRY_AFTER_MS),
        (None, None),
        ("", None),
        ("soon", None),
        ("-5", None),
        ("1.5", None),
        ("2023-11-14T22:13:50Z", None),
    ],
)
def test_parse_retry_after(value, expected):
    assert parse_retry_after(value, NOW) == expected


def test_now_is_what_it_says():
    assert datetime.fromtimestamp(NOW / 1000, UTC) == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)


# -- backoff ------------------------------------------------------------------------------


def test_fixed_backoff():
    policy = RetryPolicy(backoff="fixed", min_backoff_ms=750, jitter=0.0)
    assert [backoff_ms(policy, n, rng()) for n in range(1, 6)] == [750] * 5


def test_exponential_backoff_is_capped():
    policy = RetryPolicy(min_backoff_ms=1_000, max_backoff_ms=10_000, multiplier=2.0, jitter=0.0)
    schedule = [backoff_ms(policy, n, rng()) for n in range(1, 8)]
    assert schedule == [1_000, 2_000, 4_000, 8_000, 10_000, 10_000, 10_000]


def test_exponential_backoff_survives_huge_failure_counts():
    policy = RetryPolicy(multiplier=10.0, jitter=0.0)
    assert backoff_ms(policy, 10_000, rng()) == policy.max_backoff_ms
    zero = RetryPolicy(min_backoff_ms=0, multiplier=10.0, jitter=0.0)
    assert backoff_ms(zero, 10_000, rng()) == 0


def test_jitter_stays_in_bounds_and_varies():
    policy = RetryPolicy(min_backoff_ms=1_000, max_backoff_ms=60_000, jitter=0.2)
    r = random.Random(7)
    draws = [backoff_ms(policy, 3, r) for _ in range(2_000)]  # base 4000
    assert min(draws) >= 3_200
    assert max(draws) <= 4_800
    assert len(set(draws)) > 100
    assert min(draws) < 3_400 and max(draws) > 4_600  # the whole band is used


def test_jitter_never_exceeds_the_cap_or_goes_negative():
    policy = RetryPolicy(min_backoff_ms=1_000, max_backoff_ms=5_000, jitter=0.9)
    r = random.Random(3)
    draws = [backoff_ms(policy, n, r) for n in range(1, 10) for _ in range(300)]
    assert min(draws) >= 0
    assert max(draws) == 5_000


def test_jitter_is_reproducible_with_a_seeded_rng():
    policy = RetryPolicy()
    assert [backoff_ms(policy, 2, random.Random(1)) for _ in range(3)] == [
        backoff_ms(policy, 2, random.Random(1))
    ] * 3


def test_backoff_needs_a_failure():
    with pytest.raises(ValueError):
        backoff_ms(RetryPolicy(), 0, rng())


# -- decide -------------------------------------------------------------------------------


def test_success():
    d = decide(NO_JITTER, 1, 204, None, None, NOW, rng())
    assert (d.action, d.due_ms, d.status) == ("success", None, 204)


def test_fatal_response_dead_letters_at_once():
    d = decide(NO_JITTER, 1, 404, None, None, NOW, rng())
    assert d == Decision("dead_letter", None, "fatal response 404", 404)


def test_fatal_pseudo_code():
    policy = replace(
        NO_JITTER, responses=(ResponseRule("timeout", "dead_letter"),) + DEFAULT_RESPONSES
    )
    d = decide(policy, 1, None, "timeout", None, NOW, rng())
    assert d == Decision("dead_letter", None, "fatal response timeout", None)


def test_retry_due_after_backoff():
    d = decide(NO_JITTER, 1, 500, None, "3600", NOW, rng())  # 500 does not honour Retry-After
    assert d.action == "retry"
    assert d.due_ms == NOW + 1_000
    assert d.status == 500
    assert "HTTP 500" in d.reason
    assert decide(NO_JITTER, 3, None, "timeout", None, NOW, rng()).due_ms == NOW + 4_000


def test_retry_after_wins_when_longer_and_honoured():
    d = decide(NO_JITTER, 1, 503, None, "30", NOW, rng())
    assert d.due_ms == NOW + 30_000
    assert "Retry-After" in d.reason
    d = decide(NO_JITTER, 1, 429, None, "Tue, 14 Nov 2023 22:13:25 GMT", NOW, rng())
    assert d.due_ms == NOW + 5_000


def test_backoff_wins_when_retry_after_is_shorter_or_garbage():
    assert decide(NO_JITTER, 3, 503, None, "1", NOW, rng()).due_ms == NOW + 4_000
    assert decide(NO_JITTER, 1, 503, None, "tomorrow", NOW, rng()).due_ms == NOW + 1_000
    assert decide(NO_JITTER, 1, 503, None, None, NOW, rng()).due_ms == NOW + 1_000


def test_retries_exhausted():
    policy = replace(NO_JITTER, max_attempts=3)
    assert decide(policy, 2, 503, None, None, NOW, rng()).action == "retry"
    d = decide(policy, 3, 503, None, None, NOW, rng())
    assert d == Decision("dead_letter", None, "retries exhausted after 3 attempts: HTTP 503", 503)
    d = decide(replace(policy, max_attempts=1), 1, None, "connection_error", None, NOW, rng())
    assert d.reason == "retries exhausted after 1 attempt: connection_error"


def test_success_after_many_attempts_is_still_success():
    assert (
        decide(replace(NO_JITTER, max_attempts=2), 7, 200, None, None, NOW, rng()).action
        == "success"
    )


def test_decide_uses_the_rng_for_jitter():
    policy = RetryPolicy(jitter=0.5)
    dues = {decide(policy, 2, 500, None, None, NOW, random.Random(s)).due_ms for s in range(20)}
    assert len(dues) > 10
    assert all(NOW + 1_000 <= due <= NOW + 3_000 for due in dues)


def test_attempts_made_must_be_positive():
    with pytest.raises(ValueError):
        decide(NO_JITTER, 0, 500, None, None, NOW, rng())


# -- retries in place -----------------------------------------------------------------------


def test_a_retry_waits_in_place_when_due_within_the_window_of_the_first_failure():
    policy = RetryPolicy(in_place_window_ms=2_000)
    assert retries_in_place(policy, first_failure_ms=NOW, due_ms=NOW + 2_000)
    assert not retries_in_place(policy, first_failure_ms=NOW, due_ms=NOW + 2_001)
    # The window counts from the first failure, so a chain of retries in place is bounded.
    assert not retries_in_place(policy, first_failure_ms=NOW - 1_500, due_ms=NOW + 1_000)


def test_a_window_of_zero_sends_every_retry_through_the_rq():
    policy = RetryPolicy(min_backoff_ms=0, in_place_window_ms=0)
    assert not retries_in_place(policy, first_failure_ms=NOW, due_ms=NOW)


def test_by_default_a_task_lingers_as_long_as_the_window_and_zero_turns_the_linger_off():
    """Without a linger the retries still wait in place while the task has other deliveries."""
    assert linger_ms(RetryPolicy()) == RetryPolicy().in_place_window_ms == 2_000
    policy = RetryPolicy(in_place_linger_ms=0)
    assert linger_ms(policy) == 0
    assert retries_in_place(policy, first_failure_ms=NOW, due_ms=NOW + 1_000)
    assert waits_in_task(policy, 1_000)


def test_the_linger_is_the_setting_capped_at_the_window():
    assert linger_ms(RetryPolicy(in_place_linger_ms=1_500)) == 1_500
    assert linger_ms(RetryPolicy(in_place_window_ms=500, in_place_linger_ms=2_000)) == 500
    assert linger_ms(RetryPolicy(in_place_window_ms=0, in_place_linger_ms=2_000)) == 0


# -- validation ---------------------------------------------------------------------------


def test_default_policy_is_valid():
    validate_retry_policy(RetryPolicy())


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"max_attempts": 0}, "retry.max_attempts"),
        ({"max_attempts": 2.5}, "retry.max_attempts"),
        ({"max_attempts": True}, "retry.max_attempts"),
        ({"backoff": "linear"}, "retry.backoff"),
        ({"min_backoff_ms": -1}, "retry.min_backoff_ms"),
        ({"min_backoff_ms": 5_000, "max_backoff_ms": 1_000}, "retry.max_backoff_ms"),
        ({"multiplier": 0.5}, "retry.multiplier"),
        ({"multiplier": float("nan")}, "retry.multiplier"),
        ({"jitter": 1.0}, "retry.jitter"),
        ({"jitter": -0.1}, "retry.jitter"),
        ({"in_place_window_ms": -1}, "retry.in_place_window_ms"),
        ({"in_place_window_ms": 60_001}, "retry.in_place_window_ms"),
        ({"in_place_window_ms": 1.5}, "retry.in_place_window_ms"),
        ({"in_place_linger_ms": -1}, "retry.in_place_linger_ms"),
        ({"in_place_linger_ms": 60_001}, "retry.in_place_linger_ms"),
        (
            {"responses": (ResponseRule("2xx", "success"), ResponseRule("6xx", "retry"))},
            "retry.responses[1].codes",
        ),
        (
            {"responses": (ResponseRule("2xx", "success"), ResponseRule("40", "retry"))},
            "retry.responses[1].codes",
        ),
        ({"responses": (ResponseRule("timeouts", "retry"),)}, "retry.responses[0].codes"),
        ({"responses": (ResponseRule("2xx", "succeed"),)}, "retry.responses[0].action"),
        (
            {"responses": (ResponseRule("2xx", "success", "yes"),)},
            "retry.responses[0].honour_retry_after",
        ),
        ({"responses": (ResponseRule("5xx", "retry"),)}, "retry.responses"),
        ({"responses": ()}, "retry.responses"),
    ],
)
def test_validation_names_the_field(changes, field):
    with pytest.raises(InvalidArgument) as e:
        validate_retry_policy(replace(RetryPolicy(), **changes))
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")


def test_validation_prefix():
    with pytest.raises(InvalidArgument) as e:
        validate_retry_policy(RetryPolicy(jitter=2.0), prefix="subscriptions[0].retry")
    assert e.value.field == "subscriptions[0].retry.jitter"


def test_valid_custom_table():
    validate_retry_policy(
        RetryPolicy(
            responses=(
                ResponseRule("2xx", "success"),
                ResponseRule("409", "success"),
                ResponseRule("429", "retry", honour_retry_after=True),
                ResponseRule("timeout", "dead_letter"),
                ResponseRule("connection_error", "retry"),
            )
        )
    )
