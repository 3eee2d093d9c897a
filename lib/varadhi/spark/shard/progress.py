"""What a running shard reports: its counters, rates, where it reads and what its state holds,
as progress documents (`varadhi.kafka.progress`) that `varadhi status` and the notebooks read.

`ShardProgress.open` starts publishing once the lease is held, with the counters of the shard's
last document (`ShardStats.resumed`: a restarted shard goes on from them). Documents are
rate-limited unless forced; every batch's counters are forced out (without waiting for the
broker), so a shard killed right after a batch loses none of them.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from varadhi.core.circuit import CircuitBreaker
from varadhi.core.state_rows import StateRow
from varadhi.kafka import subscriptions
from varadhi.kafka.progress import ProgressPublisher, latest_progress
from varadhi.kafka.settings import Settings
from varadhi.spark.layouts import Layout
from varadhi.spark.shard.reading import consumed
from varadhi.spark.shard.stats import Rates, ShardStats, summarize, where_reading


class Holder(Protocol):
    """Who holds the shard's lease (`varadhi.spark.shard.lease.ShardLease`)."""

    instance: str
    epoch: int | None


class ShardProgress:
    """The progress of shard `shard` of subscription `name` (module docstring)."""

    def __init__(self, settings: Settings, name: str, shard: int, circuit: CircuitBreaker):
        self.settings, self.name, self.shard, self.circuit = settings, name, shard, circuit
        self.stats = ShardStats()
        self.summary: dict[str, Any] = {}  # `summarize` of the state's pending groups
        self.where: dict[str, Any] = {}  # `where_reading`, what the last batch read, waits
        self._rates = Rates()
        self._publisher: ProgressPublisher | None = None
        self._holder: Holder | None = None

    def open(self, sub: subscriptions.Subscription, holder: Holder) -> None:
        """Publish from now on, as the lease's `holder`; counters and the last position resumed
        from the shard's last document (the position only at the same shard count)."""
        self._holder = holder
        self._publisher = ProgressPublisher(self.settings, self.name, self.shard)
        # A lease at epoch 1 was never held before at this shard count: nothing to resume, and
        # no reason to read back through other subscriptions' documents for it.
        earlier = [self.shard] if (holder.epoch or 0) > 1 else []
        found = latest_progress(self.settings, self.name, earlier, sub.created_ms)
        last = found.get(self.shard)
        self.stats = ShardStats.resumed(last, sub.shard_count)
        carried = last if last and last.get("shard_count") == sub.shard_count else {}
        self.where = {k: carried[k] for k in ("generation", "layout", "consumed") if k in carried}
        self.where["shard_count"] = sub.shard_count

    def reading(self, shard_count: int, layout: Layout, assign: dict[str, list[int]]) -> None:
        """A query of `layout` started, reading `assign`."""
        self.where = where_reading(self.where, shard_count, layout, assign)

    def state(self, pending: dict[str, list[StateRow]]) -> None:
        """The state's pending groups, as the status summary shows them."""
        self.summary = summarize(pending)

    def read(self, query) -> None:
        """Keep what `query`'s last batch read for the next document (a batch may end after
        the last look that recorded it)."""
        read = consumed(query.lastProgress)
        if read is not None:
            self.where["consumed"] = read

    def publish(self, state: str, query=None, force: bool = False, flush: bool | None = None):
        """Send a progress document (rate-limited unless `force`; waits for the broker when
        `flush`, by default when forced). Nothing before `open`."""
        if self._publisher is None or self._holder is None:
            return
        s = self.stats
        rates = self._rates.update(time.monotonic(), s.delivered, s.failures)
        if query is not None:
            self.read(query)
        doc = {
            "state": state,
            "shard": self.shard,
            "instance": self._holder.instance,
            "epoch": self._holder.epoch,
            **self.where,
            **self.summary,
            "totals": s.totals(),
            "rates": rates,
            "last_batch": s.last_batch,
            "circuit": self.circuit.status(),
        }
        self._publisher.publish(doc, force=force, flush=force if flush is None else flush)

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
