"""Fixtures of the cluster tier: a Spark standalone master and worker on loopback
(`scripts/spark-cluster`, started for the tier and stopped after it, on a folder of its own), jobs
run with `spark-submit.sh` and `VARADHI_SPARK_MASTER=spark://...`, and a way to tell which
process holds the HTTP connections to an endpoint (/proc), so that a test can show where
delivery ran.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300  # one spark-submit run, JVM start-up included, on a loaded 2-core machine


@dataclass(frozen=True)
class Cluster:
    """A running standalone cluster: its master URL, folder and the worker JVM's pid."""

    url: str
    folder: Path
    worker_pid: int

    def executor_logs(self) -> list[Path]:
        """Every executor's stderr (work/<app id>/<executor id>/stderr)."""
        return sorted((self.folder / "work").glob("app-*/*/stderr"))


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory) -> Cluster:
    folder = tmp_path_factory.mktemp("spark-cluster")
    env = {**os.environ, "VARADHI_SPARK_CLUSTER_DIR": str(folder)}
    script = str(ROOT / "scripts" / "spark-cluster")
    started = subprocess.run(
        [script, "start"], env=env, capture_output=True, text=True, timeout=300
    )
    assert started.returncode == 0, started.stderr
    url = started.stdout.strip().splitlines()[-1]
    try:
        assert url.startswith("spark://127.0.0.1:"), started.stdout
        yield Cluster(url, folder, int((folder / "worker.pid").read_text()))
    finally:
        subprocess.run([script, "stop"], env=env, timeout=120, check=False)


@pytest.fixture(scope="session")
def submit_env(spark_cluster, settings, tmp_path_factory) -> dict[str, str]:
    """The environment of a `spark-submit.sh` run on the cluster: this run's Kafka, catalog and
    warehouse, and a spark-defaults.conf that gives each application one core (1 GiB), so two
    applications (two shards, or two feeders) run at once on the 2-core worker."""
    conf = tmp_path_factory.mktemp("spark-conf")
    (conf / "spark-defaults.conf").write_text("spark.cores.max 1\nspark.executor.memory 1g\n")
    return {
        **os.environ,
        "VARADHI_SPARK_MASTER": spark_cluster.url,
        "VARADHI_BOOTSTRAP": settings.bootstrap,
        "VARADHI_CATALOG_TOPIC": settings.catalog_topic,
        "VARADHI_WAREHOUSE": settings.warehouse,
        "SPARK_CONF_DIR": str(conf),
    }


class Submitted:
    """`spark-submit.sh ARGS` in its own process group, output to a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(ROOT / "spark-submit.sh"), *args],
                env=env,
                cwd=log.parent,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            pytest.fail(f"{self.log.name} did not end within {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture
def submit(submit_env, tmp_path):
    """submit(*args) -> a started `spark-submit.sh` run on the cluster; stopped after the test."""
    runs: list[Submitted] = []

    def start(*args: str) -> Submitted:
        run = Submitted(list(args), submit_env, tmp_path / f"run-{len(runs)}.log")
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, 9)
            run.proc.wait()


# -- which process delivers ------------------------------------------------------------------


def _parent(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def ancestors(pid: int) -> list[int]:
    """pid's parent, grandparent, ... up to init."""
    out = []
    while (pid := _parent(pid)) not in (None, 0, 1):
        out.append(pid)
    return out


def _descendants(roots: set[int]) -> set[int]:
    parents = {int(p): _parent(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    tree, grew = set(roots), True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _connections_to(port: int) -> set[str]:
    """Socket inodes of established TCP connections whose remote port is `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


@dataclass(frozen=True)
class Owner:
    """A process seen holding a connection: pid, command line, and its ancestors (pid, command
    line), parent first, as they were when it was seen."""

    pid: int
    cmd: str
    chain: list[tuple[int, str]]


class ConnectionOwners:
    """While open, every 0.1 s: which processes (of the trees under `roots`) hold an established
    TCP connection to `port`. `owners` collects them (pid -> Owner)."""

    def __init__(self, port: int, roots: set[int]):
        self.port, self.roots = port, roots
        self.owners: dict[int, Owner] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _scan(self) -> None:
        inodes = _connections_to(self.port)
        if not inodes:
            return
        for pid in _descendants(self.roots):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        if pid not in self.owners:
                            chain = [(p, cmdline(p)) for p in ancestors(pid)]
                            self.owners[pid] = Owner(pid, cmdline(pid), chain)
                        break
                except OSError:
                    continue

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._scan()

    def __enter__(self) -> ConnectionOwners:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def assert_delivered_by_executors(owners: dict[int, Owner], cluster: Cluster, driver: int) -> None:
    """Every process seen holding a connection to the endpoint is a Spark Python worker whose
    ancestors include an executor JVM started by the cluster's worker, and not the driver."""
    assert owners, "no process was seen holding a connection to the endpoint"
    for owner in owners.values():
        assert "pyspark.daemon" in owner.cmd or "pyspark.worker" in owner.cmd, owner
        pids = [p for p, _ in owner.chain]
        assert driver not in pids, f"the driver's process delivered: {owner}"
        executor = next(
            (i for i, (_, cmd) in enumerate(owner.chain) if "CoarseGrainedExecutorBackend" in cmd),
            None,
        )
        assert executor is not None, f"no executor JVM above {owner}"
        assert pids[executor + 1] == cluster.worker_pid, f"not the cluster's executor: {owner}"


@pytest.fixture
def watch_connections():
    """watch_connections(port, roots) -> a `ConnectionOwners` (a context manager)."""
    return ConnectionOwners


@pytest.fixture
def assert_on_executors(spark_cluster):
    """assert_on_executors(owners, driver_pid): see `assert_delivered_by_executors`."""

    def check(owners: dict[int, Owner], driver: int) -> None:
        assert_delivered_by_executors(owners, spark_cluster, driver)

    return check
