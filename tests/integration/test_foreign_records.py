"""Records another program wrote on the catalog and progress topics, against the real broker:
every reader skips them with a warning (docs/bad-input.md, rows 37 and 38)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import pytest
from kafka import KafkaProducer

from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.leases import Lease
from varadhi.kafka.progress import ProgressPublisher, latest_progress, progress_topic
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService

pytestmark = [pytest.mark.kafka]

JUNK = [
    (b"\xff\xfe", b"{}"),
    (b"topic/junk", b"not json"),
    (b"topic/junk2", b"\xff\x00"),
    (b"topic/junk3", b"[1, 2, 3]"),
    (b"subscription/junk4", b"42"),
]


def write_junk(bootstrap: str, topic: str) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        for k, v in JUNK:
            producer.send(topic, key=k, value=v).get(30)
    finally:
        producer.close()


def test_junk_on_the_catalog_and_progress_topics_is_skipped(settings, caplog):
    run = uuid.uuid4().hex[:8]
    own = replace(settings, catalog_topic=f"__varadhi_catalog_junk_{run}")
    topic, name = f"junk-{run}", f"junk-http-{run}"  # Kafka topic names are the broker's
    catalog = Catalog(own)
    try:
        TopicService(catalog).create(topic, 2)
        write_junk(own.bootstrap, own.catalog_topic)
        spec = parse_spec(
            {"name": name, "topic": topic, "endpoint": {"url": "http://127.0.0.1:1/"}}
        )
        with caplog.at_level(logging.WARNING, logger="varadhi.kafka.catalog"):
            SubscriptionService(catalog).create(spec)  # reads past the junk, then writes
            fresh = Catalog(own)  # a new reader from the start
            try:
                snapshot = fresh.snapshot()
                assert topic in snapshot.items("topic")
                assert name in snapshot.items("subscription")
                lease = Lease(fresh, f"{name}/s1/0")
                lease.acquire()
                write_junk(own.bootstrap, own.catalog_topic)
                lease.check()  # the lease check reads through the junk as well
            finally:
                fresh.close()
        assert "another program wrote" in caplog.text

        ProgressPublisher(own, name, 0).publish({"state": "running"}, force=True, flush=True)
        write_junk(own.bootstrap, progress_topic(own))
        assert latest_progress(own, name)[0]["state"] == "running"
    finally:
        catalog.close()
