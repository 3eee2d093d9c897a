"""Endpoint health in a library member: the subscription suspended when every attempt failed for
`circuit_breaker.suspend_after`, and how it ends (pure: the runtime acts on `step`).

The shards' semantics (`varadhi.spark.shard.job`, docs/subscriptions.md#circuit-breaker), with
members in place of shards:

- The evidence is the member's circuit (`shared_circuit.SharedCircuit`), which counts the other
  members' attempts too: `failing_since_ms`, since when every attempt of the subscription
  failed. Once that lasted `suspend_after`, the first member to see it records the suspension
  in the catalog (`Suspension` with its member id; one already recorded stays).
- `resume: operator`: every member hands out nothing and reads nothing (as paused) until
  `varadhi subscription resume` ends it; each then counts failure afresh (the wait was no
  attempt's failure).
- `resume: probe`: every member goes on under its circuit (open: nothing; half-open: its probes),
  not only the one that suspended it (a member may leave; any member's probe answers the same
  question), and the first member whose circuit is closed with no failure since ends the
  suspension. A member started during a suspension begins closed with nothing failed: it ends
  the suspension at once and delivers, as a restarted probing shard does; if the endpoint still
  fails, the subscription is suspended again `suspend_after` later.

Hazards: members look at the catalog every 5 s (`runtime.CATALOG_CHECK_S`), so a suspension
starts up to 5 s after `suspend_after`, and one member may hand out for up to 5 s after
another suspended the subscription (its circuit is then open anyway when the endpoint fails for
all); a suspension recorded by a library member names no shard (`shard` -1): run by the shards,
it ends only by a resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from varadhi.core.circuit import State
from varadhi.kafka.subscriptions import Suspension

#: The `shard` of a suspension recorded by a library member (no shard probes it).
NO_SHARD = -1


@dataclass(frozen=True)
class Step:
    """What a member does about the subscription's suspension now: `suspend` (record
    `reason`), `end` (its probe found the endpoint healthy: clear the suspension), `resumed`
    (an operator or another member ended it: count failure afresh), or `none`."""

    action: Literal["suspend", "end", "resumed", "none"]
    reason: str | None = None


NOTHING = Step("none")


def step(
    suspended: Suspension | None,
    was_suspended: bool,
    due: str | None,
    circuit: State,
    failing: bool,
) -> Step:
    """The member's step, from the catalog's `suspended`, whether the member last saw it
    suspended, the circuit's `suspension_due` reason (`due`), its state and whether it has
    counted failure without a success since (`failing`)."""
    if suspended is None:
        if was_suspended:
            return Step("resumed")
        return Step("suspend", due) if due is not None else NOTHING
    if suspended.resume == "probe" and circuit == "closed" and not failing:
        return Step("end")
    return NOTHING


def holds(suspended: Suspension | None) -> bool:
    """Whether a member hands out and reads nothing for `suspended`: `resume: operator` only
    (under `probe`, the circuit holds it)."""
    return suspended is not None and suspended.resume != "probe"
