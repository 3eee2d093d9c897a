"""A secured local broker for tests: `VARADHI_KAFKA_SECURE=1 scripts/kafka start` on free
loopback ports and its own folder, wiped afterwards.

`secured_broker(folder)` yields a `SecuredBroker`: its SASL_SSL bootstrap address, its folder,
its listeners (`SASL_SSL`, `MTLS`, `OAUTH` -> host:port, from `scripts/kafka listeners`) and
`client_config(user, mechanism)`, the path of the client properties file the script wrote
(`scripts/kafka client-config USER MECHANISM`). Starting takes ~10-20 s (a JVM, a throw-away CA,
SCRAM users, ACLs); share one broker per test module.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "kafka"


def free_port_pair() -> int:
    """A port P such that P and P + 1 are free on 127.0.0.1 now (the broker and controller)."""
    for _ in range(50):
        port = 30000 + int.from_bytes(os.urandom(2), "big") % 20000
        ok = True
        for p in (port, port + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no two free ports")


@dataclass(frozen=True)
class SecuredBroker:
    bootstrap: str
    folder: Path
    env: dict[str, str] = field(repr=False)
    listeners: dict[str, str] = field(default_factory=dict)

    def script(self, *args: str) -> str:
        """Run scripts/kafka ARGS for this broker; its stdout (raises when it fails)."""
        done = subprocess.run(
            [str(SCRIPT), *args], env=self.env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"scripts/kafka {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout.strip()

    def client_config(self, user: str = "alice", mechanism: str = "scram-sha-512") -> str:
        return self.script("client-config", user, mechanism)


@contextlib.contextmanager
def secured_broker(folder: Path, heap: str = "-Xmx512m -Xms128m") -> Iterator[SecuredBroker]:
    env = {
        **os.environ,
        "VARADHI_KAFKA_PORT": str(free_port_pair()),
        "VARADHI_KAFKA_DIR": str(folder),
        "VARADHI_KAFKA_SECURE": "1",
        "VARADHI_KAFKA_HEAP": heap,
    }
    broker = SecuredBroker("", folder, env)
    try:
        bootstrap = broker.script("start")
        listeners = dict(line.split(" ", 1) for line in broker.script("listeners").splitlines())
        yield SecuredBroker(bootstrap, folder, env, listeners)
    finally:
        subprocess.run([str(SCRIPT), "wipe"], env=env, capture_output=True, text=True)
