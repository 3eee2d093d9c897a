"""What a delivery attempt's outcome means: success, retry (and when), or dead-letter.

Pure functions, no I/O. The clock (`now_ms`) and the randomness of jitter (`rng`) are
arguments, so every decision can be replayed in a test. The HTTP engine (`varadhi.core.delivery`)
reports outcomes; the shard job asks `decide` what to do with each and acts on the answer.

An outcome is either an HTTP status (`status` set, `error` None) or a failure to get one
(`status` None, `error` one of `"timeout"`, `"connection_error"`). It is matched against the
policy's response table (`RetryPolicy.responses`, first matching rule wins); an outcome no rule
matches is dead-lettered, because silently retrying or accepting something nobody configured
is worse than parking it with a reason a person can read.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime
from typing import Literal, get_args

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Action, Backoff, ResponseRule, RetryPolicy

ERRORS = ("timeout", "connection_error", "invalid_response")
"""The pseudo codes of an attempt that got no usable HTTP response. `invalid_response` (batch
mode only, `varadhi.core.batching`): the endpoint answered 207 with a multi-status body that is not
JSON, or lists an id the request did not carry, or leaves one out."""

MAX_RETRY_AFTER_MS = 3_600_000
"""Upper bound on the wait a Retry-After header can impose: one hour.

A retried message blocks its whole group (per-group order), so an endpoint that answers
`Retry-After: 86400`, or a date far in the future, by mistake would silently stall groups for a
day. An hour is long enough for any real maintenance window to be honoured and short enough
that such a mistake shows up as retries in the RQ, not as a stuck subscription."""

MAX_IN_PLACE_WINDOW_MS = 60_000
"""Upper bound on `RetryPolicy.in_place_window_ms` and `in_place_linger_ms`. A delivery task may
wait the linger past its other deliveries, holding its micro-batch (and every group of the
shard) back, and a message waiting in place holds its group's later messages in the task;
longer waits belong in the RQ."""

UNMATCHED = ResponseRule("unmatched", "dead_letter")
"""What `classify` returns when no rule of the table matches the outcome."""

_CODE = re.compile(r"[1-5](?:\d\d|xx)")
_DELTA_SECONDS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Decision:
    """`due_ms` (epoch ms) is set only for `retry`; `status` is the attempt's HTTP status, if any."""

    action: Literal["success", "retry", "dead_letter"]
    due_ms: int | None
    reason: str
    status: int | None


def describe_outcome(status: int | None, error: str | None) -> str:
    """`"HTTP 503"`, `"timeout"` or `"connection_error"`: the outcome as reasons name it."""
    _check_outcome(status, error)
    return f"HTTP {status}" if error is None else error


def classify(status: int | None, error: str | None, rules: Sequence[ResponseRule]) -> ResponseRule:
    """The first rule of `rules` matching the outcome, or `UNMATCHED` (action `dead_letter`).

    A rule's `codes` matches an exact status (`"404"`), a status class (`"4xx"`), or an error
    pseudo code (`"timeout"`, `"connection_error"`). Raises ValueError for an impossible outcome
    (both or neither of `status` and `error`)."""
    _check_outcome(status, error)
    if error is not None:
        keys = (error,)
    else:
        code = str(status)
        keys = (code, f"{code[0]}xx")
    for rule in rules:
        if rule.codes in keys:
            return rule
    return UNMATCHED


def parse_retry_after(value: str | None, now_ms: int) -> int | None:
    """Milliseconds to wait that a Retry-After header value asks for, or None.

    Accepts delta-seconds (`"120"`) and an HTTP-date (IMF-fixdate, RFC 850 or asctime; a date
    without a zone is GMT, as HTTP requires). A date in the past means 0. The result is capped at
    `MAX_RETRY_AFTER_MS`. Anything else (empty, negative, fractional, unparsable) is None: a
    malformed header must not change the backoff the policy would use anyway."""
    if value is None:
        return None
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        # Compare before multiplying: a digit string can be arbitrarily long.
        seconds = int(text)
        return MAX_RETRY_AFTER_MS if seconds >= MAX_RETRY_AFTER_MS // 1000 else seconds * 1000
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    wait_ms = math.ceil(when.timestamp() * 1000) - now_ms
    return min(max(wait_ms, 0), MAX_RETRY_AFTER_MS)


