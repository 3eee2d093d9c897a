"""A feeder whose old RQ/DLQ storage topic holds nothing is marked done without Spark
(`varadhi.ops.feeders.feed_if_empty`, which `varadhi-job feeder` calls first); one whose topic holds a
record is left to copy. Against the real broker; the change-shards before it uses the
session's Spark."""

from __future__ import annotations

import pytest
from kafka import KafkaProducer

from varadhi.cli import main as cli
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import change_shards_plan
from varadhi.ops.feeders import feed_if_empty

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def feeders(catalog, name: str) -> dict[str, dict]:
    op = catalog.snapshot().get(
        change_shards_plan.OPERATION, change_shards_plan.operation_name(name)
    )
    return {f["source"]: f for f in op["feeders"]}


def test_an_empty_source_is_fed_without_spark_and_a_full_one_is_not(
    settings, spark, catalog, unique_name, capsys
):
    topic = unique_name("feed-empty")
    TopicService(catalog).create(topic, 2)
    spec = parse_spec(
        {
            "name": unique_name("feed-empty-sub"),
            "topic": topic,
            "shards": 1,
            "endpoint": {"url": "http://127.0.0.1:9/unused"},
        }
    )
    SubscriptionService(catalog).create(spec)
    name = spec.name
    change = ["subscription", "change-shards", name, "--to", "2", "--feeders", "external"]
    assert cli([*change, "--output", "json"]) == 0
    capsys.readouterr()
    rq, dlq = f"{name}.rq.0", f"{name}.dlq.0"
    assert set(feeders(catalog, name)) == {rq, dlq}
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap)
    producer.send(dlq, key=b"g1", value=b"a dead letter", partition=0).get(30)
    producer.close()

    assert feed_if_empty(catalog, name, rq) is True
    assert feed_if_empty(catalog, name, dlq) is False
    found = feeders(catalog, name)
    assert (found[rq]["done"], found[rq]["records"]) == (True, 0)
    assert found[dlq]["done"] is False  # its record is copied by `feed`, with Spark
    op = catalog.snapshot().get(
        change_shards_plan.OPERATION, change_shards_plan.operation_name(name)
    )
    assert op["step"] == "feed"  # not done while a feeder is not
