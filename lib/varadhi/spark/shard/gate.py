"""Where a shard's control loop and its batch thread meet: a query is stopped between batches only.

Spark runs `foreachBatch` on a thread of its own while the control loop watches the query.
`BatchGate.run` runs a batch under the gate's lock; `BatchGate.stop` stops a query between
batches: it marks the gate stopping (a batch Spark plans from then on does nothing), waits for
the batch in flight, then for Spark to commit it, then stops the query. A batch refused that way
(or because the circuit moved since the query started) raises `StopRequested` and is remembered
(`take_refused`), so that the next query of the same checkpoint plans it again under its own
limits instead of re-running the range the refusing query planned.

Hazard: Spark commits a batch after `foreachBatch` returned, within its trigger. Stopping the
query before the trigger ends interrupts that commit, and the next run delivers the batch again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from varadhi.core.errors import StopRequested

log = logging.getLogger("varadhi.spark.shard.job")

# How long `stop` waits for Spark to commit the batch that just ran before it stops the query
# anyway (logged): a commit takes milliseconds; this only bounds a stuck trigger.
COMMIT_WAIT_S = 30


class BatchGate:
    """The gate of one shard (`label` names it in log lines); one query at a time passes it."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Lock()
        self._stopping = False
        self._checkpoint = ""  # the running query's
        self._started_ms = 0  # the running query's start, wall clock (as Spark's batchTimestampMs)
        self._refused: tuple[str, int, int] | None = None  # (checkpoint, batch, query start ms)
        self.completed: tuple[str, int] = ("", -1)  # (checkpoint, batch) last completed here
        self.passed = 0  # batches completed since the running query's `open`
        self.last_end = time.monotonic()  # when the last batch ended (or the query started)

    def open(self, checkpoint: str) -> tuple[int, int] | None:
        """A query of `checkpoint` is about to start: the batch a query of the same checkpoint
        refused unstarted, as (batch id, that query's start in ms), or None; forgotten here."""
        refused, self._refused = self._refused, None
        self._checkpoint, self._started_ms = checkpoint, int(time.time() * 1000)
        self.passed = 0
        if refused is None or refused[0] != checkpoint:
            return None
        return refused[1], refused[2]

    def started(self) -> None:
        """The query started: its batches pass."""
        self._stopping = False

    def run(self, batch_id: int, circuit_moved: Callable[[], bool], body: Callable[[], None]):
        """Run batch `batch_id`'s `body` under the lock, unless the gate is stopping or the
        circuit moved since the query started (then `StopRequested`, before the batch did
        anything)."""
        self._refuse_if_closed(batch_id, circuit_moved)
        with self._lock:
            self._refuse_if_closed(batch_id, circuit_moved)
            try:
                body()
                self.completed = (self._checkpoint, batch_id)
                self.passed += 1
            finally:
                self.last_end = time.monotonic()

    def busy(self) -> bool:
        """Whether a batch runs now."""
        return self._lock.locked()

    def stop(self, query) -> None:
        """Stop `query` between batches (module docstring)."""
        self._stopping = True  # a batch Spark plans from now on does nothing (StopRequested)
        with self._lock:  # the batch in flight finishes
            pass
        # A trigger that plans a new batch ends it refused (and the query failed).
        deadline = time.monotonic() + COMMIT_WAIT_S
        while query.isActive and query.status["isTriggerActive"]:
            if time.monotonic() > deadline:
                log.warning("%s: the batch did not commit in %d s", self.label, COMMIT_WAIT_S)
                break
            time.sleep(0.02)
        query.stop()

    def _refuse_if_closed(self, batch_id: int, circuit_moved: Callable[[], bool]) -> None:
        if self._stopping or circuit_moved():
            self._refused = (self._checkpoint, batch_id, self._started_ms)
            raise StopRequested()
