"""The driver of one subscription shard: its control loop, one Structured Streaming query at a time.

One shard = one query reading, with the Kafka source's `assign`, exactly the main-topic (MQ) and
retry-queue (RQ) partitions it owns (`varadhi.spark.records.Source`), and delivering with
`foreachBatch`. `ShardJob` is the control loop and the wiring of the driver's parts: it takes the
lease or stands by for it (`varadhi.spark.shard.lease`), turns SIGINT/SIGTERM into a stop between
batches, waits while the subscription is paused or its circuit is open, picks the reader layout
and moves to the next (`varadhi.spark.shard.reading`), runs the query and stops it for a `QueryEnd`
reason or judges its failure (`varadhi.spark.shard.ends`), ticks parked retries (`varadhi.spark.shard.ticks`)
and publishes progress (`varadhi.spark.shard.stats`).

Each micro-batch runs the batch-commit protocol (`varadhi.spark.shard.commit.BatchCommit`: lease check,
re-send of a batch committed already, delivery on executors, one idempotent GroupState commit,
RQ/DLQ records in one Kafka transaction, lease check) with the shard's ports: the `StateStore`,
the `ShardLease`, the RQ/DLQ sender (`varadhi.spark.shard.sender`: the shard's transactional producer)
and `_Batch` (the catalog, re-drives, filter, dedup window, delivery with the delivery journal:
`varadhi.spark.shard.journal`). What a crash between two steps leaves is documented there.

Reader layouts (DESIGN hazard 3). A shard reads one main-topic storage topic at a time: it moves
from T_i to T_i+1 only when produce has moved off T_i more than a grace period ago (producers poll
the catalog) and the shard has consumed all of T_i. Each layout has its own checkpoint, its own
starting offsets (carried over from the previous layout) and its own idempotency id, since batch
ids restart at 0 in a new checkpoint (hazard 7). Layout changes, pauses, SIGINT and SIGTERM all
stop the query between batches (`_stop_between_batches`), never inside one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
from kafka.errors import KafkaError
from pyspark.sql import DataFrame, Observation, SparkSession

from varadhi.core import filters
from varadhi.core.circuit import CircuitBreaker, probe_retry
from varadhi.core.errors import (
    Fenced,
    InvalidArgument,
    KafkaUnavailable,
    StopRequested,
    VaradhiError,
)
from varadhi.core.policies import CircuitPolicy
from varadhi.core.state_rows import (
    RESULT_SCHEMA,
    STATE_SCHEMA,
    Kind,
    StateRow,
    delivered_ids,
    normalise,
)
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import jvm_errors, leases, subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.progress import ProgressPublisher, latest_progress
from varadhi.kafka.settings import Settings
from varadhi.spark import checkpoints, journal, layouts, warehouse_fs
from varadhi.spark.batch import (
    BatchContext,
    ForwardRule,
    by_group,
    chained,
    deliver_records,
    parked_within,
    process_partition,
    ran_parked,
)
from varadhi.spark.dedup import DedupWindow
from varadhi.spark.layouts import Layout
from varadhi.spark.records import Source, batch_records, delivery_records, filter_records
from varadhi.spark.shard.commit import BatchCommit
from varadhi.spark.shard.ends import (
    ControlOutage,
    QueryEnd,
    RunEnd,
    Verdict,
    catalog_change,
    idle,
    judge,
)
from varadhi.spark.shard.journal import ShardJournal
from varadhi.spark.shard.lease import ShardLease
from varadhi.spark.shard.reading import EndOffsets, LayoutMoves, caught_up, consumed
from varadhi.spark.shard.sender import QueueSender
from varadhi.spark.shard.stats import (
    Rates,
    ShardStats,
    due_heads,
    next_due,
    summarize,
    where_reading,
)
from varadhi.spark.shard.ticks import Ticks
from varadhi.spark.startup import Ahead, StartupClock
from varadhi.spark.state_store import StateStore
from varadhi.spark.stop_signals import StopSignals

log = logging.getLogger("varadhi.spark.shard.job")

# Producers learn of a switch within a second and give up on a record after 30 s
# (producer.KAFKA_DEFAULTS), so nothing reaches a storage topic later than this after the switch.
SEAL_GRACE_MS = int(os.environ.get("VARADHI_SEAL_GRACE_MS", "35000"))


# How old a micro-batch's view of the catalog (its filter, pending re-drives) may be: what the
# batch's lease check, just before, read.
LEASE_CHECK_READ_S = 1.0


@dataclass(frozen=True)
class _QueryPlan:
    """One query of a layout (`ShardJob._prepare_query`): what it reads, its state table,
    checkpoint and idempotency id, and the most records a batch reads."""

    source: Source
    state_path: str
    checkpoint: str
    app_id: str
    limit: int


class ShardJob:
    """Runs shard `shard` of subscription `name` until stopped, fenced or failed.

    `run()` returns the process exit code (`shard_ends.RunEnd`): 0 stopped on request or idle,
    3 fenced by a newer instance; a failure raises (exit code 1 through the job runner).
    `stop_when_idle_s` bounds a run (tests, demo, benchmarks).
    """

    def __init__(
        self,
        name: str,
        shard: int,
        settings: Settings | None = None,
        spark: SparkSession | None = None,
        stop_when_idle_s: float | None = None,
        standby: bool = False,
        lease_ttl_ms: int | None = None,
    ):
        self.settings = settings or Settings.from_env()
        self.catalog = Catalog(self.settings)
        self.name = name
        self.shard = shard
        self.stop_when_idle_s = stop_when_idle_s
        # Failover (`varadhi.spark.shard.lease`): the lease's TTL, and whether this instance waits for
        # the active one's lease to expire instead of taking it at once.
        self.standby = standby
        self.lease_ttl_ms = lease_ttl_ms or leases.ttl_from_env()
        self._spark = spark
        self.stats = ShardStats()
        self._startup = StartupClock(f"{name} shard {shard}")  # INFO line per phase
        self._batch_lock = threading.Lock()
        self._stopping = False
        self._signal = threading.Event()
        self._last_batch_end = time.monotonic()
        self._circuit = CircuitBreaker(CircuitPolicy())  # configured from the spec
        self._query_circuit = "closed"  # the circuit state the running query was started in
        # (checkpoint, batch, its query's start in ms) refused unstarted
        self._aborted: tuple[str, int, int] | None = None
        self._query_checkpoint = ""
        self._query_started_ms = 0  # wall clock, as Spark's batchTimestampMs
        self._completed = ("", -1)  # (checkpoint, batch) this process last completed
        self._ticks = Ticks(self.settings, shard)  # wake the query for due retries
        self._query = None
        self._sender: QueueSender | None = None  # RQ/DLQ records (`varadhi.spark.shard.sender`)
        self._store: StateStore | None = None
        self._dedup: DedupWindow | None = None
        self._summary: dict[str, Any] = {}
        self._publisher: ProgressPublisher | None = None
        self._rates = Rates()
        self._where: dict[str, Any] = {}
        self._end_offsets = EndOffsets(self.settings)  # idle checks and layout moves
        self._layouts = LayoutMoves(self.catalog, name, shard, self._end_offsets)
        self._partitions_read = 0  # main-topic partitions of the running query
        # The delivery journal: its topic, and what a batch a crashed run left uncommitted skips.
        self._journal = ShardJournal(self.settings, name, shard)
        # What a shard-count change handed this shard's layout (`journal.HandOver`), if any.
        self._handover: tuple[journal.HandOver, Layout] | None = None
        # Called after each completed micro-batch as hook(last_batch, summary) (`summarize`),
        # on the batch's thread: `varadhi.spark.metrics` feeds its exporter and JSON log from it.
        self.batch_hooks: list[Any] = []

    # -- set-up ---------------------------------------------------------------------------
    def _load(
        self,
    ) -> tuple[
        subscriptions.Subscription,
        topics.CompositeTopic,
        topics.CompositeTopic,
        topics.CompositeTopic,
    ]:
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, self.name)
        if not 0 <= self.shard < sub.shard_count:
            raise InvalidArgument(
                f"shard {self.shard} is outside 0..{sub.shard_count - 1} of {self.name}"
            )
        return (
            sub,
            topics.from_snapshot(snap, sub.spec.topic),
            topics.from_snapshot(snap, sub.spec.rq_topic),
            topics.from_snapshot(snap, sub.spec.dlq_topic),
        )

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from varadhi.spark.session import get_spark

            self._spark = get_spark(f"varadhi-{self.name}-shard-{self.shard}")
            self._startup.mark("Spark session ready")
        return self._spark

    @property
    def _fs(self) -> warehouse_fs.WarehouseFS:
        """The checkpoint's file system, through this shard's Spark session (as Spark sees it)."""
        return warehouse_fs.HadoopFS(self.spark)

    def _owner(self, sub: subscriptions.Subscription) -> str:
        return layouts.owner(self.name, sub.shard_count, self.shard)

    def _paths(self, sub: subscriptions.Subscription, layout: Layout) -> tuple[str, str, str]:
        wh, n, sc, sh = self.settings.warehouse, self.name, sub.shard_count, self.shard
        return (
            layouts.state_path(wh, n, sc, sh),
            layouts.checkpoint_path(wh, n, sc, sh, layout),
            layouts.app_id(n, sc, sh, layout),
        )

    # -- main loop ------------------------------------------------------------------------
    def run(self) -> RunEnd:
        lease = ShardLease(self.catalog, self.name, self.shard, self.lease_ttl_ms)
        # Whatever ends the run restores the signal handlers it installed (a standby that took
        # the lease and then fails to read the catalog or start the heartbeat too: the process
        # may go on, a test, a notebook, bench/harness.py) and closes the lease's clients.
        signals: StopSignals | None = None
        try:
            sub, spark = self._start(lease)
            # Before the lease (which fences a running instance) and any write: a warehouse
            # Spark cannot write is one line, not a failed query after the fence.
            warehouse = self.settings.warehouse
            warehouse_fs.check_writable(warehouse_fs.for_path(warehouse, spark), warehouse)
            self.catalog.ensure_segment_roll()  # lease renewals must be compacted away
            self._startup.mark("warehouse and catalog checked")
            if self.standby:
                # Spark is started ahead of time; the lease is taken only once the active
                # instance's has expired (nothing before it may fence the active one: no
                # producer yet).
                signals = self._install_signals()
                if not self._stand_by(lease):
                    return RunEnd.STOPPED
                sub, _, _, _ = self._load()
            else:
                lease.take(self._owner(sub))
            self._startup.mark("lease taken")
            lease.start_heartbeat()
            self._lease = lease
            if signals is None:
                signals = self._install_signals()
            return self._hold(sub, lease)
        finally:
            if signals is not None:
                signals.restore()
            lease.close()  # `_hold` closed it already, unless the run failed before it

    def _start(self, lease: ShardLease) -> tuple[subscriptions.Subscription, SparkSession]:
        """The subscription read from the catalog, then the Spark session. A refusal of the read
        (an unknown subscription or shard) comes first, before anything starts. While the
        session starts, a normal start connects the lease's writer in a thread of its own
        (`ShardLease.prepare`: reads only, nothing fenced; `startup.Ahead`)."""
        sub, _, _, _ = self._load()
        self._startup.mark("catalog read")
        prepared: Ahead[None] | None = None
        if not self.standby:
            owner = self._owner(sub)

            def prepare() -> None:
                lease.prepare(owner)
                self._startup.mark("lease's writer connected")

            prepared = Ahead(prepare, f"varadhi-{self.name}-{self.shard}-lease-writer")
        try:
            spark = self.spark
        finally:
            if prepared is not None:
                prepared.wait()  # its error, if any, after the session's
        if prepared is not None:
            prepared.result()
        return sub, spark

    def _hold(self, sub: subscriptions.Subscription, lease: ShardLease) -> RunEnd:
        """The control loop once the lease is held and renewed: until stopped or fenced
        (`RunEnd`) or failed (raises); releases the lease and closes the shard's clients on every
        exit."""
        clean = False  # stopped on request (a signal) or idle, not fenced or failed
        try:
            self._sender = QueueSender.start(
                self.settings, self.catalog, self.name, sub.shard_count, self.shard,
                lambda: lease.epoch,
            )  # fmt: skip
            self._startup.mark("transactional producer ready")
            self._publisher = ProgressPublisher(self.settings, self.name, self.shard)
            last = latest_progress(self.settings, self.name).get(self.shard)
            self.stats = ShardStats.resumed(last, sub.shard_count)
            self._startup.mark("last progress read")
            # Where the last run stopped, for `where_reading` (same shard count only).
            carried = last if last and last.get("shard_count") == sub.shard_count else {}
            self._where = {
                k: carried[k] for k in ("generation", "layout", "consumed") if k in carried
            }
            self._where["shard_count"] = sub.shard_count
            while True:
                sub, mq, rq, dlq = self._load()
                lease.check()
                if self._signal.is_set():
                    return RunEnd.STOPPED
                if sub.paused:
                    log.info("%s shard %d: paused", self.name, self.shard)
                    self._publish("paused", force=True)
                    if self._wait_while_paused():
                        return RunEnd.STOPPED
                    continue
                self._circuit.configure(sub.spec.circuit_breaker)
                if self._circuit.poll() == "open":
                    self._publish("circuit open", force=True)
                    if self._wait_while_open():
                        return RunEnd.STOPPED
                    self._publish("running", force=True)
                    continue
                layout = self._layouts.current(sub)
                outcome = self._run_query(sub, mq, rq, dlq, layout, lease)
                if outcome in (QueryEnd.STOP, QueryEnd.IDLE):
                    clean = True
                    return RunEnd.STOPPED
        except Exception as e:
            # `Fenced`, or any failure after the lease was lost or expired (`fence_reason`).
            why = lease.fence_reason(e)
            if why is None:
                raise
            self._signal.clear()  # not a clean stop, even if one was asked for meanwhile
            log.warning("%s shard %d: %s; stopping without committing", self.name, self.shard, why)
            self._publish("fenced", force=True)
            return RunEnd.FENCED
        finally:
            # An operator's stop marks the lease stopped: standbys do not take over (a crash
            # lets it expire).
            lease.release(clean=clean or self._signal.is_set())
            self._publish("stopped", force=True)
            lease.close()
            self._close()

    def _stand_by(self, lease: ShardLease) -> bool:
        """Stand by for the shard's lease (`ShardLease.stand_by`), reporting under this
        instance's standby key; True once taken, False when asked to stop first. Follows a
        shard-count change (a shard beyond the count is refused, exit 2)."""

        def owner_of() -> tuple[str, int]:
            sub, _, _, _ = self._load()
            return self._owner(sub), sub.shard_count

        publisher = ProgressPublisher(self.settings, self.name, self.shard, standby=lease.instance)
        return lease.stand_by(owner_of, publisher, self._signal.wait)

    def _publish(self, state: str, query=None, force: bool = False, flush: bool | None = None):
        """Send a progress document (rate-limited unless forced; waits for the broker when
        `flush`, by default when forced); see `varadhi.ops.status`."""
        if self._publisher is None:
            return
        s = self.stats
        rates = self._rates.update(time.monotonic(), s.delivered, s.failures)
        read = consumed(query.lastProgress) if query is not None else None
        if read is not None:
            self._where["consumed"] = read
        doc = {
            "state": state,
            "shard": self.shard,
            "instance": self._lease.instance,
            "epoch": self._lease.epoch,
            **self._where,
            **self._summary,
            "totals": s.totals(),
            "rates": rates,
            "last_batch": s.last_batch,
            "circuit": self._circuit.status(),
        }
        self._publisher.publish(doc, force=force, flush=force if flush is None else flush)

    def _wait_while_paused(self) -> bool:
        """Sleep until resumed (False) or asked to stop (True)."""
        while not self._signal.wait(1.0):
            self._lease.check()
            if not subscriptions.from_snapshot(self.catalog.snapshot(), self.name).paused:
                return False
        return True

    def _wait_while_open(self) -> bool:
        """Read and send nothing until the circuit half-opens, the subscription is paused or
        reconfigured (False), or the shard is asked to stop (True)."""
        while not self._signal.wait(min(1.0, max(0.01, self._circuit.seconds_to_half_open()))):
            self._lease.check()
            sub = subscriptions.from_snapshot(self.catalog.snapshot(), self.name)
            self._circuit.configure(sub.spec.circuit_breaker)
            if sub.paused or self._circuit.poll() != "open":
                return False
            self._publish("circuit open")
        return True

    def _install_signals(self) -> StopSignals:
        """SIGINT and SIGTERM stop the shard between micro-batches (`varadhi.spark.stop_signals`): the
        session first, since creating the SparkContext installs PySpark's own SIGINT handler,
        which would cancel the batch in flight."""
        signals = StopSignals(self.spark, lambda _signum: self._signal.set())
        signals.install()
        return signals

    def request_stop(self) -> None:
        self._signal.set()

    def _run_query(self, sub, mq, rq, dlq, layout: Layout, lease: ShardLease) -> QueryEnd:
        """Run one query for `layout` until something asks it to stop; say why it stopped. Three
        steps: what it reads and skips (`_prepare_query`), the query (`_start_query`), then
        watching it between batches (`_watch`); the query is stopped between batches on every
        way out. What its last batch read is kept for the next progress document (`paused`,
        `stopped`): a batch may end after the last look that recorded it."""
        plan = self._prepare_query(sub, mq, rq, layout)
        query = self._start_query(sub, layout, plan, dict(
            sub=sub, mq=mq, rq=rq, dlq=dlq, state_path=plan.state_path, app_id=plan.app_id,
            lease=lease,
        ))  # fmt: skip
        try:
            end = self._watch(query, sub, rq, layout, plan.source.assign, lease)
        finally:
            if query.isActive:
                self._stop_between_batches(query)
        read = consumed(query.lastProgress)
        if read is not None:
            self._where["consumed"] = read
        return end

    def _prepare_query(self, sub, mq, rq, layout: Layout) -> _QueryPlan:
        """Before a query of `layout` starts: its source and paths, the state table's parked
        retries (ticks and status), the circuit it runs in and its read limit, a batch this
        process refused unstarted forgotten, the delivery journal's re-run set and a
        shard-count change's hand-over."""
        source = Source.of(sub, mq, rq, layout, self.shard)
        self._partitions_read = source.mq_partitions
        state_path, checkpoint, app_id = self._paths(sub, layout)
        if self._store is None or self._store.path != state_path:
            self._store = StateStore(self.spark, state_path, self._lease.instance)
        # Parked retries that fall due before any new input arrives need a tick to run; status
        # shows what waits from the start, not only after the first batch.
        pending = self._store.pending()
        self._ticks.next_due_ms = next_due(pending)
        self._summary = summarize(pending)
        self._startup.mark("state table read")
        # Half-open, the query reads a few records (`varadhi.core.circuit`); the query stops when the
        # circuit moves. A batch this process refused before doing anything is planned again
        # under this query's limit (Spark would re-run it with the range it planned).
        self._query_circuit = self._circuit.poll()
        normal = sub.spec.consumption.max_messages_per_batch
        limit = self._circuit.read_limit(normal) or normal
        aborted, self._aborted, self._query_checkpoint = self._aborted, None, checkpoint
        self._query_started_ms = int(time.time() * 1000)
        forget = aborted and aborted[0] == checkpoint
        # only a plan the refusing query made: one an earlier run left is re-run, journal read
        if forget and checkpoints.forget_planned_batch(
            checkpoint, aborted[1], self._fs, planned_since_ms=aborted[2]
        ):
            log.info("%s shard %d: batch %d planned again", self.name, self.shard, aborted[1])
        self._journal.plan_replay(checkpoint, checkpoints.uncommitted_batch(checkpoint, self._fs))
        doc = self.catalog.get(journal.HANDOVER_KIND, self._owner(sub))
        handover = journal.HandOver.of_layout(doc, layout.generation, layout.seq)
        self._handover = (handover, layout) if handover else None
        self._journal.ensure(sub)
        self._startup.mark("checkpoint and journal checked")
        return _QueryPlan(source, state_path, checkpoint, app_id, limit)

    def _start_query(self, sub, layout: Layout, plan: _QueryPlan, ctx: dict[str, Any]):
        """Start the Structured Streaming query of `plan`, each micro-batch (`batch_records` of
        its Kafka records) to `_on_batch` with `ctx`; returns it running. The projection is
        part of the streaming query, so Spark analyses its expressions once, not in every
        micro-batch (about 20 ms a batch)."""
        options = plan.source.options(kafka_clients.spark_source_options(self.settings), plan.limit)
        stream = self.spark.readStream.format("kafka").options(**options).load()
        query = (
            batch_records(stream, sub, ctx["mq"])
            .writeStream.foreachBatch(lambda df, batch_id: self._on_batch(df, batch_id, **ctx))
            .option("checkpointLocation", plan.checkpoint)
            .trigger(processingTime=f"{sub.spec.consumption.trigger_interval_ms} milliseconds")
            .queryName(f"varadhi-{self.name}-{self.shard}-g{layout.generation}-L{layout.seq}")
            .start()
        )
        self._query = query
        self._startup.mark("query started")
        self._stopping = False
        assign = plan.source.assign
        self._where = where_reading(self._where, sub.shard_count, layout, assign)
        log.info(
            "%s shard %d: reading %s (layout %d, circuit %s, at most %d records a batch)",
            self.name,
            self.shard,
            assign,
            layout.seq,
            self._query_circuit,
            plan.limit,
        )
        return query

    def _watch(self, query, sub, rq, layout: Layout, assign, lease: ShardLease) -> QueryEnd:
        """Watch a running query between batches until it ends (`_ended`) or something ends
        it (`_stop_reason`, idle); meanwhile tick parked retries and publish progress."""
        self._last_batch_end = query_started = time.monotonic()
        outage = ControlOutage()
        while True:
            if not query.isActive:
                return self._ended(query, sub, lease, self._last_batch_end > query_started)
            try:
                reason = self._look(query, sub, rq, layout, assign, lease)
                outage.ok()
            except (KafkaError, KafkaUnavailable) as e:
                # Kafka away (a broker restarting): the query delivers on by itself, and the
                # lease's expiry still fences. A look that stopped the query fails the shard.
                first = outage.since is None
                if not (
                    kafka_clients.transient(e)
                    and query.isActive
                    and outage.ride_out(time.monotonic())
                ):
                    raise
                if first:
                    log.warning(
                        "%s shard %d: Kafka does not answer between batches (%s); delivering "
                        "on and trying again, for at most %.0f s",
                        self.name,
                        self.shard,
                        e,
                        outage.limit_s,
                    )
                reason = None
            if reason is not None:
                return reason
            time.sleep(0.5)

    def _look(self, query, sub, rq, layout: Layout, assign, lease: ShardLease) -> QueryEnd | None:
        """One look between batches: `_stop_reason`, then re-drives and wake-up ticks, progress,
        and the idle check of a bounded run. A reason comes with the query stopped."""
        reason = self._stop_reason(query, sub, layout, lease)
        if reason is not None:
            return reason
        redrives = dlq_ops.pending_for(self.catalog.snapshot(), self.name, self.shard)
        self._ticks.maybe_tick(rq, sub, redrive_waiting=bool(redrives))
        self._publish("running", query)
        if idle(
            self.stop_when_idle_s,
            quiet_s=time.monotonic() - self._last_batch_end,
            retry_waiting=self._ticks.next_due_ms is not None,
            batch_running=self._batch_lock.locked(),
            all_read=lambda: caught_up(
                consumed(query.lastProgress), assign, self._end_offsets(assign)
            ),
        ):
            self._stop_between_batches(query)
            return QueryEnd.IDLE
        return None

    def _ended(self, query, sub, lease: ShardLease, replayed: bool) -> QueryEnd:
        """Why a query that ended by itself ended: its failure's verdict (`shard_ends.judge`,
        acted on by `_failed`), else the circuit it moved or a stop (a refused batch)."""
        failure = jvm_errors.query_failure(query)
        verdict = judge(failure, replayed=replayed)
        if verdict is not None:
            assert failure is not None
            return self._failed(verdict, failure, sub, lease)
        if self._circuit.state != self._query_circuit:
            return QueryEnd.CIRCUIT
        return QueryEnd.STOP

    def _stop_reason(self, query, sub, layout: Layout, lease: ShardLease) -> QueryEnd | None:
        """One look between batches, in this order: a stop asked for, the lease (raises
        `Fenced`), the circuit moved, the catalog (`shard_ends.catalog_change`), the next
        layout. A reason comes with the query stopped between batches; None: go on."""
        if self._signal.is_set():
            self._stop_between_batches(query)
            return QueryEnd.STOP
        lease.check()
        if self._circuit.state != self._query_circuit:  # opened, or a probe decided
            # Right after the batch that moved it: let Spark commit that batch first, or the
            # next query runs it again.
            checkpoints.await_commit(*self._completed, lambda: query.isActive, self._fs)
            self._stop_between_batches(query)
            return QueryEnd.CIRCUIT
        current = subscriptions.from_snapshot(self.catalog.snapshot(), self.name)
        self._circuit.configure(current.spec.circuit_breaker)
        changed = catalog_change(sub, current)
        if changed is not None:
            self._stop_between_batches(query)
            return changed
        return QueryEnd.LAYOUT if self._maybe_next_layout(query, sub, layout) else None

    def _failed(
        self, verdict: Verdict, failure: jvm_errors.Diagnosis, sub, lease: ShardLease
    ) -> QueryEnd:
        """Act on a failed query's verdict (`shard_ends.judge`): restart it, or raise."""
        if verdict is Verdict.FENCED:
            raise Fenced(f"lease {self._owner(sub)}", lease.epoch or 0, -1)
        # A query that died after this instance lost its lease is fenced, not failed (a
        # zombie's Spark found the new holder's checkpoint files).
        lease.check()
        if verdict is Verdict.ZOMBIE:
            log.warning(
                "%s shard %d: another instance wrote this checkpoint (a fenced one, still "
                "running); restarting the query",
                self.name,
                self.shard,
            )
            return QueryEnd.RESTART
        if verdict is Verdict.SPARK_55271:
            log.warning(
                "%s shard %d: Spark's Kafka source failed after a replayed batch (SPARK-55271); "
                "restarting the query",
                self.name,
                self.shard,
            )
            return QueryEnd.RESTART
        denied = failure.of(jvm_errors.Denied)
        if verdict is Verdict.DENIED and denied is not None:
            raise kafka_clients.as_error(self.settings, denied)
        raise VaradhiError(f"query failed: {failure.error}")

    def _stop_between_batches(self, query) -> None:
        self._stopping = True  # a batch Spark plans from now on does nothing (StopRequested)
        with self._batch_lock:  # the batch in flight finishes
            pass
        # Spark commits a batch after `foreachBatch` returned, within its trigger: stopping the
        # query before the trigger ends interrupts the commit, and the next run delivers the
        # batch again. A trigger that plans a new batch ends it refused (and the query failed).
        deadline = time.monotonic() + 30
        while query.isActive and query.status["isTriggerActive"]:
            if time.monotonic() > deadline:
                log.warning("%s shard %d: the batch did not commit in 30 s", self.name, self.shard)
                break
            time.sleep(0.02)
        query.stop()

    # -- layouts -----------------------------------------------------------------------------
    def _maybe_next_layout(self, query, sub, layout: Layout) -> bool:
        """Stop the query and save the next layout when the shard may move to the next
        main-topic storage topic (`shard_reading.LayoutMoves`); status says why it waits at a
        boundary where groups change shards."""
        pending = int(self._summary.get("blocked_groups", 0))
        ready, waiting = self._layouts.ready(
            sub, layout, consumed(query.lastProgress), pending, SEAL_GRACE_MS
        )
        if waiting is not None:
            self._where["waiting"] = waiting
        if not ready:
            return False
        self._stop_between_batches(query)
        self._layouts.move(sub, layout, consumed(query.lastProgress))
        return True

    # -- the micro-batch ------------------------------------------------------------------
    def _on_batch(self, df: DataFrame, batch_id: int, **ctx) -> None:
        self._refuse_if_stopping(batch_id)
        with self._batch_lock:
            self._refuse_if_stopping(batch_id)
            self._ticks.batch_started()
            self._startup.mark("first batch planned")
            try:
                self._process(df, batch_id, **ctx)
                self._startup.finish("first batch done")
                self._completed = (self._query_checkpoint, batch_id)
            finally:
                self._last_batch_end = time.monotonic()

    def _refuse_if_stopping(self, batch_id: int) -> None:
        """A batch Spark planned while the driver stops the query, or after the circuit moved
        (it opened: send nothing; a probe decided: read with other limits), does nothing."""
        if self._stopping or self._circuit.state != self._query_circuit:
            self._aborted = (self._query_checkpoint, batch_id, self._query_started_ms)
            raise StopRequested()

    def _process(
        self, df: DataFrame, batch_id: int, sub, mq, rq, dlq, state_path, app_id, lease
    ) -> None:
        started = time.monotonic()
        if self._store is None or self._store.path != state_path:
            self._store = StateStore(df.sparkSession, state_path, self._lease.instance)
        work = _Batch(self, df, batch_id, app_id, sub, mq, rq, dlq, self._store)
        assert self._sender is not None  # started before any query
        sender = self._sender.to(sub, rq, dlq)
        protocol = BatchCommit(self._store, sender, lease, f"{self.name} shard {self.shard}")
        outcome = protocol.run(app_id, batch_id, work, started)
        if outcome.resent:
            self.stats.replays += 1
            return
        counts = outcome.counts
        self._finish_batch(
            batch_id, counts.get("records", 0), counts, started, outcome.pending, outcome.phases
        )

    def _deliver(
        self,
        records: DataFrame,
        ctx: BatchContext,
        store: StateStore,
        pending: dict[str, list[StateRow]],
        due_groups: list[str],
    ) -> pd.DataFrame:
        """Deliver the batch on executors in one or two Spark jobs (see `varadhi.spark.batch`) and
        return every result row. Phase 1 runs in `concurrency` tasks: the Kafka partitions read,
        coalesced (or spread by group key when the shard reads fewer partitions); when
        groups have pending state, its forwarded rows come back here, are joined by the parked
        bodies their groups (and groups whose parked head is due) need, and go to phase 2."""
        concurrency = ctx.spec.consumption.concurrency
        records = delivery_records(records, concurrency, self._partitions_read)
        # Ungrouped: RQ records and due parked retries are merged in phase 1 (`ForwardRule.of`).
        forward = ForwardRule.of(pending, ctx.spec.grouped, due_groups)
        parked = None
        if forward.parked:
            parked, forward = parked_within(by_group(store.held_rows(forward.parked)), forward)
        local = {k: pending[k] for k in forward.local | forward.parked}
        first = records.mapInArrow(
            lambda it: deliver_records(it, ctx, forward, local, parked), RESULT_SCHEMA
        ).toPandas()
        if not pending:
            return first
        is_fwd = first["kind"] == Kind.FWD
        forwarded = first[is_fwd]
        held = store.held_rows(
            (set(due_groups) - ran_parked(first, forward))
            | (set(forwarded["group_key"]) & store.held_groups())
        )
        if not len(forwarded) and not len(held):
            return first
        rows = normalise(pd.concat([normalise(forwarded), held]))  # in the state's column types
        # Only the state of the groups that take part travels with the tasks; a group phase 1
        # ran already goes on from its result there (`batch.chained`).
        first, involved = chained(first[~is_fwd], set(rows["group_key"]), pending)
        second = (
            records.sparkSession.createDataFrame(rows, STATE_SCHEMA)
            .repartition(concurrency, "group_key")
            .mapInPandas(lambda it: process_partition(it, ctx, involved), RESULT_SCHEMA)
            .toPandas()
        )
        return pd.concat([first, second], ignore_index=True)

    # -- the journal hand-over and the dedup window ----------------------------------------
    def _handed_over(self) -> journal.Accepted | None:
        """The origins a shard-count change handed this shard (`journal.HandOver`: messages an
        old shard's uncommitted batch delivered) while the query reads below them; forgotten
        once it has committed past them all."""
        if self._handover is None:
            return None
        handover, layout = self._handover
        committed = checkpoints.committed_offsets(self._query_checkpoint, self._fs) or {}
        accepted = handover.accepted_below(layouts.merged(layout.starting_offsets, committed))
        if accepted is None:
            self._handover = None
            return None
        log.info(
            "%s shard %d: %d messages an old shard delivered before the shard-count change "
            "are not sent again when this batch reads them (hand-over)",
            self.name,
            self.shard,
            len(accepted),
        )
        return accepted

    def _dedup_window(self, spark, sub) -> DedupWindow:
        if self._dedup is None:
            path = (
                f"{self.settings.warehouse}/{self.name}/dedup/s{sub.shard_count}/shard-{self.shard}"
            )
            self._dedup = DedupWindow(spark, path, int(sub.spec.dedup_window_ms))
        return self._dedup

    def _finish_batch(self, batch_id, n_records, counts, started, pending, phases) -> None:
        s = self.stats
        s.add_batch(batch_id, n_records, counts, time.monotonic() - started, phases)
        self._ticks.next_due_ms = next_due(pending)
        self._summary = summarize(pending)
        attempts, failures = int(counts.get("attempts", 0)), int(counts.get("failures", 0))
        before = self._circuit.state
        if self._circuit.record(attempts, failures) != before:
            log.warning(
                "%s shard %d: circuit %s -> %s (%d of %d attempts failed)",
                self.name,
                self.shard,
                before,
                self._circuit.state,
                failures,
                attempts,
            )
        # Every batch's counts reach the progress topic (without waiting for the broker), so a
        # restarted shard goes on from them (`ShardStats.resumed`).
        self._publish("running", force=True, flush=False)
        for hook in self.batch_hooks:
            hook(s.last_batch, self._summary)
        if n_records or counts:
            log.info("%s shard %d: batch %s", self.name, self.shard, s.last_batch)

    def _close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
        self._end_offsets.close()
        if self._sender is not None:
            self._sender.close()
        self._ticks.close()
        self.catalog.close()


