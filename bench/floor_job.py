"""The Spark job of bench/floors.py: bare Structured Streaming with no varadhi code in the query.

Run by bench/floors.py under the product's launcher (`./spark-submit.sh --job ../bench/floor_job
...`: the same spark-submit, jars, class-data archive, local file system and `--conf`s as a
shard), with the session a shard gets (`varadhi.spark.session.get_spark(local=False)`, as
`varadhi.jobs.shard` calls it). Each query reads a Kafka topic with the options a shard's query
uses (`source_options`, the same as `varadhi.spark.records.Source.options`: headers, read_committed,
failOnDataLoss, `maxOffsetsPerTrigger`), a processing-time trigger, and a `foreachBatch` that
coalesces the batch to `--concurrency` tasks (as a shard does with its Kafka partitions) and runs
one of these, then `collect()`s the tasks' few result rows:

| task     | what the Python task does                                                          |
|----------|------------------------------------------------------------------------------------|
| `noop`   | no Python at all: the batch goes to Spark's `noop` sink (JVM only)                  |
| `arrow`  | `mapInArrow` that receives every Arrow batch, reads nothing, returns one row        |
| `http`   | `arrow` + one POST per record through the product's HTTP engine (`HttpDeliverer`,   |
|          | one in-order stream per Kafka key, `--max-in-flight`), as a shard's task would      |

Modes (`--mode`):

- `first`: one query from the earliest offsets, the `arrow` task; the job ends after the first
  batch. Events: `python_started` (the first line of this script, i.e. the JVM is up and has
  started Python), `session_ready`, `query_started`, `batch_started` (foreachBatch called),
  `first_record_in_python` (the earliest time a task saw its first Arrow batch),
  `batch_done` (collect returned) and `batch_committed` (Spark's progress of batch 0).
- `latency`: for each `--variants` (`arrow`, `http`), a query from the latest offsets whose task
  reports, per record, its Kafka timestamp (the producer's send time) and when the task saw it
  (`arrow`) or its POST was answered (`http`); runs until the file `stop-<variant>` appears in
  `--work`.
- `cpu`: for each round of `--repeat` and each of `--stages`, a query from the earliest offsets
  that reads the whole backlog (`--messages`) in batches of `--batch`; `stage_start` /
  `stage_end` events bracket it with 0.6 s of idle time each side, so that bench/floors.py's
  /proc sampler, which samples every 0.25 s, cuts the CPU time at idle moments. A first
  pass of each stage (`warmup`) is not measured.

Every event is one JSON line (`{"event": ..., "t": epoch seconds, ...}`) appended to `--events`.
Hazard: the functions the tasks run are pickled by value from this file (`__main__`), so they
may use only what a Python worker imports (pyarrow, the varadhi package in the project's venv).
"""

from __future__ import annotations

import time

PYTHON_STARTED = time.time()  # before any import: the JVM has started this interpreter

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

TASKS = ("noop", "arrow", "http")
IDLE_S = 0.6  # idle time each side of a measured pass (the CPU sampler's period is 0.25 s)


def source_options(
    bootstrap: str, topic: str, partitions: int, start: int, limit: int
) -> dict[str, str]:
    """A shard's Kafka source options (`varadhi.spark.records.Source.options` of
    `kafka_clients.spark_source_options`) for every partition of `topic` from offset `start`
    (-2 earliest, -1 latest), at most `limit` records a batch."""
    from varadhi.kafka.clients import SOURCE_FETCH_MAX_WAIT_MS

    parts = list(range(partitions))
    return {
        "kafka.bootstrap.servers": bootstrap,
        "kafka.fetch.max.wait.ms": str(SOURCE_FETCH_MAX_WAIT_MS),
        "assign": json.dumps({topic: parts}),
        "startingOffsets": json.dumps({topic: {str(p): start for p in parts}}),
        "includeHeaders": "true",
        "failOnDataLoss": "true",
        "kafka.isolation.level": "read_committed",
        "maxOffsetsPerTrigger": str(limit),
    }