def backoff_ms(policy: RetryPolicy, failures: int, rng: random.Random) -> int:
    """The delay before the next attempt after `failures` (>= 1) failed attempts.

    `fixed`: `min_backoff_ms`. `exponential`: `min_backoff_ms * multiplier ** (failures - 1)`,
    capped at `max_backoff_ms`. Then +/- `jitter` of that delay, uniformly (one `rng` draw, none
    when jitter is 0), so that groups failing together do not retry together; the jittered delay
    is clamped to `[0, max_backoff_ms]`, so the cap holds for every draw."""
    if failures < 1:
        raise ValueError(f"failures must be >= 1, got {failures}")
    delay = float(policy.min_backoff_ms)
    if policy.backoff == "exponential":
        try:
            delay *= float(policy.multiplier) ** (failures - 1)
        except OverflowError:
            delay = math.inf if delay else 0.0
    delay = min(delay, float(policy.max_backoff_ms))
    if policy.jitter:
        delay *= 1.0 + rng.uniform(-policy.jitter, policy.jitter)
    return round(min(max(delay, 0.0), float(policy.max_backoff_ms)))


def decide(
    policy: RetryPolicy,
    attempts_made: int,
    status: int | None,
    error: str | None,
    retry_after_header: str | None,
    now_ms: int,
    rng: random.Random,
    detail: str | None = None,
) -> Decision:
    """What to do with a message after its `attempts_made`-th attempt (>= 1) ended so.
    `detail` (the engine's `Outcome.detail`) is quoted in the reason of an `invalid_response`
    only: what was wrong with the answer.

    - the matching rule says success: `success`;
    - it says dead_letter (or nothing matches): `dead_letter`, reason `"fatal response 404"`
      (or `"no response rule matches HTTP 102"`);
    - it says retry and `attempts_made >= policy.max_attempts`: `dead_letter`, reason
      `"retries exhausted after 5 attempts: HTTP 503"`;
    - otherwise `retry`, due at `now_ms + max(backoff, Retry-After)`, where Retry-After counts
      only when the rule honours it. Every earlier attempt failed (a success ends the story), so
      the backoff is computed for `attempts_made` failures.
    """
    if attempts_made < 1:
        raise ValueError(f"attempts_made must be >= 1, got {attempts_made}")
    rule = classify(status, error, policy.responses)
    what = describe_outcome(status, error)
    if error == "invalid_response" and detail:
        what = f"{what} ({detail})"
    if rule.action == "success":
        return Decision("success", None, f"delivered ({what})", status)
    if rule is UNMATCHED:
        return Decision("dead_letter", None, f"no response rule matches {what}", status)
    if rule.action == "dead_letter":
        code = what if error is not None else str(status)
        return Decision("dead_letter", None, f"fatal response {code}", status)
    if attempts_made >= policy.max_attempts:
        noun = "attempt" if attempts_made == 1 else "attempts"
        reason = f"retries exhausted after {attempts_made} {noun}: {what}"
        return Decision("dead_letter", None, reason, status)
    wait_ms = backoff_ms(policy, attempts_made, rng)
    reason = f"{what}; retry in {wait_ms} ms"
    if rule.honour_retry_after:
        asked_ms = parse_retry_after(retry_after_header, now_ms)
        if asked_ms is not None and asked_ms > wait_ms:
            wait_ms = asked_ms
            reason = f"{what}; retry in {wait_ms} ms (Retry-After)"
    return Decision("retry", now_ms + wait_ms, reason, status)


def retries_in_place(policy: RetryPolicy, first_failure_ms: int, due_ms: int) -> bool:
    """Whether a retry due at `due_ms` may wait inside the delivery task instead of going
    through the RQ: when it falls due within `policy.in_place_window_ms` of the message's first
    failure (so with the default policy, the first retry of a message that starts failing in
    this batch). A window of 0 turns retries in place off. The task waits while it has other
    deliveries to make and, after its last one, at most `linger_ms` more (2 s by default); the
    RQ takes a retry due later than that, due when it was (`GroupRun`, `HttpDeliverer.run`'s
    `linger_s`).

    The attempt, its headers, backoff and Retry-After are the same either way; only where the
    message waits differs."""
    return policy.in_place_window_ms > 0 and due_ms - first_failure_ms <= policy.in_place_window_ms


def waits_in_task(policy: RetryPolicy, wait_ms: int) -> bool:
    """Whether a retry read back from the RQ `wait_ms` before its due time waits for it in the
    delivery task (as a retry in place does: while the task has other deliveries and at most
    `linger_ms` after its last one) instead of being parked in the state until a later batch:
    when the wait is no longer than `policy.in_place_window_ms`. A window of 0 turns it off.

    Never early: the engine sends it once it is due. Should the task run out of other work
    first, a wait that would outlast the linger is stopped and the retry is parked, exactly as
    one due later; its RQ record is never written again (DESIGN hazard 2)."""
    return 0 < wait_ms <= policy.in_place_window_ms


