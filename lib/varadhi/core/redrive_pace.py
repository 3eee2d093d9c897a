"""The pace of a rate-capped DLQ re-drive (`varadhi dlq unsideline --rate N`): how many parked
messages a shard puts back in one micro-batch, and where such a portion ends (pure; the I/O is
`varadhi.kafka.dlq`'s).

Pace. A re-drive of rate N over S shards lets each shard take `N / S` messages a second. Each
micro-batch of the shard takes one portion of `portion_size` messages: the whole messages of
`rate x (seconds since its previous portion)` plus the fraction its previous portion left
(`carry`), at most `MAX_PORTION_S` seconds' worth (at least one message, so a share below one
a second still moves). The first portion takes one second's worth. So over any time T a shard
takes at most `rate x (T + MAX_PORTION_S)` messages; a portion's messages are delivered in its
own micro-batch, at the endpoint's speed.

Order. A shard takes the messages it selected (`Pick`s) in one fixed order (`pick_order`: DLQ
partition by partition, offsets ascending), so its progress is one offset per DLQ partition
(`taken`: below it every pick of that partition is back), which it commits with the portion.
Invariant: *a group's message never overtakes an earlier one of that group across a portion
boundary, and a group's newer traffic stays behind every message the re-drive puts back.* Put
back at its origin, a taken message sorts before the group's newer traffic; but once a group's
taken messages are delivered, nothing but a dead letter in its state would stop its newer
traffic from overtaking the messages a later portion takes. So for every group a portion takes
from, and that has picks left for later portions, the portion also leaves a *barrier*: its
earliest remaining pick (by origin) as a `dlq` entry, where the group stops as behind any dead
letter (`plan_portion`). The portion that takes that pick replaces the barrier with it, as any
re-drive replaces a `dlq` entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from varadhi.core.messages import Origin
from varadhi.core.state_rows import Scanned

#: A portion takes at most this many seconds' worth of the shard's rate.
MAX_PORTION_S = 1.0


def portion_size(
    rate_per_s: float, last_ms: int | None, carry: float, now_ms: int
) -> tuple[int, float]:
    """How many messages a portion takes now, and the fraction of a message it leaves for the
    next (pure; the module docstring). `last_ms`: when the previous portion was taken (None:
    this is the first), `carry`: what that one left. A clock that went back counts as no time."""
    cap = max(1.0, rate_per_s * MAX_PORTION_S)
    elapsed_s = 1.0 if last_ms is None else max(0, now_ms - last_ms) / 1000
    allowance = min(cap, carry + rate_per_s * elapsed_s)
    whole = math.floor(allowance + 1e-9)
    return whole, max(0.0, allowance - whole)


@dataclass(frozen=True)
class Pick:
    """A parked message a re-drive will put back: its DLQ record, group and origin (and id, for
    a barrier)."""

    topic: str
    partition: int
    offset: int
    group_key: str
    origin: Origin
    msg_id: str
    group_id: str | None


def pick_order(picks: Iterable[Pick], partitions: Sequence[tuple[str, int]]) -> list[Pick]:
    """`picks` in the order a shard takes them (pure): partition by partition as `partitions`
    lists them (the shard's DLQ partitions, storage topics oldest first), offsets ascending;
    one pick per group and origin (a DLQ record written twice is put back once)."""
    rank = {tp: i for i, tp in enumerate(partitions)}
    out, seen = [], set()
    for p in sorted(picks, key=lambda p: (rank[(p.topic, p.partition)], p.offset)):
        if (p.group_key, p.origin) not in seen:
            seen.add((p.group_key, p.origin))
            out.append(p)
    return out


def is_taken(p: Pick, taken: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether a portion has put `p` back already (pure): it lies below the progress."""
    return p.offset < int(taken.get(p.topic, {}).get(str(p.partition), 0))


@dataclass(frozen=True)
class Portion:
    """One portion (`plan_portion`): the picks it puts back, the barriers it leaves, the
    progress after it, and whether it is the last."""

    take: tuple[Pick, ...]
    barriers: tuple[Pick, ...]
    taken: Scanned
    complete: bool


def plan_portion(
    remaining: Sequence[Pick],
    budget: int,
    taken: Mapping[str, Mapping[str, int]],
    ends: Mapping[str, Mapping[str, int]],
    partitions: Sequence[tuple[str, int]],
) -> Portion:
    """The next portion of at most `budget` picks (pure). `remaining`: the picks not taken yet,
    in `pick_order`; `taken`: the progress so far; `ends`: the end offsets the re-drive started
    with; `partitions`: the order of `pick_order`.

    The progress after it: the end offset for every partition before the first pick left, that
    pick's offset for its partition, unchanged for later ones; all the ends once nothing is left
    (`complete`). Barriers: for each group it takes from that has picks left, its remaining pick
    of the lowest origin (the module docstring)."""
    take, left = tuple(remaining[:budget]), remaining[budget:]
    if not left:
        whole = {t: {p: int(o) for p, o in parts.items()} for t, parts in ends.items()}
        return Portion(take, (), whole, True)
    progress = {t: {p: int(o) for p, o in parts.items()} for t, parts in taken.items()}
    first = left[0]
    for topic, partition in partitions:
        if (topic, partition) == (first.topic, first.partition):
            progress.setdefault(topic, {})[str(partition)] = first.offset
            break
        end = ends.get(topic, {}).get(str(partition))
        if end is not None:
            progress.setdefault(topic, {})[str(partition)] = int(end)
    groups = {p.group_key for p in take}
    earliest: dict[str, Pick] = {}
    for p in left:
        if p.group_key in groups and (
            p.group_key not in earliest or p.origin < earliest[p.group_key].origin
        ):
            earliest[p.group_key] = p
    return Portion(take, tuple(earliest.values()), progress, False)
