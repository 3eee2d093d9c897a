"""RQ/DLQ records fitted to the topic's size limit (`varadhi.queue_records`) and catalog
records another program wrote (`varadhi.catalog.decode_record`)."""

from __future__ import annotations

import pytest

from varadhi import messages as m
from varadhi.catalog import decode_record
from varadhi.errors import VaradhiError
from varadhi.queue_records import OutRecord, out_record


def row(target: str, value: bytes, headers: str = "{}") -> dict:
    return {
        "target": target,
        "group_id": "g",
        "msg_id": "m1",
        "value": value,
        "headers": headers,
        "origin_index": 0,
        "origin_partition": 3,
        "origin_offset": 17,
        "attempts": 2,
        "due_ms": 0,
        "first_failure_ms": 1,
        "last_failure_ms": 2,
        "reason": "HTTP 500",
        "status": 500,
    }


def test_a_record_that_fits_is_sent_whole():
    record = out_record(row("dlq", b"abc"), 10_000)
    assert record.value == b"abc" and m.H_TRUNCATED not in dict(record.headers)
    assert dict(record.headers)[m.H_ORIGIN] == b"0:3:17"


def test_a_dead_letter_too_large_is_cut_to_the_limit_and_says_so():
    record = out_record(row("dlq", b"x" * 50_000), 4_000)
    headers = dict(record.headers)
    assert record.size <= 4_000 and 0 < len(record.value) < 4_000
    assert headers[m.H_TRUNCATED] == b"50000" and headers[m.H_ORIGIN] == b"0:3:17"


def test_foreign_headers_too_large_for_the_dlq_are_dropped_but_ours_kept():
    record = out_record(row("dlq", b"x" * 100, headers='{"x-big": "' + "h" * 9000 + '"}'), 4_000)
    headers = dict(record.headers)
    assert "x-big" not in headers and headers[m.H_TRUNCATED] == b"100"
    assert record.size <= 4_000 and headers[m.H_REASON] == b"HTTP 500"


def test_a_retry_too_large_for_the_rq_is_refused_not_cut():
    with pytest.raises(VaradhiError, match="exceeds the RQ's max.message.bytes"):
        out_record(row("rq", b"x" * 50_000), 4_000)


def test_the_size_bound_counts_key_value_and_headers():
    assert OutRecord(b"k", b"vv", [("h", b"123")]).size >= 1 + 2 + 1 + 3


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (b"topic/orders", b'{"a": 1}', ("topic/orders", {"a": 1})),
        (b"topic/orders", None, ("topic/orders", None)),
        (None, b"{}", None),
        (b"\xff\xfe", b"{}", None),
        (b"topic/x", b"not json", None),
        (b"topic/x", b"\xff", None),
        (b"topic/x", b"[1, 2]", None),
        (b"topic/x", b"42", None),
    ],
)
def test_catalog_records_of_other_programs_are_recognised(key, value, expected):
    assert decode_record(key, value) == expected
