"""Delivery throughput and end-to-end latency of subscription shards, against nginx on loopback.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/delivery.py [--messages 200000] [--groups 10000] [--only ...]

Needs: the local Kafka broker (`scripts/kafka start`), the Spark jars (`scripts/setup`), Debian's
nginx (`apt-get install nginx-light`: the endpoint of every run; without it the bench says so and
stops), wrk (`apt-get install wrk`: the endpoint's ceiling; skipped with a message if missing)
and, for the peer rows, a JDK 17 and Maven (`apt-get install openjdk-17-jdk-headless maven`: the
peer is built on first use by bench/peers/parallel-consumer/build, its dependencies from Maven
Central; skipped with a message if missing). Everything listens on 127.0.0.1 only. The bench
uses its own catalog topic, warehouse and topics, deletes them at the end (`--keep` keeps them),
and stops every process it starts (nginx, spark-submit, java). About 15 minutes on 2 cores.

What runs, in this order (`--only` picks some):

| run          | what                                                                          |
|--------------|-------------------------------------------------------------------------------|
| `ceiling`    | wrk (one thread, 64 connections, 1 KiB POST) against the same nginx config     |
| `baseline`   | a hand-written kafka-python consumer (consumer group, manual commit after each |
|              | poll batch), per-key order with `HttpDeliverer` (one Stream per key), no retry  |
| `peer`       | what users pick instead: Confluent Parallel Consumer with its Vert.x client    |
|              | (bench/peers/parallel-consumer), key order, 64 in flight, retry after 1 s, 0%  |
|              | and 10% failures, stopping once drained (as `--stop-when-idle`)                |
| `library`    | the library runtime (`varadhi-consumer SUB`, docs/library.md): 1 and 2 member  |
|              | processes (`--library-members`) of a fresh `runtime: library` subscription,     |
|              | `--max-in-flight` per process, 0% and 10% failures, each stopped (SIGTERM) once  |
|              | its consumer group committed everything of the main topic and the RQ            |
| `shard`      | `./spark-submit.sh SUB i --stop-when-idle` for 1 and 2 shards (two processes),  |
|              | grouped (10,000 groups) and ungrouped, 0% and 10% failures, draining a backlog  |
| `latency`    | 1 shard, trigger 100 ms, concurrency 1, warmed up, then a producer pacing       |
|              | 1,000 msg/s for 10 s (not measured) + 60 s (measured)                           |
| `library-latency` | one library member process, warmed up, then the latency run's paced load  |
| `crash`      | 1 shard, grouped, drains the backlog while SIGKILLed `--kills` times at random  |
|              | moments (one run per `--crash-seeds` value) and restarted: duplicate deliveries |

The backlog (`--messages` values of 1 KiB, over `--groups` group ids) is produced once with the
varadhi producer and read by every run (baseline and peer in consumer groups of their own); each
shard run is a fresh subscription on the same main topic (ungrouped = `grouped: false`, which
ignores the group id). `--journal-intervals` runs the shard and crash runs once per
`consumption.journal_interval` (0: no delivery journal), `--repeat` the shard runs several times,
interleaved. A different `--fail-messages` gives the runs with failures a backlog of their own. The
nginx endpoint answers 204; for the 10% runs, `split_clients` on (message id, attempt) answers 500
for 5% and 503 (no Retry-After) for 5% of requests, so every attempt fails independently with 10%
probability and the same messages fail in every run. Retries use the default policy: backoff 1 s,
exponential, 20% jitter, and `retry.in_place_window` 2 s (a retry due that soon after the first
failure waits in the delivery task, later ones go through the RQ); `--in-place-windows 2000 0` adds
runs with every retry through the RQ, `--in-place-lingers 2000 0` adds runs where a task does
not wait past its other deliveries for its retries (`retry.in_place_linger`; default the
policy's, 2 s). `retry.max_attempts` is raised to 10 so that no message is
dead-lettered by bad luck (10%^10).

Measurements come from nginx's access log (`$msec`, status, `X-Varadhi-Produced-At`, message id
and attempt of every request), so shard and baseline are measured the same way:

- `overall`: messages / (last successful delivery - process start): what draining a backlog from
  a cold start costs, JVM start-up and first micro-batch included;
- `delivering`: messages / (last - first successful delivery);
- `steady`: 80% of the messages / (time of the 90th - time of the 10th percent delivered);
- `cycle` (shards): the later batches' records over the time between their log lines;
- CPU per message in the steady window, per process kind (JVM, Python workers, other Python),
  sampled from /proc: on a shared machine it moves much less than the rates;
- latency: nginx's `$msec` - the producer's `varadhi-produced-ms`, per successful delivery;
- ratios: every row's steady rate over the same consumer's without failures, the best baseline's,
  the peer's at the same failure rate and the ceiling's.

The shards' per-batch log lines (records, seconds, counters) are kept in the results for
diagnosis. Two cores are shared by Kafka, nginx, the Spark JVM(s), their Python workers and
this script; two shards are two JVMs on the same two cores.

Results: a table on stdout, JSON in bench/results/delivery.json.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient
from kafka.errors import KafkaError
from kafka.record import util as record_util

from common import machine, nginx_binary, stop_process, write_results
from http_engine import _free_port, _wait_listening, run_wrk
from varadhi.core import messages as m
from varadhi.core.delivery import HttpDeliverer, Outcome, Request
from varadhi.core.policies import ConsumptionPolicy, Endpoint, RetryPolicy
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService, end_offsets
from varadhi.library.runtime import group_id
from varadhi.ops import status

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "delivery.json"
RUNS = ("ceiling", "baseline", "peer", "library", "shard", "latency", "library-latency", "crash")
PEER_DIR = ROOT / "bench" / "peers" / "parallel-consumer"
DEFAULT_IN_PLACE_MS = RetryPolicy().in_place_window_ms
DEFAULT_LINGER_MS = RetryPolicy().in_place_linger_ms
DEFAULT_JOURNAL_MS = ConsumptionPolicy().journal_interval_ms

# -- the endpoint ------------------------------------------------------------------------------

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format delivery '$msec $status $http_x_varadhi_produced_at $http_x_varadhi_message_id '
                        '$http_x_varadhi_attempt';
    access_log {tmp}/access.log delivery buffer=1m flush=1s;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
    split_clients "${{http_x_varadhi_message_id}}/${{http_x_varadhi_attempt}}" $bench_answer {{
{split}
        * 204;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            if ($bench_answer = 500) {{ return 500; }}
            if ($bench_answer = 503) {{ return 503; }}
            return 204;
        }}
    }}
}}
"""


@dataclass
class Nginx:
    url: str
    log: Path
    proc: subprocess.Popen

    def hits(self, keep_in: Path | None = None, name: str = "") -> list[Hit]:
        """Stop nginx (it flushes its buffered access log on exit) and read the log; with
        `keep_in`, copy the log there first."""
        if self.proc.poll() is None:
            stop_process(self.proc)
        if keep_in is not None:
            shutil.copy(self.log, keep_in / f"{name}-access.log")
        return read_log(self.log)


