"""Shard-count changes against the real broker, Delta and an HTTP endpoint: 2 -> 4 -> 3 shards
on a 12-partition topic with retries pending in the RQ and a dead-lettered group in the DLQ,
a producer producing between the steps, then a re-drive. Shards of one step run in threads of
this process on the session's SparkSession. An external feeder job is stopped by a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer

from varadhi.cli import main as cli
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq, subscriptions, topics
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import change_shards_plan
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import END_IDLE_S

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

GROUPS = [f"g{i}" for i in range(12)]
RETRYABLE = [500] * 4  # four failures at 1 s backoff: still pending when the shards stop
BLOCKED = "g5"


def produce(settings, topic: str, phase: str, per_group: int) -> list[tuple[str, str]]:
    sent = [(g, f"{phase}-{g}-{n}") for n in range(per_group) for g in GROUPS]
    with Producer(topic, settings) as p:
        for group, msg_id in sent:
            p.send(f"body-{msg_id}".encode(), group_id=group, message_id=msg_id)
        p.flush()
    return sent


class Shards:
    """Every shard of the subscription's current count, each `ShardJob.run()` in a thread."""

    def __init__(self, settings, spark, name: str, count: int, idle_s: float | None = None):
        self.jobs = [
            ShardJob(name, i, settings, spark=spark, stop_when_idle_s=idle_s) for i in range(count)
        ]
        self.codes: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(i, job), daemon=True)
            for i, job in enumerate(self.jobs)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, job: ShardJob) -> None:
        self.codes[i] = job.run()

    def stop(self) -> None:
        for job in self.jobs:
            job.request_stop()
        self.join()

    def join(self, timeout: float = 150) -> None:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a shard did not stop"
        assert self.codes == {i: 0 for i in range(len(self.jobs))}


def attempted(endpoint: TestEndpoint, *msg_ids: str) -> bool:
    seen = {r.message_id for r in endpoint.records()}
    return all(m in seen for m in msg_ids)


def wait(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.3)


def first_successes(endpoint: TestEndpoint) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in endpoint.records():
        if r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            out.setdefault(r.group_id, []).append(r.message_id)
    return out


def change(name: str, to: int, *extra: str) -> int:
    return cli(["subscription", "change-shards", name, "--to", str(to), "--output", "json", *extra])


