"""The library runtime's dedup window (`dedup_window`, `varadhi.library.dedup`) against the real
broker and a real HTTP endpoint: a message whose id (or, without one, whose payload) was
delivered within the window is finished unsent and counted, also by a member started later
(it reads the dedup topic before it hands anything out); `subscription delete` deletes the
topic."""

from __future__ import annotations

import pytest
from kafka import KafkaProducer

from varadhi.cli import main as cli
from varadhi.core import messages as m
from varadhi.core.policies import Endpoint
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer
from varadhi.library.dedup_topic import topic_name
from varadhi.ops.lifecycle import existing_topics
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered
from varadhi.testing.library import produce_ids, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka


def test_a_message_delivered_within_the_window_is_not_delivered_again_by_any_member(
    settings, catalog, make_topic, unique_name
):
    # a-1 is delivered from the RQ (its first attempt answered 503): remembered all the same
    with TestEndpoint(script={"a-1": [503]}) as endpoint:
        spec = library_spec(
            unique_name("lib"),
            make_topic(4),
            Endpoint(endpoint.url + "/hook"),
            dedup_window_ms=600_000,
        )
        SubscriptionService(catalog).create(spec)
        first = [f"{g}-{n}" for n in range(3) for g in ("a", "b")]
        produce_ids(settings, spec.topic, first)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: len(delivered(endpoint)) == 6, "the first six delivered", consumer)
            # copies of two delivered messages, then a new one of each key (order: after them)
            produce_ids(settings, spec.topic, ["a-1", "b-2", "a-3", "b-3"])
            # without a message id: the payload is the id (the bodies are the same); on one
            # partition, so one after the other (copies in two slots' queues may be handed out
            # at the same time, before either is remembered: at least once)
            raw = KafkaProducer(bootstrap_servers=settings.bootstrap)
            for _ in range(2):
                raw.send(
                    f"{spec.topic}.0", b"same body", headers=[(m.H_GROUP_ID, b"c")], partition=0
                )
            raw.flush()
            raw.close()
            wait_for(
                lambda: (
                    consumer.counters()["deduplicated"] == 3
                    and {"a-3", "b-3"} <= set(delivered(endpoint))
                ),
                "two copies and a same payload deduplicated, the new ones delivered",
                consumer,
            )
            ids = delivered(endpoint)
            assert sorted(i for i in ids if i in first) == sorted(first), ids  # each once
            bodies = [r for r in endpoint.records() if r.group_id == "c" and r.status < 300]
            assert len(bodies) == 1, bodies
        finally:
            consumer.stop()

        # A member started afterwards knows what was delivered before it (the dedup topic).
        produce_ids(settings, spec.topic, ["a-0", "b-4"])
        later = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: "b-4" in delivered(endpoint), "the new message", later)
            wait_for(lambda: later.counters()["deduplicated"] == 1, "a-0 deduplicated", later)
            assert delivered(endpoint).count("a-0") == 1, delivered(endpoint)
        finally:
            later.stop()
        assert existing_topics(settings, [topic_name(spec.name)]) == [topic_name(spec.name)]
        assert cli(["subscription", "delete", spec.name]) == 0
        assert existing_topics(settings, [topic_name(spec.name)]) == []
