"""De-duplication window (seed 001), for the whole subscription: a message whose id was delivered
within the window, by any shard of the subscription, is dropped, counted and logged instead of
delivered again.

Ids are the producer's message id, or the SHA-256 of the payload when the producer set none.
Each shard writes the ids it delivered to a Delta table of its own
(`<warehouse>/<sub>/dedup/s<S>/shard-<i>`: msg_id, delivered_ms; one writer per table, as object
stores need without a commit coordinator), and reads the ids of every table of the subscription:
its own, the other shards' at the current count and those of earlier shard counts, which stop
growing at a shard-count change and are read on until their ids leave the window. So a
duplicate is dropped whichever shard reads it (an ungrouped message's copy may land on another
partition), before and after change-shards or a partition-count change. Appends are idempotent
per micro-batch (txnAppId/txnVersion); every few minutes a shard deletes the rows older than the
window from its own table and from the earlier counts' tables it owns (`owned_tables`: table
`shard-j` of an earlier count belongs to current shard `j mod S`, so every table has one writer),
so the memory is bounded by the window and survives restarts. Only main-topic records are
checked: retries and re-drives carry the id of a message that was not delivered.

Hazards: at-least-once still applies inside the window when a shard dies after delivering but
before it remembered the ids (the in-flight batch), and when two shards read copies of one
message in batches that run at the same time (neither has remembered it yet); a duplicate that
arrives in the same micro-batch as its original is dropped (the first by position is kept).
"""

from __future__ import annotations

import logging
import re
import time

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from varadhi.core import messages as m
from varadhi.core.state_rows import Kind
from varadhi.spark.columns import header_column, text_id_column
from varadhi.spark.warehouse_fs import HadoopFS

log = logging.getLogger("varadhi.spark.dedup")
SCHEMA = "msg_id string, delivered_ms bigint"
EVICT_EVERY_S = 300


def dedup_id() -> F.Column:
    """The id a record is de-duplicated by: the text form of its message id header
    (`varadhi.core.record_ids`), else the SHA-256 of its value."""
    return F.coalesce(text_id_column(header_column(m.H_MSG_ID)), F.sha2(F.col("value"), 256))


def tables_root(warehouse: str, name: str) -> str:
    """The folder of subscription `name`'s dedup tables."""
    return f"{warehouse}/{name}/dedup"


def table_path(root: str, shard_count: int, shard: int) -> str:
    return f"{root}/s{shard_count}/shard-{shard}"


_TABLE = re.compile(r"s(\d+)/shard-(\d+)")


def owned_tables(tables: list[str], shard_count: int, shard: int) -> list[str]:
    """The tables among `tables` (`s<S>/shard-<j>`, relative to the root) that shard `shard` of
    `shard_count` evicts: its own, and those of other counts whose `j mod shard_count` is
    `shard` (pure). Every table has exactly one owner at a given shard count."""
    owned = []
    for table in tables:
        found = _TABLE.fullmatch(table)
        if found is None:
            continue
        count, j = int(found[1]), int(found[2])
        if (count == shard_count and j == shard) or (
            count != shard_count and j % shard_count == shard
        ):
            owned.append(table)
    return owned


class DedupWindow:
    """The window of shard `shard` of `shard_count`, its tables under `root`."""

    def __init__(
        self, spark: SparkSession, root: str, shard_count: int, shard: int, window_ms: int
    ):
        self.spark = spark
        self.root = root
        self.shard_count, self.shard = shard_count, shard
        self.path = table_path(root, shard_count, shard)
        self.window_ms = window_ms
        self._last_evict = 0.0
        self._earlier: list[str] | None = None  # tables of earlier counts: a fixed set
        self._current: set[str] = set()  # tables of the current count known to exist

    def _tables(self) -> list[str]:
        """Every dedup table of the subscription that exists now (relative to the root)."""
        if self._earlier is None:
            fs = HadoopFS(self.spark)
            self._earlier = [
                f"{count}/{shard}"
                for count in fs.list(self.root)
                if count != f"s{self.shard_count}"
                for shard in fs.list(f"{self.root}/{count}")
                if self._is_table(f"{count}/{shard}")
            ]
        for j in range(self.shard_count):
            table = f"s{self.shard_count}/shard-{j}"
            if table not in self._current and self._is_table(table):
                self._current.add(table)
        return self._earlier + sorted(self._current)

    def _is_table(self, table: str) -> bool:
        from delta.tables import DeltaTable

        return bool(DeltaTable.isDeltaTable(self.spark, f"{self.root}/{table}"))

    def _seen(self, now_ms: int) -> DataFrame | None:
        """The ids every shard of the subscription delivered within the window, or None."""
        seen = None
        for table in self._tables():
            ids = (
                self.spark.read.format("delta")
                .load(f"{self.root}/{table}")
                .filter(F.col("delivered_ms") >= now_ms - self.window_ms)
                .select("msg_id")
            )
            seen = ids if seen is None else seen.unionByName(ids)
        return seen

    def filter(
        self, records: DataFrame, now_ms: int
    ) -> tuple[DataFrame, list[tuple[str, str, str | None]]]:
        """Drop main-topic records (`Kind.MQ`, column `dedup_id`) delivered within the window
        or repeated in this batch. Returns the kept records and the dropped ones as (dedup id,
        message id, group id)."""
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
        dropped = [
            (r[0], r[1], r[2])
            for r in dropped_seen.unionByName(repeated)
            .select("dedup_id", "msg_id", "group_id")
            .collect()
        ]
        if dropped:
            log.info(
                "dropped %d duplicate messages: %s", len(dropped), [d[0] for d in dropped[:20]]
            )
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
        """Delete the rows older than the window from the tables this shard owns."""
        from delta.tables import DeltaTable

        for table in owned_tables(self._tables(), self.shard_count, self.shard):
            DeltaTable.forPath(self.spark, f"{self.root}/{table}").delete(
                F.col("delivered_ms") < now_ms - self.window_ms
            )
