"""A shard's RQ/DLQ sender: a committed batch's `out` rows as Kafka records, in one transaction.

`QueueSender` holds the shard's transactional producer (transactional id per subscription,
shard count and shard: `transactional_id`) and the largest record each RQ/DLQ storage topic
takes. `QueueSender.to(sub, rq, dlq)` is the `varadhi.spark.shard.commit.OutSender` port of one
micro-batch: `send(outs)` types the batch's `out` rows once (`state_frames.out_rows`) and writes
each to the storage topic its `target` names (the RQ's or DLQ's produce topic) on the partition of its group among those this shard owns
(`routing.internal_partition`, so the group's shard reads it again), all in one Kafka
transaction: all or none are visible to read_committed readers.

The inner fence (docs/architecture.md, "Leases and failover"): a newer instance of the shard
starts a producer with the same transactional id, and its `init_transactions` fences this one
at the broker. A send refused for that reason raises `varadhi.core.errors.Fenced` (exit 3); the
decision is `jvm_errors.classify`'s `Fenced` fact, by exact exception class. Every other Kafka
error is raised as it is (a `FencedLeaderEpochError` is a leader change, not a fence).

Contracts: `start` fences the shard's earlier instances' producers (and aborts their open
transaction) before anything is sent; nothing is sent for an empty batch; a topic's limit is
read once per process (`topics.max_message_bytes`, at most `MAX_REQUEST_BYTES`) and a DLQ record
above it is cut to fit while a retry above it fails the batch (`queue_records.out_record`); a
commit waits `SEND_TIMEOUT_S` at most (`kafka.clients.end_transaction`).
The record plan (`plan`) is pure; the producer and the limit lookup are injected, so the send is
unit-tested with an in-memory producer (tests/unit/test_shard_sender.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pandas as pd
from kafka.errors import KafkaError

from varadhi.core import routing
from varadhi.core.errors import Fenced
from varadhi.core.queue_records import MAX_REQUEST_BYTES, OutRecord, out_record
from varadhi.core.state_frames import out_rows
from varadhi.core.state_rows import OutRow
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import jvm_errors, subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings

#: Seconds a send waits for the broker's acknowledgement of each record.
SEND_TIMEOUT_S = 30


class Producer(Protocol):
    """What the sender uses of kafka-python's transactional `KafkaProducer`."""

    def begin_transaction(self) -> None: ...

    def send(self, topic: str, *, key, value, partition: int, headers) -> Any: ...

    def commit_transaction(self) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


def transactional_id(name: str, shard_count: int, shard: int) -> str:
    """The shard's transactional id: one per subscription, shard count and shard, so a newer
    instance of the same shard fences the older one's producer."""
    return f"varadhi.{name}.s{shard_count}.shard-{shard}"


#: Where the rows of each `target` go: (storage topic name, partitions this shard owns).
Targets = dict[str, tuple[str, list[int]]]


def targets(
    sub: subscriptions.Subscription,
    rq: topics.CompositeTopic,
    dlq: topics.CompositeTopic,
    shard: int,
) -> Targets:
    """The RQ's and DLQ's produce storage topics and the partitions of each that `shard`
    owns (pure)."""
    return {
        "rq": (
            rq.produce_topic.name,
            subscriptions.internal_partitions(sub, rq, rq.produce_pointer, shard),
        ),
        "dlq": (
            dlq.produce_topic.name,
            subscriptions.internal_partitions(sub, dlq, dlq.produce_pointer, shard),
        ),
    }


def plan(
    rows: list[OutRow], where: Targets, limit: Callable[[str], int]
) -> list[tuple[str, int, OutRecord]]:
    """(topic, partition, record) for each `out` row, in order (pure but for `limit`: the
    largest record a storage topic takes). Raises `VaradhiError` for a retry that does not fit."""
    planned = []
    for row in rows:
        topic, parts = where[row.target]
        partition = routing.internal_partition(routing.group_hash(row.group_key), parts)
        planned.append((topic, partition, out_record(row, limit(topic))))
    return planned


