"""Start-up time of subscription shards: from launch to the first HTTP delivery, phase by phase.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/startup.py [--scenarios one four] [--repeat 2]
    .venv/bin/python bench/startup.py --checkout before=/tmp/old-tree    # before/after in one run

Scenarios (each run is a new topic, subscription and warehouse on the shared broker; a backlog of
`--messages` 1 KiB messages over `--groups` groups is produced before the shards start):

| scenario | what starts at once                                                                  |
|----------|--------------------------------------------------------------------------------------|
| `one`    | `./spark-submit.sh SUB 0`: one shard of a 1-shard subscription (4 partitions)        |
| `four`   | a 2-shard subscription (8 partitions) changed to 4 shards by the documented path      |
|          | (pause, `change-shards --to 4 --feeders external`), then its 4 shards and 2 feeders   |
|          | (`./spark-submit.sh --job feeder`) started together, and `subscription resume`        |

The endpoint is the project's test endpoint (`varadhi.testing.endpoint`, in this process,
answering 200). A shard's first delivery is the endpoint's first request for a group the shard
owns; the run ends (SIGTERM to every shard) once each shard delivered, or after `--timeout`.

Per shard, the timeline comes from the job's `start-up:` log lines (`varadhi.spark.startup`: one INFO
line per phase), put on the bench's clock (seconds since the launch, i.e. `Popen`): the JVM,
Python, catalog read, Spark session, warehouse and catalog checks, lease, transactional
producer, last progress, GroupState table, checkpoint and journal, query started, first batch
planned, first batch done, and the first delivery seen by the endpoint. Code without those lines
(`--checkout` of an older tree) reports the first delivery only.

`--checkout NAME=PATH[:K=V,K=V]` adds a variant that runs another checkout's `spark-submit.sh`
with its `lib` first on PYTHONPATH (the venv and jars are this checkout's; every variant's `lib`
goes first, since the venv's editable install names one checkout's), with extra environment if
given; `--variant NAME:K=V,K=V` one that runs this checkout with extra environment
(a lever to measure, e.g. `--variant info:VARADHI_SPARK_LOG_LEVEL=INFO`). Variants alternate within
each repetition, so a comparison is fair on a machine whose load changes.

Results: a table on stdout, JSON in bench/results/startup.json (`--out`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import machine, write_results
from delivery import Env
from varadhi.core import routing
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "startup.json"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
PHASE = re.compile(
    r"start-up: (?P<what>.+?): (?P<phase>.+) in [\d,]+ ms \((?P<since>[\d,]+) ms since launch\)"
)


@dataclass
class Variant:
    name: str
    root: Path = ROOT
    env: dict[str, str] = field(default_factory=dict)

    def environ(self, env: Env) -> dict[str, str]:
        # The checkout's `lib` first, this one's too: the venv may name another checkout's
        # (an editable install's .pth), which would otherwise win over the checkout's own.
        out = {**env.spark_env(), **self.env}
        out["PYTHONPATH"] = os.pathsep.join(
            [str(self.root / "lib"), *filter(None, [out.get("PYTHONPATH")])]
        )
        return out


@dataclass
class Launched:
    """One process of a run: its command's log and when it was launched (epoch s)."""

    kind: str  # shard or feeder
    index: int
    proc: subprocess.Popen
    log: Path
    launched_s: float


def parse_variant(text: str) -> Variant:
    name, _, pairs = text.partition(":")
    env = dict(p.split("=", 1) for p in pairs.split(",") if p)
    return Variant(name, ROOT, env)


def parse_checkout(text: str) -> Variant:
    """`NAME=PATH[:K=V,K=V]`: another checkout, with extra environment if given."""
    name, _, rest = text.partition("=")
    path, _, pairs = rest.partition(":")
    root = Path(path).resolve()
    if not (root / "spark-submit.sh").is_file():
        raise SystemExit(f"--checkout {text}: no spark-submit.sh in {root}")
    return Variant(name, root, dict(p.split("=", 1) for p in pairs.split(",") if p))


def log_time_s(line: str) -> float | None:
    match = LOG_TIME.match(line)
    if not match:
        return None
    return (
        time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
    )


def timeline(log: Path, launched_s: float) -> dict[str, float]:
    """Phase -> seconds since launch, from a job's `start-up:` lines; `JVM started` from the
    first line's `since launch` (the launching process's start, as the job sees it)."""
    found: list[tuple[str, float, float]] = []  # phase, logged at (epoch s), since launch (s)
    for line in log.read_text(errors="replace").splitlines():
        match = PHASE.search(line)
        at = log_time_s(line)
        if match and at is not None:
            found.append((match["phase"], at, int(match["since"].replace(",", "")) / 1000))
    if not found:
        return {}
    # The job's launch on the bench's clock: a line logged as its phase ended says it exactly
    # (a phase dated back, "Python started", is logged later and gives a later figure).
    anchor = min(at - since for _, at, since in found)
    out = {"JVM started": round(anchor - launched_s, 2)}
    for phase, _, since in found:
        out.setdefault(phase, round(anchor + since - launched_s, 2))
    return out


