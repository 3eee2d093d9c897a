"""Offset bookkeeping of one partition when its records finish out of order (pure).

Records of a partition are delivered concurrently (different ordering keys), so they finish in
any order. Kafka keeps one committed offset per partition; committing past a record that has
not finished would lose it at a restart. So a partition commits the *lowest unfinished* offset,
and records in its commit metadata which records above it are still unfinished, so that a
restart or a rebalance skips the ones that finished instead of delivering them again.

The metadata (`encode`) names the unfinished offsets, not the finished ones: everything read
above the commit point and not listed finished (offsets the partition never showed, such as
transaction markers, need no entry). It is `v1,<span>,<gap>.<length>,...` in base 36: `span`
is how far above the committed offset the record reaches, and each pair is a run of
unfinished offsets, `gap` after the end of the previous run (the first run starts at the
committed offset itself, which is unfinished by definition, so its gap is 0). A partition
whose consumer holds N unfinished records needs at most N runs, a few bytes each.

Size. The broker refuses commit metadata longer than `offset.metadata.max.bytes` (4096 by
default), and a consumer that cannot commit stalls (Confluent Parallel Consumer's issues #647
and #831). `encode` never exceeds its `max_bytes`: when the runs do not fit it records fewer of
them and a shorter span, so the finished records beyond the shortened span are forgotten and
delivered again after a restart. Duplicates in that case, never a stall.

Metadata that is not of this form (written by another tool, damaged) is ignored: the partition
starts at the committed offset and delivers everything from there again.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass

VERSION = "v1"
#: Kafka's default `offset.metadata.max.bytes`; `encode` stays within it.
DEFAULT_MAX_BYTES = 4096
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def _b36_slow(n: int) -> str:
    if n == 0:
        return "0"
    out = []
    while n:
        n, r = divmod(n, 36)
        out.append(_DIGITS[r])
    return "".join(reversed(out))


#: Base 36 of 0 .. 36**2 - 1, looked up: a commit's gaps and run lengths are mostly this small,
#: and `encode` runs for every held partition at every commit (10 a second).
_SMALL = [_b36_slow(n) for n in range(36 * 36)]


def _b36(n: int) -> str:
    return _SMALL[n] if n < 1296 else _b36_slow(n)


def runs(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Offsets as sorted (first, length) runs of consecutive offsets."""
    return _runs_of_sorted(sorted(set(offsets)))


def _runs_of_sorted(ordered: list[int]) -> list[tuple[int, int]]:
    """The runs of strictly increasing `ordered` (the breaks found in one comprehension: this
    is on a member's commit path, over every record it holds unfinished)."""
    if not ordered:
        return []
    breaks = [
        i for i, (a, b) in enumerate(zip(ordered, ordered[1:], strict=False), 1) if b != a + 1
    ]
    starts = [0, *breaks]
    return [(ordered[a], b - a) for a, b in zip(starts, [*breaks, len(ordered)], strict=True)]


def encode(committed: int, upto: int, unfinished: Iterable[int], max_bytes: int) -> str:
    """The metadata of a commit at `committed` (the lowest unfinished offset) when records up to
    `upto` (exclusive) were read and `unfinished` (offsets in [committed, upto)) have not
    finished. Empty when nothing above `committed` finished. At most `max_bytes` (see the
    module docstring: fewer runs and a shorter span when they do not fit)."""
    span = upto - committed
    if span <= 0:
        return ""
    ordered = sorted(set(unfinished))
    ordered = ordered[bisect_left(ordered, committed) : bisect_left(ordered, upto)]
    listed = _runs_of_sorted(ordered)
    if len(listed) == 1 and listed[0] == (committed, span):
        return ""
    parts: list[str] = []
    # `VERSION,span,run,...,run`: the runs get what the version and the whole span's field
    # leave (a span cut short is no longer); each run costs its text and a comma
    size, room = len(VERSION) + 1, max_bytes - len(_b36(span))
    end = committed
    for first, length in listed:
        part = f"{_b36(first - end)}.{_b36(length)}"
        size += len(part) + 1
        if size > room:
            span = first - committed  # forget what finished from here on
            break
        parts.append(part)
        end = first + length
    if span <= 0 or (len(parts) == 1 and parts[0] == f"0.{_b36(span)}"):
        return ""
    return ",".join([VERSION, _b36(span), *parts])


@dataclass(frozen=True)
class Restored:
    """What a commit's metadata says: records in [committed, committed + span) are finished
    unless listed in `unfinished`."""

    committed: int
    span: int
    unfinished: frozenset[int]

    def finished(self, offset: int) -> bool:
        return (
            self.committed <= offset < self.committed + self.span and offset not in self.unfinished
        )


def decode(committed: int, metadata: str | None) -> Restored:
    """The `Restored` of a commit (nothing finished above `committed` when the metadata is
    empty or not ours)."""
    none = Restored(committed, 0, frozenset())
    if not metadata:
        return none
    fields = metadata.split(",")
    if fields[0] != VERSION or len(fields) < 2:
        return none
    try:
        span = int(fields[1], 36)
        unfinished: set[int] = set()
        end = committed
        for part in fields[2:]:
            gap, length = (int(x, 36) for x in part.split("."))
            first = end + gap
            unfinished.update(range(first, first + length))
            end = first + length
    except ValueError:
        return none
    if span < 0 or end > committed + span:
        return none
    return Restored(committed, span, frozenset(unfinished))


class Ledger:
    """One partition's records read and not finished, and its commit (`position`).

    `start` is where reading starts (the committed offset), `restored` what the commit's
    metadata said. `read(offset)` is told each record read, in order; it answers False for one
    that finished before the restart, or that it was told of already (the partition was read
    again from its commit after a rebalance that left it here): skip it. `finish(offset)` is told
    each record that finished. Not thread-safe."""

    def __init__(self, start: int, restored: Restored | None = None):
        self.start = start
        self.restored = restored if restored is not None else Restored(start, 0, frozenset())
        self.outstanding: set[int] = set()
        self.upto = start  # one past the highest offset read

    def read(self, offset: int) -> bool:
        if offset < self.upto:  # read again after a rebalance gave the partition back
            return False
        self.upto = offset + 1
        if self.restored.finished(offset):
            return False
        self.outstanding.add(offset)
        return True

    def finish(self, offset: int) -> None:
        self.outstanding.discard(offset)

    def position(self, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[int, str]:
        """(offset to commit, metadata): the lowest unfinished offset, and which records above
        it are unfinished (those of the restored commit not yet read again included)."""
        restored_end = self.restored.committed + self.restored.span
        if self.upto < restored_end:  # the restored span's unread records keep their state
            unfinished = self.outstanding | {o for o in self.restored.unfinished if o >= self.upto}
            upto = restored_end
        else:
            unfinished = self.outstanding
            upto = self.upto
        committed = min(unfinished) if unfinished else upto
        return committed, encode(committed, upto, unfinished, max_bytes)
