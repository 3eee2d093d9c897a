"""The warehouse's file access (`varadhi.spark.warehouse_fs`) and the checkpoint logic on top of it
(`varadhi.spark.checkpoints`), on local folders shaped like Spark's checkpoints. No Spark: the
`HadoopFS` side runs against a real object store in tests/objectstore."""

from __future__ import annotations

import json

import pytest

from varadhi.core.errors import InvalidArgument
from varadhi.spark import checkpoints, warehouse_fs
from varadhi.spark.s3a import S3A_PROVIDER, hadoop_conf
from varadhi.spark.warehouse_fs import LocalFS, for_path


@pytest.fixture
def no_spark(monkeypatch):
    """No active Spark session in this process (earlier tiers of a full run leave one)."""
    monkeypatch.setattr(warehouse_fs, "_active_session", lambda: None)


def plan(cp, batch: int, offsets: dict, planned_ms: int = 1_000) -> None:
    (cp / "offsets").mkdir(parents=True, exist_ok=True)
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": planned_ms, "conf": {}}
    (cp / "offsets" / str(batch)).write_text(f"v1\n{json.dumps(meta)}\n{json.dumps(offsets)}\n")
    (cp / "offsets" / f".{batch}.crc").write_bytes(b"crc")


def commit(cp, batch: int) -> None:
    (cp / "commits").mkdir(parents=True, exist_ok=True)
    (cp / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_local_fs_lists_reads_and_deletes_paths_and_file_uris(tmp_path):
    fs = LocalFS()
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "f").write_text("héllo")
    uri = f"file://{tmp_path}/a"
    assert fs.list(str(tmp_path / "a")) == fs.list(uri) == ["b", "f"]
    assert fs.list(str(tmp_path / "missing")) == [] and fs.list(f"{uri}/f") == []
    assert fs.read_text(f"{uri}/f") == "héllo"
    with pytest.raises(FileNotFoundError):
        fs.read_text(str(tmp_path / "missing"))
    assert fs.exists(f"{uri}/b") and not fs.exists(f"{uri}/c")
    fs.delete(f"{uri}/f")
    fs.delete(str(tmp_path / "a"))
    fs.delete(str(tmp_path / "a"))  # gone already: nothing to do
    assert not (tmp_path / "a").exists()


def test_committed_offsets_are_the_newest_committed_plan(tmp_path):
    cp, fs = tmp_path / "cp", LocalFS()
    assert checkpoints.committed_offsets(str(cp), fs) is None  # no checkpoint yet
    plan(cp, 0, {"t.0": {"0": 3, "1": 4}})
    assert checkpoints.committed_offsets(str(cp), fs) is None  # planned, never committed
    commit(cp, 0)
    plan(cp, 1, {"t.0": {"0": 9, "1": 4}})
    assert checkpoints.committed_offsets(str(cp), fs) == {"t.0": {"0": 3, "1": 4}}
    for n in range(2, 11):  # numeric order, not text order ("10" < "9")
        plan(cp, n, {"t.0": {"0": 10 + n}})
        commit(cp, n)
    assert checkpoints.committed_offsets(f"file://{cp}", fs) == {"t.0": {"0": 20}}


def test_forget_planned_batch_only_removes_the_newest_uncommitted_plan(tmp_path):
    cp, fs = tmp_path / "cp", LocalFS()
    assert not checkpoints.forget_planned_batch(str(cp), 0, fs, 0)  # no checkpoint
    plan(cp, 0, {"t.0": {"0": 1}})
    commit(cp, 0)
    plan(cp, 1, {"t.0": {"0": 5}})
    assert not checkpoints.forget_planned_batch(str(cp), 0, fs, 0)  # committed
    assert not checkpoints.forget_planned_batch(str(cp), 2, fs, 0)  # not the newest plan
    assert checkpoints.forget_planned_batch(str(cp), 1, fs, 1_000)
    assert sorted(p.name for p in (cp / "offsets").iterdir()) == [".0.crc", "0"]
    assert checkpoints.uncommitted_batch(str(cp), fs) is None


def test_a_plan_an_earlier_run_left_is_never_forgotten(tmp_path):
    """A shard restarted after a crash in batch 1 refuses its re-run (it was paused as its
    query started), then runs a new query in the same process. Deleting that plan made the
    new query plan batch 1 afresh, with no re-run to read the crashed run's journal: what it
    had delivered was delivered again. Only a plan the refusing query made itself goes."""
    cp, fs = tmp_path / "cp", LocalFS()
    plan(cp, 0, {"t.0": {"0": 1}})
    commit(cp, 0)
    plan(cp, 1, {"t.0": {"0": 5}}, planned_ms=1_000)  # the crashed run's plan
    assert not checkpoints.forget_planned_batch(str(cp), 1, fs, planned_since_ms=5_000)
    assert checkpoints.uncommitted_batch(str(cp), fs) == (1, 1_000)  # re-run, journal read
    plan(cp, 1, {"t.0": {"0": 5}}, planned_ms=6_000)  # planned by the query that refused it
    assert checkpoints.forget_planned_batch(str(cp), 1, fs, planned_since_ms=5_000)


