"""The floor: what bare Spark Structured Streaming costs on this machine, with no varadhi code in
the query, next to issue 13's targets for one shard.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/floors.py [--only first latency cpu] [--first-repeat 3]

Every part runs bench/floor_job.py under the product's launcher (`./spark-submit.sh --job
../bench/floor_job`: the spark-submit, jars, class-data archive, local file system and settings
of a shard, and the session `varadhi.jobs.shard` builds), with the Kafka source options of a
shard's query, against private topics on the broker of `VARADHI_BOOTSTRAP` filled with the
varadhi producer (1 KiB values, key = group id, the varadhi headers), as bench/delivery.py does.
The query is a `foreachBatch` that coalesces each batch into the shard's tasks and hands them
to `mapInArrow` functions that do (nearly) nothing (bench/floor_job.py's table):

| part      | what it measures (issue 13 target)                                                  |
|-----------|-------------------------------------------------------------------------------------|
| `first`   | `spark-submit` to the end of the first batch of `--first-messages` waiting records,  |
|           | Python task doing nothing (first delivery <= 8 s): JVM up (Python started), session |
|           | ready, query started, first batch planned, first record in a Python task, batch done |
|           | and committed; `--first-repeat` launches, CPU seconds of every process by the end    |
| `latency` | a producer pacing `--rate` msg/s; the product's latency run's query (trigger         |
|           | `--latency-trigger-ms`, one task, at most `--batch` a batch); per record, the task's |
|           | clock minus the Kafka timestamp (the send), when the task sees the record (`arrow`)  |
|           | and when its POST to nginx is answered (`http`, the product's HTTP engine): p50, p90,|
|           | p99 over `--latency-s` after a burst and `--warmup-s` (p99 < 500 ms)                 |
| `cpu`     | a `--cpu-messages` backlog read from the start in batches of `--batch`, `--concurrency`|
|           | tasks (the throughput runs' shard): `noop` (Kafka source to Spark's noop sink),      |
|           | `arrow` (to a `mapInArrow` function that reads nothing), `http` (that, plus one POST |
|           | per record through the product's HTTP engine); CPU µs per message of the JVM and the  |
|           | Python workers (and the driver's Python), from /proc, median of `--cpu-repeat` passes |
|           | after a warm-up pass of each (<= 50 µs per message)                                  |

Each figure is set against its target with a verdict: a floor at or above the target means no
code on Spark can meet it on this machine; below it, the product's excess over the floor is the
gap to close. CPU time moves much less with other work on the machine than wall time, but every
figure is inflated by load: write the load average down (the results do) and compare within a
run. Needs Debian's nginx (`apt-get install nginx-light`) for the `http` rows. With the defaults
about 5 minutes on 2 quiet cores (an estimate: 2 x 75 s of paced load, three launches, 9 passes),
10-13 minutes at load 12-57. Results: a table on stdout, JSON in bench/results/floors.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from common import machine, nginx_binary, results_head, write_results
from delivery import CpuSampler, Env, latency_stats, nginx, pace, produce_backlog
from varadhi.kafka.producer import Producer
from varadhi.kafka.topics import TopicService

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "floors.json"
PARTS = ("first", "latency", "cpu")
TARGETS = {"first_s": 8.0, "p99_ms": 500.0, "cpu_us": 50.0}  # issue 13, part 3
# The first-batch timeline's phases, in order, and the event each ends with.
PHASES = (
    ("JVM up, Python started", "python_started"),
    ("Spark session ready", "session_ready"),
    ("query started", "query_started"),
    ("first batch planned", "batch_started"),
    ("first record in a Python task", "first_record_in_python"),
    ("first batch done", "batch_done"),
    ("first batch committed", "batch_committed"),
)


# -- pure helpers --------------------------------------------------------------------------------


def read_events(text: str) -> list[dict]:
    """The job's events file: one JSON object a line. A last line without its newline is being
    written and is left out."""
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]


def first_batch_timeline(events: list[dict], launched_s: float) -> dict[str, float]:
    """Seconds since launch at which each of `PHASES` ended, from a `first` job's events
    (`first record in a Python task` is a field of `batch_done`); phases without an event are
    left out."""
    at: dict[str, float] = {}
    for e in events:
        at.setdefault(e["event"], e["t"])
        if e["event"] == "batch_done" and e.get("first_record_in_python") is not None:
            at.setdefault("first_record_in_python", e["first_record_in_python"])
    return {name: round(at[ev] - launched_s, 2) for name, ev in PHASES if ev in at}


def latency_summary(pairs: list[tuple[float, float]], since_ms: float) -> dict:
    """p50/p90/p99/max of `seen - ts` (ms) over the (ts_ms, seen_ms) pairs sent at or after
    `since_ms` (nearest rank, as bench/delivery.py's `latencies`); {} without any."""
    return latency_stats([seen - ts for ts, seen in pairs if ts >= since_ms])


@dataclass(frozen=True)
class Pass:
    """One measured pass of a `cpu` job: its task, label and wall-clock bounds (epoch s)."""

    stage: str
    label: str
    t0: float
    t1: float
    records: int


def cpu_passes(events: list[dict]) -> list[Pass]:
    """The passes of a `cpu` job whose `stage_start` has its `stage_end`, in order."""
    out, open_ = [], None
    for e in events:
        if e["event"] == "stage_start":
            open_ = e
        elif e["event"] == "stage_end" and open_ is not None:
            out.append(Pass(e["stage"], e["label"], open_["t"], e["t"], e["records"]))
            open_ = None
    return out


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of `values` ({} without any)."""
    if not values:
        return {}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def us_per_message(seconds_by_kind: dict[str, float], records: int) -> dict[str, float]:
    """CPU seconds by process kind -> µs per message, with their `total`."""
    out = {k: round(v / records * 1e6, 1) for k, v in seconds_by_kind.items()}
    out["total"] = round(sum(seconds_by_kind.values()) / records * 1e6, 1)
    return out


def median_by_key(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of each key over `rows` (the keys of the first row)."""
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]} if rows else {}


