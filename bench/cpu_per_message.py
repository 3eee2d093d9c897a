"""CPU per message of a shard's healthy delivery, step by step: the Python task and the JVM.

Part 1 runs what a Spark Python worker runs for one phase-1 task of a healthy micro-batch
(`varadhi.spark.batch.deliver_records`), on the records Spark would hand it, in this process, without
Spark or Kafka, against nginx on loopback, and measures each step's CPU time (this process's
user + system time, every thread: the delivery engine's libcurl runs in it; nginx's is not
counted):

| step    | what                                                                                |
|---------|-------------------------------------------------------------------------------------|
| `load`  | the worker's input serializer: Arrow IPC stream -> what the task function receives   |
|         | (pandas frames for `mapInPandas`, RecordBatches for `mapInArrow`)                    |
| `read`  | the task's first step alone: those records as group-queue entries (part of `task`)   |
| `task`  | `deliver_records` over them: reading, group runs, the HTTP engine, its result rows    |
| `dump`  | the worker's output serializer: the task's result -> Arrow IPC stream                |
| `engine`| for reference: the delivery engine alone (`HttpDeliverer`) sending the same requests  |
|         | from trivial streams, one per group: the floor the task's HTTP work cannot go under  |

`input` = `load` + `read`; `task - engine` is what the task spends outside the engine. The input
is a `batch_records` frame (`varadhi.spark.records`) of `--records` messages of 1 KiB over
`--groups` groups as the varadhi producer writes them (key = group id; headers message id,
produced-at, group id), with the columns the code under test hands its tasks, split into Arrow
batches of `spark.sql.execution.arrow.maxRecordsPerBatch` (10,000) as the JVM sends them. The
serializers are pyspark's own (`worker.py` picks them by the UDF's eval type), so `load` and
`dump` are what Spark's worker does, minus the socket.

Part 2 (`--spark-records`, 0 skips it) measures the JVM side in a local Spark (`local[2]`) on a
backlog the varadhi producer writes to the broker of `VARADHI_BOOTSTRAP` (`spark_stages`): the
Kafka source's rows, `batch_records`' ids and group keys, and the hand-over of the tasks'
columns to a Python map function that reads them and returns nothing, by process kind (JVM,
Python workers) from /proc.

Which of `mapInPandas` / `mapInArrow` is measured follows the code under test: the type
`deliver_records` annotates its input with. To measure an older commit, run this script with
`PYTHONPATH` pointing at that commit's `lib` (docs/benchmarks.md, "CPU per message").

    .venv/bin/python bench/cpu_per_message.py [--records 25000] [--groups 10000] [--repeat 5]
                                              [--spark-records 100000] [--fail-rate 0.1]
                                              [--signing v1] [--trace]

`--signing v1` (or `v1,v1a`: a key of each scheme) runs every step twice per repeat, interleaved:
unsigned, then with every request signed (`endpoint.signing`, `varadhi.core.signing`), and
reports both and the signed run's extra CPU per message (`signing_overhead`): the before and
after of signing in one run.

`--trace` does the same with the delivery trace on (`trace:`, `varadhi.kafka.trace`): every
attempt's event is written to a trace topic on the broker of `VARADHI_BOOTSTRAP`, the task's
writer thread's CPU counted with the rest (`trace_overhead`).

`--fail-rate` makes nginx fail that share of attempts as bench/delivery.py's failure runs do
(half 500, half 503, by message id and attempt); the task then retries in place with the
subscription defaults and sends what its linger cannot wait for to the RQ (its `out` rows), so
its CPU per message is that of a failing batch's task. nginx closes the connection after a 500
(and keeps it after a 503), so half the failures also cost the task a new connection. No engine
floor is run then.

Needs Debian's nginx (`apt-get install nginx-light`), and for part 2 the Kafka broker
(`scripts/kafka start`) and the Spark jars (`scripts/setup`). Results:
bench/results/cpu_per_message.json. About 3 minutes on 2 cores (1 without part 2). CPU time
moves far less with the machine's load than wall time, but a busy machine still inflates it
(shared caches, hyper-threads): compare runs made close together, interleaved.
"""

