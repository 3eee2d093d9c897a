"""The codecs of a micro-batch's rows (`varadhi.core.state_rows`, and `varadhi.core.state_frames`
for the rows as pandas frames), pure: every kind written and read back, through the Arrow types
Spark uses for the state table and the executors' results."""

from __future__ import annotations

from dataclasses import fields

import pandas as pd
import pyarrow as pa
import pytest

from varadhi.core import messages as m
from varadhi.core.group_state import Entry, RunCounts
from varadhi.core.state_frames import delivered_ids, frame_of, normalise, state_rows, task_stats
from varadhi.core.state_rows import (
    COLUMN_NAMES,
    RESULT_COLUMNS,
    STATE_COLUMNS,
    STATE_SCHEMA,
    Kind,
    OutRow,
    StateRow,
    TaskStats,
    decode_scanned,
    done_row,
    entry_of,
    meta_row,
    redrive_row,
    retry_headers,
    retry_state,
    stat_row,
    state_row,
    touched_row,
)
from varadhi.spark.batch import _ARROW_TYPES as ARROW_TYPES  # the types Spark hands Arrow over in


def through_arrow(frame: pd.DataFrame, columns) -> pd.DataFrame:
    """`frame` converted to the Spark schema's Arrow types and back, as a Spark job hands it over
    (a null int comes back as a float NaN)."""
    schema = pa.schema([(name, ARROW_TYPES[kind]) for name, kind in columns])
    return pa.Table.from_pandas(frame, schema=schema, preserve_index=False).to_pandas()


def entry(location="new", **kw) -> Entry:
    base = dict(
        origin=m.Origin(1, 2, 300),
        msg_id="m-1",
        group_id="g",
        location=location,
        value=b"\x00body\xff",
        headers={m.H_MSG_ID: "m-1", "x": "é\n", "b": "b64:/w=="},
        source="orders.1/2/300",
    )
    return Entry(**(base | kw))


ENTRIES = {
    "new": entry(),
    "held": entry("held", attempts=0, due_ms=5),
    "rq": entry(
        "rq",
        value=None,
        attempts=2,
        due_ms=9_000,
        first_failure_ms=1_000,
        last_failure_ms=2_000,
        reason="HTTP 503",
        status=503,
    ),
    "dlq": entry("dlq", value=None, attempts=3, reason="fatal response 404", status=404),
    "malformed": entry("held", value=None, invalid="malformed: no value"),
    "ungrouped": entry(group_id=None, headers={}),
}


def test_the_kinds_and_the_row_type_match_the_columns():
    assert len({k.value for k in Kind}) == len(Kind)
    assert list(StateRow._fields) == COLUMN_NAMES
    assert STATE_SCHEMA.startswith("kind string, group_key string")
    assert RESULT_COLUMNS[: len(STATE_COLUMNS)] == STATE_COLUMNS
    # Every counter of a group run is a task counter (a new RunCounts field needs a column).
    assert {f.name for f in fields(RunCounts)} <= {f.name for f in fields(TaskStats)}


@pytest.mark.parametrize("kind", [Kind.PENDING, Kind.OUT, Kind.FWD])
@pytest.mark.parametrize("name", ENTRIES)
def test_entries_round_trip_through_state_rows(kind, name):
    e = ENTRIES[name]
    target = "dlq" if kind == Kind.OUT else None
    row = state_row(kind, "g", e, target=target)
    assert (row.kind, row.group_key, row.target) == (kind, "g", target)
    [back] = state_rows(through_arrow(normalise(frame_of([row])), STATE_COLUMNS))
    assert back == row
    decoded = entry_of(back)
    # Bodies go with outs, forwarded records and held entries only.
    keeps_body = kind != Kind.PENDING or e.location == "held"
    assert decoded.value == (e.value if keeps_body else None)
    # A never-attempted held/new entry's reason is why it is malformed (its `invalid`).
    invalid = e.invalid if e.location in ("new", "held") else None
    assert decoded == Entry(
        **{f.name: getattr(e, f.name) for f in fields(Entry)}
        | {"value": decoded.value, "reason": e.reason or e.invalid, "invalid": invalid}
    )


