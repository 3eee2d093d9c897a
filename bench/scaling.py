"""One shard on a Spark standalone cluster with 1 and with 2 executor cores: msg/s and CPU per
message by process (driver JVM, executor JVM, Python workers), draining a backlog into nginx.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/scaling.py [--messages 100000] [--groups 10000] [--cores 1 2]

Needs what bench/delivery.py needs (the local broker, the Spark jars, Debian's nginx) and
starts its own cluster with `scripts/spark-cluster` (one worker with max(--cores) cores, on a
folder of its own; stopped at the end). Each run is a fresh grouped subscription on one backlog
(`--messages` values of 1 KiB over `--groups` group ids, `--partitions` main-topic partitions),
`./spark-submit.sh SUB 0 --stop-when-idle 3` with `VARADHI_SPARK_MASTER=spark://...` and
`spark.cores.max` = the run's cores (one executor with that many cores), and
`consumption.concurrency` = the run's cores (one delivery task per core). nginx answers 204.

Rates come from nginx's access log and CPU from /proc, the way bench/delivery.py measures them
(its functions are used): `steady` = 80% of the messages / the time between the 10th and the 90th
percent delivered; CPU per 1,000 messages in that window, per process tree: `driver` (the
spark-submit JVM and the Python driver) and `executor` (the cluster's worker tree: the worker
daemon, idle, the executor JVM and its Python workers), and nginx and Kafka. On a shared,
loaded machine the rates move with the load (recorded per run); CPU per message moves less.

Results: a table on stdout, JSON in bench/results/scaling.json. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, nginx_binary, write_results
from delivery import (
    CpuSampler,
    Env,
    ShardProcesses,
    batch_summary,
    broker_pid,
    cpu_pressure,
    create_subscription,
    nginx,
    produce_backlog,
    steady_cpu,
    summarise,
)
from varadhi.kafka.topics import TopicService

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scaling.json"
CLUSTER = ROOT / "scripts" / "spark-cluster"


class ClusterEnv(Env):
    """The bench's catalog and warehouse, with spark-submit pointed at the cluster and a
    spark-defaults.conf (in `conf_dir`) that the run rewrites with its core count."""

    def __init__(self, master: str, conf_dir: Path, keep: bool = False):
        super().__init__(keep=keep)
        self.master, self.conf_dir = master, conf_dir

    def use_cores(self, cores: int) -> None:
        (self.conf_dir / "spark-defaults.conf").write_text(
            f"spark.cores.max {cores}\nspark.executor.memory 1g\n"
        )

    def spark_env(self) -> dict[str, str]:
        return {
            **super().spark_env(),
            "VARADHI_SPARK_MASTER": self.master,
            "SPARK_CONF_DIR": str(self.conf_dir),
        }


def start_cluster(folder: Path, cores: int) -> tuple[str, int]:
    """`scripts/spark-cluster start` on `folder` with `cores` worker cores: (master URL, worker
    pid)."""
    env = {
        **os.environ,
        "VARADHI_SPARK_CLUSTER_DIR": str(folder),
        "VARADHI_SPARK_WORKER_CORES": str(cores),
    }
    out = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the cluster did not start: {out.stderr.strip()}")
    return out.stdout.split()[-1], int((folder / "worker.pid").read_text())


def stop_cluster(folder: Path) -> None:
    env = {**os.environ, "VARADHI_SPARK_CLUSTER_DIR": str(folder)}
    subprocess.run([str(CLUSTER), "stop"], env=env, check=False)


def per_message(cpu: CpuSampler, tree: str, summary: dict) -> dict:
    """CPU ms per 1,000 messages of one tree in the steady window, total and by process kind."""
    figures = steady_cpu(cpu, tree, summary)
    return {
        "ms_per_1k": figures.get("steady_cpu_ms_per_1k"),
        "by_process": figures.get("steady_cpu_ms_per_1k_by_process", {}),
        "cores_busy": figures.get("steady_cpu_share"),
    }


def run(env: ClusterEnv, worker_pid: int, nginx_bin: str, topic: str, cores: int, args, logdir):
    """One shard with `cores` executor cores draining the backlog; one result row."""
    sub = f"bench-{env.tag}-c{cores}"
    env.use_cores(cores)
    with nginx(nginx_bin) as endpoint:
        create_subscription(env, sub, topic, endpoint.url, args, consumption={"concurrency": cores})
        load = os.getloadavg()
        started = time.time() * 1000
        procs = ShardProcesses(env, sub, 1, args.idle_s, logdir)
        roots = {
            "driver": [p.pid for p in procs.procs],
            "executor": [worker_pid],
            "nginx": [endpoint.proc.pid],
            "kafka": [pid for pid in [broker_pid()] if pid],
        }
        try:
            with CpuSampler(roots) as cpu:
                codes = procs.wait(args.run_timeout_s)
                pressure = cpu_pressure()
        finally:
            procs.stop()
        hits = endpoint.hits()
    summary = summarise(hits, args.messages, started)
    row = {
        "run": f"1 shard, {cores} executor core{'s' if cores > 1 else ''}",
        "executor_cores": cores,
        "concurrency": cores,
        "exit_codes": codes,
        **{k: summary.get(k) for k in ("complete", "delivered_unique", "first_delivery_s")},
        **{k: summary.get(k) for k in ("overall_msg_s", "delivering_msg_s", "steady_msg_s")},
        "cpu_ms_per_1k": {t: per_message(cpu, t, summary) for t in roots},
        "cpu_s_total": cpu.seconds(),
        "load_average_at_start": [round(x, 2) for x in load],
        "cpu_pressure_at_end": pressure,
        "shard_batches": batch_summary(procs.batches()),
    }
    if any(c != 0 for c in codes) or not row["complete"]:
        print(f"{row['run']}: exit codes {codes}\n{procs.tail()}", file=sys.stderr)
    return row


def print_table(rows: list[dict]) -> None:
    print()
    head = f"{'run':<26} {'steady':>7} {'deliver':>7} {'driver':>6} {'exec':>6} {'(jvm':>6} "
    print(head + f"{'py wk)':>6} {'nginx':>6} {'load':>5} {'ok':>3}")
    for r in rows:
        c = r["cpu_ms_per_1k"]
        ex = c["executor"]["by_process"]
        print(
            f"{r['run']:<26} {r['steady_msg_s'] or '-':>7} {r['delivering_msg_s'] or '-':>7} "
            f"{c['driver']['ms_per_1k'] or '-':>6} {c['executor']['ms_per_1k'] or '-':>6} "
            f"{ex.get('jvm', '-'):>6} {ex.get('python_workers', '-'):>6} "
            f"{c['nginx']['ms_per_1k'] or '-':>6} {r['load_average_at_start'][0]:>5} "
            f"{'yes' if r['complete'] else 'NO':>3}"
        )
    print(
        "steady/deliver: msg/s (10th-90th percent; first-last delivery). CPU: ms per 1,000\n"
        "messages in the steady window: driver (JVM + Python driver), exec (worker tree: executor\n"
        "JVM and Python workers). load: 1-minute load average at the run's start (2 cores)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=4, help="main topic partitions")
    parser.add_argument("--cores", nargs="+", type=int, default=[1, 2], help="executor cores")
    parser.add_argument("--max-in-flight", type=int, default=64, help="consumption.max_in_flight")
    parser.add_argument("--batch", type=int, default=25_000, help="max_messages_per_batch")
    parser.add_argument("--trigger-ms", type=int, default=500)
    parser.add_argument("--idle-s", type=float, default=3)
    parser.add_argument("--run-timeout-s", type=float, default=600)
    parser.add_argument("--keep", action="store_true", help="keep topics, warehouse and logs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.concurrency = 1  # create_subscription's default; each run sets its own

    nginx_bin = nginx_binary()
    if not nginx_bin:
        print("no nginx (apt-get install nginx-light)", file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="varadhi-bench-scaling-"))
    (work / "conf").mkdir()
    master, worker_pid = start_cluster(work / "cluster", max(args.cores))
    env = ClusterEnv(master, work / "conf", keep=args.keep)
    rows: list[dict] = []
    doc = {
        "benchmark": "scaling",
        "command": "python bench/scaling.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(load_at_start, cluster="standalone, 1 worker on loopback"),
        "settings": {
            k: getattr(args, k)
            for k in ("messages", "groups", "partitions", "cores", "max_in_flight", "batch")
        }
        | {"trigger_ms": args.trigger_ms, "grouped": True, "endpoint": "nginx, 204"},
        "rows": rows,
    }
    try:
        topic = f"bench-{env.tag}-backlog"
        TopicService(env.catalog).create(topic, args.partitions)
        doc["backlog"] = produce_backlog(env, topic, args.messages, args.groups)
        print(f"backlog: {args.messages:,} messages in {doc['backlog']['seconds']} s", flush=True)
        for cores in args.cores:
            row = run(env, worker_pid, nginx_bin, topic, cores, args, work)
            rows.append(row)
            print(f"{row['run']}: steady {row['steady_msg_s']} msg/s", flush=True)
    finally:
        env.close()
        stop_cluster(work / "cluster")
        if args.keep:
            print(f"kept logs and the cluster folder in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
