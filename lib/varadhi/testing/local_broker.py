"""A Kafka broker of a test's own (`scripts/kafka` on free ports, its data folder where the test
says), for tests that kill and restart a broker; the shared broker on 19092 is never touched.

`start` (again after `kill`: the broker restarts on its data), `kill` (SIGKILL, returns once
its port is closed), `wipe` (stop and delete the data; every test that starts one wipes it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from varadhi.testing.secure_kafka import free_port_pair

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "kafka"


class LocalBroker:
    """One single-node broker on free ports (the broker's, and its controller's on the next)."""

    def __init__(self, folder: Path):
        self.folder = folder
        # free ports, not fixed ones: other tests start brokers of their own in parallel workers
        self.port = free_port_pair(2)
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "VARADHI_KAFKA_PORT": str(self.port),
            "VARADHI_KAFKA_DIR": str(folder),
            "VARADHI_KAFKA_HEAP": "-Xmx256m -Xms64m",
        }

    def run(self, command: str) -> None:
        """`scripts/kafka COMMAND` for this broker; raises with the script's output on failure."""
        done = subprocess.run(
            [str(SCRIPT), command], env=self.env, capture_output=True, text=True, timeout=180
        )
        if done.returncode != 0:
            raise RuntimeError(f"scripts/kafka {command} failed:\n{done.stdout}{done.stderr}")

    def start(self) -> None:
        self.run("start")

    def wipe(self) -> None:
        self.run("wipe")

    def kill(self) -> None:
        """SIGKILL the broker; returns once its port no longer accepts (at its exit: at once)."""
        pid = int((self.folder / "broker.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while self.listening():
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {self.port} still accepts 60 s after SIGKILL to {pid}")
            time.sleep(0.1)

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False
