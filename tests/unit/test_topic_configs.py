"""Topic configs read through `kafka_clients.topic_configs`: kafka-python's `describe_configs`
drops per-topic error codes, so a topic the broker does not describe yet (just created) came back
without configs and callers failed with `KeyError: 'max.message.bytes'`. Fake admin clients only;
no broker."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kafka.errors import (
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
)

from varadhi.core.errors import InvalidArgument, NotAuthorized, NotFound
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.config import PLAINTEXT
from varadhi.kafka.topic_settings import TopicSettings


class FakeAdmin:
    """Answers `describe_configs` with no configs for its first `blank` calls, then with
    `max.message.bytes`; `describe_topics` with `error_code` (each topic under `name`, as
    kafka-python 3.0.12 answers)."""

    def __init__(self, blank: int, error_code: int = 0):
        self.blank = blank
        self.error_code = error_code
        self.calls = 0

    def describe_configs(self, resources, config_filter):
        self.calls += 1
        if self.calls <= self.blank:
            return {"topic": {r.name: {} for r in resources}}
        return {"topic": {r.name: {k: {"value": "2097152"} for k in r.configs} for r in resources}}

    def describe_topics(self, names):
        return [{"name": n, "error_code": self.error_code, "partitions": []} for n in names]

    def close(self):
        pass


@pytest.fixture
def catalog(monkeypatch):
    settings = SimpleNamespace(bootstrap="127.0.0.1:1", kafka=PLAINTEXT)
    return SimpleNamespace(settings=settings)


def test_a_topic_not_yet_described_is_asked_again(monkeypatch, catalog):
    admin = FakeAdmin(blank=2)
    monkeypatch.setattr(kafka_clients, "admin", lambda *a, **k: admin)
    monkeypatch.setattr(kafka_clients.time, "sleep", lambda s: None)
    assert topics.max_message_bytes(catalog, ["orders"]) == {"orders": 2_097_152}
    assert admin.calls == 3


@pytest.mark.parametrize(
    ("code", "error", "operation"),
    [
        (UnknownTopicOrPartitionError.errno, NotFound, None),
        (TopicAuthorizationFailedError.errno, NotAuthorized, "Describe"),
        (0, NotAuthorized, "DescribeConfigs"),
    ],
)
def test_a_topic_never_described_names_the_cause(monkeypatch, catalog, code, error, operation):
    admin = FakeAdmin(blank=10**9, error_code=code)
    monkeypatch.setattr(kafka_clients, "admin", lambda *a, **k: admin)
    with pytest.raises(error) as raised:
        kafka_clients.topic_configs(admin, catalog.settings, ["orders"], ["x"], wait_s=0.05)
    assert "orders" in str(raised.value)
    if operation:
        assert raised.value.operation == operation


class JustCreated:
    """A topic another client created a moment ago: `create_topics` says it exists, and the
    first `describe_topics` answers come without partitions (the answering broker's metadata
    has not caught up), as seen under load for the progress topic."""

    def __init__(self, empty: int):
        self.empty = empty
        self.describes = 0

    def create_topics(self, new_topics):
        raise TopicAlreadyExistsError()

    def describe_topics(self, names):
        self.describes += 1
        parts = [] if self.describes <= self.empty else [{"partition": 0, "replicas": [1]}]
        return [{"name": n, "error_code": 0, "partitions": parts} for n in names]


def test_a_topic_created_a_moment_ago_is_described_again_until_it_has_partitions(monkeypatch):
    admin = JustCreated(empty=2)
    monkeypatch.setattr(topics.time, "sleep", lambda s: None)
    created = topics.ensure_kafka_topic(admin, "p", 1, TopicSettings(-1, ()), "progress topic")
    assert created is False
    assert admin.describes == 3


def test_a_topic_that_keeps_no_partitions_is_still_refused(monkeypatch):
    admin = JustCreated(empty=10**9)
    with pytest.raises(InvalidArgument, match="already exists with 0 partitions, not 1"):
        topics.ensure_kafka_topic(admin, "p", 1, TopicSettings(-1, ()), wait_s=0.05)
