"""The library runtime's circuit breaker (varadhi.library.shared_circuit) against the real broker
and a real HTTP endpoint: a failing endpoint opens a member's circuit and it stops sending
(only probes go out), healed it closes and delivers everything, each key in order; two members
share the subscription's error rate (neither alone has enough attempts to open, together they
open both) and one member's successful probe closes the other; a handler's failures open it
too."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import replace

import pytest

from varadhi import Client
from varadhi.core.policies import CircuitPolicy, Endpoint
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer, Options, Success
from varadhi.library import Retry as HandlerRetry
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import FAST_RETRY, lost, order_violations, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka


def produce(settings, topic: str, groups: list[str], per_group: int) -> dict[str, list[str]]:
    """Messages `<group>-<n>`, round by round; each group's ids in produce order."""
    keys: dict[str, list[str]] = defaultdict(list)
    with Producer(topic, settings) as producer:
        for n in range(per_group):
            for g in groups:
                msg_id = f"{g}-{n}"
                producer.send(msg_id.encode(), group_id=g, message_id=msg_id)
                keys[g].append(msg_id)
        producer.flush()
    return keys


def circuit(consumer: Consumer) -> dict:
    return consumer.health()["circuit"]


def test_a_failing_endpoint_opens_the_circuit_only_probes_go_out_and_healed_all_is_delivered(
    settings, catalog, make_topic, unique_name
):
    policy = CircuitPolicy(
        min_requests=5, window_ms=10_000, open_for_ms=1_000, max_open_for_ms=2_000, probes=2
    )
    # retries due in about a second (the endpoint's Retry-After), never dead-lettered here
    retry = replace(FAST_RETRY, max_attempts=1_000)
    with TestEndpoint(retry_after_s=1) as endpoint:
        spec = library_spec(
            unique_name("lib"),
            make_topic(4),
            Endpoint(endpoint.url + "/hook"),
            circuit_breaker=policy,
            retry=retry,
        )
        SubscriptionService(catalog).create(spec)
        endpoint.outage(3_600)  # 503 to everything until healed below
        keys = produce(settings, spec.topic, [f"g{i}" for i in range(10)], per_group=10)
        max_in_flight = 4
        consumer = Consumer(
            spec.name, settings, options=Options(max_in_flight=max_in_flight)
        ).start()
        try:
            wait_for(lambda: circuit(consumer)["state"] == "open", "the circuit open", consumer)
            sent, opens = len(endpoint.records()), circuit(consumer)["consecutive_opens"]

            # Still failing: every half-open spell sends at most `probes` (2) requests, fails
            # and opens the circuit again (one more consecutive open). So between the two looks
            # at most the requests in flight when it opened (`max_in_flight`) and 2 per open
            # since arrive. Without the circuit the 100 messages, each retried about every
            # second, would send far more in those 3 s or more of spells (1 s, then 2 s, 2 s).
            def reopened_twice() -> bool:
                c = circuit(consumer)
                return c["state"] == "open" and c["consecutive_opens"] >= opens + 2

            wait_for(reopened_twice, "two failed probe spells", consumer)
            later = len(endpoint.records())  # read before the look below: an upper bound
            spells = circuit(consumer)["consecutive_opens"] - opens
            assert later - sent <= max_in_flight + policy.probes * spells, (sent, later, spells)
            # `varadhi status` shows the member's circuit (published at each move)
            members = Client(settings).status(spec.name)["library"]["members"]
            assert members[0]["circuit"]["state"] in ("open", "half_open")

            endpoint.outage(0)  # healed: the next probe succeeds and the circuit closes
            wait_for(
                lambda: not lost([i for ids in keys.values() for i in ids], endpoint.records(), []),
                "every message delivered",
                consumer,
            )
            assert circuit(consumer)["state"] == "closed"
            assert circuit(consumer)["healed_ms"] is not None  # closed by its own probe
        finally:
            consumer.stop()
        assert order_violations(endpoint.records(), keys) == []
        assert read_queue(settings, f"{spec.dlq_topic}.0") == []  # nothing dead-lettered


