"""The GroupState table in Delta (`varadhi.state_store`) with real Spark: a table written with
the schema of the version before the typed state schema (`varadhi.state_rows`) reads and takes
commits as before, and the executors' result columns (`state_rows.RESULT_SCHEMA`: typed
counters and a map of the endpoint's answers) come through a Spark job unchanged."""

from __future__ import annotations

import pytest

from varadhi import messages as m
from varadhi.batch_commit import changes
from varadhi.group_state import Entry, RunCounts
from varadhi.state_rows import (
    RESULT_COLUMNS,
    RESULT_SCHEMA,
    Kind,
    TaskStats,
    delivered_ids,
    done_row,
    entry_of,
    frame_of,
    stat_row,
    state_row,
    state_rows,
    task_stats,
    touched_row,
)
from varadhi.state_store import StateStore

pytestmark = pytest.mark.spark

# The GroupState schema as the version before varadhi.state_rows wrote it (batch.STATE_SCHEMA at
# 76a8265), kept as a literal: whatever STATE_COLUMNS becomes, tables written with it must read.
OLD_SCHEMA = (
    "kind string, group_key string, group_id string, origin_index int, origin_partition int, "
    "origin_offset bigint, msg_id string, location string, value binary, headers string, "
    "attempts int, due_ms bigint, first_failure_ms bigint, last_failure_ms bigint, "
    "reason string, status int, source string, target string, batch_id bigint, app_id string"
)
OLD_COLUMNS = [tuple(c.split()) for c in OLD_SCHEMA.split(", ")]

RQ_ROW = {  # a row as the old code wrote it (`batch.state_row`: headers as JSON)
    "kind": "pending",
    "group_key": "g",
    "group_id": "g",
    "origin_index": 0,
    "origin_partition": 1,
    "origin_offset": 5,
    "msg_id": "m5",
    "location": "rq",
    "headers": '{"varadhi-msg-id": "m5", "x": "\\u00e9"}',
    "attempts": 1,
    "due_ms": 9_000,
    "first_failure_ms": 1_000,
    "last_failure_ms": 1_000,
    "reason": "HTTP 503",
    "status": 503,
    "source": "orders.0/1/5",
}
OLD_ROWS = [
    RQ_ROW,
    RQ_ROW
    | {
        "origin_offset": 6,
        "msg_id": "m6",
        "location": "held",
        "value": b"body6",
        "headers": "{}",
        "attempts": 0,
        "due_ms": 0,
        "first_failure_ms": None,
        "last_failure_ms": None,
        "reason": None,
        "status": None,
        "source": "orders.0/1/6",
    },
    RQ_ROW | {"kind": "out", "target": "rq", "batch_id": 3, "app_id": "app"},
    {"kind": "meta", "batch_id": 3, "app_id": "app"},
    {"kind": "redrive", "msg_id": "redrive-1", "headers": '{"s.dlq.0": {"0": 4}}'},
]


def test_a_table_written_with_the_old_schema_reads_and_takes_commits(spark, tmp_path):
    path = str(tmp_path / "state")
    data = [tuple(r.get(name) for name, _ in OLD_COLUMNS) for r in OLD_ROWS]
    spark.createDataFrame(data, OLD_SCHEMA).write.format("delta").save(path)

    store = StateStore(spark, path, "w1")
    assert store.meta() == ("app", 3)
    [rq, held] = sorted(store.pending()["g"], key=lambda r: r.origin)
    assert entry_of(rq) == Entry(
        origin=m.Origin(0, 1, 5),
        msg_id="m5",
        group_id="g",
        location="rq",
        headers={m.H_MSG_ID: "m5", "x": "é"},
        attempts=1,
        due_ms=9_000,
        first_failure_ms=1_000,
        last_failure_ms=1_000,
        reason="HTTP 503",
        status=503,
        source="orders.0/1/5",
    )
    assert (held.location, held.value, held.reason, held.status) == ("held", None, None, None)
    [body] = state_rows(store.held_rows(["g"]))
    assert (body.kind, body.msg_id, body.value) == (Kind.HELD, "m6", b"body6")
    assert [r.target for r in state_rows(store.outs("app", 3))] == ["rq"]
    assert store.redrives_applied() == {"redrive-1": {"s.dlq.0": {"0": 4}}}

    # Batch 4: the retry is dead-lettered, the held message stays pending; the executors' result
    # columns (stats, delivered ids) do not reach the table.
    dead = entry_of(rq)
    dead.location, dead.attempts = "dlq", 2
    result = frame_of(
        [
            touched_row("g"),
            state_row(Kind.PENDING, "g", dead),
            state_row(Kind.PENDING, "g", entry_of(body)),
            state_row(Kind.OUT, "g", dead, target="dlq"),
            done_row("x", 1),
            stat_row(TaskStats(delivered=1, http={"status_500": 1})),
        ],
        RESULT_COLUMNS,
    )
    touched, new_rows = changes(result, "app", 4)
    assert store.commit(touched, new_rows, "app", 4)

    again = StateStore(spark, path, "w2")
    assert again.meta() == ("app", 4)
    assert sorted((r.msg_id, r.location) for r in again.pending()["g"]) == [
        ("m5", "dlq"),
        ("m6", "held"),
    ]
    assert [(r.msg_id, r.target) for r in state_rows(again.outs("app", 4))] == [("m5", "dlq")]
    assert again.redrives_applied() == {"redrive-1": {"s.dlq.0": {"0": 4}}}
    schema = spark.read.format("delta").load(path).schema
    assert [(f.name, f.dataType.simpleString()) for f in schema.fields] == OLD_COLUMNS


def test_executor_results_come_through_a_spark_job(spark):
    stats = TaskStats.of(
        RunCounts(delivered=2, attempts=3, failures=1),
        0.5,
        {"status_200": 2, "status_503": 1, "latency_sum_us": 1_234},
        records=4,
        routed=4,
        groups=2,
    )
    pending = state_row(
        Kind.PENDING,
        "g",
        Entry(m.Origin(0, 1, 2), "m2", "g", "rq", attempts=1, due_ms=5, reason="HTTP 503"),
    )
    rows = [pending, touched_row("g"), done_row("id-1", 7), stat_row(stats), stat_row(TaskStats())]

    def task(frames):  # an executor that yields these rows, as the batch's phases do
        for _ in frames:
            pass
        yield frame_of(rows, RESULT_COLUMNS)

    result = spark.range(1, numPartitions=1).mapInPandas(task, RESULT_SCHEMA).toPandas()
    assert list(result["kind"]) == ["pending", "touched", "done", "stat", "stat"]
    assert task_stats(result) == [stats, TaskStats()]
    assert delivered_ids(result) == [("id-1", 7)]
    assert state_rows(result)[0] == pending
