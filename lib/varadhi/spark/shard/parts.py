"""The parts of one shard's run, made once its lease is held (`ShardJob`), and what a query of
it reads. Typed and explicit: a query (`query_run.QueryRun`) and a micro-batch
(`micro_batch.MicroBatch`) get these instead of reaching into the job.

- `Loaded`: the subscription and its three composite topics, as one catalog read saw them;
- `ShardParts`: the shard's collaborators for the whole run (catalog, lease, circuit, sender,
  journal, trace, progress, the batch gate, ...);
- `StateStores`: the GroupState table of the running query's layout, opened once per path;
- `RateLimits`: the shard's rate governor (`varadhi.core.rate_limit`), per limit and shard count;
- `DedupWindows`: the shard's dedup window (subscription-wide: `varadhi.spark.dedup`), opened on
  first use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession

from varadhi.core.circuit import CircuitBreaker
from varadhi.core.rate_limit import RateGovernor, shard_share
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.dlq import PickCache
from varadhi.kafka.settings import Settings
from varadhi.spark.dedup import DedupWindow, tables_root
from varadhi.spark.shard.gate import BatchGate
from varadhi.spark.shard.journal import ShardJournal
from varadhi.spark.shard.lease import ShardLease
from varadhi.spark.shard.progress import ShardProgress
from varadhi.spark.shard.reading import EndOffsets, LayoutMoves
from varadhi.spark.shard.sender import QueueSender
from varadhi.spark.shard.ticks import Ticks
from varadhi.spark.shard.trace import ShardTrace
from varadhi.spark.startup import StartupClock
from varadhi.spark.state_store import StateStore


@dataclass(frozen=True)
class Loaded:
    """A subscription and its main, retry and dead-letter composite topics."""

    sub: subscriptions.Subscription
    mq: topics.CompositeTopic
    rq: topics.CompositeTopic
    dlq: topics.CompositeTopic


class StateStores:
    """The GroupState table of the running query's layout (`StateStore`), kept while the path
    stays the same (another layout of the same shard count shares it)."""

    def __init__(self, writer: str):
        self.writer = writer
        self._store: StateStore | None = None

    @property
    def current(self) -> StateStore | None:
        return self._store

    def at(self, spark: SparkSession, path: str) -> StateStore:
        if self._store is None or self._store.path != path:
            self._store = StateStore(spark, path, self.writer)
        return self._store


class DedupWindows:
    """The shard's dedup window (`varadhi.spark.dedup`), opened on first use."""

    def __init__(self, warehouse: str, name: str, shard: int):
        self.warehouse, self.name, self.shard = warehouse, name, shard
        self._window: DedupWindow | None = None

    def window(self, spark: SparkSession, sub: subscriptions.Subscription) -> DedupWindow:
        if self._window is None:
            root = tables_root(self.warehouse, self.name)
            window_ms = int(sub.spec.dedup_window_ms)
            self._window = DedupWindow(spark, root, sub.shard_count, self.shard, window_ms)
        return self._window


class RateLimits:
    """The shard's `RateGovernor` (`varadhi.core.rate_limit`) for its subscription's current
    `endpoint.max_rate` and shard count, made anew when either changes; None without a limit."""

    def __init__(self) -> None:
        self._key: tuple[float, int] | None = None
        self._governor: RateGovernor | None = None

    def governor(self, sub: subscriptions.Subscription) -> RateGovernor | None:
        limit = sub.spec.endpoint.max_rate
        if limit is None:
            return None
        if self._key != (limit, sub.shard_count) or self._governor is None:
            self._key = (limit, sub.shard_count)
            self._governor = RateGovernor(shard_share(limit, sub.shard_count))
        return self._governor


@dataclass(frozen=True)
class ShardParts:
    """One shard run's collaborators, from the lease taken to the run's end."""

    settings: Settings
    catalog: Catalog
    name: str
    shard: int
    spark: SparkSession
    lease: ShardLease
    circuit: CircuitBreaker
    ticks: Ticks  # wake the query for due retries
    sender: QueueSender  # RQ/DLQ records (`varadhi.spark.shard.sender`)
    journal: ShardJournal  # the delivery journal and a shard-count change's hand-over
    trace: ShardTrace  # the delivery trace (`varadhi trace`)
    dedup: DedupWindows
    rates: RateLimits  # `endpoint.max_rate`: this shard's share, slowed by 429/503
    redrive_picks: PickCache  # rate-capped DLQ re-drives under way (`varadhi.kafka.dlq`)
    stores: StateStores
    progress: ShardProgress
    gate: BatchGate
    end_offsets: EndOffsets  # idle checks and layout moves
    layouts: LayoutMoves
    startup: StartupClock  # one INFO line per start-up phase
    stop: threading.Event  # set by SIGINT/SIGTERM or `ShardJob.request_stop`
    stop_when_idle_s: float | None  # a bounded run (tests, demo, benchmarks)
    # Called after each completed micro-batch as hook(last_batch, summary), on the batch's
    # thread: `varadhi.spark.metrics` feeds its exporter and JSON log from it.
    batch_hooks: list[Callable[[dict[str, Any], dict[str, Any]], None]]

    @property
    def label(self) -> str:
        return f"{self.name} shard {self.shard}"
