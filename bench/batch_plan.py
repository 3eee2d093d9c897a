"""The driver's fixed cost of planning one micro-batch's delivery, whatever the batch's size.

    .venv/bin/python bench/batch_plan.py [--batches 40] [--warm 10]
    PYTHONPATH=/tmp/old/lib .venv/bin/python bench/batch_plan.py      # another checkout's code

A shard's query carries its records' columns (`varadhi.spark.records.batch_records`, built once per
query), and Spark hands each micro-batch to the shard as a plan over the batch's computed rows
(a `LogicalRDD`). For every batch the shard keeps the delivery columns and spreads them over its
tasks (`varadhi.spark.records.delivery_records`) and maps them with `mapInArrow` (`varadhi.spark.batch.deliver_batch`);
Spark then analyses, optimises and plans that. This runs those steps up to the executed plan
over such a plan (`batch_records` of a one-record DataFrame of the Kafka source's schema,
checkpointed) in a local session (no broker, no job), and reports per batch: Py4J round trips,
CPU milliseconds of this process plus the JVM's (all its threads, from /proc: it moves less with
other load than the wall clock does) and wall-clock milliseconds, medians after `--warm`
batches. It follows whichever code it imports, so PYTHONPATH set to a worktree's `lib` measures
that code.

Results: one line on stdout, JSON in bench/results/batch_plan.json (`--out`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from common import machine, results_head, write_results

RESULTS = Path(__file__).resolve().parent / "results" / "batch_plan.json"
KAFKA_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
    "timestampType int, headers array<struct<key:string,value:binary>>"
)


def jvm_cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--warm", type=int, default=10, help="batches not counted (JIT warm-up)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    load = os.getloadavg()

    from py4j import clientserver

    import varadhi
    from varadhi.core.policies import Endpoint
    from varadhi.core.state_rows import RESULT_SCHEMA
    from varadhi.spark import records as shard_query
    from varadhi.spark.records import batch_records
    from varadhi.spark.session import get_spark

    spark = get_spark("varadhi-bench-batch-plan")
    gateway = spark.sparkContext._gateway
    assert gateway is not None and gateway.proc is not None, "needs a JVM this process started"
    jvm_pid = gateway.proc.pid
    frame = spark.createDataFrame(
        [(b"k", b"v", "t.0", 0, 1, None, 0, [("varadhi-msg-id", b"m-1")])], KAFKA_SCHEMA
    )
    sub = SimpleNamespace(
        spec=SimpleNamespace(
            grouped=True, dedup_window_ms=0, endpoint=Endpoint("http://127.0.0.1/")
        )
    )
    mq = SimpleNamespace(storage_topics=[SimpleNamespace(name="t.0")])
    # A plan over computed rows, as Spark hands the shard each micro-batch.
    batch = batch_records(frame, sub, mq).localCheckpoint()
    # Older code (PYTHONPATH to a worktree) selected the delivery columns and coalesced.
    delivery_records = getattr(
        shard_query,
        "delivery_records",
        lambda r, concurrency, _: r.select(*shard_query.DELIVERY_COLUMNS).coalesce(concurrency),
    )

    calls = [0]
    send = clientserver.JavaClient.send_command

    def counting(self, *a, **k):
        calls[0] += 1
        return send(self, *a, **k)

    clientserver.JavaClient.send_command = counting
    rows = []
    for _ in range(args.batches):
        calls[0] = 0
        cpu, jvm, wall = time.process_time(), jvm_cpu_s(jvm_pid), time.perf_counter()
        planned = delivery_records(batch, 1, 4).mapInArrow(lambda it: it, RESULT_SCHEMA)
        planned._jdf.queryExecution().executedPlan()
        rows.append(
            {
                "py4j_calls": calls[0],
                "cpu_ms": 1000 * (time.process_time() - cpu + jvm_cpu_s(jvm_pid) - jvm),
                "wall_ms": 1000 * (time.perf_counter() - wall),
            }
        )
    clientserver.JavaClient.send_command = send
    counted = rows[args.warm :]
    summary = {
        k: round(statistics.median(r[k] for r in counted), 1)
        for k in ("py4j_calls", "cpu_ms", "wall_ms")
    }
    code = str(Path(varadhi.__file__).resolve().parents[1])
    print(
        f"per batch (median of {len(counted)}; code in {code}; load {load[0]:.1f}): "
        f"{summary['py4j_calls']:.0f} Py4J calls, {summary['cpu_ms']} CPU ms (driver + JVM), "
        f"{summary['wall_ms']} ms"
    )
    doc = {
        **results_head("batch_plan", argv, machine(load)),
        "code": code,
        "summary": summary,
        "batches": rows,
    }
    write_results(args.out, doc)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
