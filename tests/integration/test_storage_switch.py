"""DESIGN hazard 3: a shard reads storage topic T_i+1 of the main topic only after T_i is sealed
and drained, so no group's T_i+1 message overtakes an earlier T_i message, even when a
micro-batch is cut short (max_messages_per_batch) and producers write to T_i after the switch."""

from __future__ import annotations

import pytest

from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import topics as composite_topics
from varadhi.kafka.catalog import key
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark import layouts
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_groups_stay_in_order_across_a_storage_topic_switch(
    settings, spark, catalog, unique_name, monkeypatch
):
    monkeypatch.setattr(composite_topics, "SEAL_GRACE_MS", 1_000)
    topics = TopicService(catalog)
    name, topic = unique_name("switch-sub"), unique_name("switch")
    topics.create(topic, 2)
    groups = [f"g{i}" for i in range(8)]
    with TestEndpoint() as endpoint:
        SubscriptionService(catalog).create(
            parse_spec(
                {
                    "name": name,
                    "topic": topic,
                    "endpoint": {"url": endpoint.url},
                    "shards": 2,
                    # Small batches: the Kafka source splits them over every assigned partition.
                    "consumption": {"trigger_interval": "100ms", "max_messages_per_batch": 7},
                }
            )
        )
        produce(settings, topic, [(g, f"{g}-a{i}") for i in range(6) for g in groups])
        topics.add_storage(topic, 4)  # K = 2: each old partition maps onto two new ones
        topics.switch_produce(topic)
        produce(settings, topic, [(g, f"{g}-b{i}") for i in range(6) for g in groups])
        # A producer that has not seen the switch yet still writes to T_0.
        raw_t0 = TopicService(catalog).get(topic).storage_topics[0]
        from kafka import KafkaProducer

        from varadhi.core import messages as m
        from varadhi.core.routing import route_group

        late = KafkaProducer(bootstrap_servers=settings.bootstrap)
        late.send(
            raw_t0.name,
            key=b"g0",
            value=b"late",
            partition=route_group("g0", raw_t0.partitions, raw_t0.k),
            headers=[(m.H_MSG_ID, b"g0-a6"), (m.H_GROUP_ID, b"g0")],
        )
        late.flush()
        late.close()

        for s in range(2):
            run_until_idle(settings, spark, name, shard=s, idle_s=4)
        for g in groups:
            expected = [f"{g}-a{i}" for i in range(6)] + (["g0-a6"] if g == "g0" else [])
            expected += [f"{g}-b{i}" for i in range(6)]
            assert delivered(endpoint, g) == expected, g
        snap = catalog.snapshot()
        for s in range(2):
            layout = snap.get(layouts.READER_KIND, layouts.owner(name, 2, s))
            assert layout["mq_index"] == 1 and layout["seq"] == 1, layout
        assert key("reader", layouts.owner(name, 2, 0))
