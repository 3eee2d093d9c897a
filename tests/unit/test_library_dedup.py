"""The library runtime's dedup window (`varadhi.library.dedup`, `dedup_topic`'s record format):
the id a record is de-duplicated by, and the memory of the ids delivered within the window."""

from __future__ import annotations

import hashlib

import pytest

from varadhi.core import messages as m
from varadhi.library.dedup import DedupMemory, dedup_id
from varadhi.library.dedup_topic import decode, encode, topic_name


def test_the_id_is_the_message_id_header_else_the_values_sha256_as_the_shards_take_it():
    assert dedup_id({m.H_MSG_ID: "order-7"}, b"body") == "order-7"
    assert dedup_id({}, b"body") == hashlib.sha256(b"body").hexdigest()
    assert dedup_id({m.H_MSG_ID: ""}, b"body") == hashlib.sha256(b"body").hexdigest()
    assert dedup_id({}, None) == hashlib.sha256(b"").hexdigest()  # as `spark.batch.dedup_id`


def test_an_id_delivered_within_the_window_is_seen_and_forgotten_once_it_left_it():
    memory = DedupMemory(window_ms=1_000)
    memory.remember("a", 10_000)
    assert memory.seen("a", 10_500) and memory.seen("a", 10_999)
    assert not memory.seen("b", 10_500)
    assert not memory.seen("a", 11_000)  # a window of 1 s: delivered 1 s ago is out
    assert len(memory) == 0  # and forgotten


def test_a_later_delivery_of_an_id_keeps_it_in_the_window_from_then():
    memory = DedupMemory(window_ms=1_000)
    memory.remember("a", 10_000)
    memory.remember("a", 10_800)
    memory.remember("a", 10_100)  # an older record read late changes nothing
    assert memory.seen("a", 11_500)
    assert not memory.seen("a", 11_800)
    assert len(memory) == 0


def test_a_window_is_positive():
    with pytest.raises(ValueError, match="positive"):
        DedupMemory(0)


def test_the_topic_records_a_delivery_time_and_skips_what_no_member_wrote():
    assert topic_name("orders") == "orders.dedup"
    assert decode(encode(1_765_000_000_123)) == 1_765_000_000_123
    assert decode(b"not a time") is None and decode(None) is None and decode(b"") is None
