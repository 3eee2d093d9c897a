"""Throughput of one shard draining a backlog with a filter that drops 90% of it, against the
same shard with no filter.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/filter.py [--messages 50000] [--groups 1000] [--repeat 1]

A backlog of `--messages` 1 KiB messages over `--groups` groups is produced once, each with a
header `type` cycling over ten values (`type-0` .. `type-9`). Each run is a fresh grouped
subscription (one shard, run in this process as `ShardJob`, local Spark) on that backlog,
delivering to the project's test endpoint (`python -m varadhi.testing.endpoint`, its own process
on 127.0.0.1, answering 200 at once): `none` without a filter, `drop90` with
`filter: {header: type, in: [type-0]}`. Runs alternate (`--repeat` pairs).

Per run: the drain time (first micro-batch start to last micro-batch end, as the shard's batches
report them; JVM and query start-up excluded), records read per second (the whole backlog / drain
time), messages delivered, and the shard's `filtered` count. Expect `drop90` to read the backlog
several times faster: its dropped messages cost no Arrow transfer, no Python and no HTTP.

Uses its own catalog topic and warehouse (bench/delivery.py's `Env`), deleted at the end.
Results: a table on stdout, JSON in bench/results/filter.json. A few minutes on 2 cores.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common import machine, print_table, results_head, write_results
from delivery import Env
from harness import backlog_runs, backlog_settings, drain, parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "filter.json"
FILTERS = {"none": None, "drop90": {"header": "type", "in": ["type-0"]}}


COLUMNS = [
    ("run", "run", 7, ""),
    ("batches", "batches", 8, ""),
    ("drain s", "drain_s", 8, ""),
    ("read/s", "read_per_s", 8, ","),
    ("delivered", "delivered", 10, ","),
    ("filtered", "filtered", 9, ","),
    ("deliv/s", "delivered_per_s", 8, ","),
]


def run(env: Env, spark, topic: str, url: str, kind: str, n: int, args) -> dict:
    job = drain(env, spark, topic, url, f"{kind}-{n}", args.batch, filter=FILTERS[kind])
    seconds = job.drain_s
    s = job.stats
    return {
        "run": kind,
        "repeat": n,
        "batches": s.batches,
        "drain_s": round(seconds, 2),
        "read_per_s": round(args.messages / seconds),
        "delivered": s.delivered,
        "filtered": s.filtered,
        "delivered_per_s": round(s.delivered / seconds),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, RESULTS, backlog=50_000)
    p.add_argument("--repeat", type=int, default=1, help="pairs of runs, interleaved")
    args = p.parse_args(argv)

    load_at_start = os.getloadavg()
    rows = backlog_runs(args, "varadhi-bench-filter", FILTERS, run)
    print_table(rows, COLUMNS)
    doc = {
        **results_head("filter", argv, machine(load_at_start)),
        "settings": {
            **backlog_settings(args),
            "filters": FILTERS,
        },
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