class Events:
    """The events file: one JSON object a line, flushed at once (bench/floors.py reads it while
    the job runs)."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, event: str, t: float | None = None, **fields) -> None:
        doc = {"event": event, "t": time.time() if t is None else t, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(doc) + "\n")


# -- what the tasks run (pickled by value: pyarrow and varadhi.core.delivery only) ---------------------


def arrow_task(batches):
    """Receive every Arrow batch, read nothing; one row: (records, when the first batch came)."""
    import pyarrow as pa

    n, first = 0, None
    for b in batches:
        if first is None:
            first = time.time()
        n += b.num_rows
    yield pa.RecordBatch.from_pydict(
        {"n": [n], "first_s": [first], "ok": [0]},
        schema=pa.schema([("n", pa.int64()), ("first_s", pa.float64()), ("ok", pa.int64())]),
    )


class _KeyStream:
    """One Kafka key's records in order, one POST each, no retry; notes each answer's time."""

    __slots__ = ("requests", "i", "ok", "answered", "ts")

    def __init__(self):
        self.requests: list = []
        self.ts: list = []
        self.i = 0
        self.ok = 0
        self.answered: list = []

    def next_request(self):
        if self.i == len(self.requests):
            return None
        self.i += 1
        return self.requests[self.i - 1]

    def on_outcome(self, outcome) -> None:
        self.answered.append(time.time() * 1000)
        if outcome.status is not None and 200 <= outcome.status < 300:
            self.ok += 1


def _post_all(batches, url: str, max_in_flight: int, ts_column: str | None):
    """POST every record of `batches` through the product's HTTP engine, one stream per key.
    Returns (records, first batch time, 2xx answers, [(ts_ms, answered_ms)] if `ts_column`)."""
    from varadhi.core import messages as m
    from varadhi.core.delivery import HttpDeliverer, Request
    from varadhi.core.policies import Endpoint

    streams: dict = {}
    n, first = 0, None
    for b in batches:
        if first is None:
            first = time.time()
        # in bulk, as a shard's task reads its columns (`to_pylist` is ~20 times slower)
        cols = {
            name: b.column(name).to_numpy(zero_copy_only=False).tolist()
            for name in ("key", "value", "topic", "partition", "offset")
        }
        ts = b.column(ts_column).to_numpy(zero_copy_only=False).tolist() if ts_column else None
        for i in range(b.num_rows):
            topic, part, off = cols["topic"][i], cols["partition"][i], cols["offset"][i]
            ident = f"{topic}-{part}-{off}"
            headers = {
                m.HTTP_MESSAGE_ID: ident,
                m.HTTP_IDEMPOTENCY_KEY: ident,
                m.HTTP_ATTEMPT: "1",
                m.HTTP_SOURCE: f"{topic}/{part}/{off}",
            }
            key = cols["key"][i] if cols["key"][i] is not None else ident
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = _KeyStream()
            stream.requests.append(Request(cols["value"][i], headers))
            if ts is not None:
                stream.ts.append(ts[i])
        n += b.num_rows
    with HttpDeliverer(Endpoint(url=url), max_in_flight) as http:
        http.run(streams.values())
    ok = sum(s.ok for s in streams.values())
    pairs = (
        [p for s in streams.values() for p in zip(s.ts, s.answered, strict=True)]
        if ts_column
        else []
    )
    return n, first, ok, pairs


def http_task(url: str, max_in_flight: int):
    """The `http` task for `url`: `arrow_task`'s row, with the 2xx answers in `ok`."""

    def run(batches):
        import pyarrow as pa

        n, first, ok, _ = _post_all(batches, url, max_in_flight, None)
        yield pa.RecordBatch.from_pydict(
            {"n": [n], "first_s": [first], "ok": [ok]},
            schema=pa.schema([("n", pa.int64()), ("first_s", pa.float64()), ("ok", pa.int64())]),
        )

    return run


def latency_task(task: str, url: str, max_in_flight: int):
    """A task that returns, per record, (Kafka timestamp ms, ms when the task saw it or its POST
    was answered)."""

    def run(batches):
        import pyarrow as pa

        schema = pa.schema([("ts_ms", pa.float64()), ("seen_ms", pa.float64())])
        if task == "http":
            _, _, _, pairs = _post_all(batches, url, max_in_flight, "ts_ms")
            ts = [float(p[0]) for p in pairs]
            seen = [p[1] for p in pairs]
        else:
            ts, seen = [], []
            for b in batches:
                now = time.time() * 1000
                got = b.column("ts_ms").to_pylist()
                ts += [float(x) for x in got]
                seen += [now] * len(got)
        yield pa.RecordBatch.from_pydict({"ts_ms": ts, "seen_ms": seen}, schema=schema)

    return run


# -- the driver -----------------------------------------------------------------------------------

RESULT = "n long, first_s double, ok long"


