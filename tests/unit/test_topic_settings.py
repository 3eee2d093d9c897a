"""Topic settings of the cluster configuration (`varadhi.topic.*`) and of composite topics."""

from __future__ import annotations

import pytest

from varadhi.core.errors import InvalidArgument, KafkaConfigError
from varadhi.kafka import config as kc
from varadhi.kafka import topics
from varadhi.kafka.settings import Settings
from varadhi.kafka.topic_settings import TOPIC_KINDS, TopicSettings


def cfg(props: dict[str, str]) -> kc.KafkaConfig:
    return kc.from_properties(props, environ={})


def test_defaults_are_the_clusters():
    for kind in TOPIC_KINDS:
        assert kc.PLAINTEXT.topics(kind) == TopicSettings(-1, ())


def test_general_and_per_kind_settings():
    c = cfg(
        {
            "varadhi.topic.replication.factor": "3",
            "varadhi.topic.config.min.insync.replicas": "2",
            "varadhi.topic.dlq.config.retention.ms": "-1",
            "varadhi.topic.progress.replication.factor": "2",
            "varadhi.topic.progress.config.min.insync.replicas": "1",
            "varadhi.topic.config.cleanup.policy": "delete",
        }
    )
    assert c.topics("storage") == TopicSettings(
        3, (("cleanup.policy", "delete"), ("min.insync.replicas", "2"))
    )
    assert dict(c.topics("dlq").configs)["retention.ms"] == "-1"
    assert c.topics("progress").replication_factor == 2
    assert dict(c.topics("progress").configs)["min.insync.replicas"] == "1"
    # a general delete policy never reaches the catalog, which must stay compacted
    assert c.topics("catalog") == TopicSettings(3, (("min.insync.replicas", "2"),))
    # never passed to the clients
    assert c.spark_options() == {} and c.python_kwargs() == {}


@pytest.mark.parametrize(
    "props, message",
    [
        ({"varadhi.topic.replicaton.factor": "3"}, "did you mean varadhi.topic.replication.factor"),
        ({"varadhi.topic.config.min.insync.replica": "2"}, "did you mean min.insync.replicas"),
        ({"varadhi.topic.replication.factor": "0"}, "positive integer or -1"),
        ({"varadhi.topic.rq.replication.factor": "three"}, "positive integer or -1"),
        ({"varadhi.topic.catalog.config.cleanup.policy": "delete"}, "must be compacted"),
        ({"varadhi.topic.config.min.insync.replicas": "x"}, "positive integer"),
        (
            {
                "varadhi.topic.replication.factor": "2",
                "varadhi.topic.config.min.insync.replicas": "3",
            },
            "more than their replication factor 2",
        ),
        ({"varadhi.kafka.topics.replication.factor": "3"}, "unknown property"),
    ],
)
def test_refused(props, message):
    with pytest.raises(KafkaConfigError, match=message):
        cfg(props)


def test_with_defaults_keeps_configured_values():
    ts = TopicSettings(3, (("retention.ms", "5"),))
    assert ts.with_defaults({"retention.ms": "7", "segment.ms": "9"}) == TopicSettings(
        3, (("retention.ms", "5"), ("segment.ms", "9"))
    )


def test_settings_for_composite_topics():
    settings = Settings(
        kafka=cfg(
            {
                "varadhi.topic.replication.factor": "3",
                "varadhi.topic.rq.config.max.message.bytes": "5000000",
                "varadhi.topic.dlq.config.max.message.bytes": "1000",
            }
        )
    )
    # the product's max.message.bytes is a minimum: a larger configured one stays
    need = {"max.message.bytes": "2000000"}
    assert dict(topics.settings_for(settings, "rq", need).configs)["max.message.bytes"] == "5000000"
    assert (
        dict(topics.settings_for(settings, "dlq", need).configs)["max.message.bytes"] == "2000000"
    )
    assert topics.settings_for(settings, "storage", None, 1).replication_factor == 1


def test_composite_topic_keeps_its_configs():
    t = topics.new_topic("o.rq", 2, internal=True, configs={"max.message.bytes": "9"})
    assert t.kind == "rq" and topics.new_topic("o", 2).kind == "storage"
    again = topics.CompositeTopic.from_dict(t.to_dict())
    assert again == t and again.configs == (("max.message.bytes", "9"),)
    assert "configs" not in topics.new_topic("o", 2).to_dict()  # old documents unchanged
    grown, _ = topics.add_storage(again, 4)
    assert grown.configs == t.configs
    with pytest.raises(InvalidArgument, match="not a Kafka topic config"):
        topics.new_topic("o", 2, configs={"retention.msec": "1"})
    with pytest.raises(InvalidArgument):
        topics.new_topic("o", 2, replication_factor=0)
