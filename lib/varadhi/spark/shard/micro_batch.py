"""One micro-batch of a shard: its work for the batch-commit protocol (`commit.BatchWork`).

- `QueryInputs`: what every batch of one query shares, fixed when the query starts (the
  subscription as it was then, its topics, the reader layout and its paths, the circuit state);
- the shard's collaborators a batch uses come as `parts.ShardParts` (the catalog, the circuit,
  the wake-up ticks, the RQ/DLQ sender's limits, the journal, the dedup window);
- `MicroBatch`: one batch's work, in the order `BatchCommit` calls it: re-drives and the filter
  from the catalog, delivery (`varadhi.spark.batch.deliver_batch` on `SparkExecutors`), the dedup
  window, the re-drives marked done;
- `run_batch`: the query's `foreachBatch`: one batch through the shard's gate and the
  batch-commit protocol, then its counters, the circuit, progress and the batch hooks.

Contract: a `MicroBatch` runs on the batch's thread (Spark's `foreachBatch`), while the control
loop watches the query; it touches the state only through the store it is given (the commit
protocol's state port) and the shard's parts only through their public methods.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, replace

import pandas as pd
from pyspark.sql import DataFrame, Observation

from varadhi.core import filters
from varadhi.core.circuit import probe_retry
from varadhi.core.rate_limit import RateGovernor, TaskPace, throttled
from varadhi.core.state_frames import delivered_ids
from varadhi.core.state_rows import RESULT_SCHEMA, STATE_SCHEMA, StateRow
from varadhi.kafka import dlq as dlq_ops
from varadhi.kafka import subscriptions, topics
from varadhi.spark import journal
from varadhi.spark.batch import (
    BatchContext,
    ForwardRule,
    deliver_batch,
    deliver_records,
    process_partition,
)
from varadhi.spark.layouts import Layout
from varadhi.spark.records import delivery_records, filter_records
from varadhi.spark.shard.commit import BatchCommit, Outcome
from varadhi.spark.shard.parts import ShardParts
from varadhi.spark.shard.stats import due_heads, next_due
from varadhi.spark.state_store import StateStore
from varadhi.spark.warehouse_fs import HadoopFS

log = logging.getLogger("varadhi.spark.shard.job")

# How old a micro-batch's view of the catalog (its filter, pending re-drives) may be: what the
# batch's lease check, just before, read.
LEASE_CHECK_READ_S = 1.0


@dataclass(frozen=True)
class QueryInputs:
    """What every micro-batch of one query shares (`ShardJob` makes it when the query starts)."""

    sub: subscriptions.Subscription
    mq: topics.CompositeTopic
    rq: topics.CompositeTopic
    dlq: topics.CompositeTopic
    layout: Layout
    state_path: str
    checkpoint: str
    app_id: str  # the idempotency id of the state commits (`layouts.app_id`)
    partitions_read: int  # main-topic partitions the query reads
    circuit: str  # the circuit's state when the query started: "half_open" = every batch probes


class SparkExecutors:
    """`varadhi.spark.batch.Executors` on Spark: phase 1 a `mapInArrow` over the batch's records
    (`delivery_records`: in `concurrency` partitions; `paced`: under a rate limit), phase 2 a
    `mapInPandas` over the rows the driver sends, repartitioned by group key."""

    def __init__(
        self, records: DataFrame, concurrency: int, partitions_read: int, paced: bool = False
    ):
        self.records = delivery_records(records, concurrency, partitions_read, paced)
        self.concurrency = concurrency

    def first(
        self,
        ctx: BatchContext,
        forward: ForwardRule,
        local: dict[str, list[StateRow]],
        parked: dict[str, list[StateRow]] | None,
    ) -> pd.DataFrame:
        return self.records.mapInArrow(
            lambda it: deliver_records(it, ctx, forward, local, parked), RESULT_SCHEMA
        ).toPandas()

    def second(
        self, rows: pd.DataFrame, ctx: BatchContext, involved: dict[str, list[StateRow]]
    ) -> pd.DataFrame:
        return (
            self.records.sparkSession.createDataFrame(rows, STATE_SCHEMA)
            .repartition(self.concurrency, "group_key")
            .mapInPandas(lambda it: process_partition(it, ctx, involved), RESULT_SCHEMA)
            .toPandas()
        )


class MicroBatch:
    """Batch `batch_id` of the query `inputs` (`df`: its records, as `batch_records` makes them):
    its `commit.BatchWork` against the state copy `store`."""

    def __init__(
        self,
        inputs: QueryInputs,
        df: DataFrame,
        batch_id: int,
        store: StateStore,
        parts: ShardParts,
    ):
        self.inputs, self.df, self.batch_id, self.store, self.parts = (
            inputs, df, batch_id, store, parts
        )  # fmt: skip
        self.filter: filters.Filter | None = None
        self.redrive_ops: dict[str, dlq_ops.Redrive] = {}
        self.filtered: Observation | None = None
        self.dropped: list[tuple[str, str, str | None]] = []

    def apply_redrives(self) -> bool:
        parts, sub = self.parts, self.inputs.sub
        # The lease check just before (`BatchCommit` step 1) read the catalog: no second read.
        snapshot = parts.catalog.snapshot(max_age_s=LEASE_CHECK_READ_S)
        # The filter is read for every batch: `subscription apply` changes it from the next one.
        self.filter = subscriptions.from_snapshot(snapshot, parts.name).spec.filter
        self.redrive_ops = dlq_ops.pending_for(snapshot, parts.name, parts.shard)
        if self.redrive_ops:
            redriven = dlq_ops.apply_redrives(
                parts.settings, snapshot, sub, self.inputs.dlq, parts.shard, self.store,
                self.redrive_ops, parts.redrive_picks, int(time.time() * 1000),
            )  # fmt: skip
            log.info(
                "%s shard %d: re-driving %d parked messages", parts.name, parts.shard, redriven
            )
        return bool(self.redrive_ops)

    def deliver(self, pending: dict[str, list[StateRow]]) -> pd.DataFrame:
        parts, q = self.parts, self.inputs
        sub, app_id, batch_id = q.sub, q.app_id, self.batch_id
        now_ms = int(time.time() * 1000)
        due_groups = due_heads(pending, now_ms)
        probes = parts.circuit.due_limit()  # half-open: only a few parked retries
        if probes is not None and len(due_groups) > probes:
            due_groups = due_groups[:probes]
            parts.ticks.tick_again()  # the others are due already: tick for them
        trace = parts.trace.target(sub)
        records, self.filtered = filter_records(self.df, self.filter, traced=trace is not None)
        if sub.spec.dedup_window_ms:
            window = parts.dedup.window(self.df.sparkSession, sub)
            records, self.dropped = window.filter(records, now_ms)
        spec = sub.spec
        if q.circuit == "half_open":  # a probe: its first attempts decide
            spec = replace(spec, retry=probe_retry(spec.retry))
        ctx = BatchContext(
            spec=spec,
            mq_indexes={st.name: i for i, st in enumerate(q.mq.storage_topics)},
            now_ms=now_ms,
            seed=zlib.crc32(f"{app_id}/{batch_id}".encode()),
            dedup=bool(sub.spec.dedup_window_ms),
            max_out_bytes=parts.sender.limit(q.rq.produce_topic.name),
            journal=parts.journal.target(sub, app_id, batch_id),
            replayed=journal.joined(
                parts.journal.replayed(sub, app_id, batch_id),
                parts.journal.handed_over(q.checkpoint, HadoopFS(self.df.sparkSession)),
            ),
            pace=task_pace(parts.rates.governor(sub), spec.consumption.concurrency),
            trace=trace,
        )
        executors = SparkExecutors(
            records, spec.consumption.concurrency, q.partitions_read, ctx.pace is not None
        )
        return deliver_batch(ctx, self.store, pending, due_groups, executors)

    def after_delivery(self, result: pd.DataFrame) -> list[dict[str, int]]:
        stats = []
        sub = self.inputs.sub
        if sub.spec.dedup_window_ms:
            window = self.parts.dedup.window(self.df.sparkSession, sub)
            window.remember(delivered_ids(result), self.inputs.app_id, self.batch_id)
            stats.append({"deduplicated": len(self.dropped)})
            self.parts.trace.routed(
                sub,
                ((msg_id, group_id) for _, msg_id, group_id in self.dropped),
                "deduplicated",
                "delivered within the dedup window, or repeated in its micro-batch",
            )
        if self.filtered is not None:  # computed with the batch's first job (delivery or dedup)
            observed = self.filtered.get
            stats.append({"filtered": int(observed["filtered"])})
            self.parts.trace.routed(
                sub,
                ((r["msg_id"], r["group_id"]) for r in observed.get("traced") or ()),
                "filtered",
                "the subscription's filter does not match it",
            )
        return stats

    def finish_redrives(self) -> None:
        parts = self.parts
        dlq_ops.finish_redrives(
            parts.catalog, parts.name, parts.shard, self.store, self.redrive_ops,
            parts.redrive_picks,
        )  # fmt: skip


def run_batch(parts: ShardParts, inputs: QueryInputs, df: DataFrame, batch_id: int) -> None:
    """Batch `batch_id` of the query `inputs` (Spark's `foreachBatch`, on its thread): through
    the shard's gate (refused, doing nothing, once the query is being stopped or the circuit
    moved since it started), the batch-commit protocol, then the batch's counters."""

    def body() -> None:
        parts.ticks.batch_started()
        parts.startup.mark("first batch planned")
        _commit(parts, inputs, df, batch_id)
        parts.startup.finish("first batch done")

    parts.gate.run(batch_id, lambda: parts.circuit.state != inputs.circuit, body)


