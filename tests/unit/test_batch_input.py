"""How a phase-1 task reads its Arrow batches (`varadhi.spark.batch.record_rows`, `header_dicts`) and
returns its rows (`arrow_batch`): the same values as the record-by-record conversion
(`messages.headers_to_dict`) on whatever a producer wrote, and exactly Spark's types out; which
headers an entry gets from its record (`record_entry`)."""

from __future__ import annotations

import pyarrow as pa

from varadhi.core import messages as m
from varadhi.core.group_state import Entry, RunCounts
from varadhi.core.policies import Endpoint, SubscriptionSpec
from varadhi.core.state_frames import task_stats
from varadhi.core.state_rows import RESULT_COLUMNS, Kind, TaskStats, stat_row, state_row
from varadhi.spark.batch import (
    KEY_TEXT,
    BatchContext,
    arrow_batch,
    header_dicts,
    record_entry,
    record_rows,
)

HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))

AWKWARD = [
    [("varadhi-msg-id", b"m1"), ("varadhi-produced-ms", b"17")],
    [],  # no headers
    None,  # a null list
    [("a", None), ("b", b"")],  # a null value and an empty one
    [("a", b"first"), ("b", b"x"), ("a", b"second")],  # a repeated name keeps its first value
    [("caf\u00e9", "\u00e9t\u00e9".encode())],  # non-ASCII UTF-8
    [("bin", b"\xff\xfe\x00")],  # not UTF-8: b64
]


def _column(records) -> pa.ListArray:
    return pa.array(
        [None if r is None else [{"key": k, "value": v} for k, v in r] for r in records], HEADERS
    )


def _expected(records) -> list[dict[str, str]]:
    return [m.headers_to_dict(r) for r in records]


def test_header_dicts_are_what_headers_to_dict_makes_of_every_record():
    assert header_dicts(_column(AWKWARD)) == _expected(AWKWARD)
    assert list(header_dicts(_column(AWKWARD))[4]) == ["a", "b"]  # in the record's order


def test_a_batch_of_utf8_values_decoded_at_once_is_the_same():
    """Without the non-UTF-8 record, the batch's values are decoded in one cast (the fast path)."""
    records = AWKWARD[:-1]
    assert header_dicts(_column(records)) == _expected(records)


def test_header_dicts_of_a_sliced_column_are_those_of_its_records():
    column = _column(AWKWARD)
    assert header_dicts(column.slice(3, 3)) == _expected(AWKWARD[3:6])
    assert header_dicts(column.slice(0, 0)) == []


def test_record_rows_give_python_values_and_headers_in_order():
    batch = pa.RecordBatch.from_arrays(
        [
            pa.array(["mq", "rq"]),
            pa.array(["g", None]),
            pa.array([0, 3], pa.int32()),
            pa.array([41, 7], pa.int64()),
            pa.array([b"{}", None], pa.binary()),
            _column([[("varadhi-msg-id", b"m1")], None]),
        ],
        names=["kind", "group_id", "partition", "offset", "value", "kheaders"],
    )
    rows = list(record_rows(batch))
    assert rows == [
        (
            {"kind": "mq", "group_id": "g", "partition": 0, "offset": 41, "value": b"{}"},
            {"varadhi-msg-id": "m1"},
        ),
        ({"kind": "rq", "group_id": None, "partition": 3, "offset": 7, "value": None}, {}),
    ]
    assert all(type(row["offset"]) is int and type(row["partition"]) is int for row, _ in rows)


def test_arrow_batch_has_spark_s_types_and_nulls_for_what_a_row_lacks():
    entry = Entry(
        origin=m.Origin(0, 1, 2), msg_id="m", group_id="g", location="held", value=b"body"
    )
    stats = TaskStats.of(RunCounts(delivered=3), 0.25, {"status_204": 3}, records=3)
    rows = [
        state_row(Kind.PENDING, "g", entry),
        {"kind": Kind.TOUCHED, "group_key": "g"},
        stat_row(stats),
    ]
    batch = arrow_batch(rows, RESULT_COLUMNS)
    types = {f.name: f.type for f in batch.schema}
    assert types["origin_partition"] == pa.int32() and types["origin_offset"] == pa.int64()
    assert types["value"] == pa.binary() and types["kind"] == pa.string()
    assert types["stat_seconds"] == pa.float64()
    assert types["stat_http"] == pa.map_(pa.string(), pa.int64())
    first, second, _ = batch.to_pylist()
    assert (first["kind"], first["value"], first["origin_offset"]) == ("pending", b"body", 2)
    assert second["kind"] == "touched" and second["value"] is None and second["msg_id"] is None
    assert task_stats(batch.to_pandas()) == [stats]  # the driver reads the counters back


def test_a_main_topic_record_s_key_is_kept_in_a_shard_only_header():
    """With `endpoint.key_header` the plan hands the tasks the key's text form (`KEY_TEXT`): a
    main-topic record keeps it in `varadhi-key` (a producer's own is dropped); an RQ record keeps
    the one its shard wrote (its own Kafka key is the group id)."""
    ctx = BatchContext(
        SubscriptionSpec("s", "t", Endpoint("http://127.0.0.1:1/")), {"t.0": 0}, 0, 1
    )
    row = {"kind": "mq", "group_id": "g", "msg_id": "m", "topic": "t.0", "partition": 0,
           "offset": 5, "value": b"{}"}  # fmt: skip
    forged = {m.H_MSG_ID: "m", m.H_KEY: "forged"}

    def kept(row: dict, headers: dict[str, str]) -> str | None:
        return record_entry(row, dict(headers), ctx).headers.get(m.H_KEY)

    assert kept({**row, KEY_TEXT: "order-42"}, forged) == "order-42"
    assert kept({**row, KEY_TEXT: None}, forged) is None  # the record has no key
    assert kept(row, forged) is None  # no key_header: no column, no header
    retry = {m.H_MSG_ID: "m", m.H_KEY: "order-42", m.H_ORIGIN: "0:0:5", m.H_ATTEMPTS: "1"}
    rq = {**row, "kind": "rq", "topic": "s.rq.0", KEY_TEXT: "g"}
    assert kept(rq, retry) == "order-42"
