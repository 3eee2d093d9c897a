"""The whole flow with the warehouse on `s3a://` (SeaweedFS on loopback), the real broker and a
real HTTP endpoint: grouped delivery with retries through the RQ and a dead letter, a
shard-count change with in-process feeders, a DLQ re-drive, offset resets of the DLQ, the RQ and
the main queue (the dry run from a separate `varadhi` process, which starts its own Spark to read
the checkpoints), a replay and status. Shards run in threads of this process on the run's
SparkSession. Every command reads the shards' positions from checkpoints on the store: if one read
the local disk instead, the new shards would start from the earliest offsets (re-delivering
everything) and the dry run would show no positions; the working directory stays empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace

import pytest

from varadhi.cli import main as cli_main
from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.core.state_frames import frame_of
from varadhi.core.state_rows import RESULT_COLUMNS, Kind, state_row, touched_row
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import topics
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import offsets
from varadhi.spark import warehouse_fs
from varadhi.spark.shard.commit import changes
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import END_IDLE_S, delivered, produce

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

GROUPS = ("g1", "g2")


@pytest.fixture
def cli(capsys):
    """cli(*args) -> (exit code, stdout, stderr) of `varadhi ARGS` in this process."""

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli_main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def run_shards(settings, spark, name: str, count: int) -> None:
    """Every shard of `name` in threads of this process until idle; each must exit 0."""
    codes: dict[int, int] = {}
    jobs = [
        ShardJob(name, i, settings, spark=spark, stop_when_idle_s=END_IDLE_S) for i in range(count)
    ]
    threads = [
        threading.Thread(target=lambda i=i, j=j: codes.__setitem__(i, j.run()), daemon=True)
        for i, j in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert codes == {i: 0 for i in range(count)}


def blocked(cli, name: str) -> int:
    code, out, err = cli("status", name, "--output", "json")
    assert code == 0, err
    return sum(s["blocked_groups"] for s in json.loads(out)["shards"])


def test_the_whole_flow_keeps_its_state_on_the_object_store(
    s3_settings, s3_catalog, s3_spark, cli, on_object_store
):
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"s3-t-{suffix}", f"s3-s-{suffix}"
    wh = s3_settings.warehouse
    TopicService(s3_catalog).create(topic, 2)
    script = {"g1-1": [503], "g2-1": [503, 404], "g3-0": [404]}
    with TestEndpoint(script=script) as endpoint:
        SubscriptionService(s3_catalog).create(parse_spec(_spec(name, topic, endpoint.url)))
        produce(s3_settings, topic, [(g, f"{g}-{i}") for i in range(3) for g in GROUPS])
        started_ms = int(time.time() * 1000) - 60_000

        # One shard: g1-1 retried through the RQ, g2-1 dead-lettered, g2 blocked behind it.
        run_shards(s3_settings, s3_spark, name, 1)
        assert delivered(endpoint, "g1") == ["g1-0", "g1-1", "g1-2"]
        assert [r.status for r in endpoint.records() if r.message_id == "g1-1"] == [503, 200]
        assert delivered(endpoint, "g2") == ["g2-0"]
        assert blocked(cli, name) == 1
        fs = warehouse_fs.HadoopFS(s3_spark)
        assert {"checkpoints", "state"} <= set(fs.list(f"{wh}/{name}"))
        assert fs.list(f"{wh}/{name}/checkpoints/g0/s1/shard-0/L0/commits")

        # 1 -> 2 shards: the feeders carry the dead letter to the new DLQ; the new shards start
        # where shard 0 stopped (read from its checkpoint on the store): nothing again.
        code, out, err = cli("subscription", "change-shards", name, "--to", "2", "--output", "json")
        assert code == 0, err
        op = json.loads(out)
        assert op["step"] == "done" and op["feeders"][1]["records"] == 1  # the dead letter
        produce(s3_settings, topic, [("g3", "g3-0"), ("g3", "g3-1")])
        code, _, err = cli("dlq", "unsideline", name, "--group-ids", "g2")
        assert code == 0, err
        run_shards(s3_settings, s3_spark, name, 2)
        assert delivered(endpoint, "g1") == ["g1-0", "g1-1", "g1-2"]
        assert delivered(endpoint, "g2") == ["g2-0", "g2-1", "g2-2"]
        assert delivered(endpoint, "g3") == [] and blocked(cli, name) == 1  # g3-0 is dead

        # Fast-forwarding the DLQ skips g3-0 and unblocks g3 (its GroupState, on the store, is
        # advanced); the RQ fast-forward has nothing pending and changes no delivery.
        for queue in ("dlq", "rq"):
            code, _, err = cli(
                "offsets", "reset", name, "--queue", queue, "--to-latest", "--execute"
            )
            assert code == 0, (queue, err)
        run_shards(s3_settings, s3_spark, name, 2)
        assert delivered(endpoint, "g3") == ["g3-1"] and blocked(cli, name) == 0

        # The dry run from a separate process (no Spark session of its own until it needs the
        # checkpoints): every main partition consumed to its end.
        dry = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "varadhi"), "offsets", "reset", name]
            + ["--queue", "main", "--shift-by", "-1", "--dry-run", "--output", "json"],
            capture_output=True,
            text=True,
            timeout=600,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        assert dry.returncode == 0, dry.stderr[-3000:]
        moves = json.loads(dry.stdout)["moves"]
        storage = topics.from_snapshot(s3_catalog.snapshot(), topic).storage_topics
        ends = offsets.kafka_offsets(s3_catalog, list(storage), None).end
        assert moves and all(m["current"] == ends[m["topic"]][m["partition"]] for m in moves)

        # Main back to the earliest: every message again, in group order.
        code, _, err = cli(
            "offsets", "reset", name, "--queue", "main", "--to-earliest", "--execute"
        )
        assert code == 0, err
        run_shards(s3_settings, s3_spark, name, 2)
        for g in GROUPS:
            assert delivered(endpoint, g) == [f"{g}-{i}" for i in range(3)] * 2
        assert delivered(endpoint, "g3") == ["g3-1", "g3-0", "g3-1"]

        code, out, err = cli("replay", name, "--from", str(started_ms), "--output", "json")
        assert code == 0, err
        for g in GROUPS:
            assert delivered(endpoint, g) == [f"{g}-{i}" for i in range(3)] * 3

        code, out, err = cli("status", name, "--output", "json")
        assert code == 0, err
        assert [s["shard"] for s in json.loads(out)["shards"]] == [0, 1]
        assert fs.list(f"{wh}/{name}/state/s2") == ["shard-0", "shard-1"]


def _spec(name: str, topic: str, url: str) -> dict:
    return {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "shards": 1,
        "retry": {
            "max_attempts": 3,
            "min_backoff": "100ms",
            "max_backoff": "200ms",
            "jitter": 0,
            "in_place_window": 0,
        },  # fmt: skip
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {"enabled": False},
    }


def test_a_state_table_on_the_store_is_vacuumed(s3_spark, s3_settings, monkeypatch):
    """`StateStore`'s vacuum (`VACUUM ... LITE`) deletes the removed copies' files on the store
    too (here removed files are deletable at once; a shard's tables keep them an hour)."""
    from varadhi.spark import state_store

    monkeypatch.setattr(state_store, "VACUUM_EVERY", 4)
    path = f"{s3_settings.warehouse}/vacuum-{uuid.uuid4().hex[:6]}/state"
    store = state_store.StateStore(s3_spark, path, "a")
    entry = Entry(m.Origin(0, 0, 0), "m0", "g", "rq", attempts=1, due_ms=5)

    def commit(batch: int) -> None:
        rows = [touched_row("g"), state_row(Kind.PENDING, "g", replace(entry, msg_id=f"m{batch}"))]
        touched, new_rows = changes(frame_of(rows, RESULT_COLUMNS), "app", batch)
        assert store.commit(touched, new_rows, "app", batch)

    commit(0)
    s3_spark.sql(
        f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES "
        "('delta.deletedFileRetentionDuration' = 'interval 0 seconds')"
    )
    for batch in range(1, 10):
        commit(batch)
    latest = {f.rsplit("/", 1)[-1] for f in s3_spark.read.format("delta").load(path).inputFiles()}
    left = {f for f in warehouse_fs.HadoopFS(s3_spark).list(path) if f.endswith(".parquet")}
    assert latest <= left and len(left) <= 3 * len(latest)  # without a vacuum: 10 copies
    again = state_store.StateStore(s3_spark, path, "b")
    assert [r.msg_id for r in again.pending()["g"]] == ["m9"]
