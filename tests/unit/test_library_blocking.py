"""Block mode's pure parts: a key's blocks (`varadhi.library.blocked_keys`) and the scheduler's
blocks, sidelining and waits for re-driven copies (`varadhi.library.scheduler`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.library import blocked_keys as bk
from varadhi.library.group_state_topic import partition_of
from varadhi.library.scheduler import Scheduler, Work, live


def o(offset: int) -> m.Origin:
    return m.Origin(0, 0, offset)


def work(offset: int, key: str | None = "a", location: str = "new", **entry) -> Work:
    e = Entry(o(offset), f"id{offset}", key, location, b"x", **entry)  # type: ignore[arg-type]
    return Work(e, "t.0", 0, offset, 0, key)


def copy(offset: int, key: str | None = "a") -> Work:
    """A re-drive's RQ copy of the message at `offset`."""
    w = work(offset, key, headers={m.H_REDRIVEN: "op"})
    return replace(w, topic="s.rq.0", offset=100 + offset)


def bodiless(offset: int, location: str, key: str = "a") -> Work:
    return Work(Entry(o(offset), f"id{offset}", key, location), "s.rq.0", -1, -1, 0, key)  # type: ignore[arg-type]


def test_a_dead_letter_blocks_and_the_first_sidelined_message_is_the_mark():
    blocks = bk.dead_lettered((), o(2), "id2")
    assert blocks == (bk.Block(o(2), "id2"),)
    blocks = bk.sidelined(blocks, o(3), "id3")
    assert blocks == (bk.Block(o(2), "id2"), bk.Block(o(3), "id3", mark=True))
    assert bk.sidelined(blocks, o(4), "id4") == blocks  # behind the mark: nothing more kept
    # the dead letter's copy delivered: blocked at the mark, which later ones stay behind
    blocks = bk.delivered(blocks, o(2))
    assert blocks == (bk.Block(o(3), "id3", mark=True),)
    assert bk.sidelined(blocks, o(5), "id5") == blocks
    assert bk.delivered(blocks, o(3)) == ()


def test_a_mark_being_redriven_does_not_hold_what_is_sidelined_after_it():
    blocks = (bk.Block(o(2), "id2"), bk.Block(o(3), "id3", mark=True))
    # a rate-capped re-drive puts 2 and 3 back and holds the key at 4 (a barrier): a message
    # sidelined meanwhile becomes a mark, or the key would go on past it once 4 is back
    blocks = bk.held_back(blocks, o(4), "id4")
    after = bk.sidelined(blocks, o(9), "id9", redriving={o(2), o(3)})
    assert bk.Block(o(9), "id9", mark=True) in after
    # a dead letter again of a re-driven mark is a dead letter of its own
    assert bk.dead_lettered(blocks, o(3), "id3")[1] == bk.Block(o(3), "id3")


def test_records_round_trip_and_an_unblocked_key_is_a_tombstone():
    blocks = (bk.Block(o(2), "id2"), bk.Block(m.Origin(1, 3, 7), "x\udc80", mark=True))
    assert bk.decode(bk.encode(blocks)) == blocks
    assert bk.encode(()) is None and bk.decode(None) == ()
    with pytest.raises(ValueError, match="GroupState"):
        bk.decode(b'{"v": 1}')
    assert bk.key_text(bk.key_bytes("k\udc80")) == "k\udc80"


def test_a_keys_record_lies_in_its_slots_partitions():
    # 4 partitions, 2 slots: slot 0 owns 0-1, slot 1 owns 2-3, as a shard owns its DLQ's
    for key in ("a", "b", "c", "d"):
        assert partition_of(key, 0, 2, 4) in (0, 1)
        assert partition_of(key, 1, 2, 4) in (2, 3)


def test_a_dead_lettered_head_blocks_its_key_and_gives_back_what_waited_behind_it():
    s = Scheduler()
    for w in (work(0), work(1), work(2), work(3, "b")):
        s.add(w)
    head = s.take(0)
    assert head is not None and head.offset == 0
    assert [w.offset for w in s.to_dlq(head)] == [1, 2]  # sidelined by the caller
    assert s.pending == 1
    b = s.take(0)
    assert b is not None and b.key == "b"  # other keys go on
    assert s.take(0) is None
    assert s.blocked_before((0, "a"), o(5)) and not s.blocked_before((0, "b"), o(5))
    # a main-topic copy of the dead letter (read again after a restart) is a duplicate
    dup = work(0)
    assert s.add(dup) == [dup]
    # its re-driven copy lifts the block and is delivered
    assert s.add(copy(0)) == []
    again = s.take(0)
    assert again is not None and again.offset == 100 and again.entry.headers[m.H_REDRIVEN]
    s.done(again)
    assert not s.blocked_before((0, "a"), o(5))


def test_a_dead_letter_of_a_head_no_longer_held_changes_nothing():
    s = Scheduler()
    s.add(work(0))
    head = s.take(0)
    assert head is not None
    s.close({0})
    s.drop({0})  # its slot went in a rebalance
    assert s.to_dlq(head) is None


def test_blocks_from_the_group_state_and_waits_for_redriven_copies_keep_origin_order():
    s = Scheduler()
    s.park(bodiless(2, "dlq"))  # a restart: the key's dead letter
    s.park(bodiless(3, "dlq"))  # and its mark
    assert s.blocked_before((0, "a"), o(9))
    assert s.spill_blocked(0) == []  # a block is never sidelined
    assert s.take(0) is None
    # a re-drive puts back 2, 3 and the sidelined 4: the key waits for each copy
    for n in (2, 3, 4):
        s.await_copy(bodiless(n, "rq"))
    assert not s.blocked_before((0, "a"), o(9))
    s.add(work(9))  # a new message queues behind the copies
    for n in (4, 2, 3):  # copies read in any order are delivered in origin order
        assert s.add(copy(n)) == []
    got = []
    while (w := s.take(0)) is not None:
        got.append(w.entry.origin.offset)
        s.done(w)
    assert got == [2, 3, 4, 9]
    assert s.pending == 0


def test_what_was_held_behind_a_block_during_a_redrive_is_spilled_after_it():
    s = Scheduler()
    s.park(bodiless(2, "dlq"))
    s.park(bodiless(5, "dlq", key="b"))
    s.add(work(6))  # held while the slot's re-drive read the DLQ
    s.add(work(7, "b"))
    s.await_copy(bodiless(2, "rq"))  # the re-drive took a's dead letter, not b's
    assert [w.offset for w in s.spill_blocked(0)] == [7]
    assert s.spill_blocked(1) == []
    assert s.pending == 1
    assert s.add(copy(2)) == []
    first = s.take(0)
    assert first is not None and first.entry.origin == o(2)


def test_live_is_a_main_topic_copy():
    assert live(work(1))
    assert not live(copy(1))
    assert not live(work(1, attempts=1))


def test_a_copy_redriven_behind_a_block_that_stays_waits_behind_it():
    s = Scheduler()
    s.park(bodiless(2, "dlq"))  # the dead letter, not re-driven
    s.await_copy(bodiless(5, "rq"))  # a later message re-driven alone
    assert s.add(copy(5)) == []
    assert s.take(0) is None  # held behind the block
    assert s.spill_blocked(0) == []  # a re-driven copy is never sidelined
    assert s.add(copy(2)) == []  # the dead letter's copy, re-driven later
    got = []
    while (w := s.take(0)) is not None:
        got.append(w.entry.origin.offset)
        s.done(w)
    assert got == [2, 5]