def verdict(floor: float | None, target: float, product: str, load: float, cpus: int) -> str:
    """A plain statement of a floor against its target: at or above it, no code on Spark meets
    the target on this machine; below it, the gap between the product and the floor is the
    product's to close. Measured at a 1-minute `load` above the `cpus`, the floor is inflated by
    other work and the statement says so (judge on a quiet machine)."""
    if floor is None:
        return "not measured"
    if floor >= target:
        said = f"floor {floor:g} >= target {target:g}: cannot be met on Spark on this machine"
    else:
        said = (
            f"floor {floor:g} < target {target:g}: reachable in principle; the product's excess "
            f"over the floor ({product}) is the gap to close"
        )
    if load > cpus:
        said += (
            f" (measured at load {load:.1f} on {cpus} cores: inflated, judge on a quiet machine)"
        )
    return said


# -- running the job -----------------------------------------------------------------------------


class FloorJob:
    """bench/floor_job.py under `./spark-submit.sh` in its own process group, with an events
    file and a work folder (checkpoints, stop files) of its own."""

    def __init__(self, env: Env, topic: str, partitions: int, mode: str, logdir: Path, *opts: str):
        self.work = Path(tempfile.mkdtemp(prefix=f"floor-{mode}-", dir=logdir))
        self.events_path = self.work / "events.jsonl"
        self.events_path.touch()
        self.log = self.work / "job.log"
        cmd = [
            str(ROOT / "spark-submit.sh"),
            "--job",
            "../bench/floor_job",
            "--mode",
            mode,
            "--bootstrap",
            env.settings.bootstrap,
            "--topic",
            topic,
            "--partitions",
            str(partitions),
            "--events",
            str(self.events_path),
            "--work",
            str(self.work),
            *opts,
        ]
        with open(self.log, "w") as f:
            self.launched_s = time.time()
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )

    def events(self) -> list[dict]:
        return read_events(self.events_path.read_text())

    def wait_for(self, ok, timeout_s: float, what: str) -> list[dict]:
        """Until `ok(events)` holds; raises with the log's tail if the job ends or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.events()
            if ok(events):
                return events
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"floor job: no {what} (exit {self.proc.poll()}):\n{self.tail()}")

    def stop_variant(self, variant: str) -> None:
        (self.work / f"stop-{variant}").touch()

    def finish(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@contextmanager
def topic_with(env: Env, name: str, partitions: int, backlog: int, groups: int):
    """A composite topic `bench-<tag>-<name>` with `backlog` messages; yields its storage
    topic's name (Env.close deletes it)."""
    topic = f"bench-{env.tag}-{name}"
    TopicService(env.catalog).create(topic, partitions)
    if backlog:
        produce_backlog(env, topic, backlog, groups)
    yield topic, TopicService(env.catalog).get(topic).produce_topic.name


