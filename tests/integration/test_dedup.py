"""De-duplication window against the real broker, Delta and an HTTP endpoint."""

from __future__ import annotations

import time

import pytest
from kafka import KafkaProducer

from varadhi.kafka import producer, topics
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_duplicates_within_the_window_are_delivered_once(
    settings, spark, make_subscription, catalog
):
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url, dedup_window="30m")
        produce(settings, spec.topic, [("g", "m1"), ("g", "m2"), ("g", "m1")])  # same batch
        run_until_idle(settings, spark, spec.name)
        produce(settings, spec.topic, [("g", "m2"), ("g", "m3")])  # a later batch
        job = run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["m1", "m2", "m3"]
        assert job.stats.deduplicated == 2  # one in each run: a shard's counters go on

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
