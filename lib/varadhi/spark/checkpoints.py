"""Where a shard is: the offsets its last committed micro-batch read up to.

Spark keeps them in the query's checkpoint: `offsets/<batch>` (written when a batch is planned)
and `commits/<batch>` (written once it completed). The position of a stopped shard is the end
offsets of its newest committed batch, or, before its first commit, the starting offsets of its
reader layout. Operations that move shards (offset reset, shard-count change) run while shards
are stopped and start them again from positions computed here.

Checkpoints are read (and a never-run batch plan removed) through a `WarehouseFS`
(`varadhi.spark.warehouse_fs`): Hadoop's FileSystem API of a Spark session for a warehouse on an
object store (`s3a://`, `abfss://`, `gs://`, `dbfs:/`) or a Unity Catalog volume, the local file
system for a local warehouse in a process without Spark. Functions take it as `fs`; callers
resolve it once (`warehouse_fs.for_path`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from varadhi.kafka import subscriptions
from varadhi.kafka.catalog import Catalog
from varadhi.spark import layouts
from varadhi.spark.layouts import Layout
from varadhi.spark.warehouse_fs import WarehouseFS, child, for_path

Offsets = dict[str, dict[str, int]]  # storage topic -> partition (as text) -> next offset


def _batches(fs: WarehouseFS, folder: str) -> list[int]:
    return sorted(int(n) for n in fs.list(folder) if n.isdigit())


def committed_offsets(checkpoint: str, fs: WarehouseFS) -> Offsets | None:
    """End offsets of the newest committed batch of a Kafka-source query, or None."""
    batches = _batches(fs, child(checkpoint, "commits"))
    if not batches:
        return None
    lines = fs.read_text(child(child(checkpoint, "offsets"), str(batches[-1]))).splitlines()
    return {
        t: {str(p): int(o) for p, o in parts.items()} for t, parts in json.loads(lines[2]).items()
    }


def shard_position(
    catalog: Catalog, sub: subscriptions.Subscription, shard: int, fs: WarehouseFS | None = None
) -> tuple[Layout, Offsets]:
    """A shard's current reader layout and the offsets it has consumed (starting offsets where it
    has not committed a batch yet; -2 means "from the beginning"). `fs` defaults to
    `warehouse_fs.for_path(warehouse)` (which may start Spark for a remote warehouse)."""
    layout = layouts.current(catalog.snapshot(), sub.name, sub.shard_count, shard, sub.generation)
    warehouse = catalog.settings.warehouse
    path = layouts.checkpoint_path(warehouse, sub.name, sub.shard_count, shard, layout)
    fs = fs or for_path(warehouse, purpose=f"varadhi-{sub.name}-positions")
    return layout, layouts.merged(layout.starting_offsets, committed_offsets(path, fs) or {})


def uncommitted_batch(checkpoint: str, fs: WarehouseFS) -> tuple[int, int] | None:
    """(batch id, planning time in ms since the epoch) of the newest batch planned in the
    checkpoint and never committed, or None. A query started on the checkpoint runs that batch
    first, again: an earlier run started it and may have delivered part of it
    (`varadhi.spark.journal`). The time is Spark's `batchTimestampMs`, kept when the batch re-runs;
    0 when the plan does not say."""
    plan = uncommitted_plan(checkpoint, fs)
    return None if plan is None else (plan[0], plan[1])


def uncommitted_plan(checkpoint: str, fs: WarehouseFS) -> tuple[int, int, Offsets] | None:
    """`uncommitted_batch` with the end offsets of that batch's plan (what it reads up to, per
    storage topic and partition; {} when the plan does not say), or None."""
    offsets = child(checkpoint, "offsets")
    planned = max(_batches(fs, offsets), default=-1)
    if planned < 0 or fs.exists(child(child(checkpoint, "commits"), str(planned))):
        return None
    try:
        lines = fs.read_text(child(offsets, str(planned))).splitlines()
    except OSError:
        lines = []
    try:
        planned_ms = int(json.loads(lines[1]).get("batchTimestampMs", 0))
    except (IndexError, ValueError, AttributeError):
        planned_ms = 0
    try:
        ends = {
            t: {str(p): int(o) for p, o in parts.items()}
            for t, parts in json.loads(lines[2]).items()
        }
    except (IndexError, ValueError, AttributeError, TypeError):
        ends = {}
    return planned, planned_ms, ends


def forget_planned_batch(
    checkpoint: str, batch_id: int, fs: WarehouseFS, planned_since_ms: int
) -> bool:
    """Delete the plan of batch `batch_id` (`offsets/<id>`) if it is the newest plan, was
    never committed, and was planned at or after `planned_since_ms` (its `batchTimestampMs`),
    so that the next query on the checkpoint plans that batch again under its own limits
    (`maxOffsetsPerTrigger`) instead of re-running the planned range. Only for a batch whose
    `foreachBatch` did nothing (a shard refuses a batch planned while it stops its query); a
    batch that may have had effects must be re-run as planned. `planned_since_ms` is the start
    of the query that refused it: a plan older than that is one an earlier run left (it crashed
    in that batch, which delivered messages), and its re-run is what reads that run's delivery
    journal (`uncommitted_batch`), so it is kept. Returns whether a plan was deleted."""
    offsets = child(checkpoint, "offsets")
    if max(_batches(fs, offsets), default=-1) != batch_id:
        return False
    if fs.exists(child(child(checkpoint, "commits"), str(batch_id))):
        return False
    planned = uncommitted_batch(checkpoint, fs)
    if planned is None or planned[1] < planned_since_ms:
        return False
    for name in (str(batch_id), f".{batch_id}.crc"):  # the plan and Hadoop's checksum of it
        fs.delete(child(offsets, name))
    return True


def await_commit(
    checkpoint: str,
    batch_id: int,
    running: Callable[[], bool],
    fs: WarehouseFS,
    timeout_s: float = 10.0,
) -> bool:
    """Wait until Spark has committed batch `batch_id` (`commits/<id>`) while `running()`.

    `foreachBatch` returns before Spark writes the commit; a query stopped in between runs the
    batch again on its next start. A driver that stops its query because of what a batch just
    did waits for this first. False on timeout (or a checkpoint `fs` cannot read)."""
    if batch_id < 0:
        return False
    done = child(child(checkpoint, "commits"), str(batch_id))
    deadline = time.monotonic() + timeout_s
    while not fs.exists(done):
        if not fs.exists(checkpoint) or not running():
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