from __future__ import annotations

import argparse
import base64
import inspect
import io
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from common import machine, nginx_binary, write_results
from delivery import nginx
from varadhi.core import messages as m
from varadhi.core.delivery import HttpDeliverer, Outcome, Request
from varadhi.core.policies import Endpoint, SecretRef, SigningKey
from varadhi.core.subscription_spec import parse_spec
from varadhi.core.trace import topic_name as trace_topic_name
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import trace as kafka_trace
from varadhi.kafka.settings import Settings
from varadhi.spark import batch
from varadhi.spark.batch import BatchContext, ForwardRule, deliver_records

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_per_message.json"
TOPIC = "bench.0"
ARROW_BATCH = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default

# The Arrow schema of `varadhi.spark.records.batch_records`'s columns (Spark's string, int,
# bigint, binary and array<struct<key: string, value: binary>> types).
_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_TYPES = {
    "kind": pa.string(),
    "group_key": pa.string(),
    "group_id": pa.string(),
    "msg_id": pa.string(),
    "topic": pa.string(),
    "partition": pa.int32(),
    "offset": pa.int64(),
    "key": pa.binary(),
    "value": pa.binary(),
    "kheaders": _HEADERS,
}


def records(n: int, groups: int, columns: list[str]) -> pa.Table:
    """`n` main-topic records of one partition (1 KiB values, groups interleaved in produce
    order) with the `columns` the code under test reads (`batch_records`'s)."""
    body = os.urandom(512).hex().encode()
    produced = str(int(time.time() * 1000)).encode()
    cols: dict[str, list] = {c: [] for c in columns}
    for i in range(n):
        group = f"group-{i % groups}"
        msg_id = str(uuid.uuid4())
        row = {
            "kind": "mq",
            "group_key": group,
            "group_id": group,
            "msg_id": msg_id,
            "topic": TOPIC,
            "partition": 0,
            "offset": i,
            "key": group.encode(),
            "value": body,
            "kheaders": [
                {"key": m.H_MSG_ID, "value": msg_id.encode()},
                {"key": m.H_PRODUCED_MS, "value": produced},
                {"key": m.H_GROUP_ID, "value": group.encode()},
            ],
        }
        for c in columns:
            cols[c].append(row[c])
    return pa.table({c: pa.array(v, _TYPES[c]) for c, v in cols.items()})


def jvm_stream(table: pa.Table) -> bytes:
    """`table` as the JVM streams it to a map UDF: Arrow IPC, each batch one struct column."""
    sink = io.BytesIO()
    struct_type = pa.struct(list(table.schema))
    schema = pa.schema([("_0", struct_type)])
    with pa.ipc.new_stream(sink, schema) as writer:
        for b in table.to_batches(max_chunksize=ARROW_BATCH):
            struct = pa.StructArray.from_arrays(b.columns, fields=list(struct_type))
            writer.write_batch(pa.RecordBatch.from_arrays([struct], schema=schema))
    return sink.getvalue()


def udf_kind() -> str:
    """`arrow` when `deliver_records` takes RecordBatches (`mapInArrow`), else `pandas`."""
    first = next(iter(inspect.signature(deliver_records).parameters.values()))
    annotation = str(first.annotation)
    return "arrow" if "RecordBatch" in annotation else "pandas"


def serializer(kind: str):
    """The serializer pyspark's worker uses for a `mapInArrow` / `mapInPandas` UDF (as
    `pyspark.worker.read_udfs` builds it, with Spark's default settings)."""
    from pyspark.sql.pandas.serializers import (
        ArrowStreamPandasUDFSerializer,
        ArrowStreamUDFSerializer,
    )

    if kind == "arrow":
        return ArrowStreamUDFSerializer()
    return ArrowStreamPandasUDFSerializer(
        None, False, True, df_for_struct=True, struct_in_pandas="dict", arrow_cast=True
    )


