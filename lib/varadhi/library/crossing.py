"""When a library member's slot goes on from one storage topic of the main topic to the next
(pure; DESIGN hazard 3).

A member reads every storage topic T_0..T_n of the main topic, but a slot hands nothing of T_i+1
to the scheduler before it may *cross* the boundary after T_i: until then the slot's partitions
of T_i+1 are held (paused, and what is read of them anyway is read again later, so memory stays
bounded by `max_pending`). The slot's *frontier* is the last storage topic it reads; it moves one
boundary at a time. A slot crosses the boundary after T_i when

1. T_i is sealed: produce moved off it more than the producers' grace ago (`topics.sealed`, as
   the shards decide it), so nothing more will be written to it; and
2. the member read the slot's partitions of T_i to their end offsets (read_committed): every
   message of T_i of the slot's keys is then in the scheduler, ordered by origin (storage topic
   index first), so a key's message of T_i+1, queued after them, waits behind each of them and
   behind their retries (the scheduler's per-key FIFO); and
3. where the boundary moves groups to other slots (a K=1 storage topic, or a slot count the new
   base does not keep: `moves_groups`), the members cross together: the group's committed
   offsets reached the end of T_i and of the RQ and, in block mode, no key is blocked
   (`group_quiet`), so no message of T_i is pending anywhere (a commit is a partition's lowest
   unfinished offset; a retry is an RQ record not yet past the commit; a blocked key is a
   GroupState record). Once one member crossed, the boundary stays crossed for every member: a
   member reads T_i+1 only after crossing, so a committed offset on T_i+1 (`crossed`) shows the
   condition held once, and the RQ records and blocks that T_i+1's own messages cause later do
   not hold the others back. An offset reset keeps that true: it removes the group's commits on
   the storage topics after the one it moves the group into (`varadhi.ops.library_offsets`).

Where groups stay in their slots (a K>1 storage topic whose base the slot count divides, or one
slot) the crossing is per slot and needs no other member. An ungrouped subscription has no order
to keep: its slots read every storage topic at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from varadhi.core.routing import keeps_groups
from varadhi.kafka.topics import StorageTopic


def moves_groups(prev: StorageTopic, nxt: StorageTopic, slots: int) -> bool:
    """Whether some group is read by another slot on `nxt` than on `prev` (its predecessor),
    with `slots` slots: the members must then cross together (`group_quiet`)."""
    return not keeps_groups(prev, nxt, slots)


def read_to_end(positions: Mapping[int, int], ends: Mapping[int, int]) -> bool:
    """Every partition of `ends` read up to its end offset (`positions`: the next offset to
    read, per partition)."""
    return all(positions.get(p, 0) >= end for p, end in ends.items())


@dataclass(frozen=True)
class GroupView:
    """What every member can read from Kafka about the boundary after storage topic T_i:
    the group's committed offsets on T_i (a partition without a commit: its log start) and
    T_i's end offsets; the same of every RQ partition; whether the group has a commit on some
    partition of T_i+1 (`crossed`); and how many keys the GroupState topic holds blocked."""

    old_committed: Mapping[int, int]
    old_ends: Mapping[int, int]
    rq_committed: Mapping[str, int]
    rq_ends: Mapping[str, int]
    crossed: bool
    blocked: int


def old_left(view: GroupView) -> int:
    """Records of T_i past the group's commits."""
    return sum(max(0, e - view.old_committed.get(p, 0)) for p, e in view.old_ends.items())


def rq_left(view: GroupView) -> int:
    """Records of the RQ past the group's commits (retries not finished)."""
    return sum(max(0, e - view.rq_committed.get(p, 0)) for p, e in view.rq_ends.items())


def group_quiet(view: GroupView) -> bool:
    """Whether the members may cross a boundary that moves groups (see the module docstring):
    someone crossed already, or nothing of T_i, of the RQ or of a blocked key is pending."""
    return view.crossed or (old_left(view) == 0 and rq_left(view) == 0 and view.blocked == 0)


def waiting_text(old: str, nxt: str, view: GroupView) -> str:
    """What status says of a member whose slots wait at a boundary that moves groups."""
    return (
        f"waits at the end of {old} before {nxt} (groups move to other slots): until the group"
        f" finished {old} ({old_left(view)} left), the RQ ({rq_left(view)} retries pending)"
        f" and every blocked key ({view.blocked} blocked)"
    )
