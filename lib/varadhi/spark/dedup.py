"""De-duplication window (seed 001): a message whose id was delivered within the window is
dropped, counted and logged instead of delivered again.

Ids are the producer's message id, or the SHA-256 of the payload when the producer set none.
Each shard remembers the ids it delivered in a Delta table next to its GroupState
(`<warehouse>/<sub>/dedup/s<S>/shard-<i>`: msg_id, delivered_ms). Appends are idempotent per
micro-batch (txnAppId/txnVersion), rows older than the window are deleted every few minutes, so
the memory is bounded by the window and survives restarts. Only main-topic records are checked:
retries and re-drives carry the id of a message that was not delivered.

Hazard: at-least-once still applies inside the window when a shard dies after delivering but
before it remembered the ids (the in-flight batch); and a duplicate that arrives in the same
micro-batch as its original is dropped too (the first by position is kept).
"""

from __future__ import annotations

import logging
import time

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from varadhi.core import messages as m
from varadhi.core.state_rows import Kind
from varadhi.spark.columns import header_column, text_id_column

log = logging.getLogger("varadhi.spark.dedup")
SCHEMA = "msg_id string, delivered_ms bigint"
EVICT_EVERY_S = 300


def dedup_id() -> F.Column:
    """The id a record is de-duplicated by: the text form of its message id header
    (`varadhi.core.record_ids`), else the SHA-256 of its value."""
    return F.coalesce(text_id_column(header_column(m.H_MSG_ID)), F.sha2(F.col("value"), 256))


class DedupWindow:
    def __init__(self, spark: SparkSession, path: str, window_ms: int):
        self.spark = spark
        self.path = path
        self.window_ms = window_ms
        self._last_evict = 0.0

    def _seen(self, now_ms: int) -> DataFrame | None:
        from delta.tables import DeltaTable

        if not DeltaTable.isDeltaTable(self.spark, self.path):
            return None
        return (
            self.spark.read.format("delta")
            .load(self.path)
            .filter(F.col("delivered_ms") >= now_ms - self.window_ms)
            .select("msg_id")
        )

    def filter(self, records: DataFrame, now_ms: int) -> tuple[DataFrame, list[str]]:
        """Drop main-topic records (`Kind.MQ`, column `dedup_id`) delivered within the window
        or repeated in this batch. Returns the kept records and the dropped ids."""
        main = F.col("kind") == F.lit(Kind.MQ.value)
        mq = records.filter(main)
        first = Window.partitionBy("dedup_id").orderBy("topic", "partition", "offset")
        ranked = mq.withColumn("_n", F.row_number().over(first))
        repeated = ranked.filter("_n > 1").drop("_n")
        fresh = ranked.filter("_n = 1").drop("_n")
        seen = self._seen(now_ms)
        if seen is not None:
            seen = seen.withColumnRenamed("msg_id", "dedup_id")
            dropped_seen = fresh.join(seen, "dedup_id", "left_semi")
            fresh = fresh.join(seen, "dedup_id", "left_anti")
        else:
            dropped_seen = fresh.limit(0)
        dropped = [r[0] for r in dropped_seen.unionByName(repeated).select("dedup_id").collect()]
        if dropped:
            log.info("dropped %d duplicate messages: %s", len(dropped), dropped[:20])
        return fresh.unionByName(records.filter(~main)), dropped

    def remember(self, ids: list[tuple[str, int]], app_id: str, batch_id: int) -> None:
        """Record delivered ids (idempotent per batch); evict expired ones now and then."""
        if ids:
            (
                self.spark.createDataFrame(ids, SCHEMA)
                .write.format("delta")
                .mode("append")
                .option("txnAppId", f"{app_id}.dedup")
                .option("txnVersion", batch_id)
                .save(self.path)
            )
        if time.monotonic() - self._last_evict > EVICT_EVERY_S:
            self._last_evict = time.monotonic()
            self.evict(int(time.time() * 1000))

    def evict(self, now_ms: int) -> None:
        from delta.tables import DeltaTable

        if DeltaTable.isDeltaTable(self.spark, self.path):
            DeltaTable.forPath(self.spark, self.path).delete(
                F.col("delivered_ms") < now_ms - self.window_ms
            )
