"""The library runtime through a broker restart, as a process (issue 28, "Reliability"): a
`varadhi-consumer` member (a real process of the console script) keeps delivering when its broker
is killed and started again, loses nothing and keeps each key's order. The chaos run (members
killed, hung, joining and leaving) is bench/library_chaos.py."""

from __future__ import annotations

import time

import pytest

from varadhi.core.policies import Endpoint
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.testing import library as lib
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue

pytestmark = pytest.mark.kafka

DEADLINE_S = 180  # one generous deadline per wait: 2 cores shared with other tests


def wait_for(condition, what: str, members=()) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.pid}:\n{p.log()[-3000:]}" for p in members)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.1)


def test_a_member_rides_out_a_broker_restart(tmp_path, unique_name):
    """A broker of the test's own is killed (SIGKILL) under a delivering member and started
    again on its data: the member keeps running (no exit), goes on by itself, and delivers
    everything, each key in order, no retry early; what is produced after the restart too."""
    from varadhi.kafka.catalog import Catalog
    from varadhi.kafka.settings import Settings
    from varadhi.kafka.topics import TopicService
    from varadhi.testing.local_broker import LocalBroker

    broker = LocalBroker(tmp_path / "kafka")
    broker.start()
    settings = Settings(bootstrap=broker.bootstrap, catalog_topic=unique_name("catalog"))
    endpoint = TestEndpoint(fail_rate=0.04, mix={"500": 1.0}, latency_ms=20)
    member = None
    try:
        with endpoint:
            catalog = Catalog(settings)
            try:
                topic = unique_name("t")
                TopicService(catalog).create(topic, 4)
                spec = lib.subscription_spec(
                    unique_name("outage"), topic, Endpoint(endpoint.url + "hook")
                )
                SubscriptionService(catalog).create(spec)
            finally:
                catalog.close()
            keys = {f"g{k}": [f"g{k}-{n}" for n in range(40)] for k in range(20)}
            before = [ids[n] for n in range(30) for ids in keys.values()]
            after = [ids[n] for n in range(30, 40) for ids in keys.values()]
            produce(settings, spec.topic, before)
            member = lib.ConsumerProcess(
                settings, spec.name, tmp_path / "member.log", "--max-in-flight", "3"
            )
            wait_for(lambda: len(lib.first_successes(endpoint.records())) >= 150, "deliveries")
            broker.kill()
            # away long enough for the member's requests, commits and writes to fail
            time.sleep(5)
            broker.start()
            produce(settings, spec.topic, after)

            def drained() -> bool:
                return set(before + after) <= set(lib.first_successes(endpoint.records()))

            wait_for(drained, "every message delivered after the restart", [member])
            assert member.alive(), member.log()
            assert member.stop() == 0, member.log()
            records = endpoint.records()
            rq = read_queue(settings, f"{spec.rq_topic}.0")
        assert lib.order_violations(records, keys) == []
        assert lib.early_retries(records, rq) == []
        dups = lib.duplicates(records)
        print(f"broker restart: {len(before + after)} messages, {len(dups)} duplicates")
    finally:
        if member is not None:
            member.kill()
        broker.wipe()


def produce(settings, topic: str, ids: list[str]) -> None:
    """Each id `g<k>-<n>` as a message of group `g<k>`."""
    with Producer(topic, settings) as producer:
        for msg_id in ids:
            producer.send(msg_id.encode(), group_id=msg_id.rsplit("-", 1)[0], message_id=msg_id)
        producer.flush(60)
