"""RQ/DLQ records fitted to the topic's size limit (`varadhi.core.queue_records`) and catalog
records another program wrote (`varadhi.kafka.catalog.decode_record`)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from varadhi.core import messages as m
from varadhi.core.errors import VaradhiError
from varadhi.core.queue_records import OutRecord, out_record
from varadhi.core.state_frames import out_rows
from varadhi.core.state_rows import OutRow, StateRow
from varadhi.kafka.catalog import decode_record


def row(target: str, value: bytes, headers: str = "{}") -> OutRow:
    return OutRow(
        target=target,
        group_key="g",
        group_id="g",
        msg_id="m1",
        origin=m.Origin(0, 3, 17),
        value=value,
        headers=json.loads(headers),
        attempts=2,
        due_ms=0,
        first_failure_ms=1,
        last_failure_ms=2,
        reason="HTTP 500",
        status=500,
    )


def test_an_out_record_s_bytes_are_what_earlier_versions_wrote():
    """The RQ/DLQ record format is persisted (read back by `retry_state`, by re-drive and by
    earlier versions' shards): key, value and every header, byte for byte, from a row as the
    state table's frame holds it (nullable ints, a missing status)."""
    frame = pd.DataFrame(
        [
            StateRow("out", "~m1", None, 0, 3, 17, "m1", "rq", b"body", '{"a": "1", "b": "2"}',
                     2, 1_700, 1_000, 1_500, "HTTP 503; retry in 200 ms", 503, "t.0/3/17",
                     "rq", 9, "app")._asdict(),
            StateRow("out", "g", "g", 1, 0, 5, "m2", "dlq", b"", "{}", 1, 0, 1_000, 1_000,
                     "timed out", None, "t.1/0/5", "dlq", 9, "app")._asdict(),
        ]
    )  # fmt: skip
    frame["status"] = pd.array(frame["status"], dtype="Int32")
    first, second = (out_record(r, None) for r in out_rows(frame))
    assert (first.key, first.value) == (None, b"body")
    assert first.headers == [
        ("a", b"1"),
        ("b", b"2"),
        ("varadhi-msg-id", b"m1"),
        ("varadhi-origin", b"0:3:17"),
        ("varadhi-attempts", b"2"),
        ("varadhi-due-ms", b"1700"),
        ("varadhi-first-failure-ms", b"1000"),
        ("varadhi-last-failure-ms", b"1500"),
        ("varadhi-reason", b"HTTP 503; retry in 200 ms"),
        ("varadhi-status", b"503"),
    ]
    assert (second.key, second.value) == (b"g", b"")
    assert second.headers == [
        ("varadhi-msg-id", b"m2"),
        ("varadhi-origin", b"1:0:5"),
        ("varadhi-attempts", b"1"),
        ("varadhi-due-ms", b"0"),
        ("varadhi-first-failure-ms", b"1000"),
        ("varadhi-last-failure-ms", b"1000"),
        ("varadhi-reason", b"timed out"),
    ]


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
