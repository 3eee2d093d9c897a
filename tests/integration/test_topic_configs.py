"""Topic configs on the real broker: RQ/DLQ `max.message.bytes` from the main topic, composite
topic configs, and pre-created topics accepted when they fit, refused clearly when not."""

from __future__ import annotations

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

from varadhi.core.errors import InvalidArgument
from varadhi.core.queue_records import QUEUE_HEADROOM_BYTES
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService

pytestmark = pytest.mark.kafka


@pytest.fixture
def admin(bootstrap):
    client = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-topic-configs")
    yield client
    client.close()


def config(admin, topic: str, name: str) -> str:
    found = admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, topic, configs=[name])], config_filter="all"
    )["topic"][topic]
    return found[name]["value"]


def test_queues_take_every_record_of_the_main_topic(catalog, topic_service, unique_name, admin):
    name = unique_name("big")
    topic_service.create(name, 2, configs={"max.message.bytes": "3000000"})
    assert config(admin, f"{name}.0", "max.message.bytes") == "3000000"
    topic_service.add_storage(name, 4)
    assert config(admin, f"{name}.1", "max.message.bytes") == "3000000"  # kept by add-storage

    spec = parse_spec(
        {"name": unique_name("big-sub"), "topic": name, "endpoint": {"url": "http://127.0.0.1:9/"}}
    )
    SubscriptionService(catalog).create(spec)
    for queue in (spec.rq_topic, spec.dlq_topic):
        assert (
            int(config(admin, f"{queue}.0", "max.message.bytes"))
            == 3_000_000 + QUEUE_HEADROOM_BYTES
        )
    # the shard's limit for its RQ/DLQ records is read from the topic
    assert (
        topics.max_message_bytes(catalog, [f"{spec.rq_topic}.0"])[f"{spec.rq_topic}.0"] > 3_000_000
    )


def test_pre_created_topics(catalog, topic_service, unique_name, admin):
    fits, wrong = unique_name("pre"), unique_name("pre")
    admin.create_topics([NewTopic(f"{fits}.0", 2, 1), NewTopic(f"{wrong}.0", 3, 1)])
    topic_service.create(fits, 2)  # accepted: the partition count matches
    with pytest.raises(InvalidArgument, match=r"already exists with 3 partitions, not 4"):
        topic_service.create(wrong, 4)

    # an RQ pre-created too small for the main topic's records is refused, saying how to fix it
    sub = unique_name("pre-sub")
    admin.create_topics(
        [NewTopic(f"{sub}.rq.0", 2, 1, topic_configs={"max.message.bytes": "1000"})]
    )
    spec = parse_spec({"name": sub, "topic": fits, "endpoint": {"url": "http://127.0.0.1:9/"}})
    with pytest.raises(InvalidArgument, match=r"max.message.bytes 1000, less than .*kafka-configs"):
        SubscriptionService(catalog).create(spec)


def test_catalog_topic_must_be_compacted(settings, unique_name, admin):
    deleting, many = unique_name("__cat"), unique_name("__cat")
    admin.create_topics(
        [
            NewTopic(deleting, 1, 1),
            NewTopic(many, 2, 1, topic_configs={"cleanup.policy": "compact"}),
        ]
    )
    for name, message in (
        (deleting, "cleanup.policy=delete: it must be compacted"),
        (many, "has 2 partitions"),
    ):
        cat = Catalog(
            Settings(bootstrap=settings.bootstrap, catalog_topic=name, warehouse=settings.warehouse)
        )
        try:
            with pytest.raises(InvalidArgument, match=message):
                cat.snapshot()
        finally:
            cat.close()