@contextmanager
def nginx(binary: str, fail_rate: float = 0.0) -> Iterator[Nginx]:
    """nginx answering 204, or 500/503 for `fail_rate` of the (message id, attempt) pairs,
    logging every request to its access log. Stopped (and its files deleted) on exit."""
    half = round(fail_rate * 100 / 2, 2)
    split = f"        {half}% 500;\n        {half}% 503;" if fail_rate > 0 else ""
    with tempfile.TemporaryDirectory(prefix="varadhi-bench-delivery-nginx-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, split=split))
        proc = subprocess.Popen(
            [binary, "-p", tmp, "-e", f"{tmp}/error.log", "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_listening(port, proc, "nginx")
            yield Nginx(f"http://127.0.0.1:{port}/", Path(tmp) / "access.log", proc)
        finally:
            if proc.poll() is None:
                stop_process(proc)


@dataclass
class Hit:
    ms: float  # when nginx logged the request (its answer), ms since the epoch
    status: int
    produced_ms: int | None
    msg_id: str
    attempt: int | None


def read_log(path: Path) -> list[Hit]:
    hits = []
    with open(path) as f:
        for line in f:
            msec, status, produced, msg_id, attempt = line.split()
            hits.append(
                Hit(
                    float(msec) * 1000,
                    int(status),
                    int(produced) if produced != "-" else None,
                    msg_id,
                    int(attempt) if attempt != "-" else None,
                )
            )
    return hits


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def latency_stats(latencies_ms: list[float]) -> dict:
    """samples, p50/p90/p99 (nearest rank) and max of a list of latencies in ms, sorted here;
    {} for none."""
    lat = sorted(latencies_ms)
    if not lat:
        return {}
    return {
        "samples": len(lat),
        "p50_ms": round(percentile(lat, 50)),
        "p90_ms": round(percentile(lat, 90)),
        "p99_ms": round(percentile(lat, 99)),
        "max_ms": round(lat[-1]),
    }


def summarise(hits: list[Hit], messages: int, started_ms: float) -> dict:
    """Rates of one run from its access log (see the module docstring). `window_ms` is the
    steady window (10th to 90th percent of successful deliveries), for CPU figures."""
    ok = sorted((h for h in hits if 200 <= h.status < 300), key=lambda h: h.ms)
    unique = len({h.msg_id for h in ok})
    out: dict = {
        "messages": messages,
        "requests": len(hits),
        "delivered": len(ok),
        "delivered_unique": unique,
        "failed_requests": sum(1 for h in hits if h.status >= 300),
        "complete": unique == messages,
    }
    if not ok:
        return out
    first, last = ok[0].ms, ok[-1].ms
    out["first_delivery_s"] = round((first - started_ms) / 1000, 2)
    out["last_delivery_s"] = round((last - started_ms) / 1000, 2)
    out["overall_msg_s"] = round(unique / max(last - started_ms, 1) * 1000)
    out["delivering_msg_s"] = round(unique / max(last - first, 1) * 1000)
    i, j = len(ok) // 10, len(ok) * 9 // 10 - 1
    out["steady_msg_s"] = round((j - i) / max(ok[j].ms - ok[i].ms, 1) * 1000)
    out["window_ms"] = [ok[i].ms, ok[j].ms, j - i]
    firsts = sorted(h.ms for h in hits if h.attempt == 1)
    if firsts and any(h.status >= 300 for h in hits):
        # With failures: how fast the backlog was gone through once (every message's first
        # attempt), and how long retries took after that (backoff and retry batches).
        out["first_pass_msg_s"] = round(len(firsts) / max(firsts[-1] - firsts[0], 1) * 1000)
        out["retry_tail_s"] = round((last - firsts[-1]) / 1000, 1)
    return out


def steady_cpu(cpu: CpuSampler, tree: str, summary: dict) -> dict:
    """CPU of `tree` in the steady window, per 1,000 messages delivered in it, by process kind."""
    if "window_ms" not in summary:
        return {}
    t0, t1, n = summary["window_ms"]
    by_kind = cpu.between(tree, t0, t1)
    if not n or not by_kind:
        return {}
    return {
        "steady_cpu_ms_per_1k": round(sum(by_kind.values()) / n * 1e6),
        "steady_cpu_ms_per_1k_by_process": {k: round(v / n * 1e6) for k, v in by_kind.items()},
        "steady_cpu_share": round(sum(by_kind.values()) / max((t1 - t0) / 1000, 1e-3), 2),
    }


def latencies(hits: list[Hit], since_ms: float = 0.0) -> dict:
    """End-to-end latency (nginx's answer - produce time) of successful deliveries of messages
    produced at or after `since_ms`."""
    return latency_stats(
        [
            h.ms - h.produced_ms
            for h in hits
            if 200 <= h.status < 300 and h.produced_ms is not None and h.produced_ms >= since_ms
        ]
    )


# -- CPU accounting ----------------------------------------------------------------------------
#
# Wall-clock rates on a shared 2-core machine move with whatever else runs; CPU seconds per message
# move much less. A sampler reads /proc every 0.25 s and keeps, per process of the watched trees
# (spark-submit and everything it starts; nginx and its worker; the Kafka broker), the largest
# utime + stime seen, so a process's time counts even after it exits.

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return "python"
    if b"java" in cmd.split(b"\0")[0]:
        return "jvm"
    if b"pyspark.daemon" in cmd or b"pyspark.worker" in cmd:
        return "python_workers"
    return "python"


class CpuSampler:
    """CPU seconds of named process trees over a run (Linux /proc; zeros elsewhere), as totals
    and as a time series (`between`), by kind of process (`_kind`). The sampler's own thread
    is not counted when this process is a root (the in-process baseline)."""

    def __init__(self, roots: dict[str, list[int]]):
        self.roots = roots
        self.seen: dict[str, dict[int, float]] = {name: {} for name in roots}
        self.base: dict[int, float] = {}
        self.kinds: dict[int, str] = {}
        self.series: list[tuple[float, dict[str, dict[str, float]]]] = []
        self._own = 0.0  # this thread's CPU seconds, subtracted from our own process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        for pids in roots.values():  # long-running roots (the broker, us) count from now on
            for pid in pids:
                st = _stat(pid)
                if st:
                    self.base[pid] = st[1]

    def _sample(self) -> None:
        t0 = time.thread_time()
        parents: dict[int, int] = {}
        cpu: dict[int, float] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st:
                    parents[int(entry)], cpu[int(entry)] = st
        me = os.getpid()
        if me in cpu:
            cpu[me] -= self._own
        for name, roots in self.roots.items():
            tree = set(roots)
            grew = True
            while grew:
                more = {pid for pid, parent in parents.items() if parent in tree} - tree
                tree |= more
                grew = bool(more)
            seen = self.seen[name]
            for pid in tree & cpu.keys():
                seen[pid] = max(seen.get(pid, 0.0), cpu[pid] - self.base.get(pid, 0.0))
                if self.kinds.get(pid, "python") == "python":  # a shell may exec java later
                    self.kinds[pid] = _kind(pid)
        self.series.append((time.time() * 1000, {n: self.breakdown(n) for n in self.roots}))
        self._own += time.thread_time() - t0

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self._sample()

    def __enter__(self) -> CpuSampler:
        if os.path.isdir("/proc"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
            self._sample()

    def seconds(self) -> dict[str, float]:
        return {name: round(sum(v.values()), 1) for name, v in self.seen.items()}

    def breakdown(self, name: str) -> dict[str, float]:
        """CPU seconds of tree `name` by kind of process: the JVM, Spark's Python workers
        (`pyspark.daemon` and its forks), other Python (the shard's driver; the baseline)."""
        out: dict[str, float] = {"jvm": 0.0, "python_workers": 0.0, "python": 0.0}
        for pid, seconds in self.seen[name].items():
            out[self.kinds.get(pid, "python")] += seconds
        return {k: round(v, 3) for k, v in out.items()}

    def between(self, name: str, t0_ms: float, t1_ms: float) -> dict[str, float]:
        """CPU seconds of tree `name` by kind between two wall-clock times (nearest samples)."""
        if not self.series:
            return {}
        a = min(self.series, key=lambda s: abs(s[0] - t0_ms))[1][name]
        b = min(self.series, key=lambda s: abs(s[0] - t1_ms))[1][name]
        return {k: round(b[k] - a[k], 2) for k in b}


def broker_pid() -> int | None:
    path = Path(os.environ.get("VARADHI_KAFKA_DIR", ROOT / ".varadhi" / "kafka")) / "broker.pid"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cpu_pressure() -> float | None:
    """/proc/pressure/cpu `some avg10`: the share of the last 10 s in which something waited for
    a CPU (other work on the machine shows here)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


# -- Kafka set-up ------------------------------------------------------------------------------


class Env:
    """A private catalog topic and warehouse for this bench; `close` deletes what it created."""

    def __init__(self, keep: bool = False):
        self.tag = uuid.uuid4().hex[:8]
        self.warehouse = tempfile.mkdtemp(prefix="varadhi-bench-delivery-")
        self.settings = Settings.from_env(
            catalog_topic=f"__varadhi_catalog_bench_delivery_{self.tag}",
            warehouse=self.warehouse,
        )
        self.catalog = Catalog(self.settings)
        self.keep = keep

    def spark_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VARADHI_BOOTSTRAP": self.settings.bootstrap,
            "VARADHI_CATALOG_TOPIC": self.settings.catalog_topic,
            "VARADHI_WAREHOUSE": self.warehouse,
        }

    def close(self) -> None:
        self.catalog.close()
        if self.keep:
            print(f"kept catalog {self.settings.catalog_topic} and warehouse {self.warehouse}")
            return
        shutil.rmtree(self.warehouse, ignore_errors=True)
        try:
            admin = KafkaAdminClient(bootstrap_servers=self.settings.bootstrap)
        except KafkaError as e:
            print(f"could not delete the bench topics: {e}", file=sys.stderr)
            return
        try:
            mine = [
                t
                for t in admin.list_topics()
                if t.startswith((f"bench-{self.tag}", self.settings.catalog_topic))
            ]
            if mine:
                admin.delete_topics(mine)
        except KafkaError as e:
            print(f"could not delete the bench topics: {e}", file=sys.stderr)
        finally:
            admin.close()


def produce_backlog(env: Env, topic: str, messages: int, groups: int) -> dict:
    value = os.urandom(512).hex().encode()  # 1 KiB
    t0 = time.perf_counter()
    # Large batches: kafka-python's pure-Python CRC-32C is the cost here either way (see
    # `baseline`); this only takes the backlog's set-up time down a little.
    with Producer(
        topic, env.settings, catalog=env.catalog, batch_size=1 << 20, linger_ms=20
    ) as producer:
        for i in range(messages):
            producer.send(value, group_id=f"group-{i % groups}")
        producer.flush()
    seconds = time.perf_counter() - t0
    st = TopicService(env.catalog).get(topic).produce_topic
    in_kafka = sum(end_offsets(env.catalog, [st])[st.name])
    if in_kafka != messages:
        raise RuntimeError(f"produced {messages} messages but {st.name} holds {in_kafka}")
    return {"messages": messages, "seconds": round(seconds, 1), "msg_s": round(messages / seconds)}


# -- shards ------------------------------------------------------------------------------------

BATCH_LINE = re.compile(r"shard (\d+): batch (\{.*\})\s*$")
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def create_subscription(env: Env, name: str, topic: str, url: str, args, **over) -> None:
    consumption = {
        "concurrency": args.concurrency,
        "max_in_flight": args.max_in_flight,
        "max_messages_per_batch": args.batch,
        "trigger_interval": f"{args.trigger_ms}ms",
    }
    consumption.update(over.pop("consumption", {}))
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "shards": 1,
        "grouped": True,
        "retry": {"max_attempts": 10},
        "consumption": consumption,
        **over,
    }
    SubscriptionService(env.catalog).create(parse_spec(doc, "bench"))


class ShardProcesses:
    """`./spark-submit.sh SUB i --stop-when-idle S` for every shard, each in its own process
    group (so that a timeout can stop it and its JVM and Python workers)."""

    def __init__(self, env: Env, sub: str, shards: int, idle_s: float, logdir: Path, tag: str = ""):
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        for shard in range(shards):
            log = logdir / f"{sub}-{shard}{tag}.log"
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(
                    subprocess.Popen(
                        [
                            str(ROOT / "spark-submit.sh"),
                            sub,
                            str(shard),
                            "--stop-when-idle",
                            str(idle_s),
                        ],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        env=env.spark_env(),
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def kill(self) -> None:
        """SIGKILL every shard's process group (driver JVM, Python driver and workers): a
        crash."""
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.wait(30)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait_for_line(self, needle: str, timeout_s: float) -> bool:
        """Until every shard's log has a line containing `needle`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(needle in log.read_text(errors="replace") for log in self.logs):
                return True
            if any(p.poll() is not None for p in self.procs):
                return False
            time.sleep(0.2)
        return False

    def batches(self) -> list[dict]:
        out = []
        for log in self.logs:
            for line in log.read_text(errors="replace").splitlines():
                match = BATCH_LINE.search(line)
                if match:
                    row = {"shard": int(match.group(1)), **ast.literal_eval(match.group(2))}
                    when = LOG_TIME.match(line)
                    if when:
                        t = time.mktime(time.strptime(when.group(1), "%Y-%m-%d %H:%M:%S"))
                        row["logged_ms"] = t * 1000 + int(when.group(2))
                    out.append(row)
        return out

    def tail(self, n: int = 30) -> str:
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-n:])
            for log in self.logs
        )


def batch_summary(batches: list[dict]) -> dict:
    """Per-batch figures from the shard logs. The first batch of a query (JVM and Python worker
    start-up) apart from the rest; `cycle_msg_s`: the later batches' records over the time
    between the first and the last batch's log line, per shard and summed over shards (every
    cost of a batch cycle counted: trigger, Kafka read, shuffle, delivery, commit)."""
    if not batches:
        return {}
    firsts = [b for b in batches if b["batch_id"] == 0]
    rest = [b for b in batches if b["batch_id"] > 0 and b.get("records")]
    out: dict = {
        "batches": len(batches),
        "first_batch_s": max((b["seconds"] for b in firsts), default=None),
        "first_batch_records": sum(b["records"] for b in firsts),
    }
    if rest:
        records = sum(b["records"] for b in rest)
        seconds = sum(b["seconds"] for b in rest)
        out["later_batches_records"] = records
        out["later_batches_s"] = round(seconds, 2)
        out["later_batches_msg_s_per_shard"] = round(records / seconds) if seconds else None
    cycle = 0.0
    for shard in {b["shard"] for b in batches}:
        mine = sorted(
            (b for b in batches if b["shard"] == shard and b.get("logged_ms")),
            key=lambda b: b["batch_id"],
        )
        # the last batch of a drained backlog is a small remainder: leave it out
        full = [b for b in mine[1:] if b["records"] >= 0.5 * max(x["records"] for x in mine)]
        if full:
            span = full[-1]["logged_ms"] - mine[0]["logged_ms"]
            cycle += sum(b["records"] for b in full) / (span / 1000) if span > 0 else 0
    if cycle:
        out["cycle_msg_s"] = round(cycle)
    return out


def run_shards(
    env: Env,
    nginx_bin: str,
    topic: str,
    messages: int,
    shards: int,
    grouped: bool,
    fail_rate: float,
    in_place_ms: int,
    args,
    logdir: Path,
    journal_ms: int = DEFAULT_JOURNAL_MS,
    repeat: int = 0,
    linger_ms: int = DEFAULT_LINGER_MS,
) -> dict:
    label = (
        f"{shards} shard{'s' if shards > 1 else ''}, {'grouped' if grouped else 'ungrouped'}, "
        f"{fail_rate:.0%} fail"
    )
    sub = f"bench-{env.tag}-s{shards}-{'g' if grouped else 'u'}-f{round(fail_rate * 100)}"
    if fail_rate and in_place_ms != DEFAULT_IN_PLACE_MS:
        label += f", in place {in_place_ms / 1000:g} s"
        sub += f"-w{in_place_ms}"
    if journal_ms != DEFAULT_JOURNAL_MS:
        label += f", journal {journal_ms} ms" if journal_ms else ", no journal"
        sub += f"-j{journal_ms}"
    if repeat:
        label += f" #{repeat + 1}"
        sub += f"-r{repeat}"
    retry = {"max_attempts": 10, "in_place_window": f"{in_place_ms}ms"}
    if fail_rate and linger_ms != DEFAULT_LINGER_MS:
        retry["in_place_linger"] = f"{linger_ms}ms"
        label += f", linger {linger_ms / 1000:g} s"
        sub += f"-l{linger_ms}"
    with nginx(nginx_bin, fail_rate) as endpoint:
        create_subscription(
            env,
            sub,
            topic,
            endpoint.url,
            args,
            shards=shards,
            grouped=grouped,
            retry=retry,
            consumption={"journal_interval": f"{journal_ms}ms"},
        )
        load = os.getloadavg()[0]
        started = time.time() * 1000
        procs = ShardProcesses(env, sub, shards, args.idle_s, logdir)
        roots = {
            "shard": [p.pid for p in procs.procs],
            "nginx": [endpoint.proc.pid],
            "kafka": [pid for pid in [broker_pid()] if pid],
        }
        try:
            with CpuSampler(roots) as cpu:
                codes = procs.wait(args.run_timeout_s)
                pressure = cpu_pressure()
        finally:
            procs.stop()
        ended = time.time() * 1000
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, sub)
    summary = summarise(hits, messages, started)
    if grouped:  # followers wait for their failed head: there is no "first pass" to speak of
        summary.pop("first_pass_msg_s", None)
        summary.pop("retry_tail_s", None)
    result = {
        "run": label,
        "shards": shards,
        "grouped": grouped,
        "fail_rate": fail_rate,
        "in_place_window_ms": in_place_ms,
        "in_place_linger_ms": linger_ms if fail_rate else DEFAULT_LINGER_MS,
        "journal_interval_ms": journal_ms,
        "exit_codes": codes,
        "wall_s": round((ended - started) / 1000, 1),
        **summary,
        **cpu_figures(cpu.seconds(), summary["delivered_unique"], "shard"),
        "shard_cpu_s_by_process": cpu.breakdown("shard"),
        **steady_cpu(cpu, "shard", summary),
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
        "shard_batches": batch_summary(procs.batches()),
        "batches": procs.batches(),
    }
    if any(c != 0 for c in codes) or not result["complete"]:
        print(
            f"{label}: exit codes {codes}, complete={result['complete']}\n{procs.tail()}",
            file=sys.stderr,
        )
    return result