def test_await_commit_sees_the_commit_and_gives_up_when_the_query_stops(tmp_path):
    cp, fs = tmp_path / "cp", LocalFS()
    plan(cp, 0, {"t.0": {"0": 1}})
    assert not checkpoints.await_commit(str(cp), -1, lambda: True, fs)  # nothing completed
    assert not checkpoints.await_commit(str(cp), 0, lambda: False, fs)  # query stopped
    assert not checkpoints.await_commit(str(tmp_path / "gone"), 0, lambda: True, fs)
    commit(cp, 0)
    assert checkpoints.await_commit(str(cp), 0, lambda: True, fs)


def test_for_path_is_local_without_spark_and_refuses_a_remote_path_spark_cannot_reach(
    tmp_path, no_spark
):
    assert isinstance(for_path(str(tmp_path)), LocalFS)
    assert isinstance(for_path(f"file://{tmp_path}"), LocalFS)

    def no_session():
        raise RuntimeError("Java gateway process exited\nmore lines")

    for uri in ("s3a://bucket/wh", "abfss://c@acct.dfs.core.windows.net/wh", "dbfs:/wh"):
        with pytest.raises(InvalidArgument) as e:
            for_path(uri, no_session)
        assert str(e.value) == (
            f"warehouse: the warehouse {uri} is not a local path and Spark could not be started "
            "to reach it (Java gateway process exited)"
        )


def test_hadoop_conf_from_the_environment():
    assert hadoop_conf({}) == {}
    local = hadoop_conf(
        {
            "VARADHI_S3A_ENDPOINT": "http://127.0.0.1:8333",
            "VARADHI_S3A_ACCESS_KEY": "k",
            "VARADHI_S3A_SECRET_KEY": "s",
        }
    )
    assert local == {
        "fs.s3a.endpoint": "http://127.0.0.1:8333",
        "fs.s3a.endpoint.region": "us-east-1",
        "fs.s3a.path.style.access": "true",
        "fs.s3a.connection.ssl.enabled": "false",
        "fs.s3a.aws.credentials.provider": S3A_PROVIDER,
        "fs.s3a.access.key": "k",
        "fs.s3a.secret.key": "s",
    }
    tls = hadoop_conf(
        {
            "VARADHI_S3A_ENDPOINT": "https://s3.example.net",
            "VARADHI_S3A_PATH_STYLE": "false",
            "VARADHI_S3A_REGION": "eu-west-1",
        }
    )
    assert tls == {
        "fs.s3a.endpoint": "https://s3.example.net",
        "fs.s3a.endpoint.region": "eu-west-1",
        "fs.s3a.path.style.access": "false",
        "fs.s3a.connection.ssl.enabled": "true",
    }
    assert hadoop_conf({"VARADHI_S3A_REGION": "eu-west-1"}) == {
        "fs.s3a.endpoint.region": "eu-west-1"
    }
    with pytest.raises(InvalidArgument, match="set both VARADHI_S3A_ACCESS_KEY"):
        hadoop_conf({"VARADHI_S3A_ACCESS_KEY": "k"})


def test_the_warehouse_setting_keeps_uris_and_makes_local_paths_absolute(monkeypatch, tmp_path):
    from varadhi.kafka.settings import Settings

    monkeypatch.chdir(tmp_path)
    for uri in (
        "s3a://bucket/wh",
        "abfss://c@acct.dfs.core.windows.net/wh",
        "gs://bucket/wh",
        "dbfs:/varadhi/wh",
        "file:/data/wh",
        "hdfs:///varadhi/wh",
    ):
        monkeypatch.setenv("VARADHI_WAREHOUSE", uri)
        assert Settings.from_env().warehouse == uri
    for local, absolute in (
        ("/Volumes/main/varadhi/wh", "/Volumes/main/varadhi/wh"),
        ("rel/wh", str(tmp_path / "rel" / "wh")),
    ):
        monkeypatch.setenv("VARADHI_WAREHOUSE", local)
        assert Settings.from_env().warehouse == absolute


def test_check_writable_leaves_nothing_and_refuses_what_it_cannot_write(tmp_path):
    fs = warehouse_fs.LocalFS()
    warehouse = str(tmp_path / "wh")
    warehouse_fs.check_writable(fs, warehouse)
    assert fs.list(warehouse_fs.child(warehouse, "_varadhi")) == []
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(InvalidArgument) as refused:
        warehouse_fs.check_writable(fs, str(blocker / "wh"))
    assert "is not writable through the local file system" in str(refused.value)
    assert "\n" not in str(refused.value)
