"""The subscription's concurrency limit (`consumption.max_in_flight`) shared by its library
members: each has its slots' share of it in flight at most, taken anew as members join and
leave (docs/library.md, "Concurrency limit"; `assign.in_flight_share`)."""

from __future__ import annotations

import pytest

from varadhi.core.policies import ConsumptionPolicy, Endpoint
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.library import Consumer
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.library import produce_rounds, subscription_spec, wait_for

pytestmark = pytest.mark.kafka

LIMIT = 4
KEYS = 40


def test_members_share_the_subscriptions_concurrency_limit(settings, catalog, unique_name):
    """Two members of a 2-slot subscription limited to 4 requests at once each send at most 2,
    so the endpoint (answering after 50 ms, 40 keys ready at once) never sees more than 4; alone,
    the one left takes the whole limit."""
    topic = unique_name("lib-conc")
    TopicService(catalog).create(topic, 2)
    with TestEndpoint(latency_ms=50) as endpoint:
        spec = subscription_spec(
            unique_name("lib"),
            topic,
            Endpoint(endpoint.url),
            shards=2,
            consumption=ConsumptionPolicy(max_in_flight=LIMIT),
        )
        SubscriptionService(catalog).create(spec)
        members = [Consumer(spec.name, settings).start() for _ in range(2)]
        try:
            wait_for(
                lambda: all(len(c.health()["slots"]) == 1 for c in members),
                "a slot each",
                *members,
            )
            assert [c.health()["max_in_flight"] for c in members] == [2, 2]
            produced = produce_rounds(settings, topic, KEYS, 0, 5)
            wait_for(
                lambda: sum(c.counters()["delivered"] for c in members) == len(produced),
                "everything delivered",
                *members,
            )
            # Both members were busy at once, and never above their shares together.
            assert all(c.counters()["delivered"] for c in members)
            assert endpoint.stats()["max_concurrent"] <= LIMIT, endpoint.stats()
            members[1].stop()
            wait_for(
                lambda: members[0].health()["slots"] == [0, 1],
                "both slots with the member left",
                members[0],
            )
            assert members[0].health()["max_in_flight"] == LIMIT
        finally:
            for c in members:
                c.stop()