def run_first(env: Env, args, logdir: Path) -> dict:
    """`--first-repeat` launches, each to the end of its first batch."""
    runs = []
    with topic_with(env, "first", args.partitions, args.first_messages, args.groups) as (_, st):
        for i in range(args.first_repeat):
            load = os.getloadavg()[0]
            job = FloorJob(
                env, st, args.partitions, "first", logdir, "--concurrency", str(args.concurrency)
            )
            with CpuSampler({"job": [job.proc.pid]}) as cpu:
                try:
                    events = job.wait_for(
                        lambda ev: any(e["event"] == "done" for e in ev),
                        args.timeout_s,
                        "first batch",
                    )
                    done = next(e["t"] for e in events if e["event"] == "batch_done")
                    time.sleep(0.3)  # a sample after the batch's end
                finally:
                    code = job.finish(60)
            timeline = first_batch_timeline(events, job.launched_s)
            records = next(e["records"] for e in events if e["event"] == "batch_done")
            cpu_s = cpu.between("job", job.launched_s * 1000, done * 1000)
            runs.append(
                {
                    "run": i + 1,
                    "load_1m_at_start": round(load, 2),
                    "records_in_first_batch": records,
                    "timeline_s": timeline,
                    "cpu_s_by_first_batch_done": cpu_s,
                    "exit_code": code,
                }
            )
            print(
                f"first batch, run {i + 1} (load {load:.1f}): {timeline}, CPU s {cpu_s}", flush=True
            )
    return {
        "messages_waiting": args.first_messages,
        "runs": runs,
        "summary_s": {
            phase: spread([r["timeline_s"][phase] for r in runs if phase in r["timeline_s"]])
            for phase, _ in PHASES
        },
    }


def run_latency(env: Env, args, url: str, logdir: Path) -> dict:
    """One job, one query per variant in turn, each under the paced load."""
    out: dict = {"offered_msg_s": args.rate, "trigger_ms": args.latency_trigger_ms, "variants": {}}
    with topic_with(env, "latency", args.partitions, 0, args.groups) as (topic, st):
        job = FloorJob(
            env,
            st,
            args.partitions,
            "latency",
            logdir,
            "--concurrency",
            "1",
            "--trigger-ms",
            str(args.latency_trigger_ms),
            "--batch",
            str(args.batch),
            "--url",
            url,
            "--variants",
            *args.latency_variants,
        )
        try:
            with Producer(topic, env.settings, catalog=env.catalog) as producer:
                for variant in args.latency_variants:
                    out["variants"][variant] = latency_variant(job, producer, variant, args)
            code = job.finish(120)
        finally:
            job.kill()
        out["exit_code"] = code
    return out