def linger_ms(policy: RetryPolicy) -> int:
    """The most a delivery task waits, once it has no other delivery to make, for the retries
    waiting in it (`retries_in_place`, `waits_in_task`): `policy.in_place_linger_ms`, capped at
    the window (no such wait is longer). The engine's `linger_s`.

    0: no task idles. Its waits then overlap only its other deliveries, and what is not due
    when they end goes on as if it had never waited: a retry in place through the RQ, due when
    it was, an early RQ record parked. A linger (2 s, the default window, by default) makes
    more retries in the batch that failed them (fewer RQ round trips and parked bodies, so a
    smaller second job in grouped mode) at the price of every such batch lasting up to the
    linger longer, with every group of the shard behind it."""
    return min(policy.in_place_linger_ms, policy.in_place_window_ms)


def validate_retry_policy(policy: RetryPolicy, prefix: str = "retry") -> None:
    """Raise InvalidArgument, naming the field (`retry.max_attempts`,
    `retry.responses[2].codes`, ...), if `policy` cannot be used. `prefix` is the dotted path of
    the policy in the caller's document."""
    _require_int(policy.max_attempts, f"{prefix}.max_attempts", minimum=1)
    if policy.backoff not in get_args(Backoff):
        raise InvalidArgument(
            f"must be one of {', '.join(get_args(Backoff))}, got {policy.backoff!r}",
            field=f"{prefix}.backoff",
        )
    _require_int(policy.min_backoff_ms, f"{prefix}.min_backoff_ms", minimum=0)
    _require_int(policy.max_backoff_ms, f"{prefix}.max_backoff_ms", minimum=0)
    if policy.min_backoff_ms > policy.max_backoff_ms:
        raise InvalidArgument(
            f"must be >= min_backoff_ms ({policy.min_backoff_ms}), got {policy.max_backoff_ms}",
            field=f"{prefix}.max_backoff_ms",
        )
    for name in ("in_place_window_ms", "in_place_linger_ms"):
        value = getattr(policy, name)
        _require_int(value, f"{prefix}.{name}", minimum=0)
        if value > MAX_IN_PLACE_WINDOW_MS:
            raise InvalidArgument(
                f"must be at most {MAX_IN_PLACE_WINDOW_MS // 1000} s (longer waits belong in the"
                f" RQ), got {value}",
                field=f"{prefix}.{name}",
            )
    if not _is_number(policy.multiplier) or not policy.multiplier >= 1:
        raise InvalidArgument(
            f"must be a number >= 1, got {policy.multiplier!r}", field=f"{prefix}.multiplier"
        )
    if not _is_number(policy.jitter) or not 0 <= policy.jitter < 1:
        raise InvalidArgument(
            f"must be a number in [0, 1), got {policy.jitter!r}", field=f"{prefix}.jitter"
        )
    for i, rule in enumerate(policy.responses):
        where = f"{prefix}.responses[{i}]"
        if not isinstance(rule.codes, str) or not (
            rule.codes in ERRORS or _CODE.fullmatch(rule.codes)
        ):
            raise InvalidArgument(
                "must be a status (404), a class (4xx) or one of timeout, connection_error,"
                " invalid_response;"
                f" got {rule.codes!r}",
                field=f"{where}.codes",
            )
        if rule.action not in get_args(Action):
            raise InvalidArgument(
                f"must be one of {', '.join(get_args(Action))}, got {rule.action!r}",
                field=f"{where}.action",
            )
        if not isinstance(rule.honour_retry_after, bool):
            raise InvalidArgument(
                f"must be true or false, got {rule.honour_retry_after!r}",
                field=f"{where}.honour_retry_after",
            )
    if not any(rule.action == "success" for rule in policy.responses):
        raise InvalidArgument(
            "no rule has action success, so no delivery could ever succeed",
            field=f"{prefix}.responses",
        )


def _check_outcome(status: int | None, error: str | None) -> None:
    if error is None:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 999:
            raise ValueError(f"an outcome without error needs an HTTP status, got {status!r}")
    elif status is not None or error not in ERRORS:
        raise ValueError(f"impossible outcome: status={status!r}, error={error!r}")


def _require_int(value: object, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"must be an integer >= {minimum}, got {value!r}", field=field)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
