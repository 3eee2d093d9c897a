"""Status and a shard's resumed counters on a busy deployment, against the real broker: every
shard of every subscription publishes to one progress partition, and a shard's newest document
may lie 100,000 records back. The reader reads backward until it has it (issue 30: it read the
last 5,000 records only, so a shard restarted after a minute of others' traffic started its
counters at zero and status computed its lags from offset 0)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import pytest
from kafka import KafkaProducer

from varadhi.kafka.progress import (
    ProgressPublisher,
    latest_progress,
    progress_documents,
    progress_topic,
)

pytestmark = [pytest.mark.kafka]

OTHERS = 100_000


@pytest.fixture
def own(settings):
    """Settings with a catalog of their own: the 100,000 records go to a progress topic no other
    test reads."""
    return replace(settings, catalog_topic=f"__varadhi_catalog_scan_{uuid.uuid4().hex[:8]}")


def test_a_shards_newest_document_is_found_behind_other_subscriptions_traffic(own):
    name = f"scan-{uuid.uuid4().hex[:8]}"
    created_ms = int(time.time() * 1000) - 1_000
    publisher = ProgressPublisher(own, name, 0)
    try:
        publisher.publish({"state": "stopped", "totals": {"delivered": 1234}}, force=True)
    finally:
        publisher.close()
    # then every other subscription's shards keep publishing: 100,000 documents
    producer = KafkaProducer(bootstrap_servers=own.bootstrap, linger_ms=20, batch_size=256_000)
    try:
        body = json.dumps({"state": "running", "totals": {"delivered": 1}}).encode()
        for i in range(OTHERS):
            producer.send(progress_topic(own), key=f"other-{i % 500}/{i % 7}".encode(), value=body)
        producer.flush(120)
    finally:
        producer.close()

    found = latest_progress(own, name)  # no hint: read back to the topic's start
    assert found[0]["totals"] == {"delivered": 1234}
    assert latest_progress(own, name, [0], created_ms)[0]["state"] == "stopped"
    docs = progress_documents(own, name, since_ms=created_ms)
    assert set(docs) == {"0"}
    # a document newer than the subscription's creation is all the read looks for
    assert latest_progress(own, name, [0], int(time.time() * 1000) + 60_000) == {}
