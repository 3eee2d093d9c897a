"""A shard's RQ/DLQ sender (`varadhi.spark.shard.sender`) with an in-memory transactional producer:
where each record goes, one transaction per batch, topic limits read once, and which Kafka
errors are a fence of the shard. The Kafka side is covered by the integration tests
(test_shard_delivery, test_failover, test_shard_crash)."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest
from kafka.errors import FencedLeaderEpochError, KafkaError, ProducerFencedError

from varadhi.core import routing, subscription_spec
from varadhi.core.errors import Fenced, VaradhiError
from varadhi.core.messages import H_TRUNCATED
from varadhi.core.queue_records import MAX_REQUEST_BYTES
from varadhi.core.state_frames import out_rows
from varadhi.kafka import subscriptions as subs
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.spark.shard.sender import QueueSender, plan, targets, transactional_id


def topic(name: str, *partitions: int) -> CompositeTopic:
    storages = tuple(StorageTopic(f"{name}.{i}", p, 1) for i, p in enumerate(partitions))
    return CompositeTopic(name, storages, len(storages) - 1, (None,) * len(storages), True)


def sub_of(shards: int) -> subs.Subscription:
    spec = subscription_spec.parse_spec(
        {"name": "orders-http", "topic": "orders", "endpoint": {"url": "http://127.0.0.1:1/x"}},
        source="test.yaml",
    )
    return subs.Subscription(replace(spec, shards=shards), shard_count=shards, created_ms=0)


def row(target: str, group: str, value: bytes = b"body") -> dict:
    return {
        "kind": "out",
        "target": target,
        "group_key": group,
        "group_id": group,
        "msg_id": f"{group}-m",
        "value": value,
        "headers": "{}",
        "origin_index": 0,
        "origin_partition": 3,
        "origin_offset": 17,
        "attempts": 2,
        "due_ms": 0,
        "first_failure_ms": 1,
        "last_failure_ms": 2,
        "reason": "HTTP 500",
        "status": 500,
    }


class Future:
    def __init__(self, error: Exception | None):
        self.error = error

    def get(self, timeout=None):
        if self.error is not None:
            raise self.error


class FakeProducer:
    """kafka-python's transactional producer as the sender uses it: records become visible
    (`committed`) only when their transaction commits; `fail_with` fails the next send."""

    def __init__(self):
        self.open: list[tuple] | None = None
        self.committed: list[list[tuple]] = []
        self.fail_with: Exception | None = None
        self.closed = False

    def begin_transaction(self):
        assert self.open is None
        self.open = []

    def send(self, topic, *, key, value, partition, headers):
        assert self.open is not None, "a send outside a transaction"
        self.open.append((topic, partition, key, value, dict(headers)))
        error, self.fail_with = self.fail_with, None
        return Future(error)

    def commit_transaction(self):
        assert self.open is not None
        self.committed.append(self.open)
        self.open = None

    def close(self, timeout=None):
        self.closed = True


SUB = sub_of(2)
RQ = topic(SUB.spec.rq_topic, 4, 8)  # produce pointer: storage topic 1 (8 partitions)
DLQ = topic(SUB.spec.dlq_topic, 4)


def sender(producer, limits=None, lookups=None):
    limits = limits or {}

    def max_bytes(name):
        if lookups is not None:
            lookups.append(name)
        return limits.get(name, 1_000_000)

    return QueueSender(producer, 1, "orders-http shard 1", lambda: 7, max_bytes)


def test_each_row_goes_to_its_target_on_its_group_s_partition_of_this_shard():
    where = targets(SUB, RQ, DLQ, shard=1)
    assert where == {"rq": (f"{RQ.name}.1", [4, 5, 6, 7]), "dlq": (f"{DLQ.name}.0", [2, 3])}
    rows = [row("rq", "a"), row("dlq", "b"), row("rq", "c")]
    planned = plan(out_rows(pd.DataFrame(rows)), where, lambda _t: 1_000_000)
    for (t, partition, record), r in zip(planned, rows, strict=True):
        name, parts = where[r["target"]]
        assert t == name
        assert partition == routing.internal_partition(routing.group_hash(r["group_key"]), parts)
        assert record.key == r["group_id"].encode() and record.value == b"body"


def test_a_batch_s_records_are_sent_in_one_transaction_and_none_for_an_empty_batch():
    producer = FakeProducer()
    queues = sender(producer)
    batch = queues.to(SUB, RQ, DLQ)
    batch.send(pd.DataFrame([row("rq", "a"), row("dlq", "b")]))
    assert len(producer.committed) == 1 and len(producer.committed[0]) == 2
    assert [t for t, *_ in producer.committed[0]] == [f"{RQ.name}.1", f"{DLQ.name}.0"]
    batch.send(pd.DataFrame([]))
    assert len(producer.committed) == 1 and producer.open is None
    queues.close()
    assert producer.closed


def test_a_topic_s_limit_is_read_once_and_capped_at_what_the_producer_sends():
    lookups: list[str] = []
    dlq = f"{DLQ.name}.0"
    producer = FakeProducer()
    queues = sender(producer, {dlq: 2_000, f"{RQ.name}.1": 1 << 30}, lookups)
    queues.to(SUB, RQ, DLQ).send(pd.DataFrame([row("dlq", "a", b"x" * 5_000), row("dlq", "b")]))
    assert lookups == [dlq]
    assert queues.limit(f"{RQ.name}.1") == MAX_REQUEST_BYTES
    cut = producer.committed[0][0]
    assert len(cut[3]) < 2_000 and cut[4][H_TRUNCATED] == b"5000"
    # A retry the RQ cannot take fails the batch before anything is committed.
    small = sender(FakeProducer(), {f"{RQ.name}.1": 100})
    with pytest.raises(VaradhiError, match="max.message.bytes"):
        small.to(SUB, RQ, DLQ).send(pd.DataFrame([row("rq", "a", b"x" * 500)]))


def test_a_fenced_producer_is_a_fence_of_the_shard_in_each_form_kafka_python_raises():
    refused = KafkaError(
        f"Cannot execute transactional method because we are in an error state: "
        f"{ProducerFencedError()}"
    )
    for error in (ProducerFencedError(), refused):
        producer = FakeProducer()
        producer.fail_with = error
        with pytest.raises(Fenced, match="producer of orders-http shard 1") as raised:
            sender(producer).to(SUB, RQ, DLQ).send(pd.DataFrame([row("rq", "a")]))
        assert raised.value.mine == 7 and producer.committed == []


def test_a_leader_change_is_raised_as_it_is_not_taken_for_a_fence():
    # kafka-python's FENCED_LEADER_EPOCH (error 74): the partition's leader moved on; nothing
    # about this shard's instance. It was taken for a fence ("fenc" in the text) before.
    producer = FakeProducer()
    producer.fail_with = FencedLeaderEpochError("leader epoch 4 is older than 5")
    with pytest.raises(FencedLeaderEpochError):
        sender(producer).to(SUB, RQ, DLQ).send(pd.DataFrame([row("rq", "a")]))
    assert producer.committed == []


def test_the_transactional_id_is_one_per_subscription_shard_count_and_shard():
    assert transactional_id("orders-http", 4, 2) == "varadhi.orders-http.s4.shard-2"
