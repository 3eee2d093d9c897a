"""A broker away for longer than the lease TTL stops delivery, not the shards (issue: a single
broker SIGKILLed and back 15 s later ended both shards with exit 3, "fenced ... current epoch -1",
though nobody could have taken a lease that lives in the unreachable Kafka).

Real shard processes (`./spark-submit.sh`, two shards of one subscription) on a broker of the
test's own (`varadhi.testing.local_broker`), with a short lease TTL. The broker is SIGKILLed in the
middle of the deliveries and kept away for twice the TTL; each shard sees its lease expire and
delivers nothing until Kafka answers and its lease is still its own, then goes on by itself.
Nothing is lost, per group the first successful deliveries keep the produce order, and both
shards stop cleanly (exit 0) when asked at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark import layouts
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.local_broker import LocalBroker

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
TTL_MS = 5_000
GROUPS = 8
EXPIRED = "delivering nothing until the lease is renewed"


def produce(settings: Settings, topic: str, start: int, count: int) -> list[str]:
    ids = []
    with Producer(topic, settings) as producer:
        for n in range(start, start + count):
            g = f"g{n % GROUPS}"
            msg_id = f"{g}.{n // GROUPS:04d}"
            producer.send(f"body of {msg_id}".encode(), group_id=g, message_id=msg_id)
            ids.append(msg_id)
        producer.flush(60)
    return ids


def start_shard(settings: Settings, name: str, shard: int, tmp: Path):
    env = {
        **os.environ,
        "VARADHI_BOOTSTRAP": settings.bootstrap,
        "VARADHI_CATALOG_TOPIC": settings.catalog_topic,
        "VARADHI_WAREHOUSE": settings.warehouse,
        "VARADHI_LEASE_TTL_MS": str(TTL_MS),
    }
    env.pop("VARADHI_CRASH_AT", None)
    log = tmp / f"shard-{shard}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(ROOT / "spark-submit.sh"), name, str(shard)],
            env=env,
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, log


def test_shards_ride_out_a_broker_away_for_twice_the_lease_ttl(tmp_path):
    broker = LocalBroker(tmp_path / "kafka")
    broker.start()
    settings = Settings(bootstrap=broker.bootstrap, warehouse=str(tmp_path / "warehouse"))
    endpoint = TestEndpoint(latency_ms=20)
    endpoint.start()
    procs: list[tuple[subprocess.Popen, Path]] = []

    def tails() -> str:
        return "\n---\n".join(
            "\n".join(log.read_text(errors="replace").splitlines()[-30:]) for _, log in procs
        )

    def why(log: Path) -> str:
        """The last warnings and errors of a shard's log, before its batch lines (a CI log
        shows the start of a failure's message)."""
        lines = log.read_text(errors="replace").splitlines()
        marks = ("WARNING varadhi", "ERROR varadhi", "Error", "Exception", "failed", "exit")
        return "\n".join([line for line in lines if any(m in line for m in marks)][-25:])

    def wait_for(what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            for shard, (proc, log) in enumerate(procs):
                if proc.poll() is not None:
                    pytest.fail(f"shard {shard} exited {proc.returncode}:\n{why(log)}\n{tails()}")
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{tails()}")
            time.sleep(0.2)

    def logged(text: str) -> bool:
        return all(text in log.read_text(errors="replace") for _, log in procs)

    def delivered() -> set[str]:
        return {r.message_id for r in endpoint.records() if 200 <= r.status < 300}

    suffix = uuid.uuid4().hex[:8]
    topic, name = f"out-{suffix}", f"outs-{suffix}"
    catalog = Catalog(settings)
    try:
        TopicService(catalog).create(topic, 4)
        spec = {
            "name": name,
            "topic": topic,
            "endpoint": {"url": endpoint.url},
            "shards": 2,
            "consumption": {"trigger_interval": "100ms", "max_messages_per_batch": 20},
        }
        SubscriptionService(catalog).create(parse_spec(spec))
        procs.extend(start_shard(settings, name, shard, tmp_path) for shard in (0, 1))
        wait_for("both queries", lambda: logged("reading {"), 240)
        produced = produce(settings, topic, 0, 400)
        wait_for("deliveries under way", lambda: len(delivered()) >= 40, 180)

        # The broker dies in the middle of the deliveries and stays away for twice the TTL
        # (the outage's length is the scenario).
        broker.kill()
        time.sleep(2 * TTL_MS / 1000)
        broker.start()
        produced += produce(settings, topic, 400, 200)
        wait_for("every message delivered", lambda: set(produced) <= delivered(), 600)
        expired = [shard for shard, (_, log) in enumerate(procs) if EXPIRED in log.read_text()]
        print(f"shards that saw their lease expire and waited for it: {expired}")
        for shard in (0, 1):
            lease = catalog.get("lease", layouts.owner(name, 2, shard))
            assert lease["epoch"] == 1, lease  # never taken over: the same instance went on
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        codes = []
        for proc, _ in procs:
            try:
                codes.append(proc.wait(120))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                codes.append(proc.wait(30))
        catalog.close()
        endpoint.stop()
        broker.wipe()
    assert codes == [0, 0], tails()

    # Per group, first successful deliveries in produce order (at-least-once: repeats of what
    # was in flight at the kill are allowed).
    firsts: dict[str, list[str]] = defaultdict(list)
    seen: set[str] = set()
    for r in sorted(endpoint.records(), key=lambda r: r.seq):
        if 200 <= r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            firsts[r.group_id].append(r.message_id)
    for group, ids in firsts.items():
        assert ids == sorted(ids), f"{group} out of order: {ids}"
