"""Leases: at most one live instance of a shard (or feeder) at a time.

An instance takes the lease by bumping its epoch in the catalog (`lease/<owner>`); a newer
instance bumps it again. The older instance sees a different epoch at its next check and must
stop without committing anything (DESIGN hazard 6). Checks are cheap (an incremental catalog
read), so a shard checks at the start of every micro-batch and right before every commit.

The lease is the outer fence; the inner one is Kafka's: shards write their RQ/DLQ records with a
transactional id per shard, so the newer instance's `init_transactions` also fences the older
instance's producer at the broker.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

from .catalog import Catalog, Snapshot, key
from .errors import Fenced

KIND = "lease"


class Lease:
    def __init__(self, catalog: Catalog, owner: str):
        self.catalog = catalog
        self.owner = owner
        self.instance = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.epoch: int | None = None

    def acquire(self) -> int:
        """Take the lease from whoever had it; returns the new epoch."""

        def change(snap: Snapshot):
            current = snap.get(KIND, self.owner) or {"epoch": 0}
            doc = {
                "epoch": int(current["epoch"]) + 1,
                "instance": self.instance,
                "acquired_ms": int(time.time() * 1000),
            }
            return {key(KIND, self.owner): doc}

        written = self.catalog.mutate(change)
        self.epoch = int(written[key(KIND, self.owner)]["epoch"])
        return self.epoch

    def check(self) -> None:
        """Raise `Fenced` when another instance has taken the lease since `acquire`."""
        doc = self.catalog.get(KIND, self.owner)
        current = int(doc["epoch"]) if doc else 0
        if self.epoch is None or current != self.epoch:
            raise Fenced(f"lease {self.owner}", self.epoch or 0, current)