def output_type():
    """The Arrow type the worker writes the task's results with: the task's result columns
    (`RESULT_COLUMNS`, or `STATE_COLUMNS` in code before it) as a struct."""
    from pyspark.sql.pandas.types import to_arrow_type
    from pyspark.sql.types import (
        BinaryType,
        DoubleType,
        IntegerType,
        LongType,
        MapType,
        StringType,
        StructType,
    )

    spark_types = {
        "string": StringType(),
        "int": IntegerType(),
        "bigint": LongType(),
        "binary": BinaryType(),
        "double": DoubleType(),
        "map<string,bigint>": MapType(StringType(), LongType()),
    }
    struct = StructType()
    for name, kind in getattr(batch, "RESULT_COLUMNS", None) or batch.STATE_COLUMNS:
        struct.add(name, spark_types[kind])
    return to_arrow_type(struct)


def cpu() -> float:
    """This process's CPU seconds (every thread: the engine's libcurl included)."""
    return time.process_time()


class _Stream:
    """One group's requests, sent in order; no retry (the engine floor)."""

    def __init__(self):
        self.requests: list[Request] = []

    def next_request(self) -> Request | None:
        return self.requests.pop() if self.requests else None

    def on_outcome(self, outcome: Outcome) -> None:
        pass


def engine_floor(table: pa.Table, ctx: BatchContext) -> float:
    """CPU seconds of the delivery engine alone sending `table`'s messages, one stream per group,
    with the headers a shard sends (requests built before the clock starts)."""
    streams: dict[str, _Stream] = {}
    for row in table.select(["group_key", "msg_id", "offset", "value"]).to_pylist():
        headers = {
            m.HTTP_MESSAGE_ID: row["msg_id"],
            m.HTTP_IDEMPOTENCY_KEY: row["msg_id"],
            m.HTTP_ATTEMPT: "1",
            m.HTTP_SOURCE: f"{TOPIC}/0/{row['offset']}",
            m.HTTP_GROUP_ID: row["group_key"],
            m.HTTP_PRODUCED_AT: "1",
        }
        streams.setdefault(row["group_key"], _Stream()).requests.insert(
            0, Request(row["value"], headers)
        )
    spec = ctx.spec
    with HttpDeliverer(spec.endpoint, spec.consumption.max_in_flight, spec.delivery) as http:
        t0 = cpu()
        stats = http.run(streams.values())
        spent = cpu() - t0
    if sum(stats.by_status.values()) != table.num_rows:
        raise RuntimeError(f"the engine floor run got {stats.by_status} {stats.errors}")
    return spent


def read_entries(kind: str, loaded: list, ctx: BatchContext) -> int:
    """The task's first step alone: its input as Entries, as `deliver_records` reads it
    (`record_rows` and `record_entry` for `mapInArrow`; in code before it, `rows_of` and
    `entry_from_record`). Returns how many."""
    n = 0
    if kind == "arrow":
        for b in loaded:
            for row, headers in batch.record_rows(b):
                batch.record_entry(row, headers, ctx)
                n += 1
    else:
        for frame in loaded:
            for row in batch.rows_of(frame):
                batch.entry_from_record(row, ctx)
                n += 1
    return n


def one_run(kind: str, stream: bytes, ctx: BatchContext, n: int, failing: bool) -> dict[str, float]:
    """CPU seconds of load, read, task and dump for one task over `stream` (`read` is part of
    `task`, measured apart on the same input), and the task's counters. With `failing` (the
    endpoint fails some attempts), a message is either delivered or left to the RQ or parked,
    so fewer than `n` may be delivered; without, every one must be."""
    ser = serializer(kind)
    t0 = cpu()
    loaded = [b[0] for b in ser.load_stream(io.BytesIO(stream))]
    t1 = cpu()
    if read_entries(kind, loaded, ctx) != n:
        raise RuntimeError("the task's input lost records")
    t2 = cpu()
    out = list(deliver_records(iter(loaded), ctx, ForwardRule()))
    t3 = cpu()
    sink = io.BytesIO()
    ser.dump_stream(((o, output_type()) for o in out), sink)
    t4 = cpu()
    counts = _counts(out)
    if counts["delivered"] != n and not (failing and 0 < counts["delivered"] < n):
        raise RuntimeError(f"the task delivered {counts['delivered']} of {n} messages")
    return {"load": t1 - t0, "read": t2 - t1, "task": t3 - t2, "dump": t4 - t3} | counts


