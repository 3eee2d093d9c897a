"""A library member's shares of its subscription's limits: of `consumption.max_in_flight`
(`assign.in_flight_share`, capped by the process's own most) and, with HTTP, of
`endpoint.max_rate` (`rate_limit.slot_share`, applied by the engine's pacer). The argument that
the members' sums stay within the limits is the runtime's (`varadhi.library.runtime`, "Rate
limit" and "Concurrency limit").

Contract. `rebalanced(held)` sets the shares of the slots `held` after a rebalance, before any
of them is handed out; the engine's thread takes them up with `apply` before it hands out
anything (`Pacer` is not thread-safe: only that thread touches it). Both run under the member's
lock, as do the readers of `in_flight` and `rate` (handler threads, health).

Hazards. A member holding no slot has a rate share of 0, which the pacer cannot take (it keeps
its last one: nothing is handed out anyway), and an in-flight share of 0, which the engine takes
as 1 (it always may send one request). Before the first assignment the pacer paces at one
slot's share.
"""

from __future__ import annotations

from dataclasses import dataclass

from varadhi.core.rate_limit import Pacer, slot_share
from varadhi.library.assign import in_flight_share


@dataclass(frozen=True)
class Limits:
    """A subscription's limits as one member sees them: `slots`, its slot count; `in_flight`,
    its `consumption.max_in_flight`; `cap`, the most this process ever has in flight (at most
    `in_flight`); `max_rate`, the messages a second its endpoint takes (None: no limit); `http`,
    whether an HTTP engine delivers (else handler threads: not paced, each takes the
    in-flight share itself)."""

    slots: int
    in_flight: int
    cap: int
    max_rate: float | None
    http: bool


class Shares:
    """See the module docstring. `pacer` is the engine's (None: not paced)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.pacer: Pacer | None = None
        self.rate: float | None = None  # this member's share of `max_rate` now
        self._rate_for_engine: float | None = None  # a new share, for `apply`
        self.in_flight = 0  # this member's share of `consumption.max_in_flight` now
        self._in_flight_for_engine: int | None = None  # a new share, for `apply`
        if limits.http and limits.max_rate is not None:  # one slot's until the first assignment
            self.pacer = Pacer(slot_share(limits.max_rate, 1, limits.slots))
            self.rate = 0.0

    def rebalanced(self, held: set[int]) -> None:
        """(Under the member's lock) The shares of the slots `held`, for the engine to take."""
        limits = self.limits
        self.in_flight = min(limits.cap, in_flight_share(limits.in_flight, held, limits.slots))
        if limits.http:
            self._in_flight_for_engine = self.in_flight
        if self.pacer is not None:
            assert limits.max_rate is not None
            self.rate = slot_share(limits.max_rate, len(held), limits.slots)
            self._rate_for_engine = self.rate or None  # no slot: nothing to pace

    def apply(self) -> int | None:
        """(The engine's thread, under the member's lock) Give the pacer the rate share the
        last rebalance set; the requests the engine may now have in flight (None: unchanged)."""
        if self._rate_for_engine is not None:
            assert self.pacer is not None
            self.pacer.reshare(self._rate_for_engine)
            self._rate_for_engine = None
        in_flight, self._in_flight_for_engine = self._in_flight_for_engine, None
        return None if in_flight is None else max(in_flight, 1)
