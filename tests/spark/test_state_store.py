"""The GroupState table in Delta (`varadhi.spark.state_store`) with real Spark: a table written with
the schema of the version before the typed state schema (`varadhi.core.state_rows`) reads and takes
commits as before, and the executors' result columns (`state_rows.RESULT_SCHEMA`: typed
counters and a map of the endpoint's answers) come through a Spark job unchanged."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from varadhi.core import messages as m
from varadhi.core.group_state import Entry, RunCounts
from varadhi.core.state_frames import delivered_ids, frame_of, state_rows, task_stats
from varadhi.core.state_rows import (
    RESULT_COLUMNS,
    RESULT_SCHEMA,
    Kind,
    RedriveProgress,
    TaskStats,
    done_row,
    entry_of,
    stat_row,
    state_row,
    touched_row,
)
from varadhi.spark import state_store
from varadhi.spark.shard.commit import changes
from varadhi.spark.state_store import TABLE_PROPERTIES, StateStore, commit_stamp

pytestmark = pytest.mark.spark

# The GroupState schema as the version before varadhi.core.state_rows wrote it (batch.STATE_SCHEMA at
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
    assert (store.version, properties(spark, path)) == (0, {})
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
    # and a rate-capped re-drive's portion: its progress is committed with the batch
    progress = RedriveProgress({"s.dlq.0": {"0": 2}}, 1_000, 0.5)
    store.record_redrives({"redrive-2": {"s.dlq.0": {"0": 9}}}, {"redrive-2": progress})
    assert store.commit(touched, new_rows, "app", 4)

    again = StateStore(spark, path, "w2")
    assert again.meta() == ("app", 4)
    assert sorted((r.msg_id, r.location) for r in again.pending()["g"]) == [
        ("m5", "dlq"),
        ("m6", "held"),
    ]
    assert [(r.msg_id, r.target) for r in state_rows(again.outs("app", 4))] == [("m5", "dlq")]
    assert again.redrives_applied() == {"redrive-1": {"s.dlq.0": {"0": 4}}}
    assert again.redrives_in_progress() == {"redrive-2": ({"s.dlq.0": {"0": 9}}, progress)}
    schema = spark.read.format("delta").load(path).schema
    assert [(f.name, f.dataType.simpleString()) for f in schema.fields] == OLD_COLUMNS
    # The first commit gave the old table the state table's properties (one commit before
    # batch 4's); loading alone wrote nothing.
    assert properties(spark, path).items() >= TABLE_PROPERTIES.items()
    assert (store.version, again.version) == (2, 2)


def properties(spark, path: str) -> dict[str, str]:
    return spark.sql(f"DESCRIBE DETAIL delta.`{path}`").collect()[0]["properties"]


def pending_commit(store: StateStore, msg_id: str, batch_id: int, app_id: str = "app") -> bool:
    """Commit batch `batch_id` of `app_id`: group g's one pending message is `msg_id`."""
    entry = Entry(m.Origin(0, 0, batch_id), msg_id, "g", "rq", attempts=1, due_ms=5)
    result = frame_of([touched_row("g"), state_row(Kind.PENDING, "g", entry)], RESULT_COLUMNS)
    touched, new_rows = changes(result, app_id, batch_id)
    return store.commit(touched, new_rows, app_id, batch_id)


def test_a_commit_is_verified_from_the_delta_log_and_a_lost_one_reloads(spark, tmp_path):
    """A new table is created without column statistics; `commit` learns from the commit files
    after its copy's version whether its write won and is the latest: a write Delta skipped
    (another writer committed that batch) or another writer's later commit makes it return
    False with the copy reloaded as the table is."""
    path = str(tmp_path / "state")
    a = StateStore(spark, path, "a")
    assert a.version is None
    assert pending_commit(a, "m0", 0)
    assert a.version == 0
    assert properties(spark, path).items() >= TABLE_PROPERTIES.items()
    log = tmp_path / "state" / "_delta_log"
    assert commit_stamp((log / f"{0:020d}.json").read_text()) == "a/app/0"
    assert '"minValues"' not in (log / f"{0:020d}.json").read_text()  # no column statistics

    b = StateStore(spark, path, "b")  # another instance of the shard
    assert pending_commit(b, "m1-b", 1)
    # a's batch 1: Delta skips the write (txnVersion 1 is committed); a takes b's content.
    assert not pending_commit(a, "m1-a", 1)
    assert (a.version, a.meta()) == (1, ("app", 1))
    assert [r.msg_id for r in a.pending()["g"]] == ["m1-b"]
    assert pending_commit(a, "m2-a", 2)
    # b's copy is at version 1; its batch 3 is written after a's version 2 and is the latest.
    assert pending_commit(b, "m3-b", 3)
    assert (b.version, [r.msg_id for r in b.pending()["g"]]) == (3, ["m3-b"])
    # A commit after a's copy that is not a's own: a's write of the same batch id again is
    # skipped and a reloads (it does not take its own older commit, version 2, for the latest).
    assert not pending_commit(a, "m3-a", 3)
    assert (a.version, [r.msg_id for r in a.pending()["g"]]) == (3, ["m3-b"])
    reread = StateStore(spark, path, "c")
    assert (reread.version, reread.meta()) == (3, ("app", 3))


