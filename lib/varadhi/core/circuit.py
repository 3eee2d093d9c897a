"""A circuit breaker per shard and endpoint: closed, open, half-open (pure, clock injected).

The shard feeds it every micro-batch's delivery attempts and failures (`record`) and asks it what
to read (`read_limit`) and how many parked retries to send (`due_limit`); `poll` moves an open
circuit to half-open once its time is up. The shard acts on the answers (`varadhi.spark.shard.job`).

- **closed**: deliver normally. The batches that ended within the last `window_ms` are summed
  (the batch just ended always counts); when they made at least `min_requests` attempts and at
  least `failure_rate` of them failed, the circuit opens.
- **open**: nothing is read or sent until `open_until_ms`: `open_for_ms` after it opened, doubled
  for each consecutive open (a failed probe), at most `max_open_for_ms`.
- **half-open**: micro-batches read at most `probes` records and send at most `probes` of the
  parked retries that are due, and make no retries in place (`probe_retry`). The first batch
  that makes attempts decides: fewer than `failure_rate` of them failed closes the circuit (and
  forgets the doubling), anything else opens it again. A batch without attempts (only retries
  not due yet, a wake-up tick) decides nothing.

A failure is every attempt that did not succeed, as a batch counts them: an answer to retry or to
dead-letter, a timeout, a refused connection. A disabled policy keeps the circuit closed.

Endpoint health (`suspend_after_ms`): the breaker also remembers since when every attempt failed
(`failing_since_ms`: set by a batch whose attempts all failed, cleared by any success; batches
without attempts change nothing), whatever the circuit's state or whether it is enabled;
`suspension_due` says when that has lasted `suspend_after_ms`, and the shard then suspends the
subscription (`varadhi.spark.shard.job`).

Shared verdicts (the library runtime's members: `varadhi.library.shared_circuit`): a breaker
remembers when a half-open verdict last closed it (`healed_ms`); `heal` closes another breaker
of the same endpoint that opened before then, so one member's successful probe closes them all.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import CircuitPolicy, RetryPolicy

State = Literal["closed", "open", "half_open"]


def now_ms() -> int:
    return int(time.time() * 1000)


def probe_retry(policy: RetryPolicy) -> RetryPolicy:
    """The retry policy of a half-open probe batch: `policy` without retries in place.

    A probe is there for a verdict. Its first attempts sample the endpoint as it is now; a retry
    in place would hold the verdict back by its backoff (the batch waits for it) and spend a
    second attempt of the message while the endpoint is most likely still down: in a long
    outage, every attempt a probe spends brings its messages closer to `retry.max_attempts`
    and the DLQ. A probe message that fails goes to the RQ, due when its backoff (or
    Retry-After) says, as it would after a failed retry in place."""
    return replace(policy, in_place_window_ms=0)


def validate_circuit_policy(policy: CircuitPolicy, prefix: str = "circuit_breaker") -> None:
    """Refuse a policy that cannot work, naming the field (`circuit_breaker.failure_rate`)."""

    def bad(name: str, message: str) -> InvalidArgument:
        return InvalidArgument(message, field=f"{prefix}.{name}" if prefix else name)

    if not 0.0 < policy.failure_rate <= 1.0:
        raise bad("failure_rate", f"must be in (0, 1], got {policy.failure_rate}")
    for name in ("min_requests", "probes", "open_for_ms"):
        if getattr(policy, name) < 1:
            raise bad(name, f"must be at least 1, got {getattr(policy, name)}")
    if policy.window_ms < 0:
        raise bad("window_ms", f"must not be negative, got {policy.window_ms}")
    if policy.max_open_for_ms < policy.open_for_ms:
        raise bad(
            "max_open_for_ms",
            f"must be at least open_for ({policy.open_for_ms} ms), got {policy.max_open_for_ms} ms",
        )
    if policy.suspend_after_ms is not None and policy.suspend_after_ms < 1:
        raise bad("suspend_after_ms", f"must be positive, got {policy.suspend_after_ms} ms")
    if policy.resume not in ("probe", "operator"):
        raise bad("resume", f"must be probe or operator, got {policy.resume!r}")
    if policy.suspend_after_ms is not None and policy.resume == "probe" and not policy.enabled:
        raise bad(
            "resume",
            "probe needs the circuit breaker enabled (its half-open probes find the endpoint "
            "healthy again); set enabled: true, or resume: operator",
        )


class CircuitBreaker:
    """One shard's circuit. Thread-safe: batches `record` on Spark's stream thread while the
    shard's main loop polls and reconfigures it."""

    def __init__(self, policy: CircuitPolicy, clock: Callable[[], int] = now_ms):
        self._lock = threading.Lock()
        self._clock = clock
        self.policy = policy
        self.state: State = "closed"
        self.since_ms = clock()
        self.open_until_ms: int | None = None
        self.consecutive_opens = 0  # opens since the circuit last closed
        self.failing_since_ms: int | None = None  # every attempt since then failed
        self.opened_ms: int | None = None  # when it last opened
        self.healed_ms: int | None = (
            None  # when a half-open verdict (its own or `heal`'s) closed it
        )
        self._window: deque[tuple[int, int, int]] = deque()  # (ended ms, attempts, failures)

    def configure(self, policy: CircuitPolicy) -> None:
        """Take a changed policy (a subscription update); disabling it closes the circuit."""
        with self._lock:
            self.policy = policy
            if not policy.enabled and self.state != "closed":
                self._close(self._clock())

    def poll(self) -> State:
        """The state now: an open circuit whose time is up becomes half-open."""
        with self._lock:
            now = self._clock()
            if self.state == "open" and now >= (self.open_until_ms or 0):
                self._move("half_open", now)
            return self.state

    def record(self, attempts: int, failures: int) -> State:
        """Feed the outcome of one micro-batch; return the state after it."""
        with self._lock:
            policy, now = self.policy, self._clock()
            failures = min(max(failures, 0), attempts)
            if attempts > 0 and failures < attempts:
                self.failing_since_ms = None
            elif attempts > 0 and self.failing_since_ms is None:
                self.failing_since_ms = now
            if not policy.enabled or attempts <= 0 or self.state == "open":
                return self.state
            if self.state == "half_open":
                if failures / attempts < policy.failure_rate:
                    self.healed_ms = now
                    self._close(now)
                else:
                    self._open(now)
                return self.state
            self._window.append((now, attempts, failures))
            while self._window and self._window[0][0] < now - policy.window_ms:
                self._window.popleft()
            total = sum(a for _, a, _ in self._window)
            failed = sum(f for _, _, f in self._window)
            if total >= policy.min_requests and failed / total >= policy.failure_rate:
                self._open(now)
            return self.state

    def heal(self, healed_ms: int) -> bool:
        """Another breaker of the same endpoint closed on a half-open verdict at `healed_ms`:
        close this one too if it is open or half-open and last opened before then (a probe of
        its own that failed after that heal is newer evidence: it stays). It keeps `healed_ms`,
        not the time now, so a heal passed on never looks newer than the probe that made it.
        Returns whether it closed. Hazard: the two times come from two clocks."""
        with self._lock:
            if self.state == "closed" or healed_ms < (self.opened_ms or 0):
                return False
            self.healed_ms = healed_ms
            self._close(self._clock())
            return True

    def read_limit(self, normal: int) -> int | None:
        """Records a micro-batch may read: `normal` when closed, `probes` when half-open, None
        (read nothing) when open."""
        state = self.poll()
        if state == "open":
            return None
        return min(normal, self.policy.probes) if state == "half_open" else normal

    def due_limit(self) -> int | None:
        """How many parked retries that are due a batch may send: `probes` when half-open,
        None (all of them) otherwise."""
        return self.policy.probes if self.poll() == "half_open" else None

    def seconds_to_half_open(self) -> float:
        """Time left while open (0 otherwise)."""
        with self._lock:
            if self.state != "open" or self.open_until_ms is None:
                return 0.0
            return max(0.0, (self.open_until_ms - self._clock()) / 1000)

    def suspension_due(self) -> str | None:
        """Why the subscription should be suspended now (every attempt has failed for the
        policy's `suspend_after_ms`), or None."""
        with self._lock:
            after, since = self.policy.suspend_after_ms, self.failing_since_ms
            if after is None or since is None:
                return None
            failing_ms = self._clock() - since
            if failing_ms < after:
                return None
            return f"every attempt to the endpoint failed for {failing_ms / 1000:.0f} s"

    def forget_failing(self) -> None:
        """Start counting sustained failure afresh (a suspension ended: the time the shards
        waited is no attempt's failure)."""
        with self._lock:
            self.failing_since_ms = None

    def status(self) -> dict[str, Any]:
        """For progress documents: state, since when, until when (open), consecutive opens."""
        with self._lock:
            return {
                "state": self.state,
                "enabled": self.policy.enabled,
                "since_ms": self.since_ms,
                "open_until_ms": self.open_until_ms if self.state == "open" else None,
                "consecutive_opens": self.consecutive_opens,
                "healed_ms": self.healed_ms,
            }

    # -- transitions (under the lock) ---------------------------------------------------------
    def _move(self, state: State, now: int) -> None:
        self.state, self.since_ms = state, now

    def _open(self, now: int) -> None:
        policy = self.policy
        self.consecutive_opens += 1
        doubled = policy.open_for_ms << min(self.consecutive_opens - 1, 40)
        self.open_until_ms = now + min(policy.max_open_for_ms, doubled)
        self.opened_ms = now
        self._window.clear()
        self._move("open", now)

    def _close(self, now: int) -> None:
        self.consecutive_opens = 0
        self.open_until_ms = None
        self._window.clear()
        self._move("closed", now)
