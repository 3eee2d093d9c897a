"""A subscription's rate limit across its shards (`endpoint.max_rate`, docs/delivery.md "Rate limit"):
what the endpoint receives from 3 shards under a limit of 300 messages a second, and how fast the
rate comes back after the endpoint slowed it down with 429s.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/rate_limit.py [--limit 300] [--shards 3] [--steady-s 60]
        [--throttle-s 20] [--recover-s 60]

One grouped subscription with `--shards` shards (`./spark-submit.sh`, one process each) drains a
backlog into a recording endpoint in this process (`varadhi.testing.endpoint`), with batches of
`--batch` records (a shard sends nothing between two batches: the larger the batch, the closer
its rate stays to its share) and the circuit breaker off unless `--circuit` (it counts 429s as
failures, and its open time would follow the slow-down). Phases, timed from the first request
the endpoint sees:

1. steady (`--steady-s`): the endpoint accepts everything;
2. throttled (`--throttle-s`): it answers every request 429 with `Retry-After: 1`;
3. recovery (`--recover-s`): it accepts everything again.

Reported: the most requests the endpoint received in any 10 s window (sliding by 1 s) in the
steady and recovery phases, against the limit (+5% allowed); the mean rate of the steady phase;
and the time from the end of the throttled phase until the trailing 5 s rate first reaches 95%
of the limit (the issue asks for <= 30 s), and 95% of the best 10 s of the steady phase (a shard
sends nothing while it commits a batch, so it stays below its share). Results: a table on stdout, JSON in
bench/results/rate_limit.json. About three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import machine, results_head, write_results
from delivery import Env, ShardProcesses, create_subscription, produce_backlog
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "rate_limit.json"
WINDOW_S = 10


def max_window(times_s: list[float], start: float, end: float, width: float) -> int:
    """The most of `times_s` inside any `width`-second window within [start, end], sliding by
    one second (pure)."""
    best, t = 0, start
    while t + width <= end:
        best = max(best, sum(1 for x in times_s if t <= x < t + width))
        t += 1.0
    return best


def per_second(times_s: list[float], start: float, end: float) -> list[int]:
    """Requests in each second from `start` to `end` (pure)."""
    counts = [0] * max(0, int(end - start))
    for x in times_s:
        i = int(x - start)
        if 0 <= i < len(counts):
            counts[i] += 1
    return counts


def recovery_s(times_s: list[float], since: float, limit: float, end: float) -> float | None:
    """Seconds from `since` until the trailing 5 s rate first reaches 95% of `limit` (pure);
    None if it never does before `end`."""
    t = since + 5.0
    while t <= end:
        if sum(1 for x in times_s if t - 5.0 <= x < t) / 5.0 >= 0.95 * limit:
            return round(t - since, 1)
        t += 0.5
    return None


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--limit", type=float, default=300.0, help="endpoint.max_rate (msg/s)")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--steady-s", type=float, default=60.0)
    p.add_argument("--throttle-s", type=float, default=20.0)
    p.add_argument("--recover-s", type=float, default=60.0)
    p.add_argument("--groups", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--batch", type=int, default=3000, help="max_messages_per_batch")
    p.add_argument(
        "--circuit",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the circuit breaker on (it counts 429s as failures and opens: its own open "
        "and half-open time then follows the slow-down)",
    )
    p.add_argument("--trigger-ms", type=int, default=100)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    load = os.getloadavg()
    total_s = args.steady_s + args.throttle_s + args.recover_s
    backlog = int(args.limit * (total_s + 30))  # never runs dry
    env = Env()
    endpoint = TestEndpoint(mix={"429": 1.0}, retry_after_s=1)  # fail_rate 1.0: all 429
    endpoint.start()
    logs = Path(tempfile.mkdtemp(prefix="varadhi-bench-rate-"))
    topic, name = f"rate-{env.tag}", f"rate-{env.tag}-sub"
    shards = None
    try:
        TopicService(env.catalog).create(topic, 2 * args.shards)
        create_subscription(
            env, name, topic, endpoint.url, args,
            shards=args.shards,
            endpoint={"url": endpoint.url, "max_rate": args.limit},
            retry={"max_attempts": 1000, "min_backoff": "1s", "max_backoff": "2s"},
            circuit_breaker={"enabled": args.circuit},
        )  # fmt: skip
        produced = produce_backlog(env, topic, backlog, args.groups)
        print(f"backlog: {produced}")
        shards = ShardProcesses(env, name, args.shards, 15.0, logs)
        while not endpoint.records():
            if any(code is not None for code in (p.poll() for p in shards.procs)):
                raise RuntimeError(f"a shard ended before its first request (logs in {logs})")
            time.sleep(0.2)
        t0 = endpoint.records()[0].received_ms / 1000
        throttle_at = t0 + args.steady_s
        healthy_at = throttle_at + args.throttle_s
        end = healthy_at + args.recover_s

        def wait_until(t: float) -> None:
            while time.time() < t:
                time.sleep(0.05)

        wait_until(throttle_at)
        endpoint.fail_rate = 1.0
        wait_until(healthy_at)
        endpoint.fail_rate = 0.0
        wait_until(end)
    finally:
        if shards is not None:
            for proc in shards.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 15)
            shards.wait(120)
        endpoint.stop()
        env.close()
    times = [r.received_ms / 1000 for r in endpoint.records()]
    steady = max_window(times, t0, throttle_at, WINDOW_S)
    recovered = max_window(times, healthy_at, end, WINDOW_S)
    mean = sum(1 for x in times if t0 <= x < throttle_at) / args.steady_s
    back = recovery_s(times, healthy_at, args.limit, end)
    # what the shards sent before: batch gaps (commits) keep a shard below its share
    before = max_window(times, t0, throttle_at, WINDOW_S) / WINDOW_S
    back_to_before = recovery_s(times, healthy_at, before, end)
    bound = args.limit * WINDOW_S * 1.05
    rows = {
        "limit_msg_s": args.limit,
        "shards": args.shards,
        "steady_max_10s_window": steady,
        "recovery_max_10s_window": recovered,
        "bound_10s_window": round(bound),
        "steady_mean_msg_s": round(mean, 1),
        "throttled_429": sum(1 for r in endpoint.records() if r.status == 429),
        "back_to_95pct_s": back,
        "steady_best_msg_s": round(before, 1),
        "back_to_95pct_of_steady_s": back_to_before,
    }
    for k, v in rows.items():
        print(f"{k:>26}  {v}")
    series = per_second(times, t0, end)
    print("requests per second from the first one:", series)
    ok = steady <= bound and recovered <= bound and back is not None and back <= 30
    print("verdict:", "holds" if ok else "does NOT hold", f"(shard logs: {logs})")
    doc = results_head("rate_limit", None, machine(load)) | {
        "results": rows,
        "holds": ok,
        "phases_s": [args.steady_s, args.throttle_s, args.recover_s],
        "requests_per_second": series,
    }
    write_results(args.out, doc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
