"""Subscriptions on a real Spark standalone cluster (`scripts/spark-cluster`): every job is
`spark-submit.sh` with `VARADHI_SPARK_MASTER=spark://...`, so its tasks run in executor JVMs that
the cluster's worker started, with their own Python workers.

One subscription goes through the whole flow, in file order: a grouped shard with retries
through the RQ and a dead letter; a shard-count change 1 -> 2 whose feeders run as cluster jobs;
both new shards at once after a re-drive of the blocked group; a replay of everything. Where the
HTTP deliveries came from is checked from /proc while a shard and the replay run: every
connection to the endpoint is held by a Python worker under an executor JVM of the cluster's
worker, none by the driver (in local mode the same check fails: the workers are the driver's).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import pytest

from varadhi.cli import main as cli
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import change_shards_plan
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import END_IDLE_S

pytestmark = [pytest.mark.cluster, pytest.mark.kafka, pytest.mark.spark]

GROUPS = [f"g{i}" for i in range(6)]
RETRIED = "A-g1-0"  # 500 twice, then 200: retried through the RQ
FATAL = "A-g2-1"  # 404: dead-lettered; g2 waits behind it until a re-drive
BLOCKED = "g2"
LATENCY_MS = 200  # a group of 4 takes >= 0.8 s: its task holds a connection long enough to be seen


@dataclass
class Flow:
    name: str
    topic: str
    endpoint: TestEndpoint
    started_ms: int
    produced: list[tuple[str, str]] = field(default_factory=list)

    def produce(self, settings, phase: str, per_group: int) -> None:
        sent = [(g, f"{phase}-{g}-{n}") for n in range(per_group) for g in GROUPS]
        with Producer(self.topic, settings) as p:
            for group, msg_id in sent:
                p.send(f"body-{msg_id}".encode(), group_id=group, message_id=msg_id)
            p.flush()
        self.produced += sent

    def ids(self, group: str) -> list[str]:
        return [m for g, m in self.produced if g == group]


def first_successes(records) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in records:
        if r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            out.setdefault(r.group_id, []).append(r.message_id)
    return out


@pytest.fixture(scope="module")
def flow(catalog, settings):
    suffix = uuid.uuid4().hex[:8]
    with TestEndpoint(script={RETRIED: [500, 500], FATAL: [404]}, record_headers=True) as ep:
        topic = f"cl-{suffix}"
        TopicService(catalog).create(topic, 4)
        spec = parse_spec(
            {
                "name": f"cl-sub-{suffix}",
                "topic": topic,
                "endpoint": {"url": ep.url},
                "shards": 1,
                "retry": {
                    "max_attempts": 5,
                    "backoff": "fixed",
                    "min_backoff": "300ms",
                    "max_backoff": "300ms",
                    "jitter": 0,
                    "in_place_window": 0,  # retries through the RQ (which the change moves)
                },
                "consumption": {"trigger_interval": "200ms"},
            }
        )
        SubscriptionService(catalog).create(spec)
        ep.latency_ms = LATENCY_MS
        yield Flow(spec.name, topic, ep, int(time.time() * 1000) - 1000)


def test_a_grouped_shard_delivers_from_executors_with_retries_and_a_dead_letter(
    flow, catalog, settings, spark_cluster, submit, watch_connections, assert_on_executors
):
    flow.produce(settings, "A", 4)
    run = submit(flow.name, "0", "--stop-when-idle", str(END_IDLE_S))
    with watch_connections(flow.endpoint.port, {run.proc.pid, spark_cluster.worker_pid}) as seen:
        code = run.wait()
    assert code == 0, run.tail()
    assert_on_executors(seen.owners, run.proc.pid)

    done = first_successes(flow.endpoint.records())
    for group in GROUPS:
        expected = flow.ids(group) if group != BLOCKED else [f"A-{BLOCKED}-0"]
        assert done.get(group) == expected, group
    assert [r.status for r in flow.endpoint.records() if r.message_id == RETRIED] == [500, 500, 200]
    assert [r.status for r in flow.endpoint.records() if r.message_id == FATAL] == [404]
    assert [p["msg_id"] for p in dlq.list_parked(catalog, flow.name)] == [FATAL]
    # The executors' own logs are in the worker's work dir, and they ran this run's tasks.
    logs = spark_cluster.executor_logs()
    assert logs and any("Running task" in p.read_text(errors="replace") for p in logs)


def test_change_shards_with_feeders_on_the_cluster_then_a_replay(
    flow, catalog, settings, spark_cluster, submit, watch_connections, assert_on_executors, capsys
):
    flow.produce(settings, "B", 2)
    capsys.readouterr()
    args = ["subscription", "change-shards", flow.name, "--to", "2", "--feeders", "external"]
    assert cli([*args, "--output", "json"]) == 0
    op = json.loads(capsys.readouterr().out)
    sources = [f["source"] for f in op["feeders"]]
    assert sources == [f"{flow.name}.rq.0", f"{flow.name}.dlq.0"]

    # Both feeders at once, as Spark jobs on the cluster.
    feeders = [
        submit("--job", "feeder", "--subscription", flow.name, "--source", s) for s in sources
    ]
    for feeder in feeders:
        assert feeder.wait() == 0, feeder.tail()
    op = catalog.get(change_shards_plan.OPERATION, change_shards_plan.operation_name(flow.name))
    assert op["step"] == "done" and all(f["done"] for f in op["feeders"]), op
    parked = dlq.list_parked(catalog, flow.name)
    assert {(p["msg_id"], p["topic"]) for p in parked if p["topic"] == f"{flow.name}.dlq.1"} == {
        (FATAL, f"{flow.name}.dlq.1")
    }

    # Re-drive the blocked group; both new shards at once.
    dlq.request_unsideline(catalog, flow.name, dlq.Selector(group_ids=(BLOCKED,)))
    shards = [submit(flow.name, str(i), "--stop-when-idle", str(END_IDLE_S)) for i in range(2)]
    for shard in shards:
        assert shard.wait() == 0, shard.tail()
    done = first_successes(flow.endpoint.records())
    for group in GROUPS:
        assert done.get(group) == flow.ids(group), group

    # A replay of everything, delivered by executors.
    since = len(flow.endpoint.records())
    run = submit("--job", "replay", "--subscription", flow.name, "--from", str(flow.started_ms))
    with watch_connections(flow.endpoint.port, {run.proc.pid, spark_cluster.worker_pid}) as seen:
        code = run.wait()
    assert code == 0, run.tail()
    assert_on_executors(seen.owners, run.proc.pid)
    replayed = flow.endpoint.records(since)
    assert replayed and all(r.headers.get("X-Varadhi-Replay") for r in replayed)
    assert first_successes(replayed) == {g: flow.ids(g) for g in GROUPS}