def test_change_shards_two_four_three_keeps_group_order_and_loses_nothing(
    settings, spark, catalog, unique_name, capsys
):
    a_fail, a_fatal = ["A-g1-0", "A-g2-1", "A-g9-0"], "A-g5-1"
    d_fail = ["D-g7-0", "D-g8-1"]
    script = {m: RETRYABLE for m in a_fail} | {a_fatal: [404]}
    with TestEndpoint(script=script) as endpoint:
        topic = unique_name("reshard")
        TopicService(catalog).create(topic, 12)
        spec = parse_spec(
            {
                "name": unique_name("reshard-sub"),
                "topic": topic,
                "endpoint": {"url": endpoint.url},
                "shards": 2,
                "retry": {
                    "max_attempts": 10,
                    "backoff": "fixed",
                    "min_backoff": "1s",
                    "max_backoff": "1s",
                    "jitter": 0,
                    "in_place_window": 0,  # retries wait in the RQ, which is resharded
                },
                "consumption": {"trigger_interval": "100ms"},
            }
        )
        SubscriptionService(catalog).create(spec)
        name = spec.name
        produced = produce(settings, topic, "A", 3)

        # 2 shards: stop them while A's failures wait in the RQ and g5 is blocked on the DLQ.
        shards = Shards(settings, spark, name, 2)
        wait(lambda: attempted(endpoint, *a_fail, a_fatal, "A-g0-2"), 120)
        shards.stop()
        assert {p["msg_id"] for p in dlq.list_parked(catalog, name)} == {a_fatal}
        produced += produce(settings, topic, "B", 2)

        # The dry run changes nothing.
        capsys.readouterr()
        assert change(name, 4, "--dry-run") == 0
        plan = json.loads(capsys.readouterr().out)
        assert [f["source"] for f in plan["feeders"]] == [f"{name}.rq.0", f"{name}.dlq.0"]
        assert catalog.get("operation", change_shards_plan.operation_name(name)) is None

        assert change(name, 4) == 0
        op = json.loads(capsys.readouterr().out)
        assert op["step"] == "done" and all(f["done"] for f in op["feeders"])
        # A's retries and g5's dead letter and followers moved to the new shards' tables.
        assert op["state"]["pending"] >= 1 + 4 and op["state"]["groups"] >= 2
        assert op["feeders"][1]["records"] == 1  # the one dead letter
        sub = subscriptions.from_snapshot(catalog.snapshot(), name)
        assert (sub.shard_count, sub.rq_from, sub.dlq_from) == (4, 1, 1)
        rq = topics.from_snapshot(catalog.snapshot(), spec.rq_topic)
        assert [st.partitions for st in rq.storage_topics] == [4, 8] and rq.produce_pointer == 1
        produced += produce(settings, topic, "C", 2)
        Shards(settings, spark, name, 4, idle_s=END_IDLE_S).join()

        # 4 shards: new failures pending in the (new) RQ when they stop; a change is refused
        # while they run.
        for m in d_fail:
            endpoint.set_script(m, RETRYABLE)
        produced += produce(settings, topic, "D", 2)
        shards = Shards(settings, spark, name, 4)
        wait(lambda: attempted(endpoint, *d_fail, "D-g0-1"), 120)
        assert change(name, 3) == 2
        assert "still running" in capsys.readouterr().err
        shards.stop()
        produced += produce(settings, topic, "E", 1)

        assert change(name, 3) == 0
        op = json.loads(capsys.readouterr().out)
        assert (op["from"], op["to"], op["step"]) == (4, 3, "done")
        assert [f["source"] for f in op["feeders"]] == [f"{name}.rq.1", f"{name}.dlq.1"]
        assert subscriptions.from_snapshot(catalog.snapshot(), name).shard_count == 3
        Shards(settings, spark, name, 3, idle_s=END_IDLE_S).join()

        # g5 is still blocked behind its dead letter, which the feeders carried to dlq.2.
        done = first_successes(endpoint)
        assert done[BLOCKED] == [f"A-{BLOCKED}-0"]
        parked = dlq.list_parked(catalog, name)
        assert {(p["msg_id"], p["topic"]) for p in parked if p["topic"] == f"{name}.dlq.2"} == {
            (a_fatal, f"{name}.dlq.2")
        }

        dlq.request_unsideline(catalog, name, dlq.Selector(group_ids=(BLOCKED,)))
        Shards(settings, spark, name, 3, idle_s=END_IDLE_S).join()

        done = first_successes(endpoint)
        for group in GROUPS:
            assert done.get(group) == [m for g, m in produced if g == group], group
        assert {m for ids in done.values() for m in ids} == {m for _, m in produced}
        # The scripted failures really went through the RQ across the changes.
        for m in a_fail + d_fail:
            assert [r.status for r in endpoint.records() if r.message_id == m][:5] == [
                *RETRYABLE,
                200,
            ]


def test_a_signal_cancels_an_external_feeder_which_stays_to_run(
    settings, spark, catalog, unique_name, capsys, tmp_path
):
    """SIGTERM to the process group of `spark-submit.sh --job feeder` (the JVM and the Python
    driver) while it copies: the JVM does not go down under it; the copy is cancelled, the feeder
    stays not done (to run again), and the job exits 1 saying why."""
    topic = unique_name("feed-sig")
    TopicService(catalog).create(topic, 2)
    spec = parse_spec(
        {
            "name": unique_name("feed-sig-sub"),
            "topic": topic,
            "shards": 1,
            "endpoint": {"url": "http://127.0.0.1:9/unused"},
        }
    )
    SubscriptionService(catalog).create(spec)
    name = spec.name
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap, linger_ms=20)
    for i in range(100_000):  # a copy of some seconds: the signal comes in the middle of it
        producer.send(f"{name}.rq.0", key=f"g{i % 100}".encode(), value=b"v" * 100, partition=i % 2)
    producer.flush(60)
    producer.close()
    capsys.readouterr()
    assert change(name, 2, "--feeders", "external") == 0
    log = tmp_path / "feeder.log"
    root = Path(__file__).resolve().parents[2]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(root / "spark-submit.sh"), "--job", "feeder", "--subscription", name]
            + ["--source", f"{name}.rq.0"],
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The copy runs once Spark has started its Python workers (children of the JVM).
        workers = ["pgrep", "-P", str(proc.pid), "-f", "pyspark.daemon"]
        wait(
            lambda: (
                subprocess.run(workers, capture_output=True).returncode == 0
                or proc.poll() is not None
            ),
            240,
        )
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")[-3000:]
    assert code == 1, text
    assert "varadhi: interrupted by SIGTERM" in text and "Fatal Python error" not in text, text
    op = catalog.snapshot().get(
        change_shards_plan.OPERATION, change_shards_plan.operation_name(name)
    )
    assert [f["done"] for f in op["feeders"] if f["source"] == f"{name}.rq.0"] == [False]
