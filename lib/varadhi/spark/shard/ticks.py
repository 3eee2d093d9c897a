"""Ticks: a shard wakes its own query when a parked retry falls due, or a DLQ re-drive waits,
and no input would trigger a micro-batch (Spark runs one only when there is new data).

A tick is an empty record with the header `messages.H_TICK` on the first partition this shard
owns of its RQ's produce storage topic; the batch it triggers delivers nothing for it (the
delivery path drops tick records) but runs the parked retries that are due and the pending
re-drives. `tick_due` (pure) decides: for a waiting re-drive, one tick every
`REDRIVE_TICK_MS` since the last batch started (a rate-capped re-drive takes one portion a
batch, at most a second's worth: `varadhi.core.redrive_pace`); otherwise one tick per due time (the earliest
parked retry's `next_due_ms`), only if no batch has started since it fell due.

Threading: `batch_started` and `tick_again` are called on the batch's thread, `maybe_tick` on
the control loop's; they share two integers (a stale read costs at most one extra tick).
"""

from __future__ import annotations

import time

from kafka import KafkaProducer

from varadhi.core.messages import H_TICK
from varadhi.core.redrive_pace import MAX_PORTION_S
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.settings import Settings

#: How often a shard with a pending re-drive wakes its query when no batch runs: as often as a
#: rate-capped re-drive's portion may grow (`redrive_pace.MAX_PORTION_S`), so it keeps its pace.
REDRIVE_TICK_MS = int(MAX_PORTION_S * 1000)


def tick_due(
    now_ms: int, next_due_ms: int | None, last_batch_start_ms: int, redrive_waiting: bool
) -> bool:
    """Whether to send a tick now (pure; see the module docstring)."""
    if redrive_waiting:
        return now_ms - last_batch_start_ms >= REDRIVE_TICK_MS
    return next_due_ms is not None and now_ms >= next_due_ms > last_batch_start_ms


class Ticks:
    """The ticks of shard `shard`: when its earliest parked retry falls due (`next_due_ms`,
    None: none parked), when its last batch started, and the plain producer that sends them."""

    def __init__(self, settings: Settings, shard: int):
        self.settings, self.shard = settings, shard
        self.next_due_ms: int | None = None
        self.last_batch_start_ms = -1  # before any batch: a due time of 0 still gets a tick
        self._producer: KafkaProducer | None = None

    def batch_started(self) -> None:
        self.last_batch_start_ms = int(time.time() * 1000)

    def tick_again(self) -> None:
        """Retries that are due already were left for a later batch (a half-open circuit's
        probes): tick for them even without a new due time."""
        self.last_batch_start_ms = -1

    def maybe_tick(
        self, rq: topics.CompositeTopic, sub: subscriptions.Subscription, redrive_waiting: bool
    ) -> None:
        """Send a tick when `tick_due` says so and the shard owns a partition of its RQ."""
        now = int(time.time() * 1000)
        if not tick_due(now, self.next_due_ms, self.last_batch_start_ms, redrive_waiting):
            return
        parts = subscriptions.internal_partitions(sub, rq, rq.produce_pointer, self.shard)
        if not parts:
            return
        if self._producer is None:
            self._producer = kafka_clients.producer(self.settings, linger_ms=0)
        self._producer.send(
            rq.produce_topic.name, value=b"", partition=parts[0], headers=[(H_TICK, b"1")]
        )
        self._producer.flush(5)
        self.last_batch_start_ms = int(time.time() * 1000)  # one tick per due time

    def close(self) -> None:
        if self._producer is not None:
            try:
                self._producer.close(timeout=2)
            except Exception:  # noqa: BLE001 - closing is best-effort at exit
                pass
