"""A secured local broker for tests: `VARADHI_KAFKA_SECURE=1 scripts/kafka start` on free
loopback ports and its own folder, wiped afterwards.

`secured_broker(folder)` yields a `SecuredBroker`: its SASL_SSL bootstrap address, its folder,
its listeners (`SASL_SSL`, `MTLS`, `OAUTH` -> host:port, from `scripts/kafka listeners`) and
`client_config(user, mechanism)`, the path of the client properties file the script wrote
(`scripts/kafka client-config USER MECHANISM`). Starting takes ~10-20 s (a JVM, a throw-away CA,
SCRAM users, ACLs); share one broker per test module.

`add_users(users)` makes more SCRAM users (no ACL) and `allow({user: grants})` gives them
`varadhi.kafka.acls` grants (as `admin`, through Kafka's admin API: no JVM per call).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from varadhi.kafka import acls

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


def operation_key(operation: str) -> str:
    """kafka-python's `ACLOperation` member for Kafka's operation name: DescribeConfigs ->
    DESCRIBE_CONFIGS."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", operation).upper()


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
    def admin(self) -> Iterator[object]:
        """A kafka-python admin client as the super user `admin`."""
        from varadhi.kafka import clients, config
        from varadhi.kafka.settings import Settings

        settings = Settings(
            bootstrap=self.bootstrap, kafka=config.load(str(self.folder / "admin.properties"))
        )
        admin = clients.admin(settings)
        try:
            yield admin
        finally:
            admin.close()

    def add_users(self, users: Iterable[str]) -> dict[str, str]:
        """Make a SCRAM-SHA-512 user of each name (a new random password, kept in the broker's
        secrets folder) and write its client properties (alice's, with its name and password
        file): user -> their path. The users hold no ACL."""
        from kafka.admin import ScramMechanism, UserScramCredentialUpsertion

        users = list(users)
        passwords = {user: secrets.token_hex(12) for user in users}
        for user, password in passwords.items():
            (self.folder / "secrets" / f"{user}.password").write_text(password + "\n")
        with self.admin() as admin:
            failed = admin.alter_user_scram_credentials(
                [UserScramCredentialUpsertion(user, ScramMechanism.SCRAM_SHA_512, password)
                 for user, password in passwords.items()]
            )  # fmt: skip
        if any(failed.values()):
            raise RuntimeError(f"adding SCRAM users failed: {failed}")
        alice = Path(self.client_config("alice")).read_text()
        paths = {}
        for user in users:
            paths[user] = str(self.folder / f"{user}.properties")
            Path(paths[user]).write_text(
                alice.replace('username="alice"', f'username="{user}"').replace(
                    "/secrets/alice.password", f"/secrets/{user}.password"
                )
            )
        return paths

    def allow(self, grants: Mapping[str, Iterable[acls.Grant]]) -> None:
        """ALLOW each user (`grants`' keys) every grant of its bound `varadhi.kafka.acls.Grant`s,
        in one request."""
        from kafka.admin import (
            ACL,
            ACLOperation,
            ACLPermissionType,
            ACLResourcePatternType,
            ResourcePattern,
            ResourceType,
        )

        kinds = {
            acls.TOPIC: ResourceType.TOPIC,
            acls.TRANSACTIONAL_ID: ResourceType.TRANSACTIONAL_ID,
            acls.GROUP: ResourceType.GROUP,
        }
        patterns = {
            acls.LITERAL: ACLResourcePatternType.LITERAL,
            acls.PREFIXED: ACLResourcePatternType.PREFIXED,
        }
        wanted = [
            ACL(f"User:{user}", "*", ACLOperation[operation_key(op)], ACLPermissionType.ALLOW,
                ResourcePattern(kinds[g.resource], g.name, patterns[g.pattern]))
            for user, bound in grants.items()
            for g in bound
            for op in g.operations
        ]  # fmt: skip
        with self.admin() as admin:
            failed = admin.create_acls(wanted)["failed"]
        if failed:
            raise RuntimeError(f"adding ACLs failed: {failed}")


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
