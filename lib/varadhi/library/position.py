"""Offset resets of a `runtime: library` subscription, as its members see them (pure).

`varadhi offsets reset` of such a subscription (`varadhi.ops.library_offsets`) moves the
consumer group `varadhi-library.<subscription>`'s committed offsets. Kafka takes offsets
committed from outside a group only while the group has no member, and a member that stays
would commit its own positions over them. So the reset first records its plan, as the operation
document `operation/<subscription>/library-offset-reset` with a `step` other than `done`; a
member that sees it (`Consumer`'s look at the catalog, every 5 s) stops (exit 1), a member being
started refuses to start (exit 2), and the reset commits once the group is empty. Once `done`,
members start again from the new offsets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from varadhi.core.catalog_kinds import DocKind

#: The operation document's name under `operation/<subscription>/`.
RESET_OP = "library-offset-reset"


def reset_key(subscription: str) -> str:
    """The operation document's key (within the OPERATION kind)."""
    return f"{subscription}/{RESET_OP}"


def describe(request: Mapping[str, Any]) -> str:
    """A reset's request as the command line that asked for it (pure)."""
    value = "" if request.get("value") is None else f" {request['value']}"
    return f"--queue {request['queue']} --{request['mode']}{value}"


def reset_under_way(snapshot, subscription: str) -> str | None:
    """Why the members of `subscription` must not run now: an offset reset recorded and not done
    (its request, described), or None (pure)."""
    doc = snapshot.get(DocKind.OPERATION, reset_key(subscription))
    if not doc or doc.get("step") == "done":
        return None
    return (
        f"an offset reset of {subscription} ({describe(doc['plan'])}) is under way: start the"
        " members again once `varadhi offsets reset` has finished"
    )