# -- duplicates after crashes -------------------------------------------------------------------

SKIPPED_LINE = re.compile(r"; (\d+) of its messages were accepted then")


def run_crash(
    env: Env,
    nginx_bin: str,
    topic: str,
    messages: int,
    journal_ms: int,
    seed: int,
    args,
    logdir: Path,
) -> dict:
    """A chaos run: one shard (grouped, no failures) drains the backlog while it is SIGKILLed
    `--kills` times, each at a moment drawn (from `seed`) in `--kill-window` seconds after that
    run's first delivery (nginx's access log grew), and restarted; the last run goes on until
    idle. Duplicates are successful requests beyond the first per message id (nginx's log):
    what a crash re-delivers."""
    rng = random.Random(seed)
    delays = [round(rng.uniform(*args.kill_window), 2) for _ in range(args.kills)]
    label = (
        f"crash: 1 shard, grouped, {args.kills} kills, "
        + (f"journal {journal_ms} ms" if journal_ms else "no journal")
        + f", seed {seed}"
    )
    sub = f"bench-{env.tag}-crash-j{journal_ms}-k{seed}"
    started_runs: list[ShardProcesses] = []
    kills = []
    with nginx(nginx_bin) as endpoint:
        create_subscription(
            env,
            sub,
            topic,
            endpoint.url,
            args,
            retry={"max_attempts": 10},
            consumption={
                "journal_interval": f"{journal_ms}ms",
                "max_messages_per_batch": args.crash_batch,
            },
        )
        load = os.getloadavg()[0]
        started = time.time() * 1000
        try:
            for i, delay in enumerate(delays):
                procs = ShardProcesses(env, sub, 1, 3600, logdir, tag=f"-kill{i}")
                started_runs.append(procs)
                if not procs.wait_for_line(": reading ", 300):
                    raise RuntimeError(f"the shard did not start:\n{procs.tail()}")
                reading_ms = time.time() * 1000
                size = endpoint.log.stat().st_size if endpoint.log.exists() else 0
                deadline = time.monotonic() + 300
                while procs.procs[0].poll() is None and time.monotonic() < deadline:
                    if endpoint.log.exists() and endpoint.log.stat().st_size > size:
                        break  # this run delivers (nginx flushes its log every second)
                    time.sleep(0.05)
                time.sleep(delay)
                alive = procs.procs[0].poll() is None
                procs.kill()
                kills.append(
                    {
                        "after_s": delay,
                        "killed": alive,
                        "from_ms": reading_ms,
                        "at_ms": time.time() * 1000,
                    }
                )
            final = ShardProcesses(env, sub, 1, args.idle_s, logdir, tag="-final")
            started_runs.append(final)
            codes = final.wait(args.run_timeout_s)
        finally:
            for procs in started_runs:
                procs.stop()
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, sub)
    ok = sorted((h for h in hits if 200 <= h.status < 300), key=lambda h: h.ms)
    by_id: dict[str, list[float]] = {}
    for h in ok:
        by_id.setdefault(h.msg_id, []).append(h.ms)
    for k in kills:  # what each killed run had delivered, and how much of it was sent again
        mine = {i for i, times in by_id.items() if k["from_ms"] <= times[0] <= k["at_ms"]}
        k["delivered"] = len(mine)
        k["sent_again"] = sum(1 for i in mine if len(by_id[i]) > 1)
    skipped = [
        int(m.group(1))
        for procs in started_runs
        for log in procs.logs
        for m in SKIPPED_LINE.finditer(log.read_text(errors="replace"))
    ]
    duplicates = len(ok) - len(by_id)
    result = {
        "run": label,
        "journal_interval_ms": journal_ms,
        "seed": seed,
        "messages": messages,
        "max_messages_per_batch": args.crash_batch,
        "kills": kills,
        "final_exit_codes": codes,
        "delivered": len(ok),
        "delivered_unique": len(by_id),
        "complete": len(by_id) == messages,
        "duplicates": duplicates,
        "duplicate_pct": round(100 * duplicates / max(len(ok), 1), 2),
        "skipped_replayed_per_restart": skipped,
        "wall_s": round((time.time() * 1000 - started) / 1000, 1),
        "load_1m_at_start": round(load, 2),
    }
    if any(c != 0 for c in codes) or not result["complete"]:
        print(f"{label}: exit codes {codes}, complete={result['complete']}", file=sys.stderr)
    return result


