"""The embedded API's delivery handler: a Python callable instead of the HTTP endpoint.

A handler takes a `Message` and returns `Success()`, `Retry(after_ms, reason)` or
`Fatal(reason)`. `decision` maps that onto the subscription's retry policy exactly as an HTTP
outcome is mapped (`varadhi.core.retry.decide`): a retry waits the policy's backoff, or longer
if the handler asks (as a honoured Retry-After, capped at `retry.MAX_RETRY_AFTER_MS`), and is
dead-lettered once `max_attempts` attempts were made; a fatal result is dead-lettered at once.
A handler that raises is a retry (its exception is the reason): a bug in user code parks its
messages in the RQ and then the DLQ, it does not kill the process.

The handler runs on one of the consumer's threads; as many run at once as the consumer has
messages in flight, never two of one ordering key.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from varadhi.core.policies import RetryPolicy
from varadhi.core.retry import MAX_RETRY_AFTER_MS, Decision, backoff_ms


@dataclass(frozen=True)
class Message:
    """What a handler is given. `attempt` counts from 1; `key` is the ordering key (None:
    unordered); `source` is where this copy was read (`topic/partition/offset`)."""

    msg_id: str
    group_id: str | None
    key: str | None
    value: bytes
    headers: Mapping[str, str]
    attempt: int
    source: str


@dataclass(frozen=True)
class Success:
    pass


@dataclass(frozen=True)
class Retry:
    """Try again later: after the policy's backoff, or `after_ms` if that is longer."""

    after_ms: int | None = None
    reason: str = "handler asked to retry"


@dataclass(frozen=True)
class Fatal:
    """Dead-letter the message now."""

    reason: str = "handler failed the message"


Result = Success | Retry | Fatal
Handler = Callable[[Message], Result]


def decision(
    policy: RetryPolicy, attempts_made: int, result: object, now_ms: int, rng: random.Random
) -> Decision:
    """What to do after a handler's `attempts_made`-th attempt (>= 1) returned `result` (pure
    but for `rng`'s jitter). Anything but the three result types is a retry whose reason
    says what came back."""
    if isinstance(result, Success):
        return Decision("success", None, "delivered (handler)", None)
    if isinstance(result, Fatal):
        return Decision("dead_letter", None, f"fatal: {result.reason}", None)
    if isinstance(result, Retry):
        what, asked = result.reason, result.after_ms
    else:
        what, asked = f"handler returned {type(result).__name__}, not a result", None
    if attempts_made >= policy.max_attempts:
        noun = "attempt" if attempts_made == 1 else "attempts"
        return Decision(
            "dead_letter", None, f"retries exhausted after {attempts_made} {noun}: {what}", None
        )
    wait_ms = backoff_ms(policy, attempts_made, rng)
    if asked is not None and asked > wait_ms:
        wait_ms = min(asked, MAX_RETRY_AFTER_MS)
    return Decision("retry", now_ms + wait_ms, f"{what}; retry in {wait_ms} ms", None)