class QueueSender:
    """One shard's transactional RQ/DLQ producer (see the module docstring). `label` names the
    shard in errors; `epoch` gives the shard's lease epoch (for `Fenced`); `max_message_bytes`
    looks up a storage topic's `max.message.bytes`; `commit_timeout_s` bounds the wait for a
    transaction's commit."""

    def __init__(
        self,
        producer: Producer,
        shard: int,
        label: str,
        epoch: Callable[[], int | None],
        max_message_bytes: Callable[[str], int],
        commit_timeout_s: float = SEND_TIMEOUT_S,
    ):
        self._producer = producer
        self._commit_timeout_s = commit_timeout_s
        self.shard = shard
        self.label = label
        self._epoch = epoch
        self._max_message_bytes = max_message_bytes
        self._limits: dict[str, int] = {}  # storage topic -> largest record (`limit`)

    @classmethod
    def start(
        cls,
        settings: Settings,
        catalog: Catalog,
        name: str,
        shard_count: int,
        shard: int,
        epoch: Callable[[], int | None],
    ) -> QueueSender:
        """The shard's producer, started: its `init_transactions` fences earlier instances."""
        producer = kafka_clients.producer(
            settings,
            transactional_id=transactional_id(name, shard_count, shard),
            acks="all",
            linger_ms=5,
            max_request_size=MAX_REQUEST_BYTES,
        )
        try:
            producer.init_transactions()
        except BaseException:
            _close(producer)
            raise
        return cls(
            producer,
            shard,
            f"{name} shard {shard}",
            epoch,
            lambda topic: topics.max_message_bytes(catalog, [topic])[topic],
        )

    def limit(self, storage_topic: str) -> int:
        """The largest record the shard may write to an RQ/DLQ storage topic: its
        `max.message.bytes`, read once per topic, and at most what the producer sends."""
        if storage_topic not in self._limits:
            found = self._max_message_bytes(storage_topic)
            self._limits[storage_topic] = min(found, MAX_REQUEST_BYTES)
        return self._limits[storage_topic]

    def to(self, sub, rq: topics.CompositeTopic, dlq: topics.CompositeTopic) -> BatchSender:
        """The `OutSender` of a batch of `sub` (its RQ and DLQ as the batch's query read them)."""
        return BatchSender(self, sub, rq, dlq)

    def send(self, outs: list[OutRow], where: Targets) -> None:
        """Send the `out` rows `outs` in one Kafka transaction (nothing for none); raises
        `Fenced` when a newer producer of the shard fenced this one, and kafka-python's
        `KafkaTimeoutError` when the commit did not end in `commit_timeout_s` (a broker gone
        inside the transaction: the outcome is unknown and this sender is done; the shard rides
        the outage out with a new one, and the batch, committed in the state table, is sent
        again by step 2 of `varadhi.spark.shard.commit`)."""
        if not outs:
            return
        producer = self._producer
        try:
            producer.begin_transaction()
            futures = []
            for topic, partition, record in plan(outs, where, self.limit):
                futures.append(
                    producer.send(
                        topic,
                        key=record.key,
                        value=record.value,
                        partition=partition,
                        headers=record.headers,
                    )
                )
            for f in futures:
                f.get(timeout=SEND_TIMEOUT_S)
            kafka_clients.end_transaction(
                producer, commit=True, timeout_s=self._commit_timeout_s, what=self.label
            )
        except KafkaError as e:
            if jvm_errors.Fenced in jvm_errors.classify(e):
                raise Fenced(f"producer of {self.label}", self._epoch() or 0, -1) from e
            raise

    def close(self) -> None:
        _close(self._producer)


@dataclass(frozen=True)
class BatchSender:
    """The `varadhi.spark.shard.commit.OutSender` of one micro-batch: `QueueSender.send` to the batch's
    RQ/DLQ produce topics."""

    sender: QueueSender
    sub: subscriptions.Subscription
    rq: topics.CompositeTopic
    dlq: topics.CompositeTopic

    def send(self, outs: pd.DataFrame) -> None:
        if len(outs):
            where = targets(self.sub, self.rq, self.dlq, self.sender.shard)
            self.sender.send(out_rows(outs), where)


def _close(producer: Producer) -> None:
    try:
        producer.close(timeout=2)
    except Exception:  # noqa: BLE001 - a fenced producer may refuse to close cleanly
        pass