# -- the hand-written baseline -------------------------------------------------------------------


class _KeyStream:
    """The records of one key from one poll, delivered in order; no retry (a failure is counted
    and the next record goes on: what a consumer without retry topics can do)."""

    __slots__ = ("records", "i", "failed")

    def __init__(self):
        self.records: list = []
        self.i = 0
        self.failed = 0

    def next_request(self) -> Request | None:
        if self.i == len(self.records):
            return None
        r = self.records[self.i]
        self.i += 1
        headers = {k: v.decode() for k, v in r.headers}
        msg_id = headers.get(m.H_MSG_ID) or f"{r.topic}-{r.partition}-{r.offset}"
        out = {
            m.HTTP_MESSAGE_ID: msg_id,
            m.HTTP_IDEMPOTENCY_KEY: msg_id,
            m.HTTP_ATTEMPT: "1",
            m.HTTP_SOURCE: f"{r.topic}/{r.partition}/{r.offset}",
        }
        if m.H_GROUP_ID in headers:
            out[m.HTTP_GROUP_ID] = headers[m.H_GROUP_ID]
        if m.H_PRODUCED_MS in headers:
            out[m.HTTP_PRODUCED_AT] = headers[m.H_PRODUCED_MS]
        return Request(r.value, out)

    def on_outcome(self, outcome: Outcome) -> None:
        if outcome.status is None or not 200 <= outcome.status < 300:
            self.failed += 1


def baseline(
    env: Env, storage_topic: str, url: str, messages: int, poll_records: int, args
) -> dict:
    """Consume `storage_topic` from the start with a new consumer group until `messages` are
    delivered (or `--run-timeout-s`), committing after each delivered poll batch."""
    consumer = KafkaConsumer(
        storage_topic,
        bootstrap_servers=env.settings.bootstrap,
        group_id=f"bench-{env.tag}-baseline-{poll_records}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=poll_records,
        # kafka-python computes CRC-32C in pure Python (~8 MB/s) unless the crc32c package is
        # installed: that alone would cap this consumer near 7k msg/s. Without the package the
        # baseline is given the benefit of the doubt and does not check CRCs.
        check_crcs=record_util.crc32c_c is not None,
    )
    consumed = failed = polls = 0
    started = time.time() * 1000
    deadline = time.monotonic() + args.run_timeout_s
    try:
        with HttpDeliverer(Endpoint(url=url), args.max_in_flight) as http:
            while consumed < messages and time.monotonic() < deadline:
                polled = consumer.poll(timeout_ms=1000)
                if not polled:
                    continue
                polls += 1
                streams: dict[bytes | str, _KeyStream] = {}
                for records in polled.values():
                    for r in records:
                        k = r.key if r.key is not None else f"{r.partition}/{r.offset}"
                        stream = streams.get(k)
                        if stream is None:
                            stream = streams[k] = _KeyStream()
                        stream.records.append(r)
                        consumed += 1
                http.run(streams.values())
                failed += sum(s.failed for s in streams.values())
                consumer.commit()
    finally:
        consumer.close()
    return {"consumed": consumed, "polls": polls, "http_failures": failed, "started_ms": started}


def run_baseline(
    env: Env, nginx_bin: str, storage_topic: str, messages: int, poll_records: int, args
) -> dict:
    with nginx(nginx_bin) as endpoint:
        load = os.getloadavg()[0]
        roots = {
            "baseline": [os.getpid()],
            "nginx": [endpoint.proc.pid],
            "kafka": [pid for pid in [broker_pid()] if pid],
        }
        with CpuSampler(roots) as cpu:
            info = baseline(env, storage_topic, endpoint.url, messages, poll_records, args)
            pressure = cpu_pressure()
        hits = endpoint.hits()
    summary = summarise(hits, messages, info["started_ms"])
    return {
        "run": f"baseline: kafka-python + HttpDeliverer, poll {poll_records}",
        "max_poll_records": poll_records,
        "polls": info["polls"],
        **summary,
        **cpu_figures(cpu.seconds(), summary["delivered_unique"], "baseline"),
        **steady_cpu(cpu, "baseline", summary),
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
    }


def cpu_figures(seconds: dict[str, float], delivered: int, consumer: str) -> dict:
    """CPU seconds per process tree, and per 1,000 delivered messages for the consumer (the
    shard's processes, or the baseline's one) and for everything (consumer + nginx + Kafka)."""
    total = sum(seconds.values())
    return {
        "cpu_s": seconds,
        "consumer_cpu_ms_per_1k": round(seconds[consumer] / delivered * 1e6) if delivered else None,
        "total_cpu_ms_per_1k": round(total / delivered * 1e6) if delivered else None,
    }


# -- the library runtime ----------------------------------------------------------------------------


