"""De-duplication window against the real broker, Delta and an HTTP endpoint: one shard's
window across batches and runs, and the subscription-wide window across shards and a
shard-count change."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaProducer

from varadhi.cli import main as cli
from varadhi.client import Client
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import producer, topics
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]
PARTITIONS = 6  # 2 shards, then 3: both divide it


def test_duplicates_within_the_window_are_delivered_once(
    settings, spark, make_subscription, catalog
):
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url, dedup_window="30m", trace={"retention": "1h"})
        produce(settings, spec.topic, [("g", "m1"), ("g", "m2"), ("g", "m1")])  # same batch
        run_until_idle(settings, spark, spec.name)
        produce(settings, spec.topic, [("g", "m2"), ("g", "m3")])  # a later batch
        job = run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["m1", "m2", "m3"]
        assert job.stats.deduplicated == 2  # one in each run: a shard's counters go on
        # The trace says why each copy was not delivered (written by the shard's driver).
        for msg_id in ("m1", "m2"):
            steps = [(e["kind"], e["next"]) for e in Client(settings).trace(spec.name, msg_id)]
            assert steps == [("attempt", "delivered"), ("routed", "deduplicated")], msg_id

        # Without a message id, the payload's hash is the id.
        topic = topics.from_snapshot(catalog.snapshot(), spec.topic)
        storage, partition = producer.plan(topic, "h")
        raw = KafkaProducer(bootstrap_servers=settings.bootstrap)
        for body in (b"same", b"same", b"other"):
            raw.send(storage, key=b"h", value=body, partition=partition)
        raw.flush()
        raw.close()
        run_until_idle(settings, spark, spec.name)
        assert len([r for r in endpoint.records() if r.group_id == "h" and r.status < 300]) == 2


def test_outside_the_window_a_duplicate_is_delivered_again(settings, spark, make_subscription):
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url, dedup_window="1s")
        produce(settings, spec.topic, [("g", "m1")])
        run_until_idle(settings, spark, spec.name, idle_s=1)
        time.sleep(1.5)
        produce(settings, spec.topic, [("g", "m1")])
        run_until_idle(settings, spark, spec.name, idle_s=1)
        assert delivered(endpoint, "g") == ["m1", "m1"]


def test_a_duplicate_is_dropped_whichever_shard_reads_it_before_and_after_a_shard_count_change(
    settings, spark, catalog, unique_name
):
    """An ungrouped message's copies land on every partition, so on every shard. Before, each
    shard had a window of its own: shard 1 delivered the copy shard 0 had delivered, and after
    change-shards every new shard delivered it again."""
    name, topic = unique_name("dd-sub"), unique_name("dd")
    TopicService(catalog).create(topic, PARTITIONS)
    with TestEndpoint() as endpoint:
        SubscriptionService(catalog).create(
            parse_spec(
                {
                    "name": name,
                    "topic": topic,
                    "endpoint": {"url": endpoint.url},
                    "shards": 2,
                    "dedup_window": "30m",
                    "consumption": {"trigger_interval": "100ms"},
                }
            )
        )

        def copies(msg_id: str) -> None:  # one on each partition: round-robin, ungrouped
            produce(settings, topic, [(None, msg_id)] * PARTITIONS)

        copies("m1")
        first = run_until_idle(settings, spark, name, shard=0)
        assert delivered(endpoint) == ["m1"]
        assert first.stats.deduplicated == PARTITIONS // 2 - 1  # repeats within its own batch
        second = run_until_idle(settings, spark, name, shard=1)
        assert delivered(endpoint) == ["m1"]
        assert second.stats.deduplicated == PARTITIONS // 2  # every copy seen by shard 0

        change = cli(["subscription", "change-shards", name, "--to", "3", "--output", "json"])
        assert change == 0
        copies("m1")
        copies("m2")
        for shard in range(3):
            run_until_idle(settings, spark, name, shard=shard)
        assert sorted(delivered(endpoint)) == ["m1", "m2"]
