"""Throughput of one shard draining a backlog in batch mode (10 and 100 messages per request)
against single mode (one message per request), in the same run.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/batch_delivery.py [--messages 20000] [--groups 1000] [--repeat 2]
        [--latency-ms 0]

A backlog of `--messages` 1 KiB messages over `--groups` groups is produced once (bench/filter.py's
producer). Each run is a fresh grouped subscription (one shard, run in this process as
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

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

from common import machine, write_results
from delivery import Env
from filter import TimedShard, produce, start_endpoint
from varadhi.subscriptions import SubscriptionService, parse_spec
from varadhi.topics import TopicService

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "batch_delivery.json"
MODES = {
    "single": {"mode": "single"},
    "batch10": {"mode": "batch", "max_messages": 10},
    "batch100": {"mode": "batch", "max_messages": 100},
}


def requests_so_far(url: str, kind: str) -> int:
    """HTTP requests the endpoint answered so far, of single mode or of batches."""
    with urllib.request.urlopen(url + "stats", timeout=60) as answer:
        stats = json.load(answer)
    return stats["requests"] if kind == "single" else stats["batch_requests"]


def run(env: Env, spark, topic: str, url: str, kind: str, n: int, args) -> dict:
    name = f"bench-{env.tag}-{kind}-{n}"
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "consumption": {"max_messages_per_batch": args.batch, "trigger_interval": 0},
        "delivery": MODES[kind],
    }
    SubscriptionService(env.catalog).create(parse_spec(doc, "bench"))
    before = requests_so_far(url, kind)
    job = TimedShard(name, 0, env.settings, spark=spark, stop_when_idle_s=3)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = job.run()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    if code != 0:
        raise SystemExit(f"run {name} ended with exit code {code}")
    seconds = job.batches[-1][1] - job.batches[0][0]
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
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--groups", type=int, default=1_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100_000, help="max_messages_per_batch")
    parser.add_argument("--latency-ms", type=int, default=0, help="the endpoint's answer time")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of the three runs")
    parser.add_argument("--keep", action="store_true", help="keep the topics and warehouse")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from varadhi.spark import get_spark

    load_at_start = os.getloadavg()
    env = Env(keep=args.keep)
    proc = None
    try:
        topic = f"bench-{env.tag}"
        TopicService(env.catalog).create(topic, args.partitions)
        produced_s = produce(env, topic, args.messages, args.groups)
        print(f"produced {args.messages:,} messages in {produced_s:.1f} s")
        proc, url = start_endpoint("--latency-ms", str(args.latency_ms))
        spark = get_spark("varadhi-bench-batch-delivery")
        rows = [
            run(env, spark, topic, url, kind, n, args) for n in range(args.repeat) for kind in MODES
        ]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        env.close()
    print(
        f"{'run':>9} {'batches':>8} {'drain s':>8} {'delivered':>10} {'deliv/s':>8} "
        f"{'requests':>9} {'msg/req':>8}"
    )
    for r in rows:
        print(
            f"{r['run']:>9} {r['batches']:>8} {r['drain_s']:>8} {r['delivered']:>10,} "
            f"{r['delivered_per_s']:>8,} {r['requests']:>9,} {r['messages_per_request']:>8}"
        )
    doc = {
        "benchmark": "batch_delivery",
        "command": "python bench/batch_delivery.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(
            load_at_start, load_average_at_end=[round(x, 2) for x in os.getloadavg()]
        ),
        "settings": {
            "messages": args.messages,
            "groups": args.groups,
            "partitions": args.partitions,
            "max_messages_per_batch": args.batch,
            "endpoint_latency_ms": args.latency_ms,
            "modes": MODES,
        },
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