class LibraryMembers:
    """`count` processes of `varadhi-consumer SUB --max-in-flight N` (a `runtime: library`
    subscription), each in its own process group, its output in `logdir`; `drained` asks the
    consumer group's commits, `stop` sends SIGTERM (deliveries in flight end, offsets are
    committed) and returns the exit codes."""

    def __init__(self, env: Env, name: str, storages: list, count: int, args, logdir: Path):
        self.env, self.name, self.storages = env, name, storages
        self.logs = [logdir / f"{name}-{i}.log" for i in range(count)]
        self.procs: list[subprocess.Popen] = []
        command = [sys.executable, "-m", "varadhi.library.console", name]
        for log in self.logs:
            with open(log, "w") as out:
                self.procs.append(
                    subprocess.Popen(
                        [*command, "--max-in-flight", str(args.max_in_flight)],
                        env=env.spark_env(),
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def exited(self) -> int | None:
        """The exit code of a member that ended by itself, if one did."""
        return next((p.returncode for p in self.procs if p.poll() is not None), None)

    def drained(self) -> bool:
        """Whether the group committed every record of the main topic and the RQ: the commits
        are read first, the log ends second, so a retry written in between is not drained."""
        committed = status.group_committed(self.env.catalog, group_id(self.name))
        ends = end_offsets(self.env.catalog, self.storages)
        return status.group_lag(committed, ends, [st.name for st in self.storages]) == 0

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait until drained (True), a member exits or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.exited() is None:
            if self.drained():
                return True
            time.sleep(1)
        return False

    def stop(self) -> list[int]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        try:
            return [p.wait(120) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    def tail(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-3000:] for log in self.logs)


def library_subscription(
    env: Env, name: str, topic: str, url: str, args, in_place_ms: int = DEFAULT_IN_PLACE_MS
) -> list:
    """A fresh `runtime: library` subscription of `topic` (slots: the topic's partitions; skip
    on a dead letter and no circuit, as the shard runs; retries in place within `in_place_ms`
    of a message's first failure); returns its main and RQ storage topics."""
    create_subscription(
        env, name, topic, url, args, runtime="library", on_dead_letter="skip",
        circuit_breaker={"enabled": False}, shards=args.partitions,
        retry={"max_attempts": 10, "in_place_window": f"{in_place_ms}ms"},
    )  # fmt: skip
    sub = SubscriptionService(env.catalog).get(name)
    service = TopicService(env.catalog)
    return [service.get(topic).produce_topic, service.get(sub.spec.rq_topic).produce_topic]


def run_library(
    env: Env,
    nginx_bin: str,
    topic: str,
    messages: int,
    count: int,
    fail_rate: float,
    in_place_ms: int,
    args,
    logdir: Path,
) -> dict:
    """`count` member processes (`LibraryMembers`) drain `topic` from the start on a fresh
    subscription (`retry.in_place_window` `in_place_ms`); measured from nginx's log like every
    other run, stopped once the group committed everything; CPU from /proc (the member
    processes)."""
    name = f"bench-{env.tag}-lib-m{count}-f{round(fail_rate * 100)}-w{in_place_ms}"
    with nginx(nginx_bin, fail_rate) as endpoint:
        storages = library_subscription(env, name, topic, endpoint.url, args, in_place_ms)
        load = os.getloadavg()[0]
        started = time.time() * 1000
        members = LibraryMembers(env, name, storages, count, args, logdir)
        roots = {
            "library": members.pids(),
            "nginx": [endpoint.proc.pid],
            "kafka": [pid for pid in [broker_pid()] if pid],
        }
        try:
            with CpuSampler(roots) as cpu:
                members.wait_drained(args.run_timeout_s)
                pressure = cpu_pressure()
        finally:
            codes = members.stop()
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, name)
    summary = summarise(hits, messages, started)
    summary.pop("first_pass_msg_s", None)  # key order: no first pass, as the peer
    summary.pop("retry_tail_s", None)
    result = {
        "run": f"library: {count} member{'s' if count > 1 else ''}, key order, "
        f"{fail_rate:.0%} fail"
        + (
            f", in place {in_place_ms / 1000:g} s"
            if fail_rate and in_place_ms != DEFAULT_IN_PLACE_MS
            else ""
        ),
        "library_members": count,
        "fail_rate": fail_rate,
        "in_place_window_ms": in_place_ms,
        "max_in_flight": args.max_in_flight,
        "slots": args.partitions,
        "exit_codes": codes,
        **summary,
        **cpu_figures(cpu.seconds(), summary["delivered_unique"], "library"),
        **steady_cpu(cpu, "library", summary),
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
    }
    if codes != [0] * count or not result["complete"]:
        print(f"{result['run']}: exit codes {codes}, complete={result['complete']}\n"
              f"{members.tail()}", file=sys.stderr)  # fmt: skip
    return result


def run_library_latency(env: Env, nginx_bin: str, args, logdir: Path) -> dict:
    """One member process, warmed up by a burst it drains, then the paced load of the shard's
    latency run: `--warmup-s` seconds not measured and `--latency-s` measured ones."""
    topic = f"bench-{env.tag}-lib-latency"
    TopicService(env.catalog).create(topic, args.partitions)
    name = f"bench-{env.tag}-lib-latency-sub"
    with nginx(nginx_bin) as endpoint:
        storages = library_subscription(env, name, topic, endpoint.url, args)
        load = os.getloadavg()[0]
        members = LibraryMembers(env, name, storages, 1, args, logdir)
        try:
            with Producer(topic, env.settings, catalog=env.catalog) as producer:
                warm = pace(producer, args.rate * 10, 0.5, args.groups, threading.Event())
                if not members.wait_drained(300):
                    raise RuntimeError(f"the warm-up burst was not delivered:\n{members.tail()}")
                started = time.time() * 1000
                sent = pace(
                    producer, args.rate, args.warmup_s + args.latency_s, args.groups,
                    threading.Event(),
                )  # fmt: skip
                pressure = cpu_pressure()
            members.wait_drained(args.run_timeout_s)
        finally:
            codes = members.stop()
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, name)
    return {
        "run": f"library latency: 1 member, {args.rate:,} msg/s",
        **paced_latency(args, warm, sent, codes, hits, started),
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
    }


def paced_latency(args, warm: int, sent: int, codes: list, hits: list[Hit], started: float) -> dict:
    """What a latency run reports of its paced load: `warm` messages of warm-up, then `sent`
    from `started` (ms), of which those after `--warmup-s` are measured."""
    return {
        "offered_msg_s": args.rate,
        "warmup_messages": warm,
        "sent": sent,
        "warmup_s": args.warmup_s,
        "measured_s": args.latency_s,
        "exit_codes": codes,
        "complete": len({h.msg_id for h in hits if 200 <= h.status < 300}) == warm + sent,
        "latency": latencies(hits, started + args.warmup_s * 1000),
        "latency_including_warmup": latencies(hits, started),
    }


# -- the peer: Confluent Parallel Consumer --------------------------------------------------------


def build_peer() -> tuple[Path, str] | str:
    """(the peer's jar, its Parallel Consumer version), built by bench/peers/parallel-consumer/build
    if it is not already; or why not (no java, no mvn, a failed build)."""
    if not shutil.which("java"):
        return "no java (apt-get install openjdk-17-jdk-headless)"
    done = subprocess.run(
        [str(PEER_DIR / "build")], capture_output=True, text=True, timeout=1800, check=False
    )
    if done.returncode != 0:
        return f"its build failed:\n{done.stderr.strip()}"
    pom = (PEER_DIR / "pom.xml").read_text()
    version = re.search(r"<parallel-consumer.version>([^<]+)<", pom)
    return Path(done.stdout.strip().splitlines()[-1]), version.group(1) if version else "?"


def run_peer(
    env: Env,
    nginx_bin: str,
    peer: tuple[Path, str],
    storage_topic: str,
    messages: int,
    fail_rate: float,
    args,
    logdir: Path,
) -> dict:
    """The peer (bench/peers/parallel-consumer: key order, `--max-in-flight` records in flight,
    retry after 1 s) drains `storage_topic` from the start in a consumer group of its own and
    stops once drained for `--idle-s`; measured from nginx's log like every other run, CPU from
    /proc (its one JVM)."""
    jar, version = peer
    name = f"bench-{env.tag}-pc-f{round(fail_rate * 100)}"
    log = logdir / f"{name}.log"
    report = logdir / f"{name}.json"
    with nginx(nginx_bin, fail_rate) as endpoint:
        load = os.getloadavg()[0]
        started = time.time() * 1000
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["java", "-jar", str(jar), "--bootstrap", env.settings.bootstrap]
                + ["--topic", storage_topic, "--group", name, "--url", endpoint.url]
                + ["--max-concurrency", str(args.max_in_flight), "--retry-delay-ms", "1000"]
                + ["--stop-when-idle", str(args.idle_s), "--report", str(report)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        roots = {
            "peer": [proc.pid],
            "nginx": [endpoint.proc.pid],
            "kafka": [pid for pid in [broker_pid()] if pid],
        }
        try:
            with CpuSampler(roots) as cpu:
                try:
                    code = proc.wait(args.run_timeout_s)
                except subprocess.TimeoutExpired:
                    code = None
                pressure = cpu_pressure()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        ended = time.time() * 1000
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, name)
    summary = summarise(hits, messages, started)
    # key order: records behind a failed one wait for it, so there is no "first pass" (as grouped)
    summary.pop("first_pass_msg_s", None)
    summary.pop("retry_tail_s", None)
    result = {
        "run": f"peer: Parallel Consumer, key order, {fail_rate:.0%} fail",
        "peer": f"parallel-consumer-vertx {version}",
        "fail_rate": fail_rate,
        "max_concurrency": args.max_in_flight,
        "retry_delay_ms": 1000,
        "exit_code": code,
        "wall_s": round((ended - started) / 1000, 1),
        **summary,
        **cpu_figures(cpu.seconds(), summary["delivered_unique"], "peer"),
        **steady_cpu(cpu, "peer", summary),
        "peer_report": json.loads(report.read_text()) if report.exists() else None,
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
    }
    if code != 0 or not result["complete"]:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        print(
            f"{result['run']}: exit code {code}, complete={result['complete']}\n{tail}",
            file=sys.stderr,
        )
    return result


