"""`scripts/kafka` for real, on brokers of its own (ports 29392 and 29394, data folders in tmp; the
shared broker on 19092 is never touched): a start after a crash restarts the broker on its data,
`stop` keeps the data, `wipe` deletes it, and two ports are two brokers side by side, each with
its own data folder and pid file. Every broker the test starts is wiped at the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from varadhi.testing.harness import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kafka"
PORTS = (29392, 29394)  # each broker's controller listens on the next port


class Broker:
    """`scripts/kafka` with its own port and data folder."""

    def __init__(self, port: int, folder: Path):
        self.port, self.dir = port, folder
        self.bootstrap = f"127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "VARADHI_KAFKA_PORT": str(port),
            "VARADHI_KAFKA_DIR": str(folder),
            "VARADHI_KAFKA_HEAP": "-Xmx256m -Xms64m",
            # a narrow terminal (xdist's workers have COLUMNS=80) must not cut the broker's
            # command line short where the script looks for its data folder in it
            "COLUMNS": "40",
        }

    def run(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(SCRIPT), command], env=self.env, capture_output=True, text=True, timeout=120
        )

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def _admin(self) -> KafkaAdminClient:
        return KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10_000)

    def create_topic(self, name: str) -> None:
        admin = self._admin()
        try:
            admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
        finally:
            admin.close()

    def has_topic(self, name: str) -> bool:
        admin = self._admin()
        try:
            return name in admin.list_topics()
        finally:
            admin.close()


@pytest.fixture
def brokers(tmp_path):
    made = [Broker(port, tmp_path / f"kafka-{port}") for port in PORTS]
    for b in made:
        for port in (b.port, b.port + 1):
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} is taken"
    yield made
    for b in made:
        b.run("wipe")


def test_a_crash_keeps_the_data_stop_keeps_it_and_wipe_deletes_it(brokers):
    a, b = brokers
    for broker in brokers:
        started = broker.run("start")
        assert (started.returncode, started.stdout.strip()) == (0, broker.bootstrap), started
    pids = {int((x.dir / "broker.pid").read_text()) for x in brokers}
    assert len(pids) == 2  # side by side: a broker, a pid file and a data folder each
    a.create_topic("kept")
    b.create_topic("only-b")
    wait_for(lambda: a.has_topic("kept") and b.has_topic("only-b"), 120, "the new topics")
    assert not b.has_topic("kept")

    # A crash: the broker's JVM dies, its pid file stays behind.
    os.kill(int((a.dir / "broker.pid").read_text()), signal.SIGKILL)
    wait_for(lambda: not a.listening(), 120, "the killed broker to close its port")
    status = a.run("status")
    assert (status.returncode, status.stdout.strip()) == (1, "stopped")
    assert b.run("status").stdout.strip() == f"running {b.bootstrap}"

    restarted = a.run("start")
    assert (restarted.returncode, restarted.stdout.strip()) == (0, a.bootstrap), restarted
    wait_for(lambda: a.has_topic("kept"), 120, "the topic back after the restart")

    stopped = a.run("stop")
    assert stopped.returncode == 0 and not a.listening()
    assert (a.dir / "data" / "meta.properties").is_file()  # the data stays
    assert a.run("status").returncode == 1

    wiped = a.run("wipe")
    assert wiped.returncode == 0 and not a.dir.exists(), wiped
    assert b.run("status").stdout.strip() == f"running {b.bootstrap}"  # the other one carries on


def test_the_default_data_folder_is_per_port():
    env = {k: v for k, v in os.environ.items() if k != "VARADHI_KAFKA_DIR"}
    folders = {
        subprocess.run(
            [str(SCRIPT), "dir"],
            env={**env, "VARADHI_KAFKA_PORT": str(port)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for port in PORTS
    }
    root = SCRIPT.parents[1]
    assert folders == {str(root / ".varadhi" / f"kafka-{port}") for port in PORTS}


def test_a_broker_that_cannot_start_says_why(tmp_path):
    """A start whose JVM exits (here: its controller port is taken) ends with exit 1 and the
    broker's own error lines, so that a CI log shows the cause without the data folder."""
    port = PORTS[0] + 4
    broker = Broker(port, tmp_path / "kafka-blocked")
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port + 1))
        blocker.listen()
        try:
            started = broker.run("start")
        finally:
            broker.run("wipe")
    assert started.returncode == 1, started
    assert "the broker exited" in started.stderr
    assert "Address already in use" in started.stderr, started.stderr
