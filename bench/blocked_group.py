"""A group blocked behind a dead letter while other groups flow: batch time and driver memory
over time.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/blocked_group.py [--minutes 10] [--rate 1000] [--blocked-rate 100]
                                            [--max-held N]

One grouped subscription (one shard, `ShardJob` in this process, local Spark, block mode)
delivers to the project's test endpoint (`python -m varadhi.testing.endpoint`, its own process on
127.0.0.1, answering 200 at once). A producer process paces `--rate` messages a second of 512
bytes over `--groups` groups for `--minutes`, and besides them `--blocked-rate` a second to one
more group, `blocked`, whose first message is over the subscription's `max_message_bytes`
(2,048): it is dead-lettered as malformed at once and blocks its group for the whole run, so
every later message of `blocked` queues behind it. `--max-held` sets the subscription's
`blocked.max_held` (left out: the default).

Every micro-batch the shard notes its wall time, and the driver's memory: the GroupState copy's
rows and bytes (`StateStore.frame`, bodies included), the driver Python process's resident set
(VmRSS) and the driver JVM's used heap (total - free, after whatever the last GC left). The
report gives, per `--bucket` seconds of the run: batches, median and max batch time, records
read, and the last sample of each memory figure. Flat columns are what the
`blocked` policy (docs/architecture.md, "A blocked group's state is bounded") is for.

Uses its own catalog topic and warehouse (bench/delivery.py's `Env`), deleted at the end.
Results: a table on stdout, JSON in bench/results/blocked_group.json.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from common import endpoint_process, machine, print_table, results_head, write_results
from harness import bench_topic, parser, run_shard
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.spark.shard.job import ShardJob

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "blocked_group.json"
MAX_MESSAGE_BYTES = 2048
BLOCKED = "blocked"
COLUMNS = [
    ("from s", "from_s", 6, ".0f"),
    ("batches", "batches", 7, ""),
    ("records", "records", 8, ","),
    ("batch s", "batch_s_median", 7, ""),
    ("max s", "batch_s_max", 6, ""),
    ("state rows", "state_rows", 10, ","),
    ("blocked", "blocked_rows", 7, ","),
    ("state MiB", "state_mib", 9, ""),
    ("RSS MiB", "driver_rss_mib", 8, ""),
    ("JVM MiB", "jvm_heap_mib", 8, ""),
]


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class SampledShard(ShardJob):
    """A shard that samples batch time and driver memory after every micro-batch (its batch
    hook, on the batch's thread, once the batch committed)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples: list[dict] = []
        self.t0 = time.monotonic()
        self.batch_hooks.append(self._sample)

    def _sample(self, last_batch: dict, _summary: dict) -> None:
        state = self.state
        frame = state.frame if state is not None else None
        runtime = self.spark.sparkContext._jvm.java.lang.Runtime.getRuntime()
        blocked = state.pending().get(BLOCKED, []) if state is not None else []
        self.samples.append(
            {
                "t": round(time.monotonic() - self.t0, 2),
                "batch_s": last_batch["seconds"],
                "records": last_batch["records"],
                "state_rows": 0 if frame is None else len(frame),
                "state_bytes": 0 if frame is None else int(frame.memory_usage(deep=True).sum()),
                "blocked_rows": len(blocked),
                "driver_rss": rss_bytes(),
                "jvm_heap_used": int(runtime.totalMemory() - runtime.freeMemory()),
            }
        )


def pace(settings_env: dict, topic: str, rate: int, blocked_rate: int, groups: int, seconds: float):
    """The producer process: `rate` msg/s over `groups` groups plus `blocked_rate` msg/s to
    `blocked` (its first message over the subscription's limit), for `seconds`."""
    os.environ.update(settings_env)
    from varadhi.kafka.producer import Producer
    from varadhi.kafka.settings import Settings

    body = os.urandom(256).hex().encode()  # 512 bytes
    sent = blocked_sent = 0
    with Producer(topic, Settings.from_env(), linger_ms=20) as p:
        p.send(b"x" * (MAX_MESSAGE_BYTES + 1000), group_id=BLOCKED, message_id=f"{BLOCKED}.0")
        blocked_sent = 1
        t0 = time.monotonic()
        while (now := time.monotonic() - t0) < seconds:
            while sent < now * rate:
                p.send(body, group_id=f"group-{sent % groups}")
                sent += 1
            while blocked_sent < now * blocked_rate:
                p.send(body, group_id=BLOCKED, message_id=f"{BLOCKED}.{blocked_sent}")
                blocked_sent += 1
            time.sleep(0.01)
        p.flush()
    print(f"produced {sent:,} messages to other groups and {blocked_sent:,} to {BLOCKED}")


def buckets(samples: list[dict], width: float) -> list[dict]:
    out = []
    for n in range(int(max((s["t"] for s in samples), default=0) // width) + 1):
        rows = [s for s in samples if n * width <= s["t"] < (n + 1) * width]
        if not rows:
            continue
        last = rows[-1]
        out.append(
            {
                "from_s": n * width,
                "batches": len(rows),
                "records": sum(s["records"] for s in rows),
                "batch_s_median": round(statistics.median(s["batch_s"] for s in rows), 2),
                "batch_s_max": round(max(s["batch_s"] for s in rows), 2),
                "state_rows": last["state_rows"],
                "blocked_rows": last["blocked_rows"],
                "state_mib": round(last["state_bytes"] / 2**20, 2),
                "driver_rss_mib": round(last["driver_rss"] / 2**20, 1),
                "jvm_heap_mib": round(last["jvm_heap_used"] / 2**20, 1),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, RESULTS)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--rate", type=int, default=1000, help="msg/s to the other groups")
    p.add_argument("--blocked-rate", type=int, default=100, help="msg/s to the blocked group")
    p.add_argument("--max-held", type=int, default=None, help="blocked.max_held")
    p.add_argument("--bucket", type=float, default=60, help="report every so many seconds")
    args = p.parse_args(argv)

    from varadhi.spark.session import get_spark

    load_at_start = os.getloadavg()
    with bench_topic(args) as (env, topic), endpoint_process() as url:
        name = f"bench-{env.tag}-blocked"
        doc = {
            "name": name,
            "topic": topic,
            "endpoint": {"url": url},
            "max_message_bytes": MAX_MESSAGE_BYTES,
            "consumption": {"trigger_interval": "500ms"},
        }
        if args.max_held is not None:
            doc["blocked"] = {"max_held": args.max_held}
        SubscriptionService(env.catalog).create(parse_spec(doc, "bench"))
        spark = get_spark("varadhi-bench-blocked-group")
        job = SampledShard(name, 0, env.settings, spark=spark)
        seconds = args.minutes * 60
        producer = multiprocessing.get_context("spawn").Process(
            target=pace,
            args=(env.spark_env(), topic, args.rate, args.blocked_rate, args.groups, seconds),
        )
        producer.start()
        try:
            # The shard runs in the main thread (it installs signal handlers); a timer stops it
            # a little after the producer's last message.
            threading.Timer(seconds + 15, job.request_stop).start()
            run_shard(job, "the shard")
            producer.join(60)
        finally:
            if producer.is_alive():
                producer.terminate()
    rows = buckets(job.samples, args.bucket)
    s = job.stats
    print_table(rows, COLUMNS)
    print(f"delivered {s.delivered:,}, dead-lettered {s.dead_lettered:,}, batches {s.batches}")
    load_at_end = [round(x, 2) for x in os.getloadavg()]
    result = {
        **results_head("blocked_group", argv, machine(load_at_start, load_at_end=load_at_end)),
        "settings": {
            "minutes": args.minutes,
            "rate": args.rate,
            "blocked_rate": args.blocked_rate,
            "groups": args.groups,
            "partitions": args.partitions,
            "max_held": args.max_held,
        },
        "totals": {
            "delivered": s.delivered,
            "dead_lettered": s.dead_lettered,
            "batches": s.batches,
        },
        "buckets": rows,
    }
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