# -- latency at a fixed offered load -------------------------------------------------------------


def pace(producer: Producer, rate: int, seconds: float, groups: int, stop: threading.Event) -> int:
    """Send `rate` messages a second for `seconds`, in bursts every 10 ms; returns the count."""
    value = os.urandom(512).hex().encode()
    t0 = time.monotonic()
    sent = 0
    total = int(rate * seconds)
    while sent < total and not stop.is_set():
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        while sent < due:
            producer.send(value, group_id=f"group-{sent % groups}")
            sent += 1
        time.sleep(0.01)
    producer.flush()
    return sent


def run_latency(env: Env, nginx_bin: str, args, logdir: Path) -> dict:
    """1 shard, grouped, trigger `--latency-trigger-ms`. The shard is warmed up first (JVM and
    Python workers started, code paths compiled: a first micro-batch takes tens of seconds):
    a burst of messages, then wait for its batch. Then the paced load: `--warmup-s` more
    seconds, not measured, and `--latency-s` measured seconds."""
    topic = f"bench-{env.tag}-latency"
    TopicService(env.catalog).create(topic, args.partitions)
    sub = f"bench-{env.tag}-latency-sub"
    with nginx(nginx_bin) as endpoint:
        create_subscription(
            env,
            sub,
            topic,
            endpoint.url,
            args,
            consumption={
                "trigger_interval": f"{args.latency_trigger_ms}ms",
                "concurrency": args.latency_concurrency,
            },
        )
        load = os.getloadavg()[0]
        procs = ShardProcesses(env, sub, 1, args.idle_s, logdir)
        try:
            if not procs.wait_for_line(": reading ", 300):
                raise RuntimeError(f"the shard did not start:\n{procs.tail()}")
            with Producer(topic, env.settings, catalog=env.catalog) as producer:
                warm = pace(producer, args.rate * 10, 0.5, args.groups, threading.Event())
                if not procs.wait_for_line(": batch ", 300):
                    raise RuntimeError(f"no first batch:\n{procs.tail()}")
                started = time.time() * 1000
                sent = pace(
                    producer,
                    args.rate,
                    args.warmup_s + args.latency_s,
                    args.groups,
                    threading.Event(),
                )
                pressure = cpu_pressure()
            codes = procs.wait(args.run_timeout_s)
        finally:
            procs.stop()
        hits = endpoint.hits(logdir if args.keep or args.keep_logs else None, sub)
    batches = procs.batches()
    return {
        "run": f"latency: 1 shard, grouped, {args.rate:,} msg/s, trigger "
        f"{args.latency_trigger_ms} ms, concurrency {args.latency_concurrency}",
        **paced_latency(args, warm, sent, codes, hits, started),
        "batches_while_measured": batch_times(batches, started + args.warmup_s * 1000),
        "load_1m_at_start": round(load, 2),
        "cpu_pressure_at_end": pressure,
        "batches": batches,
    }


def batch_times(batches: list[dict], since_ms: float) -> dict:
    """Records and seconds per micro-batch logged after `since_ms` (the log line's time)."""
    chosen = [b for b in batches if b.get("logged_ms", 0) >= since_ms]
    if not chosen:
        return {}
    seconds = sorted(b["seconds"] for b in chosen)
    return {
        "batches": len(chosen),
        "records_mean": round(sum(b["records"] for b in chosen) / len(chosen)),
        "seconds_p50": percentile(seconds, 50),
        "seconds_max": seconds[-1],
    }


# -- main ----------------------------------------------------------------------------------------


def fmt_rate(v) -> str:
    return f"{v:,}" if isinstance(v, int) else "-"


def print_table(doc: dict) -> None:
    print()
    print(
        f"{'run':<44} {'msgs':>7} {'overall':>8} {'deliver':>8} {'steady':>8} {'cpu/1k':>6} "
        f"{'p50':>6} {'p99':>6} {'load':>5} {'ok':>3}"
    )
    for row in doc["rows"]:
        lat = row.get("latency") or {}
        n = row.get("messages") or row.get("sent")
        print(
            f"{row['run'][:44]:<44} {fmt_rate(n):>7} {fmt_rate(row.get('overall_msg_s')):>8} "
            f"{fmt_rate(row.get('delivering_msg_s')):>8} {fmt_rate(row.get('steady_msg_s')):>8} "
            f"{row.get('steady_cpu_ms_per_1k') or '-':>6} {lat.get('p50_ms', '-'):>6} "
            f"{lat.get('p99_ms', '-'):>6} {row.get('load_1m_at_start', '-'):>5} "
            f"{'yes' if row.get('complete', True) else 'NO':>3}"
        )
    print(
        "msg/s: overall = process start to last delivery; deliver = first to last delivery; "
        "steady = 10th to\n90th percent delivered. cpu/1k = CPU ms of the consumer's processes "
        "(shard: JVM, Python driver\nand workers; baseline: its process; peer: its JVM) per 1,000 "
        "messages in the steady window.\np50/p99 = end-to-end latency, ms. load = 1-minute load "
        "average at the start of the run (2 cores)."
    )
    for name, t in doc.get("targets", {}).items():
        print(f"target {name}: {t['verdict']} ({t['detail']})")


def targets(rows: list[dict]) -> dict:
    """The shard targets and the library's (`library_targets`), judged on this run's rows."""
    out = {}
    base = [r for r in rows if r["run"].startswith("baseline") and r.get("steady_msg_s")]
    shard1 = next(
        (
            r
            for r in rows
            if r.get("shards") == 1
            and r.get("grouped")
            and not r.get("fail_rate")
            and r.get("journal_interval_ms", DEFAULT_JOURNAL_MS) == DEFAULT_JOURNAL_MS
        ),
        None,
    )
    if base and shard1 and shard1.get("steady_msg_s"):
        best = max(base, key=lambda r: r["steady_msg_s"])
        ratio = shard1["steady_msg_s"] / best["steady_msg_s"]
        out[">= 2x baseline"] = {
            "verdict": "met" if ratio >= 2 else "NOT met",
            "detail": f"1 shard grouped, steady: {shard1['steady_msg_s']:,} msg/s vs the best "
            f"baseline's {best['steady_msg_s']:,} msg/s = {ratio:.2f}x; from a cold start "
            f"(overall) {shard1['overall_msg_s']:,} vs {best['overall_msg_s']:,}",
        }
    lat = next((r for r in rows if r["run"].startswith("latency")), None)
    if lat and lat.get("latency"):
        p99, rate = lat["latency"]["p99_ms"], lat.get("offered_msg_s", 1000)  # older rows: 1,000
        for bound_ms in (1000, 500):  # the first issue's target, then issue 13's
            out[f"p99 < {bound_ms:,} ms at {rate:,} msg/s"] = {
                "verdict": "met" if p99 < bound_ms else "NOT met",
                "detail": f"p50 {lat['latency']['p50_ms']} ms, p99 {p99} ms",
            }
    ratios, others = [], []
    for r in rows:
        if "shards" not in r or not r.get("fail_rate") or not r.get("steady_msg_s"):
            continue
        twin = no_failure_twin(r, rows)
        if twin:
            name = f"{r['shards']} shard{'s' if r['shards'] > 1 else ''} " + (
                "grouped" if r["grouped"] else "ungrouped"
            )
            steady = r["steady_msg_s"] / twin["steady_msg_s"]
            delivering = r["delivering_msg_s"] / twin["delivering_msg_s"]
            window = r.get("in_place_window_ms", DEFAULT_IN_PLACE_MS)
            linger = r.get("in_place_linger_ms", DEFAULT_LINGER_MS)
            if window == DEFAULT_IN_PLACE_MS and linger == DEFAULT_LINGER_MS:
                ratios.append((name, steady, delivering))
            elif linger != DEFAULT_LINGER_MS:
                others.append(f"{name} linger {linger / 1000:g} s {steady:.2f}")
            else:
                others.append(f"{name} in place {window / 1000:g} s {steady:.2f}")
    if ratios:
        # Judged like the throughput target, on the steady window; the first-to-last rate also
        # holds the retry tail, whose length the backoff policy sets (shown for completeness).
        out["10% failures >= 0.8x"] = {  # issue 13's target
            "verdict": "met" if all(x >= 0.8 for _, x, _ in ratios) else "NOT met",
            "detail": "steady rate with/without failures: "
            + ", ".join(f"{n} {x:.2f}" for n, x, _ in ratios)
            + "; first-to-last delivery: "
            + ", ".join(f"{n} {y:.2f}" for n, _, y in ratios)
            + ("; not judged (policy not the default): " + ", ".join(others) if others else ""),
        }
    out.update(library_targets(rows))
    return out


