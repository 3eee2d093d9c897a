"""Failover without a person: lease expiry, a standby taking over, a zombie fenced.

Real shard processes (`./spark-submit.sh`, their own process groups) under a steady stream of
messages over several groups, with a short lease TTL (`VARADHI_LEASE_TTL_MS`):

1. A runs shard 0, B stands by (`--standby`); status lists B as a standby.
2. A is SIGKILLed in the middle of its deliveries: B takes the lease within TTL + a margin and
   delivers on, beginning with A's uncommitted batch.
3. C stands by; B is frozen (SIGSTOP: a process that looks dead and comes back). C takes over;
   B, resumed, is fenced (exit 3) without a GroupState commit after C took the lease, and the
   lease stays C's.
4. Production stops; once everything is delivered, C is SIGKILLed with no standby left: status
   shows the shard dead within TTL + a margin.

Over all of it: nothing lost, and per group, first successful deliveries in produce order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from varadhi.core import messages as m
from varadhi.core.messages import H_TICK
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import status
from varadhi.spark import layouts
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]
TTL_MS = 5_000
# A standby takes over within a TTL of the holder's last renewal, plus its polls (1 s), its
# catalog reads and a loaded two-core machine (status: plus this test's poll and read).
MARGIN_S = 6.0
GROUPS = 12
FENCED = 3


class Stream:
    """Produces `g<k>.<n>` messages round-robin over the groups, about `rate` a second."""

    def __init__(self, settings, topic: str, rate: float = 20.0):
        self.settings, self.topic, self.rate = settings, topic, rate
        self.produced: dict[str, list[str]] = defaultdict(list)
        self.sent_ms: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        n = 0
        with Producer(self.topic, self.settings) as producer:
            while not self._stop.is_set():
                g = f"g{n % GROUPS:02d}"
                msg_id = f"{g}.{n // GROUPS:04d}"
                producer.send(f"body of {msg_id}".encode(), group_id=g, message_id=msg_id)
                with self._lock:
                    self.produced[g].append(msg_id)
                    self.sent_ms[msg_id] = time.time() * 1000
                n += 1
                if n % 20 == 0:
                    producer.flush(30)
                time.sleep(1 / self.rate)
            producer.flush(30)

    def ids_after(self, ms: float) -> set[str]:
        with self._lock:
            return {i for i, t in self.sent_ms.items() if t > ms}

    def all_ids(self) -> set[str]:
        with self._lock:
            return set(self.sent_ms)


class Shards:
    """Shard-0 processes of one subscription, each in its own process group."""

    def __init__(self, settings, name: str, tmp: Path):
        self.settings, self.name, self.tmp = settings, name, tmp
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, *args: str) -> tuple[subprocess.Popen, Path]:
        env = {
            **os.environ,
            "VARADHI_BOOTSTRAP": self.settings.bootstrap,
            "VARADHI_CATALOG_TOPIC": self.settings.catalog_topic,
            "VARADHI_WAREHOUSE": self.settings.warehouse,
            "VARADHI_LEASE_TTL_MS": str(TTL_MS),
        }
        env.pop("VARADHI_CRASH_AT", None)
        log = self.tmp / f"shard-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(ROOT / "spark-submit.sh"), self.name, "0", *args],
                env=env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append((proc, log))
        return proc, log

    def tails(self, lines: int = 25) -> str:
        return "\n---\n".join(
            "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for _, log in self.procs
        )

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                    except ProcessLookupError:
                        pass
                proc.wait(30)


def signal_group(proc: subprocess.Popen, sig: signal.Signals) -> float:
    os.killpg(proc.pid, sig)
    return time.time() * 1000


def wait_for(what: str, check, timeout: float, shards: Shards):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{shards.tails()}")
        time.sleep(0.2)


def state_commits(state_path: str) -> list[tuple[str, int]]:
    """(writer instance, commit time ms) of every GroupState Delta commit."""
    out = []
    for f in sorted(Path(state_path, "_delta_log").glob("*.json")):
        for line in f.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info:
                out.append(((info.get("userMetadata") or "").split("/")[0], info["timestamp"]))
    return out


@pytest.fixture
def endpoint():
    ep = TestEndpoint(fail_rate=0.05, seed=11, mix={"503": 1}, retry_after_s=0, latency_ms=30)
    ep.start()
    yield ep
    ep.stop()


def test_a_standby_takes_over_a_killed_shard_and_the_old_instance_is_fenced(
    settings, catalog, endpoint, tmp_path, varadhi_cli
):
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"fo-{suffix}", f"fos-{suffix}"
    TopicService(catalog).create(topic, 4)
    SubscriptionService(catalog).create(
        parse_spec(
            {
                "name": name,
                "topic": topic,
                "endpoint": {"url": endpoint.url},
                "shards": 1,
                "retry": {"max_attempts": 8, "min_backoff": "100ms", "max_backoff": "400ms"},
                "consumption": {"trigger_interval": "100ms"},
            }
        )
    )
    owner = layouts.owner(name, 1, 0)
    shards = Shards(settings, name, tmp_path)
    stream = Stream(settings, topic)

    def lease() -> dict:
        return catalog.get("lease", owner) or {}

    def shard_status() -> dict:
        return status.collect(catalog, name)["shards"][0]

    def delivered() -> set[str]:
        return {r.message_id for r in endpoint.records() if 200 <= r.status < 300}

    try:
        # 1. A active, B standing by, under a steady stream.
        a, a_log = shards.start()
        wait_for("A's lease", lambda: lease().get("epoch") == 1, 120, shards)
        lease_a = lease()
        assert lease_a["ttl_ms"] == TTL_MS
        b, _ = shards.start("--standby")  # its Spark starts while A's does
        wait_for("A's query", lambda: "reading {" in a_log.read_text(errors="replace"), 180, shards)
        stream.start()
        wait_for("A's deliveries", lambda: len(delivered()) > 50, 180, shards)
        wait_for("B to stand by", lambda: shard_status()["standbys"], 180, shards)
        code, out, _ = varadhi_cli("status", name)
        assert code == 0 and " running " in out and "shard 0 standby " in out, out
        assert lease()["epoch"] == 1, "the standby took a lease that was being renewed"

        # 2. SIGKILL A in the middle of its deliveries: B takes over and delivers on.
        seen = len(endpoint.records())
        wait_for("a delivery in flight", lambda: len(endpoint.records()) > seen + 5, 120, shards)
        killed_ms = signal_group(a, signal.SIGKILL)
        a.wait(30)
        wait_for("B to take the lease", lambda: lease().get("epoch") == 2, 60, shards)
        lease_b = lease()
        # When B took it, by B's stamp (this machine's clock), not when this test's poll and
        # catalog read saw it: a loaded machine slows those by seconds.
        took_s = (lease_b["acquired_ms"] - killed_ms) / 1000
        print(f"B took over {took_s:.1f} s after A was killed")
        assert took_s <= TTL_MS / 1000 + MARGIN_S, took_s
        assert lease_b["instance"] != lease_a["instance"]
        c, _ = shards.start("--standby")  # for step 3, while B delivers
        after_kill = stream.ids_after(killed_ms + 1000)
        wait_for("B's deliveries", lambda: delivered() & after_kill, 120, shards)
        print(f"B delivered again {time.time() - killed_ms / 1000:.1f} s after the kill")

        # 3. C stands by; B freezes: C takes over; B, back, is fenced and writes nothing.
        wait_for("C to stand by", lambda: shard_status()["standbys"], 180, shards)
        frozen_ms = signal_group(b, signal.SIGSTOP)
        wait_for("C to take the lease", lambda: lease().get("epoch") == 3, 60, shards)
        lease_c = lease()
        took_s = (lease_c["acquired_ms"] - frozen_ms) / 1000  # C's stamp, as for B
        assert took_s <= TTL_MS / 1000 + MARGIN_S, took_s
        after_freeze = stream.ids_after(frozen_ms + 1000)
        wait_for("C's deliveries", lambda: delivered() & after_freeze, 120, shards)
        signal_group(b, signal.SIGCONT)
        try:
            assert b.wait(90) == FENCED, shards.tails()
        except subprocess.TimeoutExpired:
            pytest.fail(f"B did not stop after it came back:\n{shards.tails()}")
        b_log = shards.procs[1][1].read_text(errors="replace")
        assert "stopping without committing" in b_log, b_log[-3000:]
        assert lease()["instance"] == lease_c["instance"] and lease()["epoch"] == 3
        assert not lease().get("stopped_ms")

        # 4. Everything produced is delivered; C killed with no standby: status says dead.
        stream.stop()
        produced = stream.all_ids()

        def dead_lettered() -> set[str]:
            return {
                r["headers"][m.H_MSG_ID]
                for r in read_queue(settings.bootstrap, f"{name}.dlq.0")
                if H_TICK not in r["headers"]
            }

        wait_for(
            "every message delivered",
            lambda: produced <= delivered() | dead_lettered(),
            180,
            shards,
        )
        killed_ms = signal_group(c, signal.SIGKILL)
        c.wait(30)
        wait_for("status to show C dead", lambda: shard_status()["state"] == "dead", 60, shards)
        dead_s = time.time() - killed_ms / 1000
        assert dead_s <= TTL_MS / 1000 + MARGIN_S, dead_s
        code, out, _ = varadhi_cli("status", name)
        assert code == 0 and " dead " in out and "standby" not in out, out
    finally:
        stream.stop()
        shards.kill_all()

    # GroupState: each instance committed only while it held the lease.
    commits = state_commits(layouts.state_path(settings.warehouse, name, 1, 0))
    for writer, ms in commits:
        if writer == lease_a["instance"]:
            assert ms < lease_b["acquired_ms"], "A committed after B took the lease"
        elif writer == lease_b["instance"]:
            assert lease_b["acquired_ms"] <= ms < lease_c["acquired_ms"], (
                "B committed outside its lease"
            )
        else:
            assert writer == lease_c["instance"], f"a commit by an unknown writer {writer}"

    # Nothing lost; per group, first successful deliveries in produce order.
    firsts: dict[str, list[str]] = defaultdict(list)
    first_seen: set[str] = set()
    for r in sorted(endpoint.records(), key=lambda r: r.seq):
        if 200 <= r.status < 300 and r.message_id not in first_seen:
            first_seen.add(r.message_id)
            firsts[r.group_id].append(r.message_id)
    lost = produced - first_seen - dead_lettered()
    assert not lost, sorted(lost)[:20]
    for group, ids in firsts.items():
        assert ids == sorted(ids), f"{group} out of order: {ids}"