COUNTED = ("delivered", "attempts", "failures", "retried_in_place", "retried")


def _counts(out: list) -> dict[str, int]:
    """The task's `COUNTED` counters, summed over its stat rows."""
    from varadhi.spark.shard.commit import stat_rows

    total = dict.fromkeys(COUNTED, 0)
    for o in out:
        frame = o.to_pandas() if isinstance(o, pa.RecordBatch) else o
        for s in stat_rows(frame):
            for k in COUNTED:
                total[k] += s[k]
    return total


def columns_read() -> list[str]:
    """The columns the shard's query hands its tasks (`batch_records`' output, less what
    the shard drops before delivery), from the code under test."""
    from varadhi.spark import records as shard_query

    names = getattr(shard_query, "DELIVERY_COLUMNS", None)
    return list(names) if names else list(_TYPES)


# -- the JVM side: reading a backlog in a local Spark -------------------------------------------


def _idle_then(seconds: float = 0.6) -> float:
    """Sleep, then the wall-clock time in ms (stage bounds fall between the CPU sampler's
    samples of an idle session, so the nearest samples are the stage's own)."""
    time.sleep(seconds)
    return time.time() * 1000


def _consume(batches):
    """A map function that reads every input batch and returns nothing: the transfer to the
    Python worker (and, for `mapInPandas`, the conversion to pandas), without any delivery."""
    for _ in batches:
        pass
    yield from ()


def spark_stages(messages: int, groups: int, kind: str, columns: list[str], repeat: int) -> dict:
    """CPU per record, by process kind (the JVM, Spark's Python workers), of a local Spark
    (`local[2]`) reading a backlog of `messages` records the varadhi producer wrote (4
    partitions) with the shard's source options, stage by stage:

    - `kafka`: the Kafka source's rows (`noop` sink);
    - `records`: `varadhi.spark.records.batch_records` (kind, ids and group key from the headers);
    - `to_python`: the columns the tasks read (`columns`) sent to a map function of the kind
      the code under test uses, which reads them and returns nothing.

    Each stage runs `repeat` times after a warm-up; the median is kept."""
    from types import SimpleNamespace

    from pyspark.sql.types import StructType

    from delivery import CpuSampler, Env, produce_backlog
    from varadhi.kafka.topics import TopicService
    from varadhi.spark.records import batch_records
    from varadhi.spark.session import get_spark

    env = Env()
    try:
        topic = f"bench-{env.tag}-cpu"
        TopicService(env.catalog).create(topic, 4)
        produce_backlog(env, topic, messages, groups)
        mq = TopicService(env.catalog).get(topic)
        sub = SimpleNamespace(
            spec=SimpleNamespace(
                grouped=True, dedup_window_ms=0, endpoint=Endpoint("http://127.0.0.1/")
            )
        )
        spark = get_spark("bench-cpu-per-message", local=True, cores=2)
        source = (
            spark.read.format("kafka")
            .option("kafka.bootstrap.servers", env.settings.bootstrap)
            .option("assign", f'{{"{mq.produce_topic.name}": [0, 1, 2, 3]}}')
            .option("startingOffsets", "earliest")
            .option("endingOffsets", "latest")
            .option("includeHeaders", "true")
            .option("kafka.isolation.level", "read_committed")
            .load()
        )
        records = batch_records(source, sub, mq)
        to_python = records.select(*columns)
        mapped = (
            to_python.mapInArrow(_consume, StructType())
            if kind == "arrow"
            else to_python.mapInPandas(_consume, StructType())
        )
        stages = {
            "kafka": lambda: source.write.format("noop").mode("overwrite").save(),
            "records": lambda: records.write.format("noop").mode("overwrite").save(),
            "to_python": lambda: mapped.write.format("noop").mode("overwrite").save(),
        }
        out: dict[str, dict[str, float]] = {}
        with CpuSampler({"spark": [os.getpid()]}) as cpu:
            for name, run in stages.items():
                run()  # warm-up (JIT, Python workers)
                samples = []
                for _ in range(repeat):
                    t0 = _idle_then()
                    run()
                    t1 = _idle_then()
                    samples.append(cpu.between("spark", t0, t1))
                out[name] = {
                    k: round(statistics.median(s[k] for s in samples) / messages * 1e6, 1)
                    for k in ("jvm", "python_workers")
                }
        spark.stop()
        return out
    finally:
        env.close()


