"""A shard's warm-up (`varadhi.warm_up.WarmUp`) against the test session and broker: its jobs
run (Python workers with the delivery code imported, one catalog record read by Spark's Kafka
source with the shard's connection options) and it says so. Whether it shortens the first batch
is bench/startup.py's to say."""

from __future__ import annotations

import logging
import time

import pytest

from varadhi import kafka_clients, warm_up

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def outcome(caplog, what: str) -> str:
    """The warm-up's log line for `what`, once it has ended (bounded by a generous deadline)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for r in caplog.records:
            if r.name == "varadhi.shard" and r.getMessage().startswith(f"{what}: "):
                return r.getMessage()
        time.sleep(0.1)
    raise AssertionError(f"{what}: the warm-up did not end")


def test_a_warm_up_runs_its_jobs_and_says_so(spark, settings, make_subscription, caplog):
    caplog.set_level(logging.INFO, logger="varadhi.shard")
    make_subscription("http://127.0.0.1:9/never-called")  # the catalog holds records
    kafka = kafka_clients.spark_options(settings)
    warm_up.WarmUp(spark, kafka, settings.catalog_topic, "warm shard")
    assert outcome(caplog, "warm shard").startswith("warm shard: Spark warmed up in ")
