"""Operations on a `runtime: library` subscription, their pure parts: the RQ record a re-drive
writes for a dead letter, and where."""

from __future__ import annotations

from varadhi.core import messages as m
from varadhi.core import routing
from varadhi.core.state_rows import retry_state
from varadhi.kafka.dlq import Parked, parked_from_record
from varadhi.library.redrive import redrivable_once, redrive_record, rq_partition


def parked(offset: int, origin: str = "0:3:17", **headers: str) -> Parked:
    h = {
        m.H_MSG_ID: "m-1",
        m.H_GROUP_ID: "g-1",
        m.H_ORIGIN: origin,
        m.H_ATTEMPTS: "5",
        m.H_DUE_MS: "123",
        m.H_FIRST_FAILURE_MS: "100",
        m.H_LAST_FAILURE_MS: "200",
        m.H_REASON: "fatal response 400",
        m.H_STATUS: "400",
        "traceparent": "00-abc",
        **headers,
    }
    return parked_from_record("s.dlq.0", 1, offset, b"g-1", b"body", m.dict_to_headers(h))


def test_a_redriven_dead_letter_is_a_retry_due_now_with_no_attempts_marked_with_the_redrive():
    record = redrive_record(parked(4), "redrive-1-abc", True, 5_000, 1_000_000)
    headers = m.headers_to_dict(record.headers)
    assert retry_state(headers) == (m.Origin.decode("0:3:17"), 0, 5_000)
    assert headers[m.H_REDRIVEN] == "redrive-1-abc"
    assert headers[m.H_MSG_ID] == "m-1" and headers["traceparent"] == "00-abc"
    for gone in (m.H_REASON, m.H_STATUS, m.H_FIRST_FAILURE_MS, m.H_LAST_FAILURE_MS):
        assert gone not in headers
    assert (record.key, record.value) == (b"g-1", b"body")


def test_a_redrive_goes_to_an_rq_partition_of_its_slot():
    for key in ("g-1", "g-2", "~m-9"):
        for slot in range(3):
            p = rq_partition(key, slot, 3, 12)
            assert p in routing.shard_partitions(slot, 3, 12)


def test_one_copy_per_origin_and_nothing_that_cannot_go_back():
    twice = [("op", parked(1)), ("op", parked(2)), ("op", parked(3, origin="0:3:18"))]
    truncated = ("op", parked(4, origin="0:3:19", **{m.H_TRUNCATED: "99"}))
    no_origin = ("op", parked(5, origin="junk"))
    kept = redrivable_once([*twice, truncated, no_origin])
    assert [p.offset for p in kept] == [1, 3]
