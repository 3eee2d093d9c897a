"""The batch-commit protocol of a shard's micro-batch, behind explicit ports.

Everything a shard guarantees rests on the order of these steps (`BatchCommit.run`), between
Spark handing `foreachBatch` a micro-batch and Spark committing its offsets:

1. `lease.check()`: a newer instance fences this one (DESIGN hazard 6);
2. if the state table's meta row is this batch (`state.meta() == (app_id, batch_id)`: a run
   committed state and died before Spark committed the batch), re-send that commit's RQ/DLQ
   records (`sender.send(state.outs(...))`) and return: nothing is delivered again;
3. `work.apply_redrives()`: DLQ re-drives pending for this shard, applied to the state copy
   (a rate-capped one: its next portion, with its progress; persisted by step 6);
4. `work.deliver(state.pending())`: deliver on executors, which journal what the endpoint
   accepted; a batch run again after a crash skips what the crashed run journaled;
5. `work.after_delivery(result)`: bookkeeping that is idempotent per batch (the dedup window,
   keyed by batch id), and its counters;
6. if anything changed (touched groups, new pending or out rows, re-drives): `lease.check()`,
   `state.commit(...)` (idempotent per `(app_id, batch_id)`: a second commit of one batch is
   skipped), then `sender.send(state.outs(...))` in one Kafka transaction, then
   `work.finish_redrives()`;
7. `lease.check()` again, also for a batch that changed nothing: a fenced instance must not
   return (and so let Spark commit) a batch the new instance runs again.

What a crash between any two steps leaves, when Spark runs the batch again (tested at every
port call by tests/unit/test_batch_commit.py):

- before the state commit: nothing recorded but the journal and the dedup window; deliveries
  since a task's last journal record repeat (at-least-once); the RQ/DLQ records are computed
  again and sent once;
- after the state commit, before the Kafka transaction commits: step 2 sends them once (an
  unfinished transaction is aborted when the next run's producer starts);
- after the Kafka transaction committed, before Spark committed the batch: step 2 sends them a
  second time. These duplicates are the documented ones: GroupState recognises RQ records it
  has seen (`varadhi.core.group_state.merge`), and a DLQ record twice shows as one parked message;
- re-drives the crashed run committed are marked done by the next batch that commits (step 2
  returns before `finish_redrives`); `apply_redrives` does not apply them again.

`crash` is called at the named crash points (`varadhi.core.faults`: `after_delivery`,
`after_state_commit`, `after_send`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd

from varadhi.core.faults import crash_point
from varadhi.core.state_frames import task_stats
from varadhi.core.state_rows import Kind, StateRow

log = logging.getLogger("varadhi.spark.shard.job")


class StatePort(Protocol):
    """The shard's GroupState table and the driver's copy of it (`varadhi.spark.state_store`)."""

    def meta(self) -> tuple[str | None, int | None]:
        """(app_id, batch_id) of the table's last commit."""
        ...

    def pending(self) -> dict[str, list[StateRow]]:
        """Group key -> its pending rows (without bodies)."""
        ...

    def outs(self, app_id: str, batch_id: int) -> pd.DataFrame:
        """The RQ/DLQ records the commit of (app_id, batch_id) holds."""
        ...

    def commit(self, touched: set[str], new_rows: pd.DataFrame, app_id: str, batch_id: int) -> bool:
        """Replace the touched groups' rows with `new_rows`, idempotently per (app_id,
        batch_id); False when another writer's commit won (the copy is reloaded)."""
        ...


class OutSender(Protocol):
    """Sends RQ/DLQ records (`out` rows) in one Kafka transaction: all or none are visible."""

    def send(self, outs: pd.DataFrame) -> None: ...


class LeasePort(Protocol):
    """The shard's lease: `check` raises `varadhi.core.errors.Fenced` once a newer instance holds
    it, `varadhi.core.errors.LeaseExpired` while it is not renewed (either way: commit nothing)."""

    def check(self) -> None: ...


