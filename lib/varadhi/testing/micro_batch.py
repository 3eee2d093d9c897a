"""A shard's micro-batch without Spark and without Kafka: the batch-commit protocol
(`varadhi.spark.shard.commit.BatchCommit`) and the delivery plan (`varadhi.spark.batch.
deliver_batch`) with in-memory ports, delivering to a real HTTP endpoint.

    state = MemoryState()
    shard = MemoryShard(spec, state)
    outcome = shard.run_batch([record(0, "g1"), record(1, "g1")])   # batch 0
    shard.sent                                                       # its RQ/DLQ records

- `MemoryState`: the state copy (`varadhi.core.state_copy.StateCopy`) whose commit replaces the
  rows in memory (the table a real commit would write);
- `InProcessExecutors`: the batch's two jobs run in this process: phase 1 over the records in
  one task, phase 2 over the rows the plan sends;
- `MemoryShard`: runs micro-batch after micro-batch of records (dicts of
  `varadhi.spark.records.DELIVERY_COLUMNS`; `record` makes one) through the protocol; what it
  sent to the RQ/DLQ is in `sent`, and `due_ms` says when the retries it holds fall due.

The clock is the wall clock, as the executors' is (`varadhi.spark.batch`): a test waits until a
retry is due (`wait_until_due`) instead of moving a clock.

What it leaves out: the filter and the dedup window (Spark plan steps), re-drives (catalog
operations), the journal; the RQ/DLQ records are not read back as the next batch's input
unless the test passes them in (`queued`). A real shard's test is still the one that
matters per feature; these run scenario tests in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import pandas as pd
import pyarrow as pa

from varadhi.core import messages as m
from varadhi.core.policies import SubscriptionSpec
from varadhi.core.queue_records import out_record
from varadhi.core.state_copy import StateCopy
from varadhi.core.state_frames import out_rows
from varadhi.core.state_rows import StateRow
from varadhi.spark.batch import (
    BatchContext,
    ForwardRule,
    deliver_batch,
    deliver_records,
    process_partition,
)
from varadhi.spark.shard.commit import BatchCommit, Outcome
from varadhi.spark.shard.stats import due_heads

MQ = "orders.0"  # the main topic's storage topic the records come from
RQ = "orders-sub.rq.0"

# What Spark hands phase 1 (`mapInArrow`): the Arrow types of `varadhi.spark.records.
# DELIVERY_COLUMNS`.
RECORDS = pa.schema(
    [
        ("kind", pa.string()),
        ("group_key", pa.string()),
        ("group_id", pa.string()),
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("value", pa.binary()),
        ("kheaders", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
    ]
)


def record(
    offset: int,
    group: str,
    body: bytes = b"{}",
    msg_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> dict:
    """A main-topic record of `group` at `offset` (message id `<group>-<offset>` by default),
    with the producer's `headers` besides the ids."""
    msg_id = msg_id or f"{group}-{offset}"
    headers = {m.H_MSG_ID: msg_id, m.H_GROUP_ID: group, **(headers or {})}
    return {
        "kind": "mq",
        "group_key": group,
        "group_id": group,
        "msg_id": msg_id,
        "topic": MQ,
        "partition": 0,
        "offset": offset,
        "value": body,
        "kheaders": [{"key": k, "value": v.encode()} for k, v in headers.items()],
    }


def queued(outs: pd.DataFrame, target: str = "rq", first_offset: int = 0) -> list[dict]:
    """The records `out` rows for `target` ("rq" or "dlq") become
    (`varadhi.core.queue_records.out_record`), as the shard's query reads them back from the RQ,
    at offsets from `first_offset`."""
    rows = [r for r in out_rows(outs) if r.target == target]
    found = []
    for offset, row in enumerate(rows, start=first_offset):
        rec = out_record(row, None)
        found.append(
            {
                "kind": "rq",
                "group_key": row.group_key,
                "group_id": row.group_id,
                "msg_id": row.msg_id,
                "topic": RQ,
                "partition": 0,
                "offset": offset,
                "value": rec.value,
                "kheaders": [{"key": k, "value": v} for k, v in rec.headers],
            }
        )
    return found


