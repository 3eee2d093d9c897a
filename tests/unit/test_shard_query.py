"""What one query of a shard reads (pure): `varadhi.spark.records.Source`."""

from __future__ import annotations

import json
from dataclasses import replace

from varadhi.core import subscription_spec
from varadhi.kafka import subscriptions as subs
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.spark.layouts import Layout
from varadhi.spark.records import Source


def topic(name: str, *partitions: int, internal: bool = False) -> CompositeTopic:
    storages = tuple(StorageTopic(f"{name}.{i}", p, 1) for i, p in enumerate(partitions))
    return CompositeTopic(name, storages, len(storages) - 1, (None,) * len(storages), internal)


def sub_of(shards: int) -> subs.Subscription:
    spec = subscription_spec.parse_spec(
        {"name": "orders-http", "topic": "orders", "endpoint": {"url": "http://127.0.0.1:1/x"}},
        source="test.yaml",
    )
    spec = replace(spec, shards=shards)
    return subs.Subscription(spec, shard_count=shards, created_ms=0)


def test_a_layout_reads_its_main_storage_topic_and_the_current_rq_storage_topics():
    sub = replace(sub_of(2), rq_from=1)  # RQ storage topic 0 was drained by feeders
    mq, rq = topic("orders", 4, 8), topic(sub.spec.rq_topic, 4, 2, internal=True)
    layout = Layout(generation=1, seq=3, mq_index=1, starting_offsets={"orders.1": {"4": 17}})
    source = Source.of(sub, mq, rq, layout, shard=1)
    assert source.assign == {"orders.1": [4, 5, 6, 7], f"{rq.name}.1": [1]}
    assert source.mq_partitions == 4
    # Carried-over offsets where the layout has them, else the earliest (-2).
    assert source.starting == {
        "orders.1": {"4": 17, "5": -2, "6": -2, "7": -2},
        f"{rq.name}.1": {"1": -2},
    }


def test_a_shard_owning_no_main_partition_still_reads_its_rq_partitions():
    sub = sub_of(2)
    mq, rq = topic("orders", 1), topic(sub.spec.rq_topic, 2, internal=True)
    source = Source.of(sub, mq, rq, Layout(1, 0, 0, {}), shard=0)
    assert source.assign == {f"{rq.name}.0": [0]} and source.mq_partitions == 0


def test_the_source_options_read_committed_and_fail_on_data_loss():
    sub = sub_of(1)
    mq, rq = topic("orders", 2), topic(sub.spec.rq_topic, 1, internal=True)
    source = Source.of(sub, mq, rq, Layout(1, 0, 0, {}), shard=0)
    opts = source.options({"kafka.bootstrap.servers": "b:1"}, limit=500)
    assert opts == {
        "kafka.bootstrap.servers": "b:1",
        "assign": json.dumps(source.assign),
        "startingOffsets": json.dumps(source.starting),
        "includeHeaders": "true",
        "failOnDataLoss": "true",
        "kafka.isolation.level": "read_committed",
        "maxOffsetsPerTrigger": "500",
    }
