"""What retries in place save: one delivery task's groups, with and without `in_place_window`,
and with and without `in_place_linger`.

Runs the body of a shard's phase-1 task (`varadhi.spark.batch.deliver_records`, the code a Spark task
runs on its Kafka records; no Spark, no Kafka) over `--groups` groups of `--per-group` 1 KiB
messages against the project's test endpoint (`python -m varadhi.testing.endpoint`, its own
process on 127.0.0.1) failing `--fail-rate` of the attempts with 500, answering after
`--latency-ms`. The same task runs with `retry.in_place_window` 0 (every retry through the RQ),
2 s (the default) without a linger (`retry.in_place_linger` 0: retries wait only while the task
has other deliveries), and 2 s with the default 2 s linger (the task waits up to 2 s past its
last delivery), under the default backoff (1 s, exponential, 20% jitter); the endpoint is restarted
for each run with the same seed, so all see the same failures.

Per run it prints what the task left for later batches: retries written to the RQ, messages
parked behind them (bodies the state table must hold and a later batch must deliver), and what
it did now: messages delivered, retries made in place, the task's wall time, and its CPU per
message (this process's time, the engine's libcurl included; the endpoint's is not).

    .venv/bin/python bench/retry_in_place.py [--latency-ms 0 20] [--groups 2000] [--per-group 10]

Writes bench/results/retry_in_place.json. About 25 seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa

from common import endpoint_process, machine, results_head, write_results
from varadhi.core import messages as m
from varadhi.core.policies import ConsumptionPolicy, Endpoint, RetryPolicy, SubscriptionSpec
from varadhi.spark.batch import BatchContext, ForwardRule, deliver_records
from varadhi.spark.shard.commit import stat_rows

RESULTS = Path(__file__).resolve().parent / "results" / "retry_in_place.json"
TOPIC = "bench.0"


def records(groups: int, per_group: int) -> pd.DataFrame:
    """Kafka source rows (as the shard's reader yields them) of one partition, groups
    interleaved in produce order."""
    rows = []
    body = b"x" * 1024
    for n in range(per_group):
        for g in range(groups):
            offset = len(rows)
            headers = [
                {"key": m.H_MSG_ID, "value": f"g{g}.{n}".encode()},
                {"key": m.H_GROUP_ID, "value": f"g{g}".encode()},
            ]
            rows.append(
                {
                    "kind": "mq",
                    "group_key": f"g{g}",
                    "group_id": f"g{g}",
                    "msg_id": f"g{g}.{n}",
                    "topic": TOPIC,
                    "partition": 0,
                    "offset": offset,
                    "key": f"g{g}".encode(),
                    "value": body,
                    "kheaders": headers,
                }
            )
    return pd.DataFrame(rows)


def run(args, frame: pd.DataFrame, latency_ms: int, window_ms: int, linger_ms: int) -> dict:
    options = ("--fail-rate", str(args.fail_rate), "--mix", "500=1", "--seed", "7")
    with endpoint_process(*options, "--latency-ms", str(latency_ms)) as url:
        spec = SubscriptionSpec(
            name="bench",
            topic="bench",
            endpoint=Endpoint(url=url),
            retry=RetryPolicy(
                max_attempts=10, in_place_window_ms=window_ms, in_place_linger_ms=linger_ms
            ),
        )
        ctx = BatchContext(spec, {TOPIC: 0}, int(time.time() * 1000), seed=1)
        started, cpu_started = time.perf_counter(), time.process_time()
        [batch] = deliver_records(iter([pa.RecordBatch.from_pandas(frame)]), ctx, ForwardRule())
        out = batch.to_pandas()
        seconds = time.perf_counter() - started
        cpu_s = time.process_time() - cpu_started  # this process's threads: libcurl's too
    [stat] = stat_rows(out)
    pending = out[out["kind"] == "pending"]
    return {
        "latency_ms": latency_ms,
        "in_place_window_ms": window_ms,
        "in_place_linger_ms": linger_ms,
        "messages": len(frame),
        "seconds": round(seconds, 2),
        "cpu_us_per_message": round(cpu_s * 1e6 / len(frame), 1),
        "delivered": stat["delivered"],
        "retried_in_place": stat["retried_in_place"],
        "retried_through_rq": stat["retried"],
        "groups_blocked": int(pending["group_key"].nunique()),
        "parked": int((pending["location"] == "held").sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency-ms", nargs="+", type=int, default=[0, 20])
    parser.add_argument("--groups", type=int, default=2_000)
    parser.add_argument("--per-group", type=int, default=10)
    parser.add_argument("--fail-rate", type=float, default=0.1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    load_at_start = os.getloadavg()
    frame = records(args.groups, args.per_group)
    window = RetryPolicy().in_place_window_ms
    rows = [
        run(args, frame, latency, *setting)
        for latency in args.latency_ms
        for setting in ((0, 0), (window, 0), (window, window))
    ]
    print(
        f"{'latency':>8} {'window':>7} {'linger':>7} {'seconds':>8} {'delivered':>10} "
        f"{'in place':>9} {'to RQ':>6} {'blocked':>8} {'parked':>7} {'CPU us/msg':>10}"
    )
    for r in rows:
        print(
            f"{r['latency_ms']:>6}ms {r['in_place_window_ms'] / 1000:>6g}s "
            f"{r['in_place_linger_ms'] / 1000:>6g}s {r['seconds']:>8} "
            f"{r['delivered']:>10,} {r['retried_in_place']:>9,} {r['retried_through_rq']:>6,} "
            f"{r['groups_blocked']:>8,} {r['parked']:>7,} {r['cpu_us_per_message']:>10}"
        )
    doc = {
        **results_head("retry_in_place", argv, machine(load_at_start)),
        "settings": {
            "groups": args.groups,
            "per_group": args.per_group,
            "fail_rate": args.fail_rate,
            "max_in_flight": ConsumptionPolicy().max_in_flight,
        },
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
