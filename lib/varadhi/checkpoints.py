"""Where a shard is: the offsets its last committed micro-batch read up to.

Spark keeps them in the query's checkpoint: `offsets/<batch>` (written when a batch is planned)
and `commits/<batch>` (written once it completed). The position of a stopped shard is the end
offsets of its newest committed batch, or, before its first commit, the starting offsets of its
reader layout. Operations that move shards (offset reset, shard-count change) run while shards
are stopped and start them again from positions computed here.

Hazard: this reads the checkpoint through the local file system, which is what the embedded
defaults use; on a cluster the warehouse must be a path this process can read (a mounted volume).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from . import layouts, subscriptions
from .catalog import Catalog
from .layouts import Layout

Offsets = dict[str, dict[str, int]]  # storage topic -> partition (as text) -> next offset


def committed_offsets(checkpoint: str) -> Offsets | None:
    """End offsets of the newest committed batch of a Kafka-source query, or None."""
    commits = os.path.join(checkpoint, "commits")
    if not os.path.isdir(commits):
        return None
    batches = sorted(int(n) for n in os.listdir(commits) if n.isdigit())
    if not batches:
        return None
    with open(os.path.join(checkpoint, "offsets", str(batches[-1])), encoding="utf-8") as f:
        lines = f.read().splitlines()
    return {
        t: {str(p): int(o) for p, o in parts.items()} for t, parts in json.loads(lines[2]).items()
    }


def shard_position(
    catalog: Catalog, sub: subscriptions.Subscription, shard: int
) -> tuple[Layout, Offsets]:
    """A shard's current reader layout and the offsets it has consumed (starting offsets where it
    has not committed a batch yet; -2 means "from the beginning")."""
    layout = layouts.current(catalog.snapshot(), sub.name, sub.shard_count, shard, sub.generation)
    path = layouts.checkpoint_path(
        catalog.settings.warehouse, sub.name, sub.shard_count, shard, layout
    )
    return layout, layouts.merged(layout.starting_offsets, committed_offsets(path) or {})


def uncommitted_batch(checkpoint: str) -> tuple[int, int] | None:
    """(batch id, planning time in ms since the epoch) of the newest batch planned in the
    checkpoint and never committed, or None. A query started on the checkpoint runs that batch
    first, again: an earlier run started it and may have delivered part of it
    (`varadhi.journal`). The time is Spark's `batchTimestampMs`, kept when the batch re-runs;
    0 when the plan does not say."""
    offsets = os.path.join(checkpoint, "offsets")
    if not os.path.isdir(offsets):
        return None
    planned = max((int(n) for n in os.listdir(offsets) if n.isdigit()), default=-1)
    if planned < 0 or os.path.exists(os.path.join(checkpoint, "commits", str(planned))):
        return None
    try:
        with open(os.path.join(offsets, str(planned)), encoding="utf-8") as f:
            lines = f.read().splitlines()
        planned_ms = int(json.loads(lines[1]).get("batchTimestampMs", 0))
    except (OSError, IndexError, ValueError, AttributeError):
        planned_ms = 0
    return planned, planned_ms


def forget_planned_batch(checkpoint: str, batch_id: int) -> bool:
    """Delete the plan of batch `batch_id` (`offsets/<id>`) if it is the newest plan and was
    never committed, so that the next query on the checkpoint plans that batch again under its
    own limits (`maxOffsetsPerTrigger`) instead of re-running the planned range. Only for a
    batch whose `foreachBatch` did nothing (a shard refuses a batch planned while it stops its
    query); a batch that may have had effects must be re-run as planned. Returns whether a plan
    was deleted."""
    offsets = os.path.join(checkpoint, "offsets")
    if not os.path.isdir(offsets):
        return False
    planned = [int(n) for n in os.listdir(offsets) if n.isdigit()]
    if max(planned, default=-1) != batch_id:
        return False
    if os.path.exists(os.path.join(checkpoint, "commits", str(batch_id))):
        return False
    for name in (str(batch_id), f".{batch_id}.crc"):  # the plan and Hadoop's checksum of it
        try:
            os.remove(os.path.join(offsets, name))
        except FileNotFoundError:
            pass
    return True


def await_commit(
    checkpoint: str, batch_id: int, running: Callable[[], bool], timeout_s: float = 10.0
) -> bool:
    """Wait until Spark has committed batch `batch_id` (`commits/<id>`) while `running()`.

    `foreachBatch` returns before Spark writes the commit; a query stopped in between runs the
    batch again on its next start. A driver that stops its query because of what a batch just
    did waits for this first. False on timeout (or a checkpoint this process cannot read)."""
    done = os.path.join(checkpoint, "commits", str(batch_id))
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(done):
        if batch_id < 0 or not os.path.isdir(checkpoint) or not running():
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