def test_the_other_kinds_round_trip():
    scanned = {"s.dlq.0": {"0": 12, "3": 4}}
    rows = [meta_row("app", 7), touched_row("g"), redrive_row("redrive-1", scanned)]
    back = state_rows(through_arrow(normalise(frame_of(rows)), STATE_COLUMNS))
    assert back == rows
    assert (back[0].kind, back[0].app_id, back[0].batch_id) == (Kind.META, "app", 7)
    assert back[1].kind == Kind.TOUCHED and back[1].origin_index is None
    assert back[2].kind == Kind.REDRIVE and decode_scanned(back[2].headers) == scanned


def test_executor_results_carry_stats_and_delivered_ids_in_their_own_columns():
    counts = RunCounts(delivered=3, retried=1, attempts=5, failures=2, over_limit=1)
    http = {"status_200": 3, "status_503": 2, "latency_le_50": 5, "latency_sum_us": 12_345}
    stats = TaskStats.of(counts, 1.23456, http, records=7, routed=6, groups=2)
    rows = [
        state_row(Kind.PENDING, "g", ENTRIES["rq"]),
        touched_row("g"),
        done_row("id-1", 1_700),
        done_row("id-2", 1_800),
        stat_row(stats),
        stat_row(TaskStats()),  # a task that read nothing
    ]
    result = through_arrow(frame_of(rows, RESULT_COLUMNS), RESULT_COLUMNS)
    assert list(result["kind"]) == ["pending", "touched", "done", "done", "stat", "stat"]
    assert task_stats(result) == [stats, TaskStats()]
    assert stats.seconds == 1.235
    assert delivered_ids(result) == [("id-1", 1_700), ("id-2", 1_800)]
    counters = stats.counters()
    assert counters["delivered"] == 3 and counters["records"] == 7 and counters["groups"] == 2
    assert counters["status_503"] == 2 and "seconds" not in counters and "http" not in counters
    # The state columns of a result are state rows (the driver commits them as they are).
    assert state_rows(result)[0] == state_row(Kind.PENDING, "g", ENTRIES["rq"])


def test_retry_headers_round_trip_through_a_kafka_record():
    e = ENTRIES["rq"]
    row = OutRow.of(state_row(Kind.OUT, "g", e, target="rq"))
    headers = m.headers_to_dict(m.dict_to_headers(retry_headers(row)))
    assert retry_state(headers) == (e.origin, e.attempts, e.due_ms)
    assert headers["x"] == "é\n" and headers[m.H_MSG_ID] == "m-1"
    assert (headers[m.H_REASON], headers[m.H_STATUS]) == ("HTTP 503", "503")
    assert headers[m.H_FIRST_FAILURE_MS] == "1000"
    # An id-less message keeps its id (its group key when ungrouped) in the record.
    bare = OutRow.of(state_row(Kind.OUT, "~m-1", ENTRIES["ungrouped"], target="dlq"))
    assert m.headers_to_dict(m.dict_to_headers(retry_headers(bare)))[m.H_MSG_ID] == "m-1"
    with pytest.raises(KeyError):
        retry_state({})


def test_a_table_with_fewer_or_more_columns_reads_into_the_state_columns():
    """What a table written with another column set reads as (`normalise`): missing columns are
    null, unknown ones dropped."""
    row = state_row(Kind.PENDING, "g", ENTRIES["dlq"])
    old = through_arrow(normalise(frame_of([row])), STATE_COLUMNS).drop(columns=["source"])
    old["future_column"] = 1
    [back] = state_rows(normalise(old))
    assert back == row._replace(source=None)
    assert list(normalise(old).columns) == COLUMN_NAMES


def test_read_before_compares_a_sources_offset_with_its_partitions_position():
    from varadhi.core.state_rows import read_before

    positions = {("s.rq.0", 1): 5}
    assert read_before("s.rq.0/1/4", positions)
    assert not read_before("s.rq.0/1/5", positions)  # at the position: not passed
    assert not read_before("s.rq.0/0/0", positions)  # a partition the positions lack
    assert not read_before("t.0/1/0", positions)  # another topic (the main topic's copy)
    for odd in (None, "", "s.rq.0", "s.rq.0/1", "s.rq.0/x/1", "/1/1"):
        assert not read_before(odd, positions), odd
