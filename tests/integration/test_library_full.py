"""A library member at `max_pending` whose held messages all wait for retries in the RQ.

At `max_pending` a member stops reading the main topic (`Consumer._full`). If every message it
holds waits behind its key's retry, only reading that retry's copy back from the RQ lets any of
them go: the member must read the RQ on while it reads no more of the main topic.
"""

from __future__ import annotations

import pytest

from varadhi.core.policies import Endpoint
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.library import Consumer, Options
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.library import subscription_spec, wait_for

pytestmark = pytest.mark.kafka

MESSAGES = 36


def test_a_member_full_of_messages_behind_a_retry_reads_the_retry_and_goes_on(
    settings, catalog, unique_name
):
    """One key, 36 messages, `max_pending` 4: the first answers 503 once, so its copy goes to
    the RQ and the 3 messages read behind it (and itself, as a placeholder) fill the member.
    The copy is read back, delivered, and the key's other messages follow in order."""
    topic = unique_name("lib-full")
    TopicService(catalog).create(topic, 1)
    ids = [f"k-{n:02d}" for n in range(MESSAGES)]
    with TestEndpoint() as endpoint:
        endpoint.set_script(ids[0], [503])
        spec = subscription_spec(unique_name("lib"), topic, Endpoint(endpoint.url), shards=1)
        SubscriptionService(catalog).create(spec)
        with Producer(topic, settings) as producer:
            for msg_id in ids:
                producer.send(msg_id.encode(), group_id="k", message_id=msg_id)
            producer.flush()
        consumer = Consumer(spec.name, settings, options=Options(max_pending=4)).start()
        try:
            wait_for(
                lambda: consumer.counters()["delivered"] == MESSAGES,
                "every message of the key delivered",
                consumer,
            )
        finally:
            consumer.stop()
        delivered = [r.message_id for r in endpoint.records() if r.status == 200]
    assert delivered == ids, delivered
    assert consumer.counters()["retried"] == 1