class Job:
    def __init__(self, args: argparse.Namespace, events: Events):
        self.args = args
        self.events = events
        self.spark = None
        self.queries = 0

    def session(self) -> None:
        from varadhi.spark.session import get_spark  # the shard's session (varadhi.jobs.shard)

        self.spark = get_spark("varadhi-floor", local=False)
        self.events("session_ready")

    def stream(self, start: int, trigger_ms: int, on_batch, columns=()):
        """Start a query over the topic from `start` with the shard's source options, each batch
        (its raw Kafka columns but the timestamps, plus `columns`) to `on_batch(df, id)`."""
        a = self.args
        self.queries += 1
        df = (
            self.spark.readStream.format("kafka")
            .options(**source_options(a.bootstrap, a.topic, a.partitions, start, a.batch))
            .load()
        )
        df = df.select("key", "value", "topic", "partition", "offset", "headers", *columns)
        return (
            df.writeStream.foreachBatch(on_batch)
            .option("checkpointLocation", str(Path(a.work) / f"checkpoint-{self.queries}"))
            .trigger(processingTime=f"{trigger_ms} milliseconds")
            .queryName(f"floor-{self.queries}")
            .start()
        )

    def first(self) -> None:
        a = self.args
        done: list[float] = []

        def on_batch(df, batch_id):
            self.events("batch_started", batch=batch_id)
            rows = df.coalesce(a.concurrency).mapInArrow(arrow_task, RESULT).collect()
            firsts = [r.first_s for r in rows if r.first_s is not None]
            self.events(
                "batch_done",
                batch=batch_id,
                records=sum(r.n for r in rows),
                first_record_in_python=min(firsts) if firsts else None,
            )
            done.append(time.time())

        query = self.stream(-2, a.trigger_ms, on_batch)
        self.events("query_started")
        while not query.lastProgress and query.isActive:
            time.sleep(0.02)
        self.events("batch_committed", batch=(query.lastProgress or {}).get("batchId"))
        query.stop()

    def latency(self) -> None:
        from pyspark.sql import functions as F

        a = self.args
        for variant in a.variants:
            fn = latency_task(variant, a.url, a.max_in_flight)

            def on_batch(df, batch_id, fn=fn, variant=variant):
                t0 = time.time()
                rows = df.coalesce(a.concurrency).mapInArrow(fn, "ts_ms double, seen_ms double")
                got = rows.collect()
                self.events(
                    "latency",
                    variant=variant,
                    batch=batch_id,
                    started=t0,
                    samples=[[r.ts_ms, r.seen_ms] for r in got],
                )

            query = self.stream(
                -1, a.trigger_ms, on_batch, [F.unix_millis("timestamp").alias("ts_ms")]
            )
            self.events("query_started", variant=variant)
            stop = Path(a.work) / f"stop-{variant}"
            while not stop.exists() and query.isActive:
                time.sleep(0.1)
            query.stop()
            self.events("query_stopped", variant=variant)

    def cpu_pass(self, stage: str, label: str) -> None:
        """One query reading the whole backlog with task `stage`, bracketed by idle time."""
        a = self.args
        run = http_task(a.url, a.max_in_flight)

        def on_batch(df, batch_id):
            if stage == "noop":
                df.write.format("noop").mode("overwrite").save()
                return
            rows = (
                df.coalesce(a.concurrency)
                .mapInArrow(arrow_task if stage == "arrow" else run, RESULT)
                .collect()
            )
            if stage == "http" and sum(r.ok for r in rows) != sum(r.n for r in rows):
                raise RuntimeError(f"batch {batch_id}: not every POST was answered 2xx: {rows}")

        time.sleep(IDLE_S)
        self.events("stage_start", stage=stage, label=label)
        query = self.stream(-2, a.trigger_ms, on_batch)
        read = 0
        while read < a.messages and query.isActive:
            time.sleep(0.25)  # each look is a Py4J call and the progress JSON: not too often
            read = sum(p["numInputRows"] for p in query.recentProgress)
        query.stop()
        self.events("stage_end", stage=stage, label=label, records=read)
        time.sleep(IDLE_S)
        if read < a.messages:
            raise RuntimeError(f"{stage}: the query read {read} of {a.messages} records")

    def cpu(self) -> None:
        a = self.args
        for stage in a.stages:  # each plan's code generation, consumers and workers, once
            self.cpu_pass(stage, "warmup")
        for r in range(a.repeat):
            for stage in a.stages:
                self.cpu_pass(stage, f"round {r + 1}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("first", "latency", "cpu"), required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True, help="a Kafka topic (storage topic), all partitions")
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True, help="checkpoints and stop files")
    p.add_argument("--concurrency", type=int, default=2, help="tasks a batch is coalesced into")
    p.add_argument("--trigger-ms", type=int, default=500)
    p.add_argument("--batch", type=int, default=50_000, help="maxOffsetsPerTrigger")
    p.add_argument("--url", default="", help="the endpoint of the http task")
    p.add_argument("--max-in-flight", type=int, default=64)
    p.add_argument("--variants", nargs="+", choices=("arrow", "http"), default=["arrow"])
    p.add_argument("--stages", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--messages", type=int, default=0, help="the backlog a cpu pass reads")
    args = p.parse_args(argv)
    events = Events(args.events)
    events("python_started", t=PYTHON_STARTED)
    job = Job(args, events)
    job.session()
    getattr(job, args.mode)()
    events("done")
    job.spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
