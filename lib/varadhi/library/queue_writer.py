"""A library member's writes of RQ and DLQ records, and when a message's offset finishes.

Contract. `QueueWriter.send(target, work, also)` writes `work`'s record to the RQ or the DLQ as
a shard writes it (`state_rows.OutRow`, `queue_records.out_record` within the queue's record
limit), on the partition of the queue its slot owns for its group key; `work`'s offset is
finished (`finished((partition, offset))`) only once the broker acknowledged the record and
every write of `also` (block mode: its key's GroupState record). `finish_after` finishes an
offset after other writes alone (a delivered message's GroupState and dedup records). A write
refused calls `failed` with its error: the member stops (a retry or dead letter not written
must not be committed past). `retry_target` decides whether a retry fits the RQ.

Hazards. `finished` and `failed` run on the producer's I/O thread (or at once, with nothing to
await): they must be thread-safe and must not block (the member's queue of finished offsets; its
failure, which only takes its lock).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from kafka import TopicPartition

from varadhi.core import routing
from varadhi.core.queue_records import out_record
from varadhi.core.state_rows import OutRow
from varadhi.core.trace import Next
from varadhi.kafka.topics import StorageTopic
from varadhi.library.blocking import after_acks
from varadhi.library.scheduler import Work

#: A message's place, once its offset finished.
Finished = tuple[TopicPartition, int]


def retry_target(record_bytes: int, rq_limit: int) -> tuple[Next, str | None]:
    """Where a failed attempt that its decision retries goes: ("rq", None), or ("dlq", why)
    when its record (`record_bytes`, `group_state.out_bytes`) may exceed the RQ's record limit
    (a shard dead-letters it the same way)."""
    if record_bytes > rq_limit:
        why = (
            f"not retried: a record of about {record_bytes} bytes exceeds "
            f"the retry queue's {rq_limit}"
        )
        return "dlq", why
    return "rq", None


@dataclass(frozen=True)
class Queues:
    """The member's RQ and DLQ (their produce topics), each one's record limit by topic name
    (`limits`: its `max.message.bytes`, at most a request's), and the subscription's slot count
    (`slots`: a slot writes to its own partitions of each queue)."""

    rq: StorageTopic
    dlq: StorageTopic
    limits: Mapping[str, int]
    slots: int

    @property
    def rq_limit(self) -> int:
        return self.limits[self.rq.name]


class QueueWriter:
    """See the module docstring. `producer`: the member's idempotent producer."""

    def __init__(
        self,
        producer,
        queues: Queues,
        finished: Callable[[Finished], None],
        failed: Callable[[BaseException], None],
    ):
        self.producer = producer
        self.queues = queues
        self.finished = finished
        self.failed = failed

    def finish_after(self, work: Work, futures: list) -> None:
        """Finish `work`'s offset once every one of `futures` succeeded (at once: none)."""
        where = (TopicPartition(work.topic, work.partition), work.offset)
        after_acks(futures, partial(self.finished, where), self.failed)

    def send(self, target: str, work: Work, also: list = ()) -> None:
        """Write `work`'s RQ (`target` "rq") or DLQ ("dlq") record; its offset finishes once it
        and the writes `also` are acknowledged."""
        e = work.entry
        queues = self.queues
        queue = queues.rq if target == "rq" else queues.dlq
        row = OutRow(
            target,
            work.group_key,
            e.group_id,
            e.msg_id,
            e.origin,
            e.value,
            e.headers,
            e.attempts,
            e.due_ms,
            e.first_failure_ms,
            e.last_failure_ms,
            e.reason,
            e.status,
        )
        record = out_record(row, queues.limits[queue.name])
        owned = routing.shard_partitions(work.slot, queues.slots, queue.partitions)
        partition = routing.internal_partition(routing.group_hash(work.group_key), owned)
        future = self.producer.send(
            queue.name,
            key=record.key,
            value=record.value,
            partition=partition,
            headers=record.headers,
        )
        self.finish_after(work, [future, *also])
