"""A shard's local Spark warmed up before its first micro-batch, while the driver gets ready for it.

Measured on a quiet machine (docs/benchmarks.md, *First delivery within 8 s*), a shard's first
batch took about 6 s against a fraction of a second for the next ones: it started the Python
workers and imported the delivery code in them, compiled its first generated classes (Janino,
cold) and built the JVM's first Kafka consumers (class loading, cold code). `WarmUp` does that
work ahead, in a thread of its own, once the shard holds its lease and while the driver's main
thread starts its transactional producer, reads its last progress, GroupState table, checkpoint
and journal and starts the query (not earlier: taking the lease is a write whose time counts
against the lease's TTL, and the warm-up would compete with it for the CPU):

1. one Spark job of `parallelism` tasks through `mapInArrow` (the eval type of a batch's phase
   1), each importing `varadhi.batch` and what it imports (pandas, pyarrow, pycurl) in its
   Python worker, which Spark then keeps for the batches (`spark.python.worker.reuse`);
2. one record of the catalog topic read by Spark's Kafka source (`read_one`: the driver's
   offset reader, an executor's Kafka consumer) with a projection whose generated code Janino
   compiles.

Both only read (the catalog topic holds at least the shard's subscription). The jobs run in
their own job group, which `cancel` cancels (a shard that stops or fails early does not wait
for them). A failure is logged and otherwise ignored: a warm-up that did not happen costs the
first batch what it cost before, nothing more.

Only where it pays: a local master (executors in the driver's JVM and on its machine), a
session this process started for the shard (a notebook's or a test's session is left alone),
and a core to spare: the work moves earlier, it does not go away, so on a machine whose 1-minute
load average is at or above its core count the warm-up only competes with the start-up (on the
shared 2-core machine at load 20-35 it slowed a standby's takeover and ran into the first batch).
`VARADHI_WARM_UP=1` warms up whatever the load, `0` never (both to measure it). It costs
nothing per batch afterwards: the workers are the ones the batches use, and the warm-up's Kafka
consumer is closed by Spark's consumer pool when idle (`spark.kafka.consumer.cache.timeout`, 5
minutes).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

from pyspark.sql import SparkSession

from . import jvm_errors

log = logging.getLogger("varadhi.shard")

JOB_GROUP = "varadhi-warm-up"
ENV = "VARADHI_WARM_UP"


def wanted(
    env: Mapping[str, str],
    own_session: bool,
    master: Callable[[], str],
    load_1m: float,
    cores: int,
) -> bool:
    """Whether a shard warms its Spark up (`master()` is asked last): its own session
    (`own_session`) on a local master, and `VARADHI_WARM_UP` is 1 (always), or unset and a core is
    idle (the 1-minute load average `load_1m` below `cores`). 0 turns it off."""
    setting = env.get(ENV, "").strip().lower()
    if not own_session or setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("1", "true", "yes", "on") and load_1m >= cores:
        return False
    return master().startswith("local")


def machine_load() -> tuple[float, int]:
    """This machine's 1-minute load average and core count, for `wanted`; a load that cannot be
    read counts as busy."""
    cores = os.cpu_count() or 1
    try:
        return os.getloadavg()[0], cores
    except OSError:
        return float(cores), cores


def import_delivery(batches: Iterator) -> Iterator:
    """A `mapInArrow` function (runs in a Python worker): imports the delivery code a batch's
    tasks run, then passes its input through."""
    import varadhi.batch  # noqa: F401 - the import is the point

    yield from batches


def warm_python_workers(spark: SparkSession, parallelism: int) -> None:
    """Start `parallelism` Python workers (one task each, run side by side) with the delivery
    code imported."""
    df = spark.range(0, parallelism, 1, parallelism)
    df.mapInArrow(import_delivery, df.schema).collect()


def read_one(spark: SparkSession, kafka: Mapping[str, str], topic: str) -> None:
    """Read the first record of partition 0 of `topic` with Spark's Kafka source and `kafka`'s
    connection options (`kafka_clients.spark_options`)."""
    (
        spark.read.format("kafka")
        .options(**kafka)
        .option("assign", json.dumps({topic: [0]}))
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
        .selectExpr("length(value) + partition AS n", "CAST(key AS STRING) AS k")
        .limit(1)
        .collect()
    )


class WarmUp:
    """The warm-up jobs (module docstring) in a daemon thread, started at construction."""

    def __init__(self, spark: SparkSession, kafka: Mapping[str, str], topic: str, what: str):
        self._spark = spark
        self._what = what
        self._thread = threading.Thread(
            target=self._run, args=(dict(kafka), topic), name=JOB_GROUP, daemon=True
        )
        self._thread.start()

    def _run(self, kafka: dict[str, str], topic: str) -> None:
        started = time.monotonic()
        sc = self._spark.sparkContext
        try:
            sc.setJobGroup(JOB_GROUP, f"{self._what}: warm-up", interruptOnCancel=True)
            warm_python_workers(self._spark, sc.defaultParallelism)
            read_one(self._spark, kafka, topic)
        except Exception as e:  # noqa: BLE001 - the first batch then does it, as without
            log.info("%s: warm-up not done (%s)", self._what, jvm_errors.headline(e))
            return
        log.info("%s: Spark warmed up in %.1f s", self._what, time.monotonic() - started)

    def cancel(self) -> None:
        """Cancel what is still running (a shard that stops or fails early)."""
        if self._thread.is_alive():
            try:
                self._spark.sparkContext.cancelJobGroup(JOB_GROUP)
            except Exception:  # noqa: BLE001 - the context is gone: nothing left to cancel
                pass