def _commit(parts: ShardParts, inputs: QueryInputs, df: DataFrame, batch_id: int) -> None:
    started = time.monotonic()
    store = parts.stores.at(df.sparkSession, inputs.state_path)
    work = MicroBatch(inputs, df, batch_id, store, parts)
    sender = parts.sender.to(inputs.sub, inputs.rq, inputs.dlq)
    outcome = BatchCommit(store, sender, parts.lease, parts.label).run(
        inputs.app_id, batch_id, work, started
    )
    if outcome.resent:
        parts.progress.stats.replays += 1
        return
    _finished(parts, inputs, batch_id, outcome, time.monotonic() - started)


def task_pace(governor: RateGovernor | None, tasks: int) -> TaskPace | None:
    """Each delivery task's pace for the next batch (`varadhi.core.rate_limit`), or None."""
    return None if governor is None else governor.task_pace(tasks)


def _finished(
    parts: ShardParts, inputs: QueryInputs, batch_id: int, outcome: Outcome, seconds: float
) -> None:
    """A batch committed: its counters, the next tick, the status summary, the circuit's and
    the rate governor's verdicts, progress (every batch's counts reach the progress topic, without waiting for the
    broker, so a restarted shard goes on from them: `ShardStats.resumed`) and the hooks."""
    progress, circuit, counts = parts.progress, parts.circuit, outcome.counts
    s = progress.stats
    n_records = counts.get("records", 0)
    s.add_batch(batch_id, n_records, counts, seconds, outcome.phases)
    parts.ticks.next_due_ms = next_due(outcome.pending)
    progress.state(outcome.pending)
    attempts, failures = int(counts.get("attempts", 0)), int(counts.get("failures", 0))
    governor = parts.rates.governor(inputs.sub)
    if governor is not None:
        governor.observe(throttled(counts))
    before = circuit.state
    if circuit.record(attempts, failures) != before:
        log.warning(
            "%s: circuit %s -> %s (%d of %d attempts failed)",
            parts.label,
            before,
            circuit.state,
            failures,
            attempts,
        )
    progress.publish("running", force=True, flush=False)
    for hook in parts.batch_hooks:
        hook(s.last_batch, progress.summary)
    if n_records or counts:
        log.info("%s: batch %s", parts.label, s.last_batch)
