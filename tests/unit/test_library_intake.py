"""What a library member makes of the records it polls (`varadhi.library.intake`): when it
reads the main topic, and each record as work, as a shard reads it (pure, no services)."""

from __future__ import annotations

from types import SimpleNamespace

from kafka import TopicPartition

from varadhi.core import messages as m
from varadhi.core.policies import Endpoint, RequestShaping, SubscriptionSpec
from varadhi.library.intake import Intake, full, ids
from varadhi.library.keys import OrderingKey

MAIN = TopicPartition("t.000", 1)
RQ = TopicPartition("s.rq.000", 0)


def _record(value=b"{}", key=b"k1", offset=7, **headers):
    raw = [(name.replace("_", "-"), text.encode()) for name, text in headers.items()]
    return SimpleNamespace(key=key, value=value, headers=raw, offset=offset)


def _intake(dedup=False, shaping: RequestShaping | None = None, **spec_fields) -> Intake:
    endpoint = Endpoint("http://127.0.0.1:1/", shaping=shaping or RequestShaping())
    spec = SubscriptionSpec("s", "t", endpoint, **spec_fields)
    return Intake("s", spec, RQ.topic, OrderingKey("record-key"), dedup)


def test_the_main_topic_waits_while_full_unless_a_slot_still_catches_up_on_its_rq():
    assert not full(9, 10, catching_up=False)
    assert full(10, 10, catching_up=False)
    assert full(11, 10, catching_up=False)
    assert not full(10, 10, catching_up=True)  # that slot hands out nothing before: read on


def test_ids_are_the_headers_or_else_the_records_place_and_key():
    assert ids(MAIN, _record(varadhi_msg_id="m1", varadhi_group_id="g1")) == ("m1", "g1")
    assert ids(MAIN, _record()) == ("t.000-1-7", "k1")
    assert ids(MAIN, _record(key=None)) == ("t.000-1-7", None)


def test_a_main_topic_record_is_work_of_its_storage_topic_slot_and_ordering_key():
    work = _intake().work(MAIN, _record(varadhi_origin="0:0:0", x_app="1"), index=2, slot=1)
    assert work is not None
    assert (work.topic, work.partition, work.offset, work.slot, work.key) == (
        "t.000",
        1,
        7,
        1,
        "k1",
    )
    e = work.entry
    assert e.origin == m.Origin(2, 1, 7) and e.attempts == 0 and e.invalid is None
    assert e.headers == {"x-app": "1"}  # a shard's control header is dropped
    assert e.source == "t.000/1/7" and work.dedup_id is None
    assert _intake(grouped=False).work(MAIN, _record(), 0, 1).key is None  # unordered


def test_a_main_topic_record_without_a_value_or_too_large_is_invalid_work():
    assert _intake().work(MAIN, _record(value=None), 0, 0).entry.invalid == "malformed: no value"
    big = _intake(max_message_bytes=3).work(MAIN, _record(value=b"1234"), 0, 0)
    assert big.entry.invalid == "malformed: value of 4 bytes exceeds 3"


def test_with_a_key_header_the_records_key_travels_in_the_headers():
    shaped = _intake(shaping=RequestShaping(key_header="K"))
    assert shaped.work(MAIN, _record(), 0, 0).entry.headers == {m.H_KEY: "k1"}
    assert m.H_KEY not in _intake().work(MAIN, _record(), 0, 0).entry.headers


def test_an_rq_record_is_a_retry_of_its_origin_and_one_without_retry_state_is_dropped():
    copy = _record(varadhi_origin="1:3:40", varadhi_attempts="2", varadhi_due_ms="5000")
    work = _intake(dedup=True).work(RQ, copy, index=0, slot=0)
    assert work is not None
    e = work.entry
    assert (e.origin, e.attempts, e.due_ms) == (m.Origin(1, 3, 40), 2, 5000)
    assert work.dedup_id is not None  # with a dedup window: the same id as its message's
    assert _intake().work(RQ, _record(), 0, 0) is None