def start(
    variant: Variant, env: Env, args: list[str], kind: str, index: int, logdir: Path, tag: str
) -> Launched:
    log = logdir / f"{tag}-{kind}-{index}.log"
    with open(log, "w") as f:
        launched = time.time()
        proc = subprocess.Popen(
            [str(variant.root / "spark-submit.sh"), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=variant.environ(env),
            cwd=variant.root,
            start_new_session=True,
        )
    return Launched(kind, index, proc, log, launched)


def stop(procs: list[Launched], sig: int = signal.SIGTERM) -> list[int | None]:
    for p in procs:
        if p.proc.poll() is None:
            try:
                os.killpg(p.proc.pid, sig)
            except ProcessLookupError:
                pass
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.proc.wait(60))
        except subprocess.TimeoutExpired:
            os.killpg(p.proc.pid, signal.SIGKILL)
            codes.append(p.proc.wait())
    return codes


_TICK = os.sysconf("SC_CLK_TCK")


class GroupCpu:
    """CPU seconds of each launched process's session (spark-submit's process, its JVM, Python
    driver and workers share the session `start` gives them; the workers' daemon has a process
    group of its own), from /proc: utime + stime, and cutime + cstime for children already
    waited for (spark-submit's launcher JVM). The largest figure seen per process counts, so a
    process's time stays counted after it exits."""

    def __init__(self, sids: list[int]):
        self.seen: dict[int, dict[int, float]] = {g: {} for g in sids}

    def sample(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[3]) in self.seen:
                cpu = sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK
                mine = self.seen[int(fields[3])]
                mine[int(entry)] = max(mine.get(int(entry), 0.0), cpu)

    def seconds(self, sid: int) -> float:
        return round(sum(self.seen[sid].values()), 2)


def varadhi(env: dict[str, str], *args: str) -> None:
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "varadhi"), *args], env=env, check=True, capture_output=True
    )


def produce(env: Env, topic: str, messages: int, groups: int) -> dict[str, int]:
    """Produce the backlog; group id -> main-topic partition."""
    value = os.urandom(512).hex().encode()
    parts: dict[str, int] = {}
    with Producer(topic, env.settings, catalog=env.catalog, linger_ms=20) as p:
        for i in range(messages):
            gid = f"group-{i % groups}"
            sent = p.send(value, group_id=gid)
            parts[gid] = sent.partition
        p.flush()
    return parts


def run_once(
    variant: Variant, scenario: str, args, env: Env, endpoint: TestEndpoint, logdir: Path, n: int
) -> dict:
    tag = f"{scenario}-{variant.name}-{n}"
    topic, sub = f"bench-{env.tag}-{tag}", f"bench-{env.tag}-{tag}-sub"
    shards, partitions = (1, 4) if scenario == "one" else (4, 8)
    TopicService(env.catalog).create(topic, partitions)
    spec = {
        "name": sub,
        "topic": topic,
        "endpoint": {"url": endpoint.url},
        "shards": 1 if scenario == "one" else 2,
        "grouped": True,
    }
    SubscriptionService(env.catalog).create(parse_spec(spec, "bench"))
    group_partition = produce(env, topic, args.messages, args.groups)
    shard_of = {
        g: routing.shard_of_partition(p, shards, partitions) for g, p in group_partition.items()
    }
    environ = variant.environ(env)
    procs: list[Launched] = []
    feeders: list[str] = []
    if scenario == "four":
        varadhi(environ, "subscription", "pause", sub)
        varadhi(environ, "subscription", "change-shards", sub, "--to", "4", "--feeders", "external")
        op = env.catalog.snapshot().get("operation", f"{sub}/change-shards") or {}
        feeders = [f["source"] for f in op.get("feeders", []) if not f.get("done")]
    since = len(endpoint.records())
    load = os.getloadavg()
    try:
        for shard in range(shards):
            procs.append(start(variant, env, [sub, str(shard)], "shard", shard, logdir, tag))
        for i, source in enumerate(feeders):
            job = ["--job", "feeder", "--subscription", sub, "--source", source]
            procs.append(start(variant, env, job, "feeder", i, logdir, tag))
        if scenario == "four":
            varadhi(environ, "subscription", "resume", sub)
        return measure(variant, scenario, args, endpoint, procs, shards, shard_of, since, load, n)
    finally:
        stop(procs, signal.SIGKILL)  # anything still running (an interrupted run): no leftovers


