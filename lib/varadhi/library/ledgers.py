"""The offsets of the partitions a library member holds: per partition its `offsets.Ledger`
(what it read, what finished above the lowest unfinished offset) and its last commit, and the
offsets finished on other threads, to be applied by the Kafka thread.

Contract. `finished(where)` may be called from any thread (delivery and handler threads, the
producer's I/O thread once a write is acknowledged); the Kafka thread applies them
(`apply_finished`) and reads and finishes offsets itself (`read`, `finish`). `positions` gives
the commits to make: a partition's `Ledger.position` where it moved since its last commit
(`to_commit`, pure); `committed` records a commit's answer. `install`, `forget`, `partitions`,
`get` and `commits` are used under the member's lock (its rebalance, health, status).

Locks. A ledger's offsets are read and finished by the Kafka thread and committed by the
rebalance listener (kafka-python's I/O thread: `positions` of revoked partitions), so reading,
finishing and taking positions take this object's lock; it is taken alone or inside the
member's lock, never the other way round.

Hazard. An offset finished for a partition forgotten meanwhile (revoked) is dropped: its next
owner reads it again (at least once).
"""

from __future__ import annotations

import threading
from queue import Empty, SimpleQueue

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from varadhi.library.offsets import Ledger

#: A partition's commit: the offset and its metadata (`Ledger.position`).
Position = tuple[int, str]


def to_commit(ledger: Ledger, last: Position | None) -> Position | None:
    """The commit a partition needs (None: none): its position, once it read something and
    where the position moved since its `last` commit."""
    if ledger.upto <= ledger.start:
        return None
    position = ledger.position()
    return None if position == last else position


class Ledgers:
    """See the module docstring."""

    def __init__(self):
        self._ledgers: dict[TopicPartition, Ledger] = {}
        self._committed: dict[TopicPartition, Position] = {}
        self._finished: SimpleQueue[tuple[TopicPartition, int]] = SimpleQueue()
        self._lock = threading.Lock()

    # -- any thread ------------------------------------------------------------------------
    def finished(self, where: tuple[TopicPartition, int]) -> None:
        """Offset `where` finished (applied by the Kafka thread: `apply_finished`)."""
        self._finished.put(where)

    # -- under the member's lock ------------------------------------------------------------
    def partitions(self):
        """The partitions held (a live view: read it under the member's lock)."""
        return self._ledgers.keys()

    def get(self, tp: TopicPartition) -> Ledger | None:
        return self._ledgers.get(tp)

    def install(self, tp: TopicPartition, ledger: Ledger, last: Position | None) -> None:
        """Hold `tp` with `ledger`, committed at `last` (None: no commit yet)."""
        self._ledgers[tp] = ledger
        if last is not None:
            self._committed[tp] = last

    def forget(self, tp: TopicPartition) -> None:
        self._ledgers.pop(tp, None)
        self._committed.pop(tp, None)

    def commits(self) -> dict[str, int]:
        """The committed offset of each partition held, by `topic/partition` (status)."""
        return {f"{tp.topic}/{tp.partition}": c[0] for tp, c in sorted(self._committed.items())}

    def committed(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """A commit of `offsets` succeeded (partitions forgotten meanwhile stay forgotten)."""
        for tp, om in offsets.items():
            if tp in self._ledgers:  # not forgotten (a revoke's commit) meanwhile
                self._committed[tp] = (om.offset, om.metadata)

    # -- the Kafka thread (and `positions`: the rebalance listener too) -------------------------
    def read(self, ledger: Ledger, offset: int) -> bool:
        """`Ledger.read`: False for an offset that finished before (skip it)."""
        with self._lock:
            return ledger.read(offset)

    def finish(self, ledger: Ledger, offset: int) -> None:
        with self._lock:
            ledger.finish(offset)

    def apply_finished(self) -> None:
        """Finish the offsets finished on other threads, of the partitions still held."""
        while True:
            try:
                tp, offset = self._finished.get_nowait()
            except Empty:
                return
            ledger = self._ledgers.get(tp)
            if ledger is not None:
                self.finish(ledger, offset)

    def positions(self, tps) -> dict[TopicPartition, OffsetAndMetadata]:
        """The commit of each of `tps` held that needs one (`to_commit`)."""
        out = {}
        with self._lock:
            for tp in tps:
                ledger = self._ledgers.get(tp)
                if ledger is None:
                    continue
                position = to_commit(ledger, self._committed.get(tp))
                if position is not None:
                    out[tp] = OffsetAndMetadata(position[0], position[1], -1)
        return out
