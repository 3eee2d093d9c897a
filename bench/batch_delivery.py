"""Throughput of one shard draining a backlog in batch mode (10 and 100 messages per request)
against single mode (one message per request), in the same run.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/batch_delivery.py [--messages 20000] [--groups 1000] [--repeat 2]
        [--latency-ms 0]

A backlog of `--messages` 1 KiB messages over `--groups` groups is produced once (bench/harness.py's
`produce`). Each run is a fresh grouped subscription (one shard, run in this process as
`ShardJob`, local Spark, default consumption policy: 2 delivery tasks of 64 requests in flight)
on that backlog, delivering to the project's test endpoint (`python -m varadhi.testing.endpoint`,
its own process on 127.0.0.1, answering 200 after `--latency-ms`): `single`, `batch10`
(`delivery: {mode: batch, max_messages: 10}`) and `batch100` (`max_messages: 100`). Runs
alternate (`--repeat` rounds of the three). The first round includes the session's warm-up (the
first query's code generation and Python workers), which slows its first run most: compare the
later rounds.

Per run: the drain time (first micro-batch start to last micro-batch end; JVM and query start-up
excluded), messages delivered per second, HTTP requests made (the endpoint's count) and messages
per request. A request carries at most one message per group, so batches fill only while many
groups have messages: `--groups` bounds the batch size a task can reach.

Uses its own catalog topic and warehouse (bench/delivery.py's `Env`), deleted at the end.
Results: a table on stdout, JSON in bench/results/batch_delivery.json. A few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

from common import machine, print_table, results_head, write_results
from delivery import Env
from harness import backlog_runs, backlog_settings, drain, parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "batch_delivery.json"
MODES = {
    "single": {"mode": "single"},
    "batch10": {"mode": "batch", "max_messages": 10},
    "batch100": {"mode": "batch", "max_messages": 100},
}
COLUMNS = [
    ("run", "run", 9, ""),
    ("batches", "batches", 8, ""),
    ("drain s", "drain_s", 8, ""),
    ("delivered", "delivered", 10, ","),
    ("deliv/s", "delivered_per_s", 8, ","),
    ("requests", "requests", 9, ","),
    ("msg/req", "messages_per_request", 8, ""),
]


def requests_so_far(url: str, kind: str) -> int:
    """HTTP requests the endpoint answered so far, of single mode or of batches."""
    with urllib.request.urlopen(url + "stats", timeout=60) as answer:
        stats = json.load(answer)
    return stats["requests"] if kind == "single" else stats["batch_requests"]


def run(env: Env, spark, topic: str, url: str, kind: str, n: int, args) -> dict:
    before = requests_so_far(url, kind)
    job = drain(env, spark, topic, url, f"{kind}-{n}", args.batch, delivery=MODES[kind])
    seconds = job.drain_s
    requests = requests_so_far(url, kind) - before
    s = job.stats
    return {
        "run": kind,
        "repeat": n,
        "batches": s.batches,
        "drain_s": round(seconds, 2),
        "delivered": s.delivered,
        "delivered_per_s": round(s.delivered / seconds),
        "requests": requests,
        "messages_per_request": round(s.delivered / requests, 1) if requests else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, RESULTS, backlog=20_000)
    p.add_argument("--latency-ms", type=int, default=0, help="the endpoint's answer time")
    p.add_argument("--repeat", type=int, default=2, help="rounds of the three runs")
    args = p.parse_args(argv)

    load_at_start = os.getloadavg()
    latency = ("--latency-ms", str(args.latency_ms))
    rows = backlog_runs(args, "varadhi-bench-batch-delivery", MODES, run, *latency)
    print_table(rows, COLUMNS)
    load_at_end = [round(x, 2) for x in os.getloadavg()]
    doc = {
        **results_head(
            "batch_delivery", argv, machine(load_at_start, load_average_at_end=load_at_end)
        ),
        "settings": {
            **backlog_settings(args),
            "endpoint_latency_ms": args.latency_ms,
            "modes": MODES,
        },
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