def wait(p: Launched, deadline: float) -> int | None:
    """`p`'s exit code, waiting until `deadline` (monotonic s) at most; None if still running."""
    try:
        return p.proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def measure(variant, scenario, args, endpoint, procs, shards, shard_of, since, load, n) -> dict:
    """Wait until every shard delivered once (or `--timeout`), stop the shards and read the
    logs: one result row."""
    first: dict[int, float] = {}
    cpu = GroupCpu([p.proc.pid for p in procs])
    cpu_at_last_first = None  # CPU s of every launched process when the last shard delivered
    deadline = time.monotonic() + args.timeout
    seen = since
    next_sample = 0.0
    while len(first) < shards and time.monotonic() < deadline:
        if time.monotonic() >= next_sample:
            cpu.sample()
            next_sample = time.monotonic() + 0.5
        for r in endpoint.records(seen):
            seen += 1
            s = shard_of.get(r.group_id or "")
            if s is not None and 200 <= r.status < 300 and s not in first:
                first[s] = r.received_ms / 1000
                if len(first) == shards:
                    cpu.sample()
                    cpu_at_last_first = round(sum(cpu.seconds(p.proc.pid) for p in procs), 2)
        if all(p.proc.poll() is not None for p in procs if p.kind == "shard"):
            break
        time.sleep(0.05)
    # Let the first batches log their end, then stop.
    wait_until = time.monotonic() + 15
    shard_procs = [p for p in procs if p.kind == "shard"]
    while time.monotonic() < wait_until and not all(
        "first batch done" in p.log.read_text(errors="replace") for p in shard_procs
    ):
        time.sleep(0.2)
    feeder_codes = [wait(p, deadline) for p in procs if p.kind == "feeder"]
    codes = stop(shard_procs)
    rows = []
    for p in procs:
        row: dict = {"kind": p.kind, "index": p.index, "phases": timeline(p.log, p.launched_s)}
        if p.kind == "shard" and p.index in first:
            row["first_delivery_s"] = round(first[p.index] - p.launched_s, 2)
        row["cpu_s_when_all_delivered"] = cpu.seconds(p.proc.pid)
        rows.append(row)
    launched0 = min(p.launched_s for p in procs)
    return {
        "variant": variant.name,
        "scenario": scenario,
        "repetition": n,
        "load_average_at_start": [round(x, 2) for x in load],
        "all_delivered_s": round(max(first.values()) - launched0, 2)
        if len(first) == shards
        else None,
        # CPU of every launched process (JVMs, Python drivers and workers) by then: it moves
        # much less with other load on the machine than the time does.
        "cpu_s_when_all_delivered": cpu_at_last_first,
        "shard_exits": codes,
        "feeder_exits": feeder_codes,
        "processes": rows,
    }


def median(values: list) -> float | None:
    ok = [v for v in values if v is not None]
    return round(statistics.median(ok), 2) if ok else None


def summary(runs: list[dict]) -> list[dict]:
    """Per (scenario, variant): the median, and every run's figure, of the time and CPU until
    every shard delivered once."""
    out = []
    keys = sorted({(r["scenario"], r["variant"]) for r in runs})
    for scenario, variant in keys:
        mine = [r for r in runs if (r["scenario"], r["variant"]) == (scenario, variant)]
        times = [r["all_delivered_s"] for r in mine]
        cpus = [r["cpu_s_when_all_delivered"] for r in mine]
        out.append(
            {
                "scenario": scenario,
                "variant": variant,
                "runs": len(mine),
                "all_delivered_s_median": median(times),
                "all_delivered_s": times,
                "cpu_s_median": median(cpus),
                "cpu_s": cpus,
            }
        )
    return out


def print_run(run: dict) -> None:
    print(
        f"\n== {run['scenario']} / {run['variant']} #{run['repetition']}: every shard delivered "
        f"after {run['all_delivered_s']} s, {run['cpu_s_when_all_delivered']} CPU s "
        f"(load {run['load_average_at_start'][0]}; shard exits "
        f"{run['shard_exits']}, feeder exits {run['feeder_exits']})"
    )
    for p in run["processes"]:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in p["phases"].items())
        first = p.get("first_delivery_s")
        print(
            f"  {p['kind']} {p['index']}: {phases}"
            + (f" | first delivery {first:.1f} s" if first else "")
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenarios", nargs="+", default=["one", "four"], choices=["one", "four"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--checkout", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,...")
    ap.add_argument("--no-current", action="store_true", help="run only the named variants")
    ap.add_argument("--logdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    variants = [parse_checkout(c) for c in args.checkout]
    if not args.no_current:
        variants.append(Variant("current"))
    variants += [parse_variant(v) for v in args.variant]
    env = Env()
    logdir = args.logdir or Path(env.warehouse) / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    runs: list[dict] = []
    try:
        with TestEndpoint() as endpoint:
            for n in range(args.repeat):
                for scenario in args.scenarios:
                    for variant in variants:
                        run = run_once(variant, scenario, args, env, endpoint, logdir, n)
                        print_run(run)
                        runs.append(run)
    finally:
        env.close()
    doc = {
        "command": " ".join(
            [Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]
        ),
        "machine": machine(load),
        "summary": summary(runs),
        "runs": runs,
    }
    print("\nsummary (from launch until every shard delivered once: seconds, CPU seconds):")
    for s in doc["summary"]:
        print(
            f"  {s['scenario']:5} {s['variant']:12} median {s['all_delivered_s_median']} s "
            f"{s['cpu_s_median']} CPU s; runs {s['all_delivered_s']} s, {s['cpu_s']} CPU s"
        )
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
