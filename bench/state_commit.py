"""CPU and wall time of one GroupState commit (`varadhi.spark.state_store.StateStore.commit`), what a
micro-batch with failures pays on top of delivery, in a local Spark session (no Kafka).

The state is what a grouped shard holds with 10% of attempts failing (docs/benchmarks.md,
"Delivery throughput and latency"): `--groups` groups waiting for a retry, each with its `rq`
head, its RQ record (an `out` row with a 1 KiB body) and `--held` followers parked with their
1 KiB bodies. Every commit replaces them with as many new groups (the state turns over: last
batch's groups were delivered), as a 50,000-record batch does. Variants, each on a new table:

- `bodies`: as above;
- `nobody`: the same rows without the followers' bodies (what a commit would cost if parked
  bodies were kept out of it).

CPU is the Spark JVM's (from /proc) plus this process's, per commit, median after the first
`--warmup` commits of each run. It follows the code it imports: run it with `PYTHONPATH` set to
a worktree of another commit to measure that one, back to back with this one:

    git worktree add /tmp/before <rev>
    PYTHONPATH=/tmp/before/lib .venv/bin/python bench/state_commit.py
    .venv/bin/python bench/state_commit.py

About 2 minutes on 2 cores. Results: bench/results/state_commit.json (`--out`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from common import machine, print_table, results_head, write_results
from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.core.state_frames import frame_of
from varadhi.core.state_rows import RESULT_COLUMNS, Kind, state_row, touched_row
from varadhi.spark.session import get_spark
from varadhi.spark.shard.commit import changes
from varadhi.spark.state_store import StateStore

RESULTS = Path(__file__).resolve().parent / "results" / "state_commit.json"
BODY = b"x" * 1024


def batch_result(batch: int, groups: int, held: int, bodies: bool):
    """What a batch's tasks return for `groups` new blocked groups (and the groups of the batch
    before, touched: delivered)."""
    rows = []
    for g in range(groups):
        key, first = f"g{batch}-{g}", batch * 1_000_000 + g * (held + 1)
        head = Entry(m.Origin(0, 0, first), f"m{first}", key, "rq", attempts=1, due_ms=1)
        head.reason, head.status = "HTTP 500", 500
        rows += [touched_row(f"g{batch - 1}-{g}"), state_row(Kind.PENDING, key, head)]
        rows.append(
            state_row(Kind.OUT, key, Entry(head.origin, head.msg_id, key, "held", BODY), "rq")
        )
        for i in range(1, held + 1):
            follower = Entry(
                m.Origin(0, 0, first + i), f"m{first + i}", key, "held", BODY if bodies else None
            )
            follower.source = f"t/0/{first + i}"
            rows.append(state_row(Kind.PENDING, key, follower))
    return frame_of(rows, RESULT_COLUMNS)


def jvm_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(spark, folder: str, variant: str, args) -> dict:
    path = f"{folder}/{variant}"
    shutil.rmtree(path, ignore_errors=True)
    jvm = spark.sparkContext._gateway.proc.pid
    store = StateStore(spark, path, "bench")
    cpu, wall = [], []
    for b in range(args.commits):
        result = batch_result(b, args.groups, args.held, variant == "bodies")
        touched, new_rows = changes(result, "bench", b)
        t0, j0, p0 = time.monotonic(), jvm_cpu_s(jvm), time.process_time()
        assert store.commit(touched, new_rows, "bench", b)
        wall.append(time.monotonic() - t0)
        cpu.append(jvm_cpu_s(jvm) - j0 + time.process_time() - p0)
    cpu, wall = cpu[args.warmup :], wall[args.warmup :]
    return {
        "variant": variant,
        "rows": len(store.frame),
        "cpu_s": round(statistics.median(cpu), 3),
        "cpu_s_mean": round(statistics.fmean(cpu), 3),
        "wall_s": round(statistics.median(wall), 3),
        "load": round(os.getloadavg()[0], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=500, help="blocked groups per commit")
    p.add_argument("--held", type=int, default=3, help="parked followers per group")
    p.add_argument("--commits", type=int, default=12, help="commits per run")
    p.add_argument("--warmup", type=int, default=2, help="first commits of a run left out")
    p.add_argument("--repeat", type=int, default=2, help="rounds of the variants, interleaved")
    p.add_argument("--variants", nargs="+", default=["bodies", "nobody"])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    load = os.getloadavg()
    spark = get_spark("bench-state-commit")
    rows = []
    with tempfile.TemporaryDirectory(prefix="varadhi-bench-state-") as folder:
        for r in range(args.repeat):
            for variant in args.variants:
                rows.append({"round": r, **run(spark, folder, variant, args)})
                print(rows[-1], flush=True)
    print_table(
        rows,
        [
            ("round", "round", 5, ""),
            ("variant", "variant", 8, ""),
            ("rows", "rows", 6, ","),
            ("CPU s", "cpu_s", 7, ".3f"),
            ("wall s", "wall_s", 7, ".3f"),
            ("load", "load", 5, ".1f"),
        ],
    )
    code = Path(__import__("varadhi").__file__).resolve().parents[2]
    rev = subprocess.run(
        ["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    doc = results_head("state_commit", None, machine(load)) | {"code": rev, "rows": rows}
    write_results(args.out, doc)


if __name__ == "__main__":
    main()
