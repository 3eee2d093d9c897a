"""Operations on a running subscription against the real broker, Delta and an HTTP endpoint:
DLQ browse and re-drive, pause and resume, status. One in-process shard per test."""

from __future__ import annotations

import threading
import time

import pytest

from varadhi import dlq, status
from varadhi.cli import main as cli
from varadhi.producer import Producer
from varadhi.shard import ShardJob
from varadhi.subscriptions import SubscriptionService, parse_spec
from varadhi.testing.endpoint import TestEndpoint
from varadhi.topics import TopicService

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


@pytest.fixture
def make_subscription(catalog, unique_name):
    """Factory: a 2-partition topic and a one-shard grouped subscription delivering to `url`."""

    def make(url: str, **overrides):
        topic = unique_name("ops")
        TopicService(catalog).create(topic, 2)
        doc = {
            "name": unique_name("ops-sub"),
            "topic": topic,
            "endpoint": {"url": url},
            "shards": 1,
            "retry": {
                "max_attempts": 2,
                "min_backoff": "100ms",
                "max_backoff": "200ms",
                "jitter": 0,
            },
            "consumption": {"trigger_interval": "100ms"},
        }
        doc.update(overrides)
        spec = parse_spec(doc)
        SubscriptionService(catalog).create(spec)
        return spec

    return make


def produce(settings, topic: str, messages: list[tuple[str, str]]) -> None:
    with Producer(topic, settings) as p:
        for group, msg_id in messages:
            p.send(f"body-{msg_id}".encode(), group_id=group, message_id=msg_id)
        p.flush()


def run_until_idle(settings, spark, name: str, idle_s: float = 3) -> ShardJob:
    job = ShardJob(name, 0, settings, spark=spark, stop_when_idle_s=idle_s)
    assert job.run() == 0
    return job


def delivered(endpoint: TestEndpoint, group: str) -> list[str]:
    return [r.message_id for r in endpoint.records() if r.group_id == group and r.status < 300]


def test_unsideline_redrives_in_order_and_unblocks_the_group(
    settings, spark, make_subscription, catalog
):
    ids = [f"m{i}" for i in range(6)]
    with TestEndpoint(script={"m1": [404]}) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", i) for i in ids] + [("other", "o1")])
        run_until_idle(settings, spark, spec.name)
        # m1 is parked, m2.. wait behind it (block mode); other groups flow.
        assert delivered(endpoint, "g") == ["m0"]
        assert delivered(endpoint, "other") == ["o1"]
        parked = dlq.list_parked(catalog, spec.name)
        assert [(p["msg_id"], p["status"], p["attempts"], p["state"]) for p in parked] == [
            ("m1", 404, 1, "parked")
        ]
        assert parked[0]["reason"].startswith("fatal response 404")
        doc = status.collect(catalog, spec.name)
        assert doc["shards"][0]["blocked_groups"] == 1
        assert doc["shards"][0]["queues"]["dlq"]["parked"] == 1

        assert cli(["dlq", "unsideline", spec.name, "--group-ids", "g"]) == 0
        produce(settings, spec.topic, [("g", "m6")])  # live traffic stays behind the re-drive
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ids + ["m6"]
        attempts = [r.attempt for r in endpoint.records() if r.message_id == "m1"]
        assert attempts == [1, 1]  # attempts were reset by the re-drive
        assert [p["state"] for p in dlq.list_parked(catalog, spec.name)] == ["redriven"]
        assert status.collect(catalog, spec.name)["shards"][0]["blocked_groups"] == 0


def test_unsideline_refuses_bad_requests_without_side_effects(
    settings, catalog, make_subscription, capsys
):
    spec = make_subscription("http://127.0.0.1:9/")
    before = dlq.redrives(catalog.snapshot(), spec.name)
    assert cli(["dlq", "unsideline", spec.name]) == 2
    assert cli(["dlq", "unsideline", "no-such-sub", "--group-ids", "g"]) == 2
    assert cli(["dlq", "unsideline", spec.name, "--failed-since", "yesterday"]) == 2
    assert cli(["dlq", "unsideline", spec.name, "--failed-until", "2026-01-01T00:00:00Z"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "not a time" in err and "needs --failed-since" in err
    assert dlq.redrives(catalog.snapshot(), spec.name) == before


def test_pause_stops_consuming_and_resume_carries_on(settings, spark, make_subscription, catalog):
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", f"a{i}") for i in range(5)])
        job = ShardJob(spec.name, 0, settings, spark=spark)
        thread = threading.Thread(target=job.run, daemon=True)
        thread.start()
        _wait(lambda: len(delivered(endpoint, "g")) == 5, 90)
        assert cli(["subscription", "pause", spec.name]) == 0
        _wait(lambda: status.collect(catalog, spec.name)["shards"][0]["state"] == "paused", 30)
        produce(settings, spec.topic, [("g", f"b{i}") for i in range(5)])
        time.sleep(3)
        assert len(delivered(endpoint, "g")) == 5  # nothing consumed while paused
        assert cli(["subscription", "resume", spec.name]) == 0
        _wait(lambda: len(delivered(endpoint, "g")) == 10, 90)
        assert delivered(endpoint, "g") == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
        job.request_stop()
        thread.join(60)
        assert not thread.is_alive()


def _wait(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError("condition not met in time")