def test_a_state_table_writes_no_checkpoint_in_its_first_commits(spark, tmp_path):
    """A checkpoint costs its commit about a second (three Spark jobs) however small the table:
    a state table takes one every 100 commits, not Delta's 10, and still loads whole and
    current from its commit files alone."""
    path = str(tmp_path / "state")
    store = StateStore(spark, path, "a")
    for batch in range(12):
        assert pending_commit(store, f"m{batch}", batch)
    log = tmp_path / "state" / "_delta_log"
    assert not list(log.glob("*.checkpoint*.parquet"))
    reread = StateStore(spark, path, "b")
    assert (reread.version, reread.meta()) == (11, ("app", 11))
    assert [r.msg_id for r in reread.pending()["g"]] == ["m11"]


def test_a_state_table_is_vacuumed_as_its_versions_pass_a_multiple(spark, tmp_path, monkeypatch):
    """Every commit leaves the previous copy's files behind: the store vacuums the table when
    its version passes a multiple of `VACUUM_EVERY`, so the files left are about the latest
    copy's, and the table still loads whole (the vacuum's own commits are stepped over). Here
    removed files are deletable at once; a shard's tables keep them an hour."""
    monkeypatch.setattr(state_store, "VACUUM_EVERY", 4)
    path = str(tmp_path / "state")
    store = StateStore(spark, path, "a")
    assert pending_commit(store, "m0", 0)
    spark.sql(
        f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES "
        "('delta.deletedFileRetentionDuration' = 'interval 0 seconds')"
    )
    for batch in range(1, 10):
        assert pending_commit(store, f"m{batch}", batch)
    latest = {Path(f).name for f in spark.read.format("delta").load(path).inputFiles()}
    left = {f.name for f in (tmp_path / "state").glob("*.parquet")}
    assert latest <= left and len(left) <= 3 * len(latest)  # without a vacuum: 10 copies
    reread = StateStore(spark, path, "b")
    assert (reread.meta(), [r.msg_id for r in reread.pending()["g"]]) == (("app", 9), ["m9"])


def test_a_state_tables_log_keeps_two_days_not_thirty(spark, tmp_path):
    """Delta deletes log files older than the table's log retention (counted in whole days)
    that come before a checkpoint, when it writes a later one. A state table keeps two days:
    commit files three days old are gone after the next checkpoints (with Delta's default 30
    days they stay), and the table still loads whole and current. Checkpoints every 3 commits
    here; a shard's tables take one every 100."""
    path = str(tmp_path / "state")
    store = StateStore(spark, path, "a")
    assert pending_commit(store, "m0", 0)
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.checkpointInterval' = '3')")
    for batch in range(1, 5):
        assert pending_commit(store, f"m{batch}", batch)
    log = tmp_path / "state" / "_delta_log"
    assert list(log.glob("*.checkpoint.parquet"))
    three_days_ago = time.time() - 3 * 86_400
    for f in log.iterdir():
        if f.is_file():
            os.utime(f, (three_days_ago, three_days_ago))
    for batch in range(5, 12):
        assert pending_commit(store, f"m{batch}", batch)
    assert not (log / f"{0:020d}.json").exists()
    reread = StateStore(spark, path, "b")
    assert (reread.meta(), [r.msg_id for r in reread.pending()["g"]]) == (("app", 11), ["m11"])


def test_commit_stamp_reads_the_commit_info_line():
    info = '{"commitInfo":{"timestamp":1,"userMetadata":"w/app/7","operation":"WRITE"}}'
    assert commit_stamp('{"txn":{"appId":"app","version":7}}\n' + info + "\n") == "w/app/7"
    assert commit_stamp('{"commitInfo":{"timestamp":1}}') is None
    assert commit_stamp('{"add":{"path":"x"}}') is None


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
