"""Shard-consistent routing (seed 000) and partition-to-shard assignment.

`route(h, P, K) = (K*h) % P + (h // P) % K` sends a group to a partition such that, when a storage
topic with P' = K*P/K0 partitions follows one with P, every partition j of the old topic maps onto
the contiguous block [j*K', (j+1)*K' - 1] of the new one. A subscription whose shard owns a
contiguous, evenly sized range of partitions therefore keeps every group on the same shard across
storage topics of compatible K. That is what lets ordered delivery survive partition growth.

All functions here are pure and cheap; they are used on the driver, on executors and in producers.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import Protocol

import mmh3

_UINT32 = 0xFFFFFFFF


def group_hash(group_id: str) -> int:
    """Unsigned 32-bit murmur3 (seed 0) of the group id's UTF-8 bytes."""
    return mmh3.hash(group_id.encode("utf-8"), 0, signed=False) & _UINT32


def route(h: int, partitions: int, k: int) -> int:
    """The partition for hash `h` on a storage topic with `partitions` partitions and factor `k`."""
    if partitions <= 0:
        raise ValueError(f"partitions must be positive, got {partitions}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    return (k * h) % partitions + (h // partitions) % k


def route_group(group_id: str, partitions: int, k: int) -> int:
    """`route(group_hash(group_id), partitions, k)`."""
    return route(group_hash(group_id), partitions, k)


def is_even_partition_count(partitions: int) -> bool:
    """Seed 000's rule: 1, 2, 3, or a multiple of 4 or of 6 shards evenly for many shard counts."""
    return partitions in (1, 2, 3) or (
        partitions > 0 and (partitions % 4 == 0 or partitions % 6 == 0)
    )


def next_k(previous_partitions: int, previous_k: int, new_partitions: int) -> int:
    """The K of a storage topic appended after one with (`previous_partitions`, `previous_k`).

    The base partition count is P_prev / K_prev (the count the composite topic started its current
    compatible run with). If the new count is a multiple of that base, K = new / base; otherwise
    K = 1 and the new topic starts a new run (its subscriptions may need resharding).
    """
    base = previous_partitions // previous_k
    if base > 0 and previous_partitions % previous_k == 0 and new_partitions % base == 0:
        return new_partitions // base
    return 1


def shard_partitions(shard_id: int, shard_count: int, partitions: int) -> list[int]:
    """Default assignment: shard `sid` of `S` owns [sid*P/S, (sid+1)*P/S - 1] (integer division).

    When S does not divide P the ranges are uneven (some shards own one partition more); when S > P
    some shards own none. Callers that need an even spread check `divides_evenly` first.
    """
    if not 0 <= shard_id < shard_count:
        raise ValueError(f"shard id {shard_id} is outside 0..{shard_count - 1}")
    start = shard_id * partitions // shard_count
    end = (shard_id + 1) * partitions // shard_count
    return list(range(start, end))


def assignment(shard_count: int, partitions: int) -> list[list[int]]:
    """The partition list of every shard, index = shard id."""
    return [shard_partitions(s, shard_count, partitions) for s in range(shard_count)]


def divides_evenly(shard_count: int, partitions: int) -> bool:
    return shard_count > 0 and partitions % shard_count == 0


def shard_of_partition(partition: int, shard_count: int, partitions: int) -> int:
    """The shard that owns `partition` under the default assignment."""
    for sid in range(shard_count):
        if partition in shard_partitions(sid, shard_count, partitions):
            return sid
    raise ValueError(f"partition {partition} is outside 0..{partitions - 1}")


def internal_partition(h: int, owned: Sequence[int]) -> int:
    """The partition of an internal queue (RQ/DLQ) for a group whose shard owns `owned`.

    Failed messages must land in a partition that their group's shard reads; within the shard's
    range the group is spread by its hash, so one group always uses one partition (its order in
    the internal queue is its write order).
    """
    if not owned:
        raise ValueError("the shard owns no partition of the internal queue")
    return owned[h % len(owned)]


class Storage(Protocol):
    """A storage topic as routing sees it (`topics.StorageTopic`)."""

    partitions: int
    k: int


def _block_shards(st: Storage, shard_count: int) -> list[int | None]:
    """Per base residue b (a group's `h % (P/K)`), the one shard that reads every partition a
    group with that residue may be routed to on `st` (K*b .. K*b+K-1), or None when they belong
    to several shards (pure)."""
    owner = [0] * st.partitions
    for s in range(shard_count):
        for p in shard_partitions(s, shard_count, st.partitions):
            owner[p] = s
    k = st.k if st.k > 0 and st.partitions % st.k == 0 else 1
    out: list[int | None] = []
    for b in range(st.partitions // k):
        shards = set(owner[k * b : k * b + k])
        out.append(shards.pop() if len(shards) == 1 else None)
    return out


def keeps_groups(prev: Storage, nxt: Storage, shard_count: int) -> bool:
    """Whether every group is read by the same shard on storage topic `nxt` as on `prev`, the
    one before it, with `shard_count` shards (a library subscription's slots too).

    The router puts a group with hash h on partition K*(h % B) + (h // P) % K of a storage topic
    with P partitions, factor K and base B = P/K. So a shard reads all of a group's possible
    partitions on a topic when it owns the whole block of its residue h % B, and the pairs of
    residues (h % B1, h % B2) that occur are exactly those equal modulo gcd(B1, B2) (Chinese
    remainder theorem). It holds for one shard, for topics of one run whose base the shard
    count divides, and rarely otherwise (a K=1 topic starts a new run)."""
    if shard_count == 1:
        return True
    first, second = _block_shards(prev, shard_count), _block_shards(nxt, shard_count)
    g = gcd(len(first), len(second))
    for c in range(g):
        seen = set(first[c::g]) | set(second[c::g])
        if len(seen) != 1 or None in seen:
            return False
    return True