class MemoryState(StateCopy):
    """A state table in memory: a commit replaces the rows with what it would write."""

    def commit(self, touched: set[str], new_rows: pd.DataFrame, app_id: str, batch_id: int) -> bool:
        if self.meta() == (app_id, batch_id):
            return True  # Delta skips a batch's second commit (txnAppId/txnVersion)
        self.frame = self.committed(touched, new_rows, app_id, batch_id)
        return True


class InProcessExecutors:
    """`varadhi.spark.batch.Executors` in this process: phase 1 in one task (the job's first)."""

    def __init__(self, records: Iterable[dict]):
        self.records = pa.RecordBatch.from_pylist(list(records), schema=RECORDS)

    def first(
        self,
        ctx: BatchContext,
        forward: ForwardRule,
        local: dict[str, list[StateRow]],
        parked: dict[str, list[StateRow]] | None,
    ) -> pd.DataFrame:
        out = deliver_records(iter([self.records]), ctx, forward, local, parked, first_task=True)
        return pd.concat([b.to_pandas() for b in out], ignore_index=True)

    def second(
        self, rows: pd.DataFrame, ctx: BatchContext, involved: dict[str, list[StateRow]]
    ) -> pd.DataFrame:
        return pd.concat(list(process_partition(iter([rows]), ctx, involved)), ignore_index=True)


class ListSender:
    """The RQ/DLQ sender: every batch's `out` rows, in order."""

    def __init__(self):
        self.sent: list[pd.DataFrame] = []

    def send(self, outs: pd.DataFrame) -> None:
        if len(outs):
            self.sent.append(outs)


class HeldLease:
    """A lease nobody takes away."""

    def check(self) -> None:
        pass


@dataclass
class _Work:
    """One batch's `commit.BatchWork`: no re-drives, delivery by `deliver_batch`."""

    ctx: BatchContext
    state: MemoryState
    records: list[dict]

    def apply_redrives(self) -> bool:
        return False

    def deliver(self, pending: dict[str, list[StateRow]]) -> pd.DataFrame:
        due = due_heads(pending, self.ctx.now_ms)
        return deliver_batch(self.ctx, self.state, pending, due, InProcessExecutors(self.records))

    def after_delivery(self, result: pd.DataFrame) -> list[dict[str, int]]:
        return []

    def finish_redrives(self) -> None:
        pass


@dataclass
class MemoryShard:
    """Micro-batches of one shard of `spec` over `state` (module docstring)."""

    spec: SubscriptionSpec
    state: MemoryState = field(default_factory=MemoryState)
    app_id: str = "sub.g1.s1.shard-0.L0"
    sender: ListSender = field(default_factory=ListSender)
    batches: int = 0

    @property
    def sent(self) -> pd.DataFrame:
        """Every RQ/DLQ record sent so far (`out` rows)."""
        if not self.sender.sent:
            return pd.DataFrame()
        return pd.concat(self.sender.sent, ignore_index=True)

    def due_ms(self) -> int | None:
        """When the earliest retry the state or the RQ holds falls due (None: none waits)."""
        dues = [r.due_ms for rows in self.state.pending().values() for r in rows if r.due_ms]
        return min(dues) if dues else None

    def wait_until_due(self) -> None:
        """Sleep until every retry sent so far is due (at most its backoff: milliseconds)."""
        due = self.due_ms()
        if due is not None:
            time.sleep(max(0.0, due / 1000 - time.time()) + 0.01)

    def run_batch(self, records: Iterable[dict]) -> Outcome:
        """Run the next micro-batch over `records` through the batch-commit protocol."""
        batch_id, self.batches = self.batches, self.batches + 1
        ctx = BatchContext(
            spec=self.spec, mq_indexes={MQ: 0}, now_ms=int(time.time() * 1000), seed=batch_id
        )
        protocol = BatchCommit(self.state, self.sender, HeldLease(), "memory shard")
        work = _Work(ctx, self.state, list(records))
        return protocol.run(self.app_id, batch_id, work, started=0.0)
