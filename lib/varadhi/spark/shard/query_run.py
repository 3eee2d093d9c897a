"""One Structured Streaming query of a shard's reader layout: prepared, started, watched between
batches, ended (`QueryRun.run` returns why it ended, a `QueryEnd`).

1. `_prepare`: the source (the shard's partitions of the layout's main-topic storage topic and
   of the current RQ storage topics), the layout's state table, checkpoint and idempotency id,
   the state's parked retries (ticks and status), the circuit the query runs in and its read
   limit, a batch a previous query refused unstarted planned again, the delivery journal's
   re-run set and a shard-count change's hand-over;
2. `_start`: the query, each micro-batch to `micro_batch.run_batch`;
3. `_watch`: between batches, `_stop_reason` (a stop asked for, the lease, the circuit moved,
   the catalog, the next layout) or the query's own end (`_ended`: its failure judged by
   `ends.judge`), re-drive and wake-up ticks, progress, and the idle check of a bounded run.

The query is stopped between batches (`gate.BatchGate.stop`) on every way out. Kafka away
between batches (a broker restarting) is ridden out for `ends.ControlOutage`'s limit while the
query delivers on; the lease's expiry still fences.
"""

from __future__ import annotations

import logging
import time

from kafka.errors import KafkaError

from varadhi.core.errors import Fenced, KafkaUnavailable, LeaseExpired, VaradhiError
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import jvm_errors, subscriptions, topics
from varadhi.spark import checkpoints, journal, layouts
from varadhi.spark.layouts import Layout
from varadhi.spark.records import Source, batch_records
from varadhi.spark.shard.ends import ControlOutage, QueryEnd, Verdict, catalog_change, idle, judge
from varadhi.spark.shard.micro_batch import QueryInputs, run_batch
from varadhi.spark.shard.parts import Loaded, ShardParts
from varadhi.spark.shard.reading import caught_up, consumed
from varadhi.spark.shard.stats import next_due
from varadhi.spark.warehouse_fs import HadoopFS

log = logging.getLogger("varadhi.spark.shard.job")

# How long the control loop sleeps between two looks at a running query.
LOOK_INTERVAL_S = 0.5