def _samples(events: list[dict], variant: str) -> list[tuple[float, float]]:
    return [
        (ts, seen)
        for e in events
        if e["event"] == "latency" and e["variant"] == variant
        for ts, seen in e["samples"]
    ]


def latency_variant(job: FloorJob, producer: Producer, variant: str, args) -> dict:
    """A burst, its batch, then `--warmup-s` + `--latency-s` at `--rate`; then stop the query."""
    # Batch 0 fixes where "latest" is: records sent before it would never be read.
    job.wait_for(
        lambda ev: any(e["event"] == "latency" and e["variant"] == variant for e in ev),
        args.timeout_s,
        f"{variant} query's batch 0",
    )
    load = os.getloadavg()[0]
    warm = pace(producer, args.rate * 10, 0.5, args.groups, threading.Event())
    job.wait_for(lambda ev: len(_samples(ev, variant)) >= warm, args.timeout_s, "warm-up batch")
    started = time.time() * 1000
    sent = pace(producer, args.rate, args.warmup_s + args.latency_s, args.groups, threading.Event())
    try:
        events = job.wait_for(
            lambda ev: len(_samples(ev, variant)) >= warm + sent, 120, "every record seen"
        )
    finally:
        job.stop_variant(variant)
    pairs = _samples(events, variant)
    batches = [e for e in events if e["event"] == "latency" and e["variant"] == variant]
    measured = started + args.warmup_s * 1000
    sizes = [len(e["samples"]) for e in batches if e["started"] * 1000 >= measured]
    result = {
        "load_1m_at_start": round(load, 2),
        "warmup_messages": warm,
        "sent": sent,
        "seen": len(pairs),
        "latency": latency_summary(pairs, measured),
        "batches_while_measured": len(sizes),
        "mean_records_per_batch": round(statistics.mean(sizes), 1) if sizes else None,
    }
    print(f"latency, {variant} (load {load:.1f}): {result['latency']}", flush=True)
    return result


def run_cpu(env: Env, args, url: str, logdir: Path) -> dict:
    """One job: a warm-up pass of every stage, then `--cpu-repeat` rounds of every stage."""
    with topic_with(env, "cpu", args.partitions, args.cpu_messages, args.groups) as (_, st):
        load = os.getloadavg()[0]
        job = FloorJob(
            env,
            st,
            args.partitions,
            "cpu",
            logdir,
            "--concurrency",
            str(args.concurrency),
            "--trigger-ms",
            str(args.trigger_ms),
            "--batch",
            str(args.batch),
            "--url",
            url,
            "--stages",
            *args.cpu_stages,
            "--repeat",
            str(args.cpu_repeat),
            "--messages",
            str(args.cpu_messages),
        )
        with CpuSampler({"job": [job.proc.pid]}) as cpu:
            try:
                events = job.wait_for(
                    lambda ev: any(e["event"] == "done" for e in ev),
                    args.timeout_s * 4,
                    "cpu passes",
                )
            finally:
                code = job.finish(60)
    passes = []
    for p in cpu_passes(events):
        seconds = cpu.between("job", p.t0 * 1000, p.t1 * 1000)
        passes.append(
            {
                "stage": p.stage,
                "label": p.label,
                "seconds": round(p.t1 - p.t0, 2),
                "records": p.records,
                "cpu_us_per_msg": us_per_message(seconds, p.records),
            }
        )
    stages = {
        s: median_by_key(
            [p["cpu_us_per_msg"] for p in passes if p["stage"] == s and p["label"] != "warmup"]
        )
        for s in args.cpu_stages
    }
    for s, us in stages.items():
        print(f"cpu, {s} (load {load:.1f}): {us} µs/msg", flush=True)
    return {
        "messages": args.cpu_messages,
        "load_1m_at_start": round(load, 2),
        "cpu_us_per_msg": stages,
        "passes": passes,
        "exit_code": code,
    }


