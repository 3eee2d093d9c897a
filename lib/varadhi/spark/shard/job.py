"""The driver of one subscription shard: its control loop, one Structured Streaming query at a time.

`ShardJob.run` takes the lease or stands by for it (`lease`), turns SIGINT and SIGTERM into a stop
between batches, makes the run's parts (`parts.ShardParts`), and then, until stopped, fenced or
failed: reads the subscription, waits while it is paused or its circuit is open, picks the reader
layout (`reading`) and runs one query of it (`query_run.QueryRun`) until the query ends for a
`ends.QueryEnd` reason. A micro-batch (`micro_batch`) runs the batch-commit protocol (`commit`).
Layout changes, pauses, SIGINT and SIGTERM all stop a query between batches (`gate`), never inside
one. docs/architecture.md walks one micro-batch through these modules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pyspark.sql import SparkSession

from varadhi.core.circuit import CircuitBreaker, now_ms
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import InvalidArgument, LeaseExpired
from varadhi.core.policies import CircuitPolicy
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import leases, subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.dlq import PickCache
from varadhi.kafka.progress import ProgressPublisher
from varadhi.kafka.settings import Settings
from varadhi.spark import layouts, warehouse_fs
from varadhi.spark.shard.ends import ControlOutage, QueryEnd, RunEnd, waits_on_suspension
from varadhi.spark.shard.gate import BatchGate
from varadhi.spark.shard.journal import ShardJournal
from varadhi.spark.shard.lease import ShardLease
from varadhi.spark.shard.parts import DedupWindows, Loaded, RateLimits, ShardParts, StateStores
from varadhi.spark.shard.progress import ShardProgress
from varadhi.spark.shard.query_run import QueryRun
from varadhi.spark.shard.reading import EndOffsets, LayoutMoves
from varadhi.spark.shard.sender import QueueSender
from varadhi.spark.shard.ticks import Ticks
from varadhi.spark.shard.trace import ShardTrace
from varadhi.spark.startup import Ahead, StartupClock
from varadhi.spark.state_store import StateStore
from varadhi.spark.stop_signals import StopSignals

log = logging.getLogger("varadhi.spark.shard.job")


class ShardJob:
    """Runs shard `shard` of subscription `name` until stopped, fenced or failed.

    `run()` returns the process exit code (`ends.RunEnd`): 0 stopped on request or idle, 3 fenced
    by a newer instance; a failure raises (exit code 1 through the job runner).
    `stop_when_idle_s` bounds a run (tests, demo, benchmarks); `standby` waits for the active
    instance's lease to expire instead of taking it at once (failover). Without `spark`, the
    session is made once the subscription was read and accepted (`_start`): a local one, or
    with `cluster` the one spark-submit or the cluster configured.
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
        cluster: bool = False,
    ):
        self.settings = settings or Settings.from_env()
        self.catalog = Catalog(self.settings)
        self.name, self.shard = name, shard
        self.stop_when_idle_s = stop_when_idle_s
        self.standby = standby
        self.lease_ttl_ms = lease_ttl_ms or leases.ttl_from_env()
        # Called after each completed micro-batch as hook(last_batch, summary) (`summarize`),
        # on the batch's thread: `varadhi.spark.metrics` feeds its exporter and JSON log from it.
        self.batch_hooks: list[Any] = []
        self.suspension_hooks: list[Callable[[bool], None]] = []  # endpoint health, for metrics
        self._spark = spark
        self._cluster = cluster
        self._startup = StartupClock(f"{name} shard {shard}")  # INFO line per phase
        self._stop = threading.Event()
        self._circuit = CircuitBreaker(CircuitPolicy())  # configured from the spec
        self._progress = ShardProgress(self.settings, name, shard, self._circuit)
        self._run: QueryRun | None = None  # the query of the current layout
        # This shard probes the subscription's suspension (`resume: probe`): its last turn found
        # it suspended by this shard. Seen unsuspended next, an operator resumed it.
        self._probing = False

    @property
    def stats(self):
        """The shard's counters (`stats.ShardStats`), resumed from its last progress document."""
        return self._progress.stats

    @property
    def query(self):
        """The running Structured Streaming query, or None."""
        return self._run.query if self._run is not None else None

    @property
    def state(self) -> StateStore | None:
        """The running query's GroupState copy (read it on the batch's thread: a batch hook),
        or None."""
        return self._run.parts.stores.current if self._run is not None else None

    def request_stop(self) -> None:
        """Stop between batches, as SIGINT or SIGTERM do."""
        self._stop.set()

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from varadhi.spark.session import get_spark

            self._spark = get_spark(
                f"varadhi-{self.name}-shard-{self.shard}", local=not self._cluster
            )
            self._startup.mark("Spark session ready")
        return self._spark

    def check(self) -> None:
        """Refuse, before anything starts, what `run` would refuse at its start: an unknown
        subscription or shard, a subscription of another runtime, an endpoint the platform does
        not allow. For callers that start something around the job first (`spark.metrics`
        starts the session); `run` checks again."""
        self._load()

    def _load(self) -> Loaded:
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, self.name)
        # Before the session and the lease at a start; before each query of a running shard
        # (a runtime change while it was paused ends it here, before it delivers).
        subscriptions.check_runtime(sub, "spark", "a Spark shard")
        if not 0 <= self.shard < sub.shard_count:
            raise InvalidArgument(
                f"shard {self.shard} is outside 0..{sub.shard_count - 1} of {self.name}"
            )
        # The endpoint's secrets and address as this shard's platform settings allow them, at
        # its start and before each query (the executors check again).
        kafka = kafka_clients.config_of(self.settings)
        policy = EndpointPolicy.from_env(kafka_names=kafka.env_references())
        subscriptions.check_platform(sub.spec, policy)
        return Loaded(
            sub,
            topics.from_snapshot(snap, sub.spec.topic),
            topics.from_snapshot(snap, sub.spec.rq_topic),
            topics.from_snapshot(snap, sub.spec.dlq_topic),
        )

    def _owner(self, sub: subscriptions.Subscription) -> str:
        return layouts.owner(self.name, sub.shard_count, self.shard)

    # -- the run ------------------------------------------------------------------------------
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
                sub = self._load().sub
            else:
                lease.take(self._owner(sub))
            self._startup.mark("lease taken")
            lease.start_heartbeat()
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
        sub = self._load().sub
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
        (`RunEnd`) or failed (raises); releases the lease and closes the run's parts on every
        exit. Kafka away (an expired lease, or a Kafka error that may pass) stops delivery, not
        the shard (`_rides_out`): it waits for the lease to be renewed (`await_renewal`) and goes
        on with it, or ends fenced."""
        clean = False  # stopped on request (a signal) or idle, not fenced or failed
        parts = None
        outage = ControlOutage()  # Kafka errors ridden out since the last batch completed
        try:
            parts = self._parts(sub, lease)
            batches = self._progress.stats.batches
            while True:
                if self._progress.stats.batches != batches:
                    batches = self._progress.stats.batches
                    outage.ok()
                try:
                    clean = self._deliver(parts, lease)
                    return RunEnd.STOPPED
                except Exception as e:
                    if not self._rides_out(e, lease, outage):
                        raise
                    log.warning(
                        "%s shard %d: %s; delivering nothing until the lease is renewed",
                        self.name, self.shard, e,
                    )  # fmt: skip
                if not lease.await_renewal(self._stop.wait):
                    return RunEnd.STOPPED
                parts = self._after_outage(parts, sub, lease)
        except Exception as e:
            # `Fenced`, or any failure after the lease was taken (`fence_reason`).
            why = lease.fence_reason(e)
            if why is None:
                raise
            self._stop.clear()  # not a clean stop, even if one was asked for meanwhile
            log.warning("%s shard %d: %s; stopping without committing", self.name, self.shard, why)
            self._progress.publish("fenced", force=True)
            return RunEnd.FENCED
        finally:
            # An operator's stop marks the lease stopped: standbys do not take over (a crash
            # lets it expire).
            lease.release(clean=clean or self._stop.is_set())
            self._progress.publish("stopped", force=True)
            lease.close()
            self._close(parts)

    @staticmethod
    def _rides_out(error: Exception, lease: ShardLease, outage: ControlOutage) -> bool:
        """Whether the delivery loop's `error` is Kafka away, to wait out rather than fail: the
        lease expired (not renewed for its TTL, nobody seen to hold it), or a Kafka error that
        may pass (a broker back from an outage whose clients time out once more), for at most
        `ends.CONTROL_OUTAGE_S` without a batch completing. Not a fence (`fence_reason`)."""
        if lease.fence_reason(error) is not None:
            return False
        if isinstance(error, LeaseExpired) or lease.expired():
            return True
        return kafka_clients.transient(error) and outage.ride_out(time.monotonic())

    def _deliver(self, parts: ShardParts, lease: ShardLease) -> bool:
        """Deliver until stopped (returns whether cleanly: on request or idle, and not while
        paused, suspended or with the circuit open, which a stop also ends) or failed (raises):
        each turn reads the subscription, checks the lease, waits while paused or suspended
        (`_suspension`) or while the circuit is open, else runs one query (`QueryRun`) until it
        ends."""
        while True:
            loaded = self._load()
            lease.check()
            if self._stop.is_set():
                return False
            sub = loaded.sub
            if sub.paused:
                log.info("%s shard %d: paused", self.name, self.shard)
                self._progress.publish("paused", force=True)
                if self._wait_while(lease, self._still_paused):
                    return False
                continue
            self._circuit.configure(sub.spec.circuit_breaker)
            turn = self._suspension(sub, lease)
            if turn is not None:
                if turn:
                    return False
                continue
            if self._circuit.poll() == "open":
                self._progress.publish("circuit open", force=True)
                if self._wait_while(lease, self._circuit_open, self._until_half_open):
                    return False
                self._progress.publish("running", force=True)
                continue
            self._run = QueryRun(parts, loaded, parts.layouts.current(sub))
            if self._run.run() in (QueryEnd.STOP, QueryEnd.IDLE):
                return True

    def _suspension(self, sub: subscriptions.Subscription, lease: ShardLease) -> bool | None:
        """Endpoint health (`circuit_breaker.suspend_after`): suspend the subscription when every
        attempt failed for that long, wait while it is suspended (`ends.waits_on_suspension`),
        or end the suspension this shard probes once its circuit closed (a probe succeeded).
        None: deliver on; False: look again; True: asked to stop while waiting."""
        suspended = sub.suspended
        if suspended is None and self._probing:
            # An operator resumed while this shard probed: deliver again with the failure clock
            # started afresh, as the shards that waited do, rather than suspend again at once
            # for the failures the suspension already answered.
            self._probing = False
            self._circuit.forget_failing()
            log.info("%s shard %d: suspension ended by an operator", self.name, self.shard)
        if suspended is None:
            why = self._circuit.suspension_due()
            if why is None:
                return None
            policy = sub.spec.circuit_breaker
            subscriptions.SubscriptionService(self.catalog).set_suspended(
                self.name,
                subscriptions.Suspension(why, now_ms(), self.shard, policy.resume),
            )
            how = (
                "a probe finds it healthy" if policy.resume == "probe" else "an operator resumes it"
            )
            log.warning(
                "%s shard %d: %s; subscription suspended until %s (`varadhi subscription resume`)",
                self.name, self.shard, why, how,
            )  # fmt: skip
            return False
        self._report_suspended(True)
        if waits_on_suspension(sub, self.shard):
            log.warning(
                "%s shard %d: suspended by shard %d since %s: %s",
                self.name, self.shard, suspended.shard, suspended.since_ms, suspended.reason,
            )  # fmt: skip
            self._progress.publish("suspended", force=True)
            if self._wait_while(lease, self._still_suspended):
                return True
            self._circuit.forget_failing()  # the wait was no attempt's failure
            self._report_suspended(False)
            log.info("%s shard %d: suspension ended; delivering again", self.name, self.shard)
            return False
        if self._circuit.poll() == "closed" and self._circuit.failing_since_ms is None:
            self._probing = False
            subscriptions.SubscriptionService(self.catalog).set_suspended(self.name, None)
            self._report_suspended(False)
            log.info(
                "%s shard %d: a probe found the endpoint healthy; suspension ended",
                self.name, self.shard,
            )  # fmt: skip
            return False
        self._probing = True
        return None  # this shard probes: its circuit's half-open batches

    def _report_suspended(self, suspended: bool) -> None:
        for hook in self.suspension_hooks:
            hook(suspended)

    def _still_suspended(self, current: subscriptions.Subscription) -> bool:
        """Whether this shard keeps waiting on the subscription's suspension, reported while it
        does (rate-limited, as `_still_paused`)."""
        if current.paused or not waits_on_suspension(current, self.shard):
            return False
        self._progress.publish("suspended")
        return True

    def _after_outage(
        self, parts: ShardParts, sub: subscriptions.Subscription, lease: ShardLease
    ) -> ShardParts:
        """The parts to deliver with once the lease is renewed after Kafka was away: a new
        transactional producer (its `init_transactions` aborts a transaction the outage left
        open; the old one may be in an error state), the rest as they were."""
        log.info("%s shard %d: lease renewed; delivering again", self.name, self.shard)
        parts.sender.close()
        sender = QueueSender.start(
            self.settings, self.catalog, self.name, sub.shard_count, self.shard, lambda: lease.epoch
        )
        return replace(parts, sender=sender)

    def _parts(self, sub: subscriptions.Subscription, lease: ShardLease) -> ShardParts:
        """The run's parts, once the lease is held: the RQ/DLQ producer first (its
        `init_transactions` fences older instances), then the last progress document."""
        settings, name, shard = self.settings, self.name, self.shard
        sender = QueueSender.start(
            settings, self.catalog, name, sub.shard_count, shard, lambda: lease.epoch
        )
        self._startup.mark("transactional producer ready")
        try:
            self._progress.open(sub, lease)
            self._startup.mark("last progress read")
            end_offsets = EndOffsets(settings)
            return ShardParts(
                settings=settings, catalog=self.catalog, name=name, shard=shard,
                spark=self.spark, lease=lease, circuit=self._circuit,
                ticks=Ticks(settings, shard), sender=sender,
                journal=ShardJournal(settings, name, shard),
                trace=ShardTrace(settings, name, shard),
                dedup=DedupWindows(settings.warehouse, name, shard),
                rates=RateLimits(), redrive_picks=PickCache(),
                stores=StateStores(lease.instance), progress=self._progress,
                gate=BatchGate(f"{name} shard {shard}"), end_offsets=end_offsets,
                layouts=LayoutMoves(self.catalog, name, shard, end_offsets),
                startup=self._startup, stop=self._stop, stop_when_idle_s=self.stop_when_idle_s,
                batch_hooks=self.batch_hooks,
            )  # fmt: skip
        except BaseException:
            sender.close()
            raise

    def _stand_by(self, lease: ShardLease) -> bool:
        """Stand by for the shard's lease (`ShardLease.stand_by`), reporting under this
        instance's standby key; True once taken, False when asked to stop first. Follows a
        shard-count change (a shard beyond the count is refused, exit 2)."""

        def owner_of() -> tuple[str, int]:
            sub = self._load().sub
            return self._owner(sub), sub.shard_count

        publisher = ProgressPublisher(self.settings, self.name, self.shard, standby=lease.instance)
        return lease.stand_by(owner_of, publisher, self._stop.wait)

    def _still_paused(self, current: subscriptions.Subscription) -> bool:
        """Whether the subscription stays paused, reported while it does (rate-limited): a
        paused shard's document stays fresh, so status shows it `paused`, not `silent`."""
        if not current.paused:
            return False
        self._progress.publish("paused")
        return True

    def _circuit_open(self, current: subscriptions.Subscription) -> bool:
        """Whether the circuit stays open (reconfigured from `current`; paused, suspended or a
        suspension due ends the wait), reported while it does."""
        self._circuit.configure(current.spec.circuit_breaker)
        if current.paused or self._circuit.poll() != "open":
            return False
        if waits_on_suspension(current, self.shard) or (
            current.suspended is None and self._circuit.suspension_due()
        ):
            return False
        self._progress.publish("circuit open")
        return True

    def _until_half_open(self) -> float:
        return min(1.0, max(0.01, self._circuit.seconds_to_half_open()))

    def _wait_while(self, lease: ShardLease, holds, interval=lambda: 1.0) -> bool:
        """Read and send nothing while `holds(subscription)` (looked at every `interval()`
        seconds): False once it no longer holds, True when asked to stop first."""
        while not self._stop.wait(interval()):
            lease.check()
            if not holds(subscriptions.from_snapshot(self.catalog.snapshot(), self.name)):
                return False
        return True

    def _install_signals(self) -> StopSignals:
        """SIGINT and SIGTERM stop the shard between micro-batches (`varadhi.spark.stop_signals`):
        the session first, since creating the SparkContext installs PySpark's own SIGINT
        handler, which would cancel the batch in flight."""
        signals = StopSignals(self.spark, lambda _signum: self._stop.set())
        signals.install()
        return signals

    def _close(self, parts: ShardParts | None) -> None:
        self._progress.close()
        if parts is not None:
            parts.end_offsets.close()
            parts.sender.close()
            parts.ticks.close()
        self.catalog.close()
