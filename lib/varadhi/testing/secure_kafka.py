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


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 when unknown)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair(span: int = 4) -> int:
    """A port P such that P .. P + span - 1 are free on 127.0.0.1 now (the broker, its
    controller, and the MTLS and OAUTH listeners `scripts/kafka` puts above them).

    P is drawn below the kernel's ephemeral range: a port in that range may be taken by any
    outgoing connection (Spark's, the broker clients') between this check and the broker's
    bind, and the broker then exits with "Address already in use".
    """
    high = min(max(ephemeral_low(), 21000), 32768) - span
    for _ in range(50):
        port = 20000 + int.from_bytes(os.urandom(2), "big") % (high - 20000)
        ok = True
        for p in range(port, port + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError(f"no {span} free ports in a row below {high + span}")


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