def library_targets(rows: list[dict]) -> dict:
    """Issue 28's targets for the library runtime, judged on this run's rows: one member
    without failures >= 1.3x the peer's steady rate at <= 40 µs of CPU a message, >= 0.8x of
    its own healthy rate with 10% failing, p99 < 50 ms at the latency run's load, and the
    first delivery < 2 s after the process started."""
    out = {}
    lib = [r for r in rows if r.get("library_members") == 1 and r.get("steady_msg_s")]
    healthy = next((r for r in lib if not r["fail_rate"]), None)
    peer = next(
        (r for r in rows if r.get("peer") and not r["fail_rate"] and r.get("steady_msg_s")), None
    )
    if healthy and peer:
        ratio = healthy["steady_msg_s"] / peer["steady_msg_s"]
        cpu = healthy.get("steady_cpu_ms_per_1k")
        met = ratio >= 1.3 and cpu is not None and cpu <= 40
        out["library >= 1.3x peer, <= 40 µs/msg"] = {
            "verdict": "met" if met else "NOT met",
            "detail": f"1 member, steady: {healthy['steady_msg_s']:,} msg/s vs the peer's "
            f"{peer['steady_msg_s']:,} = {ratio:.2f}x, {cpu} µs of the member's CPU a message",
        }
    for failing in (r for r in lib if r["fail_rate"] and healthy):
        ratio = failing["steady_msg_s"] / healthy["steady_msg_s"]
        first_to_last = failing["delivering_msg_s"] / healthy["delivering_msg_s"]
        window = failing.get("in_place_window_ms", DEFAULT_IN_PLACE_MS)
        schedule = (
            f"retries due within {window / 1000:g} s of the first failure wait in the member, "
            "later ones go through the RQ"
            if window
            else "every retry goes through the RQ"
        )
        label = "" if window == DEFAULT_IN_PLACE_MS else f" (in place {window / 1000:g} s)"
        out[f"library {failing['fail_rate']:.0%} failures >= 0.8x{label}"] = {
            "verdict": "met" if ratio >= 0.8 else "NOT met",
            "detail": f"steady {ratio:.2f}, first-to-last {first_to_last:.2f}; backoff 1 s, "
            f"exponential, 20% jitter: {schedule}",
        }
    lat = next((r for r in rows if r["run"].startswith("library latency")), None)
    if lat and lat.get("latency"):
        p99 = lat["latency"]["p99_ms"]
        out[f"library p99 < 50 ms at {lat['offered_msg_s']:,} msg/s"] = {
            "verdict": "met" if p99 < 50 else "NOT met",
            "detail": f"p50 {lat['latency']['p50_ms']} ms, p99 {p99} ms",
        }
    if healthy and "first_delivery_s" in healthy:
        first = healthy["first_delivery_s"]
        out["library first delivery < 2 s"] = {
            "verdict": "met" if first < 2 else "NOT met",
            "detail": f"{first} s from the process's start (Python imports, catalog, join)",
        }
    return out


def _consumer(row: dict) -> tuple | None:
    """What a row's no-failure twin shares with it: the consumer and its settings (not the
    failure rate, nor the retry policy); None for rows that have no twin."""
    if row.get("peer"):
        return ("peer", row["peer"])
    if "library_members" in row:
        return ("library", row["library_members"])
    if "shards" in row:
        return ("shard", row["shards"], row["grouped"], row.get("journal_interval_ms"))
    return None


def no_failure_twin(row: dict, rows: list[dict]) -> dict | None:
    """The first row of the same consumer (`_consumer`) without failures that has a steady rate."""
    key = _consumer(row)
    if key is None:
        return None
    return next(
        (
            x
            for x in rows
            if x.get("fail_rate") == 0 and x.get("steady_msg_s") and _consumer(x) == key
        ),
        None,
    )


def ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Each row's steady rate over the steady rate of: the same consumer without failures
    (`no_failures`, rows with failures only), the best baseline (`baseline`), the peer at the same
    failure rate (`peer`; the baseline counts as 0%) and wrk's ceiling (`ceiling`), by the row's
    `run`, two decimals. A reference is left out of its own ratios; rows without a steady rate
    (latency, crash) and the ceiling have none."""

    def steady(r: dict) -> int | None:
        return r.get("steady_msg_s")

    ceiling = next((r for r in rows if r["run"].startswith("ceiling") and steady(r)), None)
    base = max(
        (r for r in rows if r["run"].startswith("baseline") and steady(r)), key=steady, default=None
    )
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        if not steady(r) or r is ceiling:
            continue
        fail = r.get("fail_rate", 0)
        peer = next(
            (x for x in rows if x.get("peer") and x["fail_rate"] == fail and steady(x)), None
        )
        twin = no_failure_twin(r, rows) if fail else None
        refs = {"no_failures": twin, "baseline": base, "peer": peer, "ceiling": ceiling}
        mine = {k: round(steady(r) / steady(x), 2) for k, x in refs.items() if x and x is not r}
        if mine:
            out[r["run"]] = mine
    return out


def print_ratios(by_run: dict[str, dict[str, float]]) -> None:
    if not by_run:
        return
    columns = ("no_failures", "baseline", "peer", "ceiling")
    print()
    print(f"{'steady msg/s over:':<52} " + " ".join(f"{c:>11}" for c in columns))
    for run, mine in by_run.items():
        print(f"{run[:52]:<52} " + " ".join(f"{mine.get(c, '-'):>11}" for c in columns))
    print(
        "no_failures = the same consumer without failures; baseline = the best baseline (no "
        "failures);\npeer = Parallel Consumer at the same failure rate; ceiling = wrk's req/s."
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults that depend on other arguments filled in."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=200_000, help="backlog of a throughput run")
    parser.add_argument(
        "--fail-messages",
        type=int,
        default=None,
        help="backlog of a run with failures (default: --messages, the same backlog as the runs "
        "without)",
    )
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4, help="main topic partitions")
    parser.add_argument("--only", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--shards", nargs="+", type=int, default=[1, 2])
    parser.add_argument(
        "--library-members",
        nargs="+",
        type=int,
        default=[1, 2],
        help="member processes of the library runs, one set of runs per value",
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["grouped", "ungrouped"], default=["grouped", "ungrouped"]
    )
    parser.add_argument("--fail-rates", nargs="+", type=float, default=[0.0, 0.1])
    parser.add_argument(
        "--in-place-windows",
        nargs="+",
        type=int,
        default=[DEFAULT_IN_PLACE_MS],
        metavar="MS",
        help="retry.in_place_window of the runs with failures, one set of runs per value "
        f"(default: the policy's {DEFAULT_IN_PLACE_MS} ms; 0 sends every retry through the RQ)",
    )
    parser.add_argument(
        "--in-place-lingers",
        nargs="+",
        type=int,
        default=[DEFAULT_LINGER_MS],
        metavar="MS",
        help="retry.in_place_linger of the runs with failures, one set of runs per value: how "
        "long a task may wait past its other deliveries for its retries (default: the policy's "
        f"{DEFAULT_LINGER_MS} ms)",
    )
    parser.add_argument(
        "--journal-intervals",
        nargs="+",
        type=int,
        default=[DEFAULT_JOURNAL_MS],
        metavar="MS",
        help="consumption.journal_interval of the shard and crash runs, one set of runs per "
        f"value (default: the policy's {DEFAULT_JOURNAL_MS} ms; 0: no delivery journal)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the shard runs this many times, interleaved"
    )
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per crash run")
    parser.add_argument(
        "--kill-window",
        nargs=2,
        type=float,
        default=[0.0, 5.0],
        metavar=("FROM", "TO"),
        help="a crash run kills its shard at a moment drawn in this many seconds after the "
        "run's first delivery",
    )
    parser.add_argument(
        "--crash-seeds", nargs="+", type=int, default=[1, 2], help="one crash run per seed"
    )
    parser.add_argument(
        "--crash-batch",
        type=int,
        default=ConsumptionPolicy().max_messages_per_batch,
        help="consumption.max_messages_per_batch of the crash runs (default: the policy's)",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="consumption.concurrency")
    parser.add_argument("--max-in-flight", type=int, default=64, help="consumption.max_in_flight")
    parser.add_argument(
        "--batch",
        type=int,
        default=50_000,
        help="consumption.max_messages_per_batch (50,000: several batches per shard, so the "
        "steady window spans batch boundaries even with two shards)",
    )
    parser.add_argument("--trigger-ms", type=int, default=500, help="trigger of throughput runs")
    parser.add_argument("--latency-trigger-ms", type=int, default=100)
    parser.add_argument(
        "--latency-concurrency",
        type=int,
        default=1,
        help="consumption.concurrency of the latency run (1: one delivery task per micro-batch, "
        "what a low-volume, latency-sensitive subscription would set)",
    )
    parser.add_argument("--rate", type=int, default=1000, help="offered load of the latency run")
    parser.add_argument("--latency-s", type=float, default=60)
    parser.add_argument("--warmup-s", type=float, default=10)
    parser.add_argument("--baseline-poll-records", nargs="+", type=int, default=[500, 5000])
    parser.add_argument("--idle-s", type=float, default=3, help="--stop-when-idle of the shards")
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--wrk-seconds", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep topics, warehouse and logs")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the shards' and nginx's logs"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.fail_messages is None:
        args.fail_messages = args.messages
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nginx_bin, wrk_bin = nginx_binary(), shutil.which("wrk")
    if not nginx_bin:
        print(
            "skipping every delivery run: no nginx (apt-get install nginx-light)", file=sys.stderr
        )
        return 2
    load_at_start = os.getloadavg()
    env = Env(keep=args.keep)
    logdir = Path(tempfile.mkdtemp(prefix="varadhi-bench-delivery-logs-"))
    rows: list[dict] = []
    doc: dict = {
        "benchmark": "delivery",
        "command": "python bench/delivery.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(load_at_start),
        "kafka_python_crc32c": "C (crc32c package)"
        if record_util.crc32c_c is not None
        else "pure Python (the baseline skips CRC checks)",
        "settings": {
            k: getattr(args, k)
            for k in (
                "messages",
                "fail_messages",
                "groups",
                "partitions",
                "concurrency",
                "max_in_flight",
                "batch",
                "trigger_ms",
                "latency_trigger_ms",
                "latency_concurrency",
                "rate",
                "idle_s",
                "in_place_windows",
                "in_place_lingers",
                "journal_intervals",
                "repeat",
                "kills",
                "kill_window",
                "crash_seeds",
                "crash_batch",
            )
        },
        "rows": rows,
    }
    peer: tuple[Path, str] | str | None = None
    if "peer" in args.only:  # built first: a failed build is seen before the backlog
        peer = build_peer()
        if isinstance(peer, str):
            print(f"skipping the peer rows: {peer}", file=sys.stderr)
        else:
            jar = peer[0].relative_to(ROOT) if peer[0].is_relative_to(ROOT) else peer[0]
            doc["peer"] = {"jar": str(jar), "parallel_consumer": peer[1]}
    try:
        needs_backlog = {"baseline", "peer", "library", "shard", "crash"} & set(args.only)
        if needs_backlog:
            topic = f"bench-{env.tag}-backlog"
            TopicService(env.catalog).create(topic, args.partitions)
            doc["backlog"] = produce_backlog(env, topic, args.messages, args.groups)
            print(
                f"backlog: {args.messages:,} messages in {doc['backlog']['seconds']} s", flush=True
            )
            storage = f"{topic}.0"

        def backlog_for(fail_rate: float) -> tuple[str, int]:
            """(varadhi topic, messages) a run with this failure rate reads: the main backlog,
            or with failures and a different `--fail-messages`, its own (produced once)."""
            if fail_rate == 0 or args.fail_messages == args.messages:
                return topic, args.messages
            fail_topic = f"bench-{env.tag}-backlog-f"
            if "fail_backlog" not in doc:
                TopicService(env.catalog).create(fail_topic, args.partitions)
                doc["fail_backlog"] = produce_backlog(
                    env, fail_topic, args.fail_messages, args.groups
                )
            return fail_topic, args.fail_messages

        if "ceiling" in args.only:
            if wrk_bin:
                with nginx(nginx_bin) as endpoint:
                    w = run_wrk(wrk_bin, endpoint.url, args.max_in_flight, args.wrk_seconds)
                rows.append(
                    {
                        "run": f"ceiling: wrk -t1 -c{args.max_in_flight} (req/s)",
                        "overall_msg_s": w["req_per_s"],
                        "delivering_msg_s": w["req_per_s"],
                        "steady_msg_s": w["req_per_s"],
                        **w,
                    }
                )
                print(f"ceiling: {w['req_per_s']:,} req/s", flush=True)
            else:
                print("skipped the ceiling: no wrk (apt-get install wrk)", file=sys.stderr)
        if "baseline" in args.only:
            for poll in args.baseline_poll_records:
                row = run_baseline(env, nginx_bin, storage, args.messages, poll, args)
                rows.append(row)
                print(f"{row['run']}: steady {row.get('steady_msg_s')} msg/s", flush=True)
        if isinstance(peer, tuple):
            for fail_rate in args.fail_rates:
                source, size = backlog_for(fail_rate)
                row = run_peer(env, nginx_bin, peer, f"{source}.0", size, fail_rate, args, logdir)
                rows.append(row)
                print(f"{row['run']}: steady {row.get('steady_msg_s')} msg/s", flush=True)
        if "library" in args.only:
            for fail_rate, members in itertools.product(args.fail_rates, args.library_members):
                source, size = backlog_for(fail_rate)
                windows = args.in_place_windows if fail_rate > 0 else [DEFAULT_IN_PLACE_MS]
                for window in windows:
                    row = run_library(
                        env, nginx_bin, source, size, members, fail_rate, window, args, logdir
                    )
                    rows.append(row)
                    print(
                        f"{row['run']}: steady {row.get('steady_msg_s')} msg/s, first delivery "
                        f"{row.get('first_delivery_s')} s, {row.get('steady_cpu_ms_per_1k')} CPU "
                        "ms/1k",
                        flush=True,
                    )
        if "shard" in args.only:
            for fail_rate in args.fail_rates:
                source, size = backlog_for(fail_rate)
                windows = args.in_place_windows if fail_rate > 0 else [DEFAULT_IN_PLACE_MS]
                lingers = args.in_place_lingers if fail_rate > 0 else [DEFAULT_LINGER_MS]
                for repeat, window, linger, shards, mode, journal_ms in itertools.product(
                    range(args.repeat),
                    windows,
                    lingers,
                    args.shards,
                    args.modes,
                    args.journal_intervals,
                ):
                    row = run_shards(
                        env,
                        nginx_bin,
                        source,
                        size,
                        shards,
                        mode == "grouped",
                        fail_rate,
                        window,
                        args,
                        logdir,
                        journal_ms=journal_ms,
                        repeat=repeat if args.repeat > 1 else 0,
                        linger_ms=linger,
                    )
                    rows.append(row)
                    print(
                        f"{row['run']}: {row.get('delivering_msg_s')} msg/s delivering, "
                        f"{row.get('steady_msg_s')} steady; {row['shard_batches']}",
                        flush=True,
                    )
        if "crash" in args.only:
            for seed, journal_ms in itertools.product(args.crash_seeds, args.journal_intervals):
                row = run_crash(
                    env, nginx_bin, topic, args.messages, journal_ms, seed, args, logdir
                )
                rows.append(row)
                print(
                    f"{row['run']}: {row['duplicates']:,} duplicates of {row['delivered']:,} "
                    f"deliveries ({row['duplicate_pct']}%); kills {row['kills']}; skipped "
                    f"{row['skipped_replayed_per_restart']}",
                    flush=True,
                )
        if "latency" in args.only:
            row = run_latency(env, nginx_bin, args, logdir)
            rows.append(row)
            print(f"{row['run']}: {row['latency']}", flush=True)
        if "library-latency" in args.only:
            row = run_library_latency(env, nginx_bin, args, logdir)
            rows.append(row)
            print(f"{row['run']}: {row['latency']}", flush=True)
    finally:
        env.close()
        if not (args.keep or args.keep_logs):
            shutil.rmtree(logdir, ignore_errors=True)
        else:
            print(f"kept logs in {logdir}")
    doc["targets"] = targets(rows)
    doc["ratios"] = ratios(rows)
    print_table(doc)
    print_ratios(doc["ratios"])
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
