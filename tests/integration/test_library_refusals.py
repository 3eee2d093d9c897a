"""A member the broker refuses says so (against the real broker): a request refused by a broker
that answered is reported as the broker's refusal, with its error, not as a failure to connect."""

from __future__ import annotations

import pytest

from varadhi.core.policies import Endpoint
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer, Options
from varadhi.testing.library import subscription_spec, wait_for

pytestmark = pytest.mark.kafka


def test_a_session_timeout_the_broker_refuses_stops_the_member_with_the_brokers_answer(
    settings, catalog, make_topic, unique_name
):
    # The broker's group.min.session.timeout.ms is 6 s (Kafka's default): it refuses a join
    # asking for 1 s with INVALID_SESSION_TIMEOUT, answering over a connection that works.
    spec = subscription_spec(
        unique_name("librefused"), make_topic(2), Endpoint("http://127.0.0.1:9/")
    )
    SubscriptionService(catalog).create(spec)
    consumer = Consumer(spec.name, settings, options=Options(session_timeout_ms=1_000)).start()
    try:
        wait_for(lambda: consumer.health()["state"] == "failed", "the member to fail", consumer)
        error = consumer.health()["error"]
        assert "InvalidSessionTimeout" in error, error
        assert "cannot connect" not in error, error
        assert f"Kafka at {settings.bootstrap}" in error, error
    finally:
        consumer.stop()
