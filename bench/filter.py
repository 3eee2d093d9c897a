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

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_results
from delivery import Env
from varadhi.producer import Producer
from varadhi.shard import ShardJob
from varadhi.subscriptions import SubscriptionService, parse_spec
from varadhi.topics import TopicService

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "filter.json"
TYPES = 10
FILTERS = {"none": None, "drop90": {"header": "type", "in": ["type-0"]}}


class TimedShard(ShardJob):
    """A shard that notes when each micro-batch started and ended (`batches`, monotonic s)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[float, float]] = []

    def _finish_batch(self, batch_id, n_records, counts, started, pending, phases) -> None:
        super()._finish_batch(batch_id, n_records, counts, started, pending, phases)
        self.batches.append((started, time.monotonic()))


def produce(env: Env, topic: str, messages: int, groups: int) -> float:
    value = os.urandom(512).hex().encode()  # 1 KiB
    t0 = time.perf_counter()
    with Producer(topic, env.settings, catalog=env.catalog, batch_size=1 << 20, linger_ms=20) as p:
        for i in range(messages):
            p.send(value, group_id=f"group-{i % groups}", headers={"type": f"type-{i % TYPES}"})
        p.flush()
    return time.perf_counter() - t0


def start_endpoint(*options: str) -> tuple[subprocess.Popen, str]:
    """The test endpoint in its own process (`options`: its command line's), and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "varadhi.testing.endpoint", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise SystemExit(f"the test endpoint did not start (said {url!r})")
    return proc, url


def run(env: Env, spark, topic: str, url: str, kind: str, n: int, args) -> dict:
    name = f"bench-{env.tag}-{kind}-{n}"
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "consumption": {"max_messages_per_batch": args.batch, "trigger_interval": 0},
        "filter": FILTERS[kind],
    }
    SubscriptionService(env.catalog).create(parse_spec(doc, "bench"))
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
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--groups", type=int, default=1_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=100_000, help="max_messages_per_batch")
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs, interleaved")
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
        proc, url = start_endpoint()
        spark = get_spark("varadhi-bench-filter")
        rows = [
            run(env, spark, topic, url, kind, n, args)
            for n in range(args.repeat)
            for kind in FILTERS
        ]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        env.close()
    print(
        f"{'run':>7} {'batches':>8} {'drain s':>8} {'read/s':>8} {'delivered':>10} "
        f"{'filtered':>9} {'deliv/s':>8}"
    )
    for r in rows:
        print(
            f"{r['run']:>7} {r['batches']:>8} {r['drain_s']:>8} {r['read_per_s']:>8,} "
            f"{r['delivered']:>10,} {r['filtered']:>9,} {r['delivered_per_s']:>8,}"
        )
    doc = {
        "benchmark": "filter",
        "command": "python bench/filter.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(load_at_start),
        "settings": {
            "messages": args.messages,
            "groups": args.groups,
            "partitions": args.partitions,
            "max_messages_per_batch": args.batch,
            "filters": FILTERS,
        },
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
