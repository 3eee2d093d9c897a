"""A shard's GroupState table in Delta, with the driver's in-memory copy of it
(`varadhi.core.state_copy.StateCopy`: what the copy answers and how a commit changes it).

The table (one per subscription, shard count and shard) holds rows of
`state_rows.STATE_SCHEMA` (kinds and columns: `varadhi.core.state_rows`):

- `pending`: one per pending message of a non-healthy group (see `varadhi.core.group_state`);
- `out`:     the RQ/DLQ records of the last committed batch (a transactional outbox: they are
             sent after the commit and re-sent if the batch is replayed);
- `meta`:    which batch (`app_id`, `batch_id`) the table's content belongs to;
- `redrive`: a DLQ re-drive applied in this table and not yet marked done in the catalog
             (`msg_id`: the operation id, `headers`: the end offsets its DLQ scan covered, as
             JSON; see `varadhi.kafka.dlq`).

A table is read into `STATE_COLUMNS` whatever columns it was written with (`normalise`): a
column it lacks reads as null, one it has beyond them is dropped.

It is small by design (healthy groups have no rows), so a shard keeps a copy in driver memory,
loaded when its query starts, and replaces the whole table when a batch changed it: one Delta
commit, idempotent per batch (`txnAppId`/`txnVersion`). Each commit carries `userMetadata`
naming the writer instance; after writing, the shard reads the Delta log's commit files after
the version its copy is (`_delta_log/<version>.json`: usually its own commit's, and one miss)
to learn whether its own write won (a fenced instance, or a replay whose txnVersion was already
committed, is skipped silently by Delta) and is the table's latest, and reloads the table if
not. Those reads replaced a read of the table's history (a Spark job: 0.1-0.6 s per commit).

The table is always read whole, so Delta's per-column statistics (data skipping) are never
used, and it is read from the log only when a shard starts. It is created with
`TABLE_PROPERTIES`: no statistics, and a checkpoint every 100 commits instead of Delta's 10 (a
checkpoint is written inside the commit that reaches it: three more Spark jobs, about a second,
for a table of a few rows; at 100 a start replays at most 99 small commit files). A table
created without them (by an earlier version, a shard-count change or an offset reset) gets them
before this store's first commit to it (one `ALTER TABLE` commit; loading alone writes nothing).

Every commit writes a whole new copy of the table and leaves the old one's files behind (Delta
only marks them removed). So that a state table does not grow forever on object storage while
an endpoint fails (a commit every few seconds), the store vacuums it each time its version
passes a multiple of `VACUUM_EVERY`: `VACUUM ... LITE`, which finds the removed files in the
log instead of listing the table (2-3 s here, against 12-28 s for a full `VACUUM` of a
two-file table), and deletes those removed more than an hour ago
(`delta.deletedFileRetentionDuration`: no reader of the table holds a version that old; a shard
loads the latest). Best effort: a failed vacuum is a warning, and the next one tries again. A
vacuum adds two commits without a writer stamp, which `commit`'s log check steps over.

The log itself (`_delta_log`: a commit file and its checksum per version, a checkpoint every
100) is kept two days (`delta.logRetentionDuration`, Delta's default 30): Delta deletes the
files before a checkpoint older than that (counted in whole days) when it writes a later
checkpoint. At a commit every three seconds, 30 days would be about 860,000 commit files per
shard; nothing reads an old version (a shard loads the latest, and its log check reads the
versions after its copy's).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import pandas as pd
from pyspark.sql import SparkSession

from varadhi.core.state_copy import StateCopy
from varadhi.core.state_frames import normalise
from varadhi.core.state_rows import COLUMN_NAMES, STATE_SCHEMA, Kind, read_before
from varadhi.spark.warehouse_fs import HadoopFS

log = logging.getLogger("varadhi.spark.state_store")

# A state table's Delta properties: no per-column statistics (the table is always read whole),
# a checkpoint every 100 commits, removed files deletable after an hour, log files kept two
# days (module docstring).
TABLE_PROPERTIES = {
    "delta.dataSkippingNumIndexedCols": "0",
    "delta.checkpointInterval": "100",
    "delta.deletedFileRetentionDuration": "interval 1 hours",
    "delta.logRetentionDuration": "interval 2 days",
}
# The store vacuums the table when its version passes a multiple of this.
VACUUM_EVERY = 100


class StateStore(StateCopy):
    """One shard's state table in Delta and the driver's copy of it (`StateCopy`)."""

    def __init__(self, spark: SparkSession, path: str, writer: str):
        self.spark = spark
        self.path = path
        self.writer = writer
        self._fs = HadoopFS(spark)
        self.version: int | None = None  # the table version the copy is (None: no table yet)
        self._missing: dict[str, str] = {}  # TABLE_PROPERTIES the table lacks
        super().__init__(self._load())

    def _load(self) -> pd.DataFrame:
        """Read the table at its latest version; sets `version` and which `TABLE_PROPERTIES`
        it lacks."""
        from delta.tables import DeltaTable

        if not DeltaTable.isDeltaTable(self.spark, self.path):
            self.version = None
            return normalise(pd.DataFrame(columns=COLUMN_NAMES))
        table = DeltaTable.forPath(self.spark, self.path)
        have = table.detail().select("properties").collect()[0]["properties"] or {}
        self._missing = {k: v for k, v in TABLE_PROPERTIES.items() if have.get(k) != v}
        self.version = int(table.history(1).select("version").collect()[0]["version"])
        reader = self.spark.read.format("delta").option("versionAsOf", self.version)
        return normalise(reader.load(self.path).toPandas())

    def _set_properties(self) -> None:
        """Give a table created without them the `TABLE_PROPERTIES` it lacks (one commit, which
        `commit`'s check of the log steps over). Best effort: a failure (another writer's
        commit at the same moment) is a warning; the next load tries again."""
        settings = ", ".join(f"'{k}' = '{v}'" for k, v in self._missing.items())
        self._missing = {}
        try:
            self.spark.sql(f"ALTER TABLE delta.`{self.path}` SET TBLPROPERTIES ({settings})")
        except Exception as e:  # noqa: BLE001 - only a performance setting; reported, not fatal
            log.warning("state table %s: could not set %s: %s", self.path, settings, e)

    def reload(self) -> None:
        self.frame = self._load()

    def drop_entries(self, location: str, origins: set[tuple[int, int, int, int]]) -> int:
        """Remove pending entries at `location` whose (origin index, partition, offset, attempts)
        is in `origins`, and write the table (offline use: the shard must be stopped). Returns how
        many were removed."""
        f = self.frame
        keys = list(
            zip(
                f["origin_index"],
                f["origin_partition"],
                f["origin_offset"],
                f["attempts"],
                strict=True,
            )
        )
        hit = [
            kind == Kind.PENDING and where == location and tuple(int(x) for x in k) in origins
            for kind, where, k in zip(f["kind"], f["location"], keys, strict=True)
        ]
        return self._drop(hit)

    def drop_held_read_before(self, positions: Mapping[tuple[str, int], int]) -> int:
        """Remove `held` pending entries read from a record before the offset `positions` gives
        its topic partition (`state_rows.read_before`): retries read back from the RQ before
        they were due, which an RQ fast-forward to those positions skips. Writes the table
        (offline use: the shard must be stopped). Returns how many were removed."""
        f = self.frame
        hit = [
            kind == Kind.PENDING and where == "held" and read_before(source, positions)
            for kind, where, source in zip(f["kind"], f["location"], f["source"], strict=True)
        ]
        return self._drop(hit)

    def _drop(self, hit: list[bool]) -> int:
        """Write the table without the rows `hit` marks (nothing when it marks none)."""
        f = self.frame
        if not any(hit):
            return 0
        frame = normalise(f[[not h for h in hit]])
        self.spark.createDataFrame(frame, STATE_SCHEMA).write.format("delta").mode(
            "overwrite"
        ).save(self.path)
        self.reload()  # the copy, and the version it is, as written
        return sum(hit)

    def commit(self, touched: set[str], new_rows: pd.DataFrame, app_id: str, batch_id: int) -> bool:
        """Replace the table with `committed(...)`, idempotently per (`app_id`, `batch_id`).
        Returns whether this writer's commit is the table's latest (False: someone else's won;
        the copy is reloaded)."""
        frame = self.committed(touched, new_rows, app_id, batch_id)
        stamp = f"{self.writer}/{app_id}/{batch_id}"
        writer = (
            self.spark.createDataFrame(frame, STATE_SCHEMA)
            .write.format("delta")
            .mode("overwrite")
            .option("txnAppId", app_id)
            .option("txnVersion", batch_id)
            .option("userMetadata", stamp)
        )
        if self.version is None:  # this write creates the table: with its properties
            writer = writer.options(**TABLE_PROPERTIES)
        elif self._missing:
            self._set_properties()
        writer.save(self.path)
        before = self.version
        version = self._latest_if_own(-1 if before is None else before, stamp)
        if version is not None:
            self.frame, self.version = frame, version
            if before is not None and before // VACUUM_EVERY < version // VACUUM_EVERY:
                self._vacuum()
            return True
        self.reload()
        return False

    def _vacuum(self) -> None:
        """Delete the table's files removed more than the retention ago (module docstring)."""
        try:
            self.spark.sql(f"VACUUM delta.`{self.path}` LITE").collect()
        except Exception as e:  # noqa: BLE001 - storage upkeep: reported, never fails a batch
            log.warning("state table %s: vacuum failed (tried again later): %s", self.path, e)

    def _latest_if_own(self, after: int, stamp: str) -> int | None:
        """The table's latest version if its commit is the one stamped `stamp`, else None, from
        the commit files after version `after` (the copy's): usually one small read and one
        miss, where a read of the table's history is a Spark job. Delta skips a write whose
        txnVersion was committed already, so then no file carries `stamp`."""
        log_dir = f"{self.path}/_delta_log"
        version, own = after + 1, None
        while True:
            try:
                text = self._fs.read_text(f"{log_dir}/{version:020d}.json")
            except FileNotFoundError:
                return own
            own = version if commit_stamp(text) == stamp else None
            version += 1


def commit_stamp(commit: str) -> str | None:
    """The `userMetadata` of a Delta commit file's `commitInfo` action (pure; None without
    one). A commit file is one JSON action per line."""
    for line in commit.splitlines():
        if '"commitInfo"' in line:
            info = json.loads(line).get("commitInfo") or {}
            return info.get("userMetadata")
    return None