class QueryRun:
    """The query of `layout` for `loaded` (the subscription as the control loop last read it)."""

    def __init__(self, parts: ShardParts, loaded: Loaded, layout: Layout):
        self.parts, self.loaded, self.layout = parts, loaded, layout
        self.query = None  # the running query, once started

    def run(self) -> QueryEnd:
        """Run the query until something asks it to stop; say why it stopped. What its last
        batch read is kept for the next progress document (`paused`, `stopped`): a batch may
        end after the last look that recorded it."""
        inputs, source, limit = self._prepare()
        query = self._start(inputs, source, limit)
        try:
            end = self._watch(query, inputs, source.assign)
        finally:
            if query.isActive:
                self.parts.gate.stop(query)
        self.parts.progress.read(query)
        return end

    def _prepare(self) -> tuple[QueryInputs, Source, int]:
        p, layout = self.parts, self.layout
        sub, mq, rq, dlq = self.loaded.sub, self.loaded.mq, self.loaded.rq, self.loaded.dlq
        source = Source.of(sub, mq, rq, layout, p.shard)
        wh, n, sc, sh = p.settings.warehouse, p.name, sub.shard_count, p.shard
        state_path = layouts.state_path(wh, n, sc, sh)
        checkpoint = layouts.checkpoint_path(wh, n, sc, sh, layout)
        # Parked retries that fall due before any new input arrives need a tick to run; status
        # shows what waits from the start, not only after the first batch.
        pending = p.stores.at(p.spark, state_path).pending()
        p.ticks.next_due_ms = next_due(pending)
        p.progress.state(pending)
        p.startup.mark("state table read")
        # Half-open, the query reads a few records (`varadhi.core.circuit`); the query stops
        # when the circuit moves. A batch this process refused before doing anything is planned
        # again under this query's limit (Spark would re-run it with the range it planned).
        circuit = p.circuit.poll()
        normal = sub.spec.consumption.max_messages_per_batch
        limit = p.circuit.read_limit(normal) or normal
        refused = p.gate.open(checkpoint)
        fs = HadoopFS(p.spark)
        # only a plan the refusing query made: one an earlier run left is re-run, journal read
        if refused and checkpoints.forget_planned_batch(
            checkpoint, refused[0], fs, planned_since_ms=refused[1]
        ):
            log.info("%s: batch %d planned again", p.label, refused[0])
        p.journal.plan_replay(checkpoint, checkpoints.uncommitted_batch(checkpoint, fs))
        doc = p.catalog.get(journal.HANDOVER_KIND, layouts.owner(n, sc, sh))
        handover = journal.HandOver.of_layout(doc, layout.generation, layout.seq)
        p.journal.expect_handover(handover, layout)
        p.journal.ensure(sub)
        p.startup.mark("checkpoint and journal checked")
        inputs = QueryInputs(
            sub=sub, mq=mq, rq=rq, dlq=dlq, layout=layout, state_path=state_path,
            checkpoint=checkpoint, app_id=layouts.app_id(n, sc, sh, layout),
            partitions_read=source.mq_partitions, circuit=circuit,
        )  # fmt: skip
        return inputs, source, limit

    def _start(self, inputs: QueryInputs, source: Source, limit: int):
        """Start the query, each micro-batch (`batch_records` of its Kafka records) to
        `run_batch`; returns it running. The projection is part of the streaming query, so
        Spark analyses its expressions once, not in every micro-batch (about 20 ms a batch)."""
        p, sub, layout = self.parts, inputs.sub, inputs.layout
        options = source.options(kafka_clients.spark_source_options(p.settings), limit)
        stream = p.spark.readStream.format("kafka").options(**options).load()
        query = (
            batch_records(stream, sub, inputs.mq)
            .writeStream.foreachBatch(lambda df, batch_id: run_batch(p, inputs, df, batch_id))
            .option("checkpointLocation", inputs.checkpoint)
            .trigger(processingTime=f"{sub.spec.consumption.trigger_interval_ms} milliseconds")
            .queryName(f"varadhi-{p.name}-{p.shard}-g{layout.generation}-L{layout.seq}")
            .start()
        )
        self.query = query
        p.startup.mark("query started")
        p.gate.started()
        p.progress.reading(sub.shard_count, layout, source.assign)
        log.info(
            "%s: reading %s (layout %d, circuit %s, at most %d records a batch)",
            p.label,
            source.assign,
            layout.seq,
            inputs.circuit,
            limit,
        )
        return query

    def _watch(self, query, inputs: QueryInputs, assign) -> QueryEnd:
        """Watch a running query between batches until it ends (`_ended`) or something ends
        it (`_look`)."""
        gate = self.parts.gate
        gate.last_end = time.monotonic()
        outage = ControlOutage()
        while True:
            if not query.isActive:
                # Counted by the gate from before the query started: its first batch may end
                # before this watch begins (a slow progress write after a broker outage).
                return self._ended(query, inputs, gate.passed > 0)
            try:
                reason = self._look(query, inputs, assign)
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
                        "%s: Kafka does not answer between batches (%s); delivering on and "
                        "trying again, for at most %.0f s",
                        self.parts.label,
                        e,
                        outage.limit_s,
                    )
                reason = None
            if reason is not None:
                return reason
            time.sleep(LOOK_INTERVAL_S)

    def _look(self, query, inputs: QueryInputs, assign) -> QueryEnd | None:
        """One look between batches: `_stop_reason`, then re-drives and wake-up ticks, progress,
        and the idle check of a bounded run. A reason comes with the query stopped."""
        p = self.parts
        reason = self._stop_reason(query, inputs)
        if reason is not None:
            return reason
        redrives = dlq_ops.pending_for(p.catalog.snapshot(), p.name, p.shard)
        p.ticks.maybe_tick(inputs.rq, inputs.sub, redrive_waiting=bool(redrives))
        p.progress.publish("running", query)
        if idle(
            p.stop_when_idle_s,
            quiet_s=time.monotonic() - p.gate.last_end,
            # a parked retry, or a re-drive (a rate-capped one goes on for many batches)
            retry_waiting=p.ticks.next_due_ms is not None or bool(redrives),
            batch_running=p.gate.busy(),
            all_read=lambda: caught_up(consumed(query.lastProgress), assign, p.end_offsets(assign)),
        ):
            p.gate.stop(query)
            return QueryEnd.IDLE
        return None

    def _ended(self, query, inputs: QueryInputs, replayed: bool) -> QueryEnd:
        """Why a query that ended by itself ended: its failure's verdict (`ends.judge`, acted
        on by `_failed`), else the circuit it moved or a stop (a refused batch)."""
        failure = jvm_errors.query_failure(query)
        verdict = judge(failure, replayed=replayed)
        if verdict is not None:
            assert failure is not None
            return self._failed(verdict, failure, inputs)
        if self.parts.circuit.state != inputs.circuit:
            return QueryEnd.CIRCUIT
        return QueryEnd.STOP

    def _stop_reason(self, query, inputs: QueryInputs) -> QueryEnd | None:
        """One look between batches, in this order: a stop asked for, the lease (raises
        `Fenced`), the circuit moved, the catalog (`ends.catalog_change`) or a suspension due
        (endpoint health), the next layout. A
        reason comes with the query stopped between batches; None: go on."""
        p = self.parts
        if p.stop.is_set():
            p.gate.stop(query)
            return QueryEnd.STOP
        p.lease.check()
        if p.circuit.state != inputs.circuit:  # opened, or a probe decided
            # Right after the batch that moved it: let Spark commit that batch first, or the
            # next query runs it again.
            fs = HadoopFS(p.spark)
            checkpoints.await_commit(*p.gate.completed, lambda: query.isActive, fs)
            p.gate.stop(query)
            return QueryEnd.CIRCUIT
        current = subscriptions.from_snapshot(p.catalog.snapshot(), p.name)
        p.circuit.configure(current.spec.circuit_breaker)
        changed = catalog_change(inputs.sub, current, p.shard)
        if changed is None and current.suspended is None and p.circuit.suspension_due():
            changed = QueryEnd.SUSPENDED  # the control loop suspends the subscription
        if changed is not None:
            p.gate.stop(query)
            return changed
        return QueryEnd.LAYOUT if self._moved_to_next_layout(query, inputs) else None

    def _failed(self, verdict: Verdict, failure: jvm_errors.Diagnosis, inputs: QueryInputs):
        """Act on a failed query's verdict (`ends.judge`): restart it, or raise."""
        p = self.parts
        owner = layouts.owner(p.name, inputs.sub.shard_count, p.shard)
        if verdict is Verdict.FENCED:
            raise Fenced(f"lease {owner}", p.lease.epoch or 0, -1)
        if verdict is Verdict.LEASE_EXPIRED:  # the control loop waits for the lease
            raise LeaseExpired(owner, p.lease.ttl_ms)
        # A query that died after this instance lost its lease is fenced, not failed (a
        # zombie's Spark found the new holder's checkpoint files).
        p.lease.check()
        if verdict is Verdict.ZOMBIE:
            log.warning(
                "%s: another instance wrote this checkpoint (a fenced one, still running); "
                "restarting the query",
                p.label,
            )
            return QueryEnd.RESTART
        if verdict is Verdict.SPARK_55271:
            log.warning(
                "%s: Spark's Kafka source failed after a replayed batch (SPARK-55271); "
                "restarting the query",
                p.label,
            )
            return QueryEnd.RESTART
        away = failure.of(jvm_errors.KafkaAway)
        if verdict is Verdict.KAFKA_AWAY and away is not None:  # ridden out by the control loop
            raise KafkaUnavailable(f"{p.label}: a batch met Kafka away ({away.error})")
        denied = failure.of(jvm_errors.Denied)
        if verdict is Verdict.DENIED and denied is not None:
            raise kafka_clients.as_error(p.settings, denied)
        raise VaradhiError(f"query failed: {failure.error}")

    def _moved_to_next_layout(self, query, inputs: QueryInputs) -> bool:
        """Stop the query and save the next layout when the shard may move to the next
        main-topic storage topic (`reading.LayoutMoves`); status says why it waits at a
        boundary where groups change shards."""
        p = self.parts
        pending = int(p.progress.summary.get("blocked_groups", 0))
        read = consumed(query.lastProgress)
        grace = topics.SEAL_GRACE_MS  # read here: tests shorten it
        ready, waiting = p.layouts.ready(inputs.sub, inputs.layout, read, pending, grace)
        if waiting is not None:
            p.progress.where["waiting"] = waiting
        if not ready:
            return False
        p.gate.stop(query)
        p.layouts.move(inputs.sub, inputs.layout, consumed(query.lastProgress))
        return True