# Random keys of the signed runs, by scheme (`--signing`), in variables the default policy allows.
SIGNING_KEYS = {
    "v1": ("VARADHI_ENDPOINT_BENCH_WHSEC", "whsec_"),
    "v1a": ("VARADHI_ENDPOINT_BENCH_WHSK", "whsk_"),
}


def signed_context(ctx: BatchContext, schemes: list[str]) -> BatchContext:
    """`ctx` with its endpoint signing every request with a fresh key of each scheme."""
    keys = []
    for scheme in schemes:
        env, prefix = SIGNING_KEYS[scheme]
        os.environ[env] = prefix + base64.b64encode(os.urandom(32)).decode()
        keys.append(SigningKey(scheme, SecretRef(env=env)))  # type: ignore[arg-type]
    endpoint = replace(ctx.spec.endpoint, signing=tuple(keys))
    return replace(ctx, spec=replace(ctx.spec, endpoint=endpoint))


def traced_context(ctx: BatchContext) -> BatchContext:
    """`ctx` with its tasks writing the delivery trace to a topic of the broker of
    `VARADHI_BOOTSTRAP` (made here with a day's retention)."""
    settings = Settings.from_env()
    topic = trace_topic_name("bench-cpu")
    partitions = kafka_trace.ensure_topic(settings, topic, 24 * 3_600_000)
    target = kafka_trace.TraceTarget(
        settings.bootstrap, topic, partitions, 0, kafka_clients.config_of(settings)
    )
    return replace(ctx, trace=target)


