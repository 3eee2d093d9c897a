"""A subscription's rate limit (`endpoint.max_rate`, messages a second for the whole subscription),
split among its shards and their delivery tasks, and slowed down by the endpoint's own signals.

Split. Shard `i` of `n` sends at most `max_rate / n` (`shard_share`): the limit holds whatever
the shard count, and follows a shard-count change (a new count starts new queries with new
shares). Within a shard, a micro-batch's delivery runs in at most `consumption.concurrency` tasks
at a time; each task gets an equal part of the shard's share as its ceiling, and starts at the
same part of the shard's current rate (`RateGovernor.task_pace`), so a shard whose tasks are fewer
or idle sends below its share, never above.

Pacing (`Pacer`, one per task): requests go out at most one message's interval apart (a batched
request of k messages costs k intervals), with no burst: over any window of W seconds a task sends
at most W x rate + one request's messages, `rate` never above the task's part of the share (its
ceiling). A 429 or 503 answer halves the task's rate at once, to at least `FLOOR` of its ceiling,
and every second without one gives back `RECOVER_PER_S` of the ceiling (the message itself is
retried as the retry policy and its Retry-After say).

Adapting across micro-batches (`RateGovernor`, one per shard, on the driver): a batch whose tasks
got 429/503 answers halves the shard's rate for the next batch (down to `FLOOR` of its share);
every second without them gives back `RECOVER_PER_S` of the share, so the full share returns
within 1 / RECOVER_PER_S seconds of the last throttled batch (10 s). The next batch's tasks
*start* at the shard's rate and recover within the batch as above (`TaskPace`): a batch planned
during a slow-down gets back to the whole share within 10 s of its last throttled answer, however
long it runs. (Its tasks' ceiling was the rate the batch started at before: a batch of 3,000
records planned right after the 429s sent a quarter of the limit for its remaining 100 s.)

The bound: every task's rate is at most its ceiling at every moment, and the ceilings of a shard's
tasks running at once add up to at most its share, so over any window of W seconds a shard sends
at most W x share plus one request's messages for each task that ran in the window (a task's
first request goes at once). Issue 29's bench (3 shards of 2 tasks under 300 msg/s, 10 s windows,
batches of 30 s or more, so at most 2 batches per window): 3,000 + 3 x 2 x 2 = 3,012 requests, of
3,150 allowed (+5%). Hazard: short micro-batches add 1 request per task each; batches of 0.5 s
with 2 tasks add 40 requests to a shard's 10 s window, 4% of a 100 msg/s share.

The library runtime (`varadhi.library`) has no shards and no micro-batches: a member holding k
of the subscription's S slots (a slot is shard s's partitions: the unit of work,
`varadhi.library.assign`) sends at most k/S of the limit (`slot_share`), paced by one `Pacer` for
all its deliveries (one HTTP engine), which slows down on 429/503 as a task's does; at each
rebalance its share is set anew (`Pacer.reshare`) before any message of its new slots goes out.
Why the members' sum stays within the limit: `varadhi.library.runtime`.

Pure but for the clocks, which are injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

#: The least a slow-down leaves of the share (of where a task started): never a stop.
FLOOR = 0.05
#: Share given back per second without a throttled answer (the full share in 10 s).
RECOVER_PER_S = 0.1
#: HTTP answers that slow the rate down.
THROTTLE_STATUSES = (429, 503)


def shard_share(max_rate: float, shard_count: int) -> float:
    """Messages a second one shard of `shard_count` may send."""
    return max_rate / shard_count


def slot_share(max_rate: float, held: int, slots: int) -> float:
    """Messages a second a library member holding `held` of a subscription's `slots` slots may
    send: `held / slots` of `max_rate` (0 when it holds none)."""
    if slots < 1 or not 0 <= held <= slots:
        raise ValueError(f"a member holds 0 to {slots} slots, not {held}")
    return max_rate * held / slots


@dataclass(frozen=True)
class TaskPace:
    """A delivery task's pace for one micro-batch: `rate`, its ceiling (its part of the shard's
    share), and `start`, the rate it starts at (the shard's rate, slowed down by throttled
    batches, divided the same way)."""

    rate: float
    start: float

    def pacer(self, clock: Callable[[], float] = time.monotonic) -> Pacer:
        return Pacer(self.rate, clock, self.start)


class Pacer:
    """One delivery task's pace: at most `rate` messages a second, starting at `start` (default:
    `rate`; at least `FLOOR` of it) and recovering towards `rate` (module docstring)."""

    def __init__(
        self, rate: float, clock: Callable[[], float] = time.monotonic, start: float | None = None
    ):
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self._clock = clock
        self._base = rate
        self.rate = rate if start is None else min(rate, max(rate * FLOOR, start))
        self._next = clock()  # when the next message may go
        self._adjusted = self._next  # when `rate` was last brought up to date

    def wait_s(self) -> float:
        """Seconds until the next message may go (0: now)."""
        return max(0.0, self._next - self._clock())

    def spend(self, messages: int = 1) -> None:
        """A request of `messages` messages went out."""
        now = self._clock()
        self._recover(now)
        self._next = max(self._next, now) + messages / self.rate

    def slow_down(self) -> None:
        """The endpoint answered 429 or 503: half the rate from now on (not below `FLOOR` of
        the ceiling); it recovers `RECOVER_PER_S` of the ceiling a second afterwards."""
        now = self._clock()
        self._recover(now)
        self.rate = max(self._base * FLOOR, self.rate / 2)

    def reshare(self, rate: float) -> None:
        """From now on `rate` is the most this pacer sends (a library member's new share after a
        rebalance). A slow-down in effect stays in effect, scaled to the new share; the next
        message keeps the time the old rate gave it. Not thread-safe: call it on the thread that
        spends."""
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        now = self._clock()
        self._recover(now)
        self.rate = self.rate * rate / self._base
        self._base = rate

    def _recover(self, now: float) -> None:
        if self.rate < self._base:
            back = self._base * RECOVER_PER_S * (now - self._adjusted)
            self.rate = min(self._base, self.rate + back)
        self._adjusted = now


class RateGovernor:
    """One shard's rate across its micro-batches (module docstring); `share` is its part of
    the subscription's limit."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic):
        self.share = share
        self.rate = share
        self._clock = clock
        self._at = clock()

    def observe(self, throttled: int) -> None:
        """A micro-batch ended with `throttled` 429/503 answers."""
        now = self._clock()
        if throttled > 0:
            self.rate = max(self.share * FLOOR, self.rate / 2)
        else:
            recovered = self.share * RECOVER_PER_S * (now - self._at)
            self.rate = min(self.share, self.rate + recovered)
        self._at = now

    def task_pace(self, tasks: int) -> TaskPace:
        """The pace of each of `tasks` delivery tasks of the next micro-batch, as of now."""
        self.observe(0)  # the time since the last batch counts towards recovery
        return TaskPace(self.share / max(1, tasks), self.rate / max(1, tasks))


def throttled(http_counts: dict[str, int]) -> int:
    """429 and 503 answers among a batch's endpoint answers (`batch.http_counts`' keys)."""
    return sum(int(http_counts.get(f"status_{s}", 0)) for s in THROTTLE_STATUSES)
