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
