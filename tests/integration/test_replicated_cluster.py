"""A 3-broker KRaft cluster (`VARADHI_KAFKA_BROKERS=3 scripts/kafka`, started and wiped here):
topics with replication factor 3 and min.insync.replicas 2 from the cluster configuration, and a
grouped shard delivering a steady stream while one broker is SIGKILLed and restarted: nothing
lost, per-group order kept. The shard runs under a supervisor that starts it again if it exits,
as deployments do: when the killed node led the catalog partition (or the lease writer's
transaction coordinator), the lease may not be renewable within its TTL and the shard stops
itself (exit 3, "not renewed ... fenced") rather than risk running beside a standby.

Known: when the killed node led the main topic's partition, the shard's Spark Kafka source stalls
about 60 s (its AdminClient's listOffsets waits for a node assignment up to
default.api.timeout.ms) before it delivers again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from varadhi.core import messages as m
from varadhi.core.messages import H_TICK
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import config as kafka_config
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
PORT = int(os.environ.get("VARADHI_TEST_CLUSTER_PORT", "29892"))


GROUPS = 8


class Stream:
    """Produces `g<k>.<n>` messages round-robin over the groups, about `rate` a second."""

    def __init__(self, settings, topic: str, rate: float = 20.0):
        self.settings, self.topic, self.rate = settings, topic, rate
        self.sent_ms: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)

    def _run(self) -> None:
        n = 0
        with Producer(self.topic, self.settings) as producer:
            while not self._stop.is_set():
                g = f"g{n % GROUPS:02d}"
                msg_id = f"{g}.{n // GROUPS:04d}"
                producer.send(f"body of {msg_id}".encode(), group_id=g, message_id=msg_id)
                producer.flush(30)  # sent_ms: acknowledged by min.insync.replicas brokers
                with self._lock:
                    self.sent_ms[msg_id] = time.time() * 1000
                n += 1
                time.sleep(1 / self.rate)

    def ids_after(self, ms: float) -> set[str]:
        with self._lock:
            return {i for i, t in self.sent_ms.items() if t > ms}

    def all_ids(self) -> set[str]:
        with self._lock:
            return set(self.sent_ms)


def wait_for(what: str, check, timeout: float, shard) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{shard.tails()}")
        time.sleep(0.2)


def kafka(env: dict, *args: str) -> str:
    done = subprocess.run(
        [str(ROOT / "scripts/kafka"), *args], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr + done.stdout + log_tails(done.stderr + done.stdout)
    return done.stdout.strip()


def log_tails(message: str, lines: int = 40) -> str:
    """The last lines of the log files a failed `scripts/kafka` names: the cluster's folder is
    wiped at the end of the module, so they go into the failure's text."""
    out = []
    for path in re.findall(r"(/\S+\.log)\b", message):
        try:
            tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        out.append(f"\n--- {path} (last {lines} lines)\n" + "\n".join(tail))
    return "".join(out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster") / "kafka"
    env = {
        **os.environ,
        "VARADHI_KAFKA_PORT": str(PORT),
        "VARADHI_KAFKA_DIR": str(folder),
        "VARADHI_KAFKA_BROKERS": "3",
    }
    try:
        bootstrap = kafka(env, "start")
        assert kafka(env, "status") == f"running {bootstrap}"
        yield env, bootstrap
    finally:
        kafka(env, "wipe")


class Shard:
    """`spark-submit.sh NAME 0` under a supervisor that starts it again when it exits, as a
    deployment's restart policy does (Databricks task retries, EMR retries, systemd). A shard
    whose lease could not be renewed within its TTL while the catalog partition had no leader
    stops itself (exit 3): it cannot know that no standby took over. `restarts` counts them."""

    def __init__(self, env: dict, name: str, tmp: Path):
        self.log = tmp / "shard.log"
        self.env, self.name, self.tmp = env, name, tmp
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._start()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(ROOT / "spark-submit.sh"), self.name, "0"],
                env=self.env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _supervise(self) -> None:
        while not self._stopping.is_set():
            code = self.proc.wait()
            with self._lock:
                if self._stopping.is_set():
                    return
                with open(self.log, "ab") as out:
                    out.write(f"\n[supervisor] shard exited {code}; starting it again\n".encode())
                self.restarts += 1
                time.sleep(1)
                self._start()

    def tails(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        with self._lock:
            self._stopping.set()
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


def test_a_broker_killed_and_restarted_under_a_delivering_shard(cluster, tmp_path):
    env, bootstrap = cluster
    props = tmp_path / "cluster.properties"
    props.write_text(
        f"bootstrap.servers={bootstrap}\n"
        "varadhi.topic.replication.factor=3\n"
        "varadhi.topic.config.min.insync.replicas=2\n"
    )
    suffix = uuid.uuid4().hex[:8]
    settings = Settings(
        bootstrap=bootstrap,
        catalog_topic=f"__varadhi_catalog_rc_{suffix}",
        warehouse=str(tmp_path / "warehouse"),
        kafka=kafka_config.load(str(props), environ={}),
    )
    catalog = Catalog(settings)
    endpoint = TestEndpoint(fail_rate=0.05, seed=5, mix={"503": 1}, retry_after_s=0, latency_ms=20)
    endpoint.start()
    topic, name = f"rc-{suffix}", f"rcs-{suffix}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-replicated")
    stream = Stream(settings, topic)
    shard = None
    try:
        TopicService(catalog).create(topic, 4)
        spec = {
            "name": name,
            "topic": topic,
            "endpoint": {"url": endpoint.url},
            "shards": 1,
            "retry": {"max_attempts": 10, "min_backoff": "100ms", "max_backoff": "400ms"},
            "consumption": {"trigger_interval": "100ms"},
        }
        SubscriptionService(catalog).create(parse_spec(spec))

        # Every topic the product made: 3 replicas, min.insync.replicas 2.
        made = [f"{topic}.0", f"{name}.rq.0", f"{name}.dlq.0", settings.catalog_topic]
        for t in admin.describe_topics(made):
            assert {len(p["replica_nodes"]) for p in t["partitions"]} == {3}, t
        found = admin.describe_configs(
            [
                ConfigResource(ConfigResourceType.TOPIC, t, configs=["min.insync.replicas"])
                for t in made
            ]
        )["topic"]
        assert {found[t]["min.insync.replicas"]["value"] for t in made} == {"2"}

        shard_env = {
            **env,
            "VARADHI_BOOTSTRAP": bootstrap,
            "VARADHI_KAFKA_CONFIG": str(props),
            "VARADHI_CATALOG_TOPIC": settings.catalog_topic,
            "VARADHI_WAREHOUSE": settings.warehouse,
        }
        shard = Shard(shard_env, name, tmp_path)

        def delivered() -> set[str]:
            return {r.message_id for r in endpoint.records() if 200 <= r.status < 300}

        wait_for(
            "the shard's query",
            lambda: "reading {" in shard.log.read_text(errors="replace"),
            240,
            shard,
        )
        stream.start()
        wait_for("deliveries", lambda: len(delivered()) > 40, 180, shard)

        # SIGKILL the leader of the main topic's partition 0 mid-delivery, then restart it.
        leader = admin.describe_topics([f"{topic}.0"])[0]["partitions"]
        node = next(p["leader_id"] for p in leader if p["partition_index"] == 0)
        admin.close()
        killed_ms = time.time() * 1000
        kafka(env, "kill-node", str(node))
        # One generous deadline: with the killed node leading the catalog's or the transaction
        # state's partitions, a catalog write first times out (30 s) and is tried again (a CI
        # run missed 120 s so).
        wait_for(
            "deliveries with a broker down",
            lambda: delivered() & stream.ids_after(killed_ms + 1000),
            300,
            shard,
        )
        print(f"delivering again {time.time() - killed_ms / 1000:.1f} s after the kill")
        kafka(env, "start-node", str(node))
        restarted_ms = time.time() * 1000
        wait_for(
            "deliveries after the restart",
            lambda: delivered() & stream.ids_after(restarted_ms + 1000),
            300,
            shard,
        )
        stream.stop()
        produced = stream.all_ids()

        def dead_lettered() -> set[str]:
            return {
                r["headers"][m.H_MSG_ID]
                for r in read_queue(bootstrap, f"{name}.dlq.0")
                if H_TICK not in r["headers"]
            }

        wait_for("every message delivered", lambda: produced <= delivered(), 180, shard)
        print(f"shard restarts by the supervisor: {shard.restarts}")
    finally:
        stream.stop()
        if shard:
            shard.kill()
        endpoint.stop()
        catalog.close()

    firsts: dict[str, list[str]] = defaultdict(list)
    seen: set[str] = set()
    for r in sorted(endpoint.records(), key=lambda r: r.seq):
        if 200 <= r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            firsts[r.group_id].append(r.message_id)
    assert not produced - seen, sorted(produced - seen)[:20]
    assert not dead_lettered()
    for group, ids in firsts.items():
        assert ids == sorted(ids), f"{group} out of order: {ids}"