def verdicts(doc: dict) -> dict[str, str]:
    """Each part's floor against its issue 13 target (`verdict`): the fastest first batch, the
    lower p99 of the latency variants, the CPU per message of the `http` stage (else `arrow`),
    each with the load its part started at."""
    cpus = doc["machine"]["cpus"] or 1
    first = doc.get("first", {})
    # No delivery can come before a Python task has its first record.
    first_s = first.get("summary_s", {}).get("first record in a Python task", {}).get("min")
    first_load = max((r["load_1m_at_start"] for r in first.get("runs", [])), default=0.0)
    lat = [v for v in doc.get("latency", {}).get("variants", {}).values() if v.get("latency")]
    best = min(lat, key=lambda v: v["latency"]["p99_ms"], default=None)
    cpu = doc.get("cpu", {})
    by_stage = cpu.get("cpu_us_per_msg", {})
    cpu_floor = (by_stage.get("http") or by_stage.get("arrow") or {}).get("total")
    return {
        "first delivery <= 8 s": verdict(
            first_s, TARGETS["first_s"], "9.7-10.2 s quiet", first_load, cpus
        ),
        "p99 < 500 ms at 1,000 msg/s": verdict(
            best["latency"]["p99_ms"] if best else None,
            TARGETS["p99_ms"],
            "p99 783 ms quiet",
            best["load_1m_at_start"] if best else 0.0,
            cpus,
        ),
        "<= 50 µs CPU per message": verdict(
            cpu_floor, TARGETS["cpu_us"], "78 µs quiet", cpu.get("load_1m_at_start", 0.0), cpus
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--groups", type=int, default=10_000, help="group ids (Kafka keys)")
    p.add_argument("--concurrency", type=int, default=2, help="tasks a batch is coalesced into")
    p.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger")
    p.add_argument("--trigger-ms", type=int, default=500, help="trigger of the cpu passes")
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--first-repeat", type=int, default=3)
    p.add_argument("--first-messages", type=int, default=400)
    p.add_argument("--rate", type=int, default=1000)
    p.add_argument("--latency-trigger-ms", type=int, default=100)
    p.add_argument("--warmup-s", type=float, default=10)
    p.add_argument("--latency-s", type=float, default=60)
    p.add_argument(
        "--latency-variants", nargs="+", choices=("arrow", "http"), default=["arrow", "http"]
    )
    p.add_argument("--cpu-messages", type=int, default=200_000)
    p.add_argument(
        "--cpu-stages",
        nargs="+",
        choices=("noop", "arrow", "http"),
        default=["noop", "arrow", "http"],
    )
    p.add_argument("--cpu-repeat", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=300, help="per wait for the job")
    p.add_argument("--keep-logs", action="store_true", help="keep the jobs' logs and events")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    binary = nginx_binary()
    needs_http = ("latency" in args.only and "http" in args.latency_variants) or (
        "cpu" in args.only and "http" in args.cpu_stages
    )
    if needs_http and not binary:
        print("floors: no nginx for the http rows (apt-get install nginx-light)", file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()
    t0 = time.monotonic()
    logdir = Path(tempfile.mkdtemp(prefix="varadhi-bench-floors-"))
    doc = results_head("floors", argv, machine(load_at_start))
    doc["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    doc["targets"] = TARGETS
    env = Env()
    try:
        with ExitStack() as stack:
            url = stack.enter_context(nginx(binary)).url if needs_http else ""
            if "first" in args.only:
                doc["first"] = run_first(env, args, logdir)
            if "latency" in args.only:
                doc["latency"] = run_latency(env, args, url, logdir)
            if "cpu" in args.only:
                doc["cpu"] = run_cpu(env, args, url, logdir)
    finally:
        env.close()
        if args.keep_logs:
            print(f"kept the jobs' logs in {logdir}")
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    doc["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["seconds"] = round(time.monotonic() - t0)
    doc["verdicts"] = verdicts(doc)
    for target, said in doc["verdicts"].items():
        print(f"{target}: {said}")
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