class _Batch:
    """One micro-batch of a `ShardJob` (`df`: its records, as `batch_records` makes them): its
    work (`batch_commit.BatchWork`: catalog, re-drives, filter, dedup window, delivery on
    executors), in the order `BatchCommit` calls them."""

    def __init__(
        self, job: ShardJob, df: DataFrame, batch_id: int, app_id: str, sub, mq, rq, dlq, store
    ):
        self.job, self.df, self.batch_id, self.app_id = job, df, batch_id, app_id
        self.sub, self.mq, self.rq, self.dlq, self.store = sub, mq, rq, dlq, store
        self.filter: filters.Filter | None = None
        self.redrive_ops: dict[str, dlq_ops.Selector] = {}
        self.filtered: Observation | None = None
        self.dropped: list[str] = []

    def apply_redrives(self) -> bool:
        job = self.job
        # The lease check just before (`BatchCommit` step 1) read the catalog: no second read.
        snapshot = job.catalog.snapshot(max_age_s=LEASE_CHECK_READ_S)
        # The filter is read for every batch: `subscription apply` changes it from the next one.
        self.filter = subscriptions.from_snapshot(snapshot, job.name).spec.filter
        self.redrive_ops = dlq_ops.pending_for(snapshot, job.name, job.shard)
        if self.redrive_ops:
            redriven = dlq_ops.apply_redrives(
                job.settings, snapshot, self.sub, self.dlq, job.shard, self.store, self.redrive_ops
            )
            log.info("%s shard %d: re-driving %d parked messages", job.name, job.shard, redriven)
        return bool(self.redrive_ops)

    def deliver(self, pending: dict[str, list[StateRow]]) -> pd.DataFrame:
        job, sub, mq, rq = self.job, self.sub, self.mq, self.rq
        app_id, batch_id = self.app_id, self.batch_id
        now_ms = int(time.time() * 1000)
        due_groups = due_heads(pending, now_ms)
        probes = job._circuit.due_limit()  # half-open: only a few parked retries
        if probes is not None and len(due_groups) > probes:
            due_groups = due_groups[:probes]
            job._ticks.tick_again()  # the others are due already: tick for them
        records, self.filtered = filter_records(self.df, self.filter)
        if sub.spec.dedup_window_ms:
            window = job._dedup_window(self.df.sparkSession, sub)
            records, self.dropped = window.filter(records, now_ms)
        spec = sub.spec
        if job._query_circuit == "half_open":  # a probe: its first attempts decide
            spec = replace(spec, retry=probe_retry(spec.retry))
        ctx = BatchContext(
            spec=spec,
            mq_indexes={st.name: i for i, st in enumerate(mq.storage_topics)},
            now_ms=now_ms,
            seed=zlib.crc32(f"{app_id}/{batch_id}".encode()),
            dedup=bool(sub.spec.dedup_window_ms),
            max_out_bytes=job._sender.limit(rq.produce_topic.name),
            journal=job._journal.target(sub, app_id, batch_id),
            replayed=journal.joined(
                job._journal.replayed(sub, app_id, batch_id), job._handed_over()
            ),
        )
        return job._deliver(records, ctx, self.store, pending, due_groups)

    def after_delivery(self, result: pd.DataFrame) -> list[dict[str, int]]:
        stats = []
        if self.sub.spec.dedup_window_ms:
            window = self.job._dedup_window(self.df.sparkSession, self.sub)
            window.remember(delivered_ids(result), self.app_id, self.batch_id)
            stats.append({"deduplicated": len(self.dropped)})
        if self.filtered is not None:  # computed with the batch's first job (delivery or dedup)
            stats.append({"filtered": int(self.filtered.get["filtered"])})
        return stats

    def finish_redrives(self) -> None:
        job = self.job
        dlq_ops.finish_redrives(job.catalog, job.name, job.shard, self.store, self.redrive_ops)


# -- helpers (pure or Spark-expression builders) ---------------------------------------------