def test_members_open_on_the_subscriptions_error_rate_and_one_members_probe_closes_both(
    settings, catalog, make_topic, unique_name
):
    """40 messages, one attempt each (a 503 asks for a retry in 10 minutes): min_requests is
    40, so a member alone, with only its slot's share of them, never opens; with the other's
    counts shared, both do. Then a new key's message goes to one member, whose probe
    succeeds; the other, with nothing due to probe with, closes on that heal."""
    policy = CircuitPolicy(min_requests=40, window_ms=60_000, open_for_ms=500, probes=2)
    with TestEndpoint(retry_after_s=600) as endpoint:
        spec = library_spec(
            unique_name("lib"),
            make_topic(4),
            Endpoint(endpoint.url + "/hook"),
            circuit_breaker=policy,
            retry=FAST_RETRY,
        )
        SubscriptionService(catalog).create(spec)
        a = Consumer(spec.name, settings).start()
        b = None
        try:
            b = Consumer(spec.name, settings).start()
            members = (a, b)
            wait_for(
                lambda: [c.health()["slots"] for c in members] in ([[0], [1]], [[1], [0]]),
                "each member holding one slot",
                *members,
            )
            endpoint.outage(3_600)
            produce(settings, spec.topic, [f"g{i}" for i in range(40)], per_group=1)
            wait_for(
                lambda: all(circuit(c)["state"] != "closed" for c in members),
                "both circuits open",
                *members,
            )
            own = [c.counters()["attempts"] for c in members]
            assert sum(own) == 40 and all(0 < n < policy.min_requests for n in own), own
            assert all(c.counters()["delivered"] == 0 for c in members)

            endpoint.outage(0)
            before = [c.counters()["attempts"] for c in members]
            produce(settings, spec.topic, ["fresh"], per_group=1)
            wait_for(
                lambda: all(circuit(c)["state"] == "closed" for c in members),
                "both circuits closed",
                *members,
            )
            probed = [
                c for c, n in zip(members, before, strict=True) if c.counters()["attempts"] > n
            ]
            assert len(probed) == 1 and probed[0].counters()["delivered"] == 1
            other = b if probed[0] is a else a
            # the other made no attempt: it closed on the prober's heal, passed on unchanged
            assert circuit(other)["healed_ms"] == circuit(probed[0])["healed_ms"] is not None
        finally:
            a.stop()
            if b is not None:
                b.stop()


def test_a_handlers_failures_open_the_circuit_of_its_member_too(
    settings, catalog, make_topic, unique_name
):
    """A Python handler instead of HTTP: its `Retry` answers are the failures; open, the member's
    handler threads are given nothing but the probes; once it succeeds again, all is handled,
    each key in order."""
    policy = CircuitPolicy(
        min_requests=5, window_ms=10_000, open_for_ms=500, max_open_for_ms=1_000, probes=1
    )
    retry = replace(FAST_RETRY, min_backoff_ms=100, max_backoff_ms=200, max_attempts=1_000)
    spec = library_spec(
        unique_name("lib"),
        make_topic(4),
        Endpoint("http://127.0.0.1:9/unused"),
        circuit_breaker=policy,
        retry=retry,
    )
    SubscriptionService(catalog).create(spec)
    lock = threading.Lock()
    calls: list[str] = []
    handled: list[tuple[str, str]] = []
    failing = threading.Event()
    failing.set()

    def handle(message):
        with lock:
            calls.append(message.msg_id)
            if failing.is_set():
                return HandlerRetry(reason="down")
            handled.append((message.group_id, message.msg_id))
        return Success()

    keys = produce(settings, spec.topic, [f"g{i}" for i in range(10)], per_group=10)
    max_in_flight = 4
    consumer = Consumer(
        spec.name, settings, handler=handle, options=Options(max_in_flight=max_in_flight)
    ).start()
    try:
        wait_for(lambda: circuit(consumer)["state"] == "open", "the circuit open", consumer)
        called, opens = len(calls), circuit(consumer)["consecutive_opens"]

        def reopened_twice() -> bool:
            c = circuit(consumer)
            return c["state"] == "open" and c["consecutive_opens"] >= opens + 2

        wait_for(reopened_twice, "two failed probe spells", consumer)
        later = len(calls)
        spells = circuit(consumer)["consecutive_opens"] - opens
        # as over HTTP: the calls in progress when it opened, then one probe per spell (the
        # handler retried about every 100-200 ms without the circuit: hundreds meanwhile)
        assert later - called <= max_in_flight + policy.probes * spells, (called, later, spells)
        failing.clear()

        def all_handled() -> bool:
            with lock:
                return {i for _, i in handled} == {i for ids in keys.values() for i in ids}

        wait_for(all_handled, "every message handled", consumer)
        assert circuit(consumer)["state"] == "closed"
    finally:
        consumer.stop()
    by_key: dict[str, list[str]] = defaultdict(list)
    for group, msg_id in handled:
        by_key[group].append(msg_id)
    assert dict(by_key) == dict(keys)  # once each, in produce order