class BatchWork(Protocol):
    """One micro-batch's own work, which the protocol puts in order."""

    def apply_redrives(self) -> bool:
        """Apply pending DLQ re-drives to the state copy; whether any are pending."""
        ...

    def deliver(self, pending: dict[str, list[StateRow]]) -> pd.DataFrame:
        """Deliver the batch given the groups' pending state; every result row
        (`state_rows.RESULT_SCHEMA`: pending, touched, out, done, stat)."""
        ...

    def after_delivery(self, result: pd.DataFrame) -> list[dict[str, int]]:
        """Bookkeeping idempotent per batch, once delivery succeeded; extra counters."""
        ...

    def finish_redrives(self) -> None:
        """After the state commit and send: mark the committed re-drives done."""
        ...


@dataclass(frozen=True)
class Outcome:
    """What `BatchCommit.run` did: `resent` (step 2: the batch was committed already and only
    its records were sent again), else the batch's counters, phase timings (seconds) and the
    state's pending groups after it."""

    resent: bool
    counts: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    pending: dict[str, list[StateRow]] = field(default_factory=dict)


@dataclass
class BatchCommit:
    """The protocol above for one shard; `label` names the shard in log lines."""

    state: StatePort
    sender: OutSender
    lease: LeasePort
    label: str
    crash: Callable[[str], None] = crash_point

    def run(self, app_id: str, batch_id: int, work: BatchWork, started: float) -> Outcome:
        """Run micro-batch `batch_id` of the query `app_id` (`started`: its monotonic start)."""
        self.lease.check()
        if self.state.meta() == (app_id, batch_id):
            log.info("%s: batch %d was committed; re-sending its records", self.label, batch_id)
            self.sender.send(self.state.outs(app_id, batch_id))
            return Outcome(resent=True)
        redriving = work.apply_redrives()
        result = work.deliver(self.state.pending())

        self.crash("after_delivery")
        phases = {"deliver_s": time.monotonic() - started}
        stats = stat_rows(result) + work.after_delivery(result)
        touched, new_rows = changes(result, app_id, batch_id)
        if touched or len(new_rows) or redriving:
            self.lease.check()
            mark = time.monotonic()
            if not self.state.commit(touched, new_rows, app_id, batch_id):
                log.warning("%s: batch %d was committed by another writer", self.label, batch_id)
            self.crash("after_state_commit")
            phases["commit_s"] = time.monotonic() - mark
            mark = time.monotonic()
            self.sender.send(self.state.outs(app_id, batch_id))
            phases["send_s"] = time.monotonic() - mark
            self.crash("after_send")
            if redriving:
                work.finish_redrives()
        # Last check before Spark commits the batch's offsets, also for a batch that changed
        # nothing: a fenced instance must not commit a batch that the new instance replays (the
        # second commit of one batch id fails that query).
        self.lease.check()
        return Outcome(
            resent=False, counts=sum_counts(stats), phases=phases, pending=self.state.pending()
        )


def stat_rows(result: pd.DataFrame) -> list[dict[str, Any]]:
    """The counters of every task (`stat` rows: `state_rows.TaskStats.counters`) (pure)."""
    return [s.counters() for s in task_stats(result)]


def changes(result: pd.DataFrame, app_id: str, batch_id: int) -> tuple[set[str], pd.DataFrame]:
    """The state change a delivery result asks for (pure): the touched groups (their old rows
    go) and the new rows (`pending`, and `out` rows stamped with the batch)."""
    touched = set(result.loc[result["kind"] == Kind.TOUCHED, "group_key"])
    new_rows = result[result["kind"].isin([Kind.PENDING, Kind.OUT])].copy()
    new_rows.loc[new_rows["kind"] == Kind.OUT, "batch_id"] = batch_id
    new_rows.loc[new_rows["kind"] == Kind.OUT, "app_id"] = app_id
    return touched, new_rows


def sum_counts(stats: list[dict[str, int]]) -> dict[str, int]:
    """The tasks' counters (`TaskStats.counters`: flat, the endpoint's answers among them)
    summed key by key (pure)."""
    total: dict[str, int] = {}
    for s in stats:
        for k, v in s.items():
            total[k] = total.get(k, 0) + int(v)
    return total
