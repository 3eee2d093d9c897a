"""The library runtime (`varadhi.library.Consumer`, docs/library.md) draining a backlog into nginx.

    scripts/kafka start
    .venv/bin/python bench/library.py [--messages 50000] [--groups 5000] [--fail 0 0.1] [--circuit]
        [--commit-interval S] [--batch N] [--max-in-flight N] [--in-place-window MS]
        [--out FILE]

One process, in this one: a topic of 12 partitions gets `--messages` 1 KiB messages over
`--groups` group ids (the varadhi producer), then, per `--fail` rate, a fresh 2-shard
subscription (skip mode; no circuit, or with `--circuit` the default one, the members' shared
circuit: its cost on the healthy path; with `--batch N`, in batch mode, up to N messages
a request: docs/delivery.md) is delivered by one `Consumer`
to nginx answering 204 (to a batch: every message accepted) (500/503 for that fraction of attempts: bench/delivery.py's `nginx`, so
its figures compare) until every message is delivered or dead-lettered. Reported per run: the
rate from `start()` to the last message (start-up included), the time to the first delivery,
and the process's CPU per message (this process also polls the counters, every 20 ms); and the
same two in the steady window, from the 10th to the 90th percent of the messages delivered
(bench/delivery.py's definition: the failures' retry tail and the start-up left out), with each
failing run's steady rate over the healthy run's when `--fail` has a 0.
Retries use the default policy (1 s backoff, growing; a retry due within the in-place window,
2 s of the first failure, waits in memory, a later one goes through the RQ); `--in-place-window`
sets that window (0: every retry through the RQ), so the two paths' costs can be told apart.
`--out` writes the runs as JSON (bench/results/). Everything listens on 127.0.0.1;
the bench uses its own catalog topic and leaves its topics behind (`varadhi topic delete`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

from common import nginx_binary
from delivery import nginx
from varadhi.core.policies import (
    CircuitPolicy,
    DeliveryPolicy,
    Endpoint,
    RetryPolicy,
    SubscriptionSpec,
)
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.library import Consumer, Options

TIMEOUT_S = 900


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=50_000)
    p.add_argument("--groups", type=int, default=5_000)
    p.add_argument("--fail", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--circuit", action="store_true", help="the spec's default circuit breaker")
    p.add_argument(
        "--commit-interval",
        type=float,
        default=Options().commit_interval_s,
        help="Options.commit_interval_s (s; default: the runtime's)",
    )
    p.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="delivery.mode: batch with max_messages N (default: single mode)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        help="Options.max_in_flight (default: the spec's consumption.max_in_flight)",
    )
    p.add_argument(
        "--in-place-window",
        type=int,
        metavar="MS",
        default=RetryPolicy().in_place_window_ms,
        help="retry.in_place_window (ms; 0: every retry through the RQ; default: the policy's)",
    )
    p.add_argument("--out", type=Path, help="write the runs to this JSON file")
    args = p.parse_args(argv)
    if args.in_place_window < 0:
        p.error("--in-place-window must be >= 0")
    retry = RetryPolicy(in_place_window_ms=args.in_place_window)  # linger: capped at the window
    delivery = (
        DeliveryPolicy() if args.batch is None else DeliveryPolicy("batch", max_messages=args.batch)
    )
    binary = nginx_binary()
    if binary is None:
        raise SystemExit("nginx is needed (apt-get install nginx-light)")
    settings = Settings.from_env(catalog_topic="__varadhi_bench_library")
    catalog = Catalog(settings)
    catalog.ensure_topic()
    topic = f"bench-lib-{uuid.uuid4().hex[:6]}"
    TopicService(catalog).create(topic, 12)
    body = b"x" * 1024
    with Producer(topic, settings, catalog=catalog, linger_ms=20, batch_size=262_144) as out:
        for i in range(args.messages):
            out.send(body, group_id=f"g{i % args.groups}")
        out.flush()
    print(
        "fail  msg/s  first delivery (s)  CPU us/msg  steady msg/s  steady CPU us/msg"
        "  retried  dead-lettered"
    )
    runs: list[dict] = []
    for fail in args.fail:
        with nginx(binary, fail) as endpoint:
            name = f"bench-lib-{uuid.uuid4().hex[:6]}"
            spec = SubscriptionSpec(
                name,
                topic,
                Endpoint(endpoint.url),
                shards=2,
                on_dead_letter="skip",
                circuit_breaker=CircuitPolicy(enabled=args.circuit),
                runtime="library",
                delivery=delivery,
                retry=retry,
            )
            SubscriptionService(catalog).create(spec)
            cpu, started = time.process_time(), time.monotonic()
            options = Options(
                commit_interval_s=args.commit_interval, max_in_flight=args.max_in_flight
            )
            consumer = Consumer(name, settings, options=options).start()
            first = None
            window = Window(args.messages)
            try:
                while True:
                    counts = consumer.counters()
                    window.see(counts["delivered"])
                    if first is None and counts["delivered"]:
                        first = time.monotonic() - started
                    if counts["delivered"] + counts["dead_lettered"] >= args.messages:
                        break
                    if consumer.health()["state"] == "failed":
                        raise SystemExit(f"the consumer failed: {consumer.health()['error']}")
                    if time.monotonic() - started > TIMEOUT_S:
                        raise SystemExit(f"not drained in {TIMEOUT_S} s: {counts}")
                    time.sleep(0.02)
                wall = time.monotonic() - started
                used = time.process_time() - cpu
            finally:
                consumer.stop()
            steady_rate, steady_cpu_us = window.figures()
            runs.append(
                {
                    "fail": fail,
                    "msg_s": round(args.messages / wall),
                    "first_s": round(first, 2),
                    "cpu_us": round(used / args.messages * 1e6),
                    "steady_msg_s": round(steady_rate),
                    "steady_cpu_us": round(steady_cpu_us),
                    "retried": counts["retried"],
                    "dead_lettered": counts["dead_lettered"],
                }
            )
            print(
                f"{fail:<5} {args.messages / wall:>6.0f} {first:>19.2f}"
                f" {used / args.messages * 1e6:>11.0f} {steady_rate:>13.0f}"
                f" {steady_cpu_us:>18.0f} {counts['retried']:>8}"
                f" {counts['dead_lettered']:>14}"
            )
    catalog.close()
    healthy = next((run["steady_msg_s"] for run in runs if run["fail"] == 0), None)
    for run in runs:
        if healthy and run["fail"]:
            run["steady_ratio"] = round(run["steady_msg_s"] / healthy, 2)
            print(f"steady with {run['fail']:g} failing / healthy: {run['steady_ratio']:.2f}")
    if args.out is not None:
        result = {
            "bench": "bench/library.py",
            "argv": sys.argv[1:] if argv is None else argv,
            "date": time.strftime("%Y-%m-%d"),
            "cores": os.cpu_count(),
            "load_1m": os.getloadavg()[0],
            "runs": runs,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.out}")
    return 0


class Window:
    """The steady window of a run: from the 10th to the 90th percent of `messages` delivered,
    its rate and CPU per message (this process's), as seen by polls of the counters."""

    def __init__(self, messages: int):
        self.low, self.high = messages // 10, messages - messages // 10
        self.start: tuple[int, float, float] | None = None  # delivered, monotonic, CPU
        self.end: tuple[int, float, float] | None = None

    def see(self, delivered: int) -> None:
        mark = (delivered, time.monotonic(), time.process_time())
        if self.start is None and delivered >= self.low:
            self.start = mark
        if self.end is None and delivered >= self.high:
            self.end = mark

    def figures(self) -> tuple[float, float]:
        """(messages a second, CPU µs a message) in the window; NaN for a window not seen."""
        if self.start is None or self.end is None or self.end[0] == self.start[0]:
            return float("nan"), float("nan")
        n = self.end[0] - self.start[0]
        seconds = max(self.end[1] - self.start[1], 1e-3)
        return n / seconds, (self.end[2] - self.start[2]) / n * 1e6


if __name__ == "__main__":
    sys.exit(main())
