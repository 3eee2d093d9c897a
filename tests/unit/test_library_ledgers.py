"""The offsets of the partitions a library member holds (`varadhi.library.ledgers`): which
commits it makes, and what happens to offsets of partitions it no longer holds (pure, no
services)."""

from __future__ import annotations

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata

from varadhi.library.ledgers import Ledgers, to_commit
from varadhi.library.offsets import Ledger

TP = TopicPartition("t.000", 0)
OTHER = TopicPartition("t.000", 1)


def test_a_partition_commits_once_it_read_something_and_only_where_its_position_moved():
    ledger = Ledger(10)
    assert to_commit(ledger, None) is None  # nothing read: its commit stands
    ledger.read(10)
    ledger.read(11)
    ledger.finish(11)
    position = to_commit(ledger, None)
    assert position is not None and position[0] == 10  # the lowest unfinished offset
    assert to_commit(ledger, position) is None  # committed there already
    ledger.finish(10)
    assert to_commit(ledger, position) == (12, ledger.position()[1])


def test_offsets_finished_elsewhere_apply_to_the_partitions_still_held():
    ledgers = Ledgers()
    ledger = Ledger(0)
    ledgers.install(TP, ledger, None)
    for offset in (0, 1):
        assert ledgers.read(ledger, offset)
    assert not ledgers.read(ledger, 1)  # read again: skipped
    ledgers.finished((TP, 0))
    ledgers.finished((OTHER, 5))  # forgotten meanwhile: dropped
    ledgers.apply_finished()
    assert ledgers.positions([TP, OTHER]) == {TP: OffsetAndMetadata(1, ledger.position()[1], -1)}


def test_a_commits_answer_is_kept_only_for_partitions_still_held():
    ledgers = Ledgers()
    ledger = Ledger(3, None)
    ledgers.install(TP, ledger, (3, ""))
    assert ledgers.commits() == {"t.000/0": 3}
    ledger.read(3)
    ledger.finish(3)
    offsets = ledgers.positions(ledgers.partitions())
    assert offsets[TP].offset == 4
    ledgers.committed({**offsets, OTHER: OffsetAndMetadata(9, "", -1)})
    assert ledgers.commits() == {"t.000/0": 4}  # OTHER: not held
    assert ledgers.positions([TP]) == {}  # nothing moved since
    ledgers.forget(TP)
    assert ledgers.get(TP) is None and ledgers.commits() == {} and not list(ledgers.partitions())
