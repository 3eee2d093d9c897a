"""Endpoint health against the real broker, Delta and an HTTP endpoint: an endpoint that fails every
attempt for `circuit_breaker.suspend_after` suspends the subscription (every shard stops, nothing
is lost, `varadhi status` says why), and the suspension ends by a probe (`resume: probe`) or only
by an operator (`resume: operator`). Two shards of one subscription run in threads of this
process on the session's SparkSession."""

from __future__ import annotations

import threading
import time

import pytest

from varadhi.cli import main as cli
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import subscriptions
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import status
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]
GROUPS = [f"g{i}" for i in range(6)]


def spec(name: str, topic: str, url: str, resume: str) -> dict:
    return {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "shards": 2,
        "retry": {"max_attempts": 1000, "min_backoff": "200ms", "max_backoff": "500ms"},
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {
            "min_requests": 2,
            "window": "2s",
            "open_for": "500ms",
            "max_open_for": "1s",
            "probes": 2,
            "suspend_after": "3s",
            "resume": resume,
        },
    }


class Shards:
    """Both shards, each `ShardJob.run()` in a thread, until `stop`."""

    def __init__(self, settings, spark, name: str):
        self.jobs = [ShardJob(name, i, settings, spark=spark) for i in range(2)]
        self.codes: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=lambda i=i, j=j: self.codes.update({i: j.run()}), daemon=True)
            for i, j in enumerate(self.jobs)
        ]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        for job in self.jobs:
            job.request_stop()
        for t in self.threads:
            t.join(150)
        assert not any(t.is_alive() for t in self.threads), "a shard did not stop"
        assert self.codes == {0: 0, 1: 0}


def shard_states(catalog, name: str) -> list[str]:
    return [s["state"] for s in status.collect(catalog, name)["shards"]]


def test_an_endpoint_failing_every_attempt_suspends_the_subscription_until_a_probe_or_a_resume(
    settings, spark, catalog, unique_name, monkeypatch
):
    name, topic = unique_name("eh-sub"), unique_name("eh")
    TopicService(catalog).create(topic, 4)
    with TestEndpoint(fail_rate=1.0, mix={"503": 1}, retry_after_s=0) as endpoint:
        service = SubscriptionService(catalog)
        service.create(parse_spec(spec(name, topic, endpoint.url, "probe")))

        def current() -> subscriptions.Subscription:
            return subscriptions.from_snapshot(catalog.snapshot(), name)

        # Which shard thread read the subscription suspended, at each of its control loop's
        # reads (`ShardJob._wait_while`).
        reads: list[threading.Thread] = []
        read_subscription = subscriptions.from_snapshot

        def observed(snap, wanted):
            sub = read_subscription(snap, wanted)
            if wanted == name and sub.suspended is not None:
                reads.append(threading.current_thread())
            return sub

        monkeypatch.setattr(subscriptions, "from_snapshot", observed)
        first = [(g, f"a-{g}-{n}") for n in range(3) for g in GROUPS]
        produce(settings, topic, first)
        shards = Shards(settings, spark, name)
        try:
            # 1. Every attempt fails: a shard suspends the subscription, the other one waits.
            wait_for(lambda: current().suspended is not None, 180, "the suspension")
            suspension = current().suspended
            assert suspension.resume == "probe" and "every attempt" in suspension.reason
            waiting = 1 - suspension.shard
            wait_for(lambda: shard_states(catalog, name)[waiting] == "suspended", 120, "a wait")
            code = cli(["status", name])
            assert code == 0

            # 1b. An operator resumes while the endpoint still fails: the shards deliver again
            # and suspend again only after `suspend_after` (3 s) of new failures. (The probing
            # shard used to suspend again at once, for the failures before the resume.)
            resumed_ms = int(time.time() * 1000)
            assert cli(["subscription", "resume", name]) == 0
            wait_for(lambda: current().suspended is not None, 180, "a suspension after resume")
            again = current().suspended
            # A bound of the logic, not of speed: failures counted only from the resume on.
            assert again.since_ms - resumed_ms >= 3_000, (again.since_ms - resumed_ms, again)
            waiting = 1 - again.shard
            wait_for(lambda: shard_states(catalog, name)[waiting] == "suspended", 120, "a wait")

            # 2. The endpoint is healthy again: the suspending shard's probe ends the suspension
            # and both shards deliver everything.
            endpoint.fail_rate = 0.0
            wait_for(lambda: current().suspended is None, 180, "a probe to end the suspension")
            wait_for(lambda: set(delivered(endpoint)) >= {m for _, m in first}, 180, "delivery")

            # 3. resume: operator. The endpoint fails again: suspended; healthy again, the
            # shards still send nothing until an operator resumes.
            service.apply(parse_spec(spec(name, topic, endpoint.url, "operator")))
            endpoint.fail_rate = 1.0
            second = [(g, f"b-{g}-{n}") for n in range(3) for g in GROUPS]
            produce(settings, topic, second)
            wait_for(lambda: current().suspended is not None, 180, "the second suspension")
            assert current().suspended.resume == "operator"
            wait_for(lambda: shard_states(catalog, name) == ["suspended"] * 2, 120, "both wait")
            endpoint.fail_rate = 0.0
            seen = len(endpoint.records())
            # Nothing is sent while suspended, over time the shards demonstrably had: three of
            # each one's control-loop reads of the subscription (once a second) saw it suspended,
            # and no query of the subscription runs meanwhile.
            since = {t: reads.count(t) for t in shards.threads}

            def three_suspended_reads_each() -> bool:
                queries = [q.name for q in spark.streams.active]
                assert not [q for q in queries if q.startswith(f"varadhi-{name}-")], queries
                assert len(endpoint.records()) == seen, "sent while suspended"
                return all(reads.count(t) - since[t] >= 3 for t in shards.threads)

            wait_for(three_suspended_reads_each, 120, "three suspended reads of each shard")
            assert current().suspended is not None
            assert cli(["subscription", "resume", name]) == 0
            assert current().suspended is None
            everything = {m for _, m in first + second}
            wait_for(lambda: set(delivered(endpoint)) >= everything, 180, "delivery after resume")
        finally:
            shards.stop()
    # Nothing lost, and per group the first successful deliveries in produce order.
    order = {g: [m for gg, m in first + second if gg == g] for g in GROUPS}
    for g in GROUPS:
        firsts = list(dict.fromkeys(delivered(endpoint, g)))
        assert firsts == order[g], g