def per_message(runs: list[dict[str, float]], n: int) -> dict[str, float]:
    """Each step's median CPU µs per message, with `total` and `input`."""
    us = {
        step: round(statistics.median(r[step] for r in runs) / n * 1e6, 1)
        for step in ("load", "read", "task", "dump")
    }
    us["total"] = round(us["load"] + us["task"] + us["dump"], 1)
    us["input"] = round(us["load"] + us["read"], 1)
    return us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=25_000, help="records of the task")
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument(
        "--fail-rate",
        type=float,
        default=0.0,
        help="share of attempts nginx fails (500 or 503, as bench/delivery.py's failure runs); "
        "the task then retries in place with the shard's defaults (no engine floor is run)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="runs of each step (median kept)")
    parser.add_argument(
        "--signing",
        metavar="SCHEMES",
        default="",
        help="also run each step with requests signed by a key of each scheme (v1, v1a, or "
        "v1,v1a), interleaved with the unsigned runs",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also run each step with the delivery trace written to the broker of "
        "VARADHI_BOOTSTRAP, interleaved with the untraced runs",
    )
    parser.add_argument(
        "--spark-records",
        type=int,
        default=100_000,
        help="backlog of the JVM-side stages (local Spark, the Kafka broker of VARADHI_BOOTSTRAP); "
        "0 skips them",
    )
    parser.add_argument("--spark-repeat", type=int, default=3, help="runs of each JVM-side stage")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    schemes = [x for x in args.signing.split(",") if x]
    if any(x not in SIGNING_KEYS for x in schemes):
        parser.error(f"--signing: schemes are v1 and v1a, got {args.signing!r}")
    binary = nginx_binary()
    if not binary:
        print("no nginx (apt-get install nginx-light)", file=sys.stderr)
        return 2
    load_at_start = os.getloadavg()
    kind = udf_kind()
    columns = columns_read()
    table = records(args.records, args.groups, columns)
    stream = jvm_stream(table)
    runs: list[dict[str, float]] = []
    signed_runs: list[dict[str, float]] = []
    traced_runs: list[dict[str, float]] = []
    floors: list[float] = []
    failing = args.fail_rate > 0
    with nginx(binary, args.fail_rate) as endpoint:
        spec = parse_spec(
            {
                "name": "bench",
                "topic": "bench",
                "endpoint": {"url": endpoint.url},
                "consumption": {"max_in_flight": args.max_in_flight},
                "retry": {"max_attempts": 10},  # as bench/delivery.py's subscriptions
            }
        )
        ctx = BatchContext(spec=spec, mq_indexes={TOPIC: 0}, now_ms=0, seed=1)
        signed = signed_context(ctx, schemes) if schemes else None
        traced = traced_context(ctx) if args.trace else None
        one_run(kind, stream, ctx, args.records, failing)  # warm-up: imports, connections
        if signed is not None:
            one_run(kind, stream, signed, args.records, failing)
        if traced is not None:
            one_run(kind, stream, traced, args.records, failing)
        for _ in range(args.repeat):
            runs.append(one_run(kind, stream, ctx, args.records, failing))
            if signed is not None:
                signed_runs.append(one_run(kind, stream, signed, args.records, failing))
            if traced is not None:
                traced_runs.append(one_run(kind, stream, traced, args.records, failing))
            if not failing:
                floors.append(engine_floor(table, ctx))
    spark = (
        spark_stages(args.spark_records, args.groups, kind, columns, args.spark_repeat)
        if args.spark_records
        else {}
    )
    n = args.records
    us = per_message(runs, n)
    signed_us = per_message(signed_runs, n) if signed_runs else {}
    traced_us = per_message(traced_runs, n) if traced_runs else {}
    if floors:
        us["engine"] = round(statistics.median(floors) / n * 1e6, 1)
        us["task_outside_engine"] = round(us["task"] - us["engine"], 1)
    counts = {k: statistics.median(r[k] for r in runs) for k in COUNTED}
    rev = subprocess.run(
        ["git", "-C", str(Path(batch.__file__).parent), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    doc = {
        "benchmark": "cpu_per_message",
        "command": "python bench/cpu_per_message.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(load_at_start, load_at_end=[round(x, 2) for x in os.getloadavg()]),
        "code": {"lib": str(Path(batch.__file__).parent), "commit": rev, "udf": kind},
        "settings": {
            "records": n,
            "groups": args.groups,
            "max_in_flight": args.max_in_flight,
            "fail_rate": args.fail_rate,
            "repeat": args.repeat,
            "columns": columns,
            "spark_records": args.spark_records,
            "spark_repeat": args.spark_repeat,
        },
        "cpu_us_per_msg": us,
        "signing": schemes,
        "cpu_us_per_msg_signed": signed_us,
        "signing_overhead": round(signed_us["total"] / us["total"] - 1, 4) if signed_us else None,
        "signed_runs_s": signed_runs,
        "cpu_us_per_msg_traced": traced_us,
        "trace_overhead": round(traced_us["total"] / us["total"] - 1, 4) if traced_us else None,
        "traced_runs_s": traced_runs,
        "task_counts": counts,
        "spark_cpu_us_per_record": spark,
        "runs_s": runs,
        "engine_runs_s": floors,
    }
    print(f"{kind} ({rev}), {n:,} records over {args.groups:,} groups: CPU us/msg")
    if failing:
        print(f"  {args.fail_rate:.0%} of attempts failing; the task's counts (median): {counts}")
    for step, value in us.items():
        extra = f"   signed ({args.signing}) {signed_us[step]:6.1f}" if step in signed_us else ""
        extra += f"   traced {traced_us[step]:6.1f}" if step in traced_us else ""
        print(f"  {step:20s} {value:6.1f}{extra}")
    if signed_us:
        print(f"  signing costs {signed_us['total'] - us['total']:+.1f} us/msg "
              f"({signed_us['total'] / us['total'] - 1:+.1%} of the total)")  # fmt: skip
    if traced_us:
        print(f"  the trace costs {traced_us['total'] - us['total']:+.1f} us/msg "
              f"({traced_us['total'] / us['total'] - 1:+.1%} of the total)")  # fmt: skip
    for stage, by_kind in spark.items():
        print(f"  spark {stage:14s} {by_kind}")
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
