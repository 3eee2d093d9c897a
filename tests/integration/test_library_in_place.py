"""Retries in place in the library runtime against the real broker and a real endpoint: a
failed attempt whose retry falls due within `retry.in_place_window` of the message's first
failure waits in the member as its key's head (`retry.retries_in_place`, as a shard's task
waits for it) and goes again once due, never before; one due later goes through the RQ.
Most library tests send every retry through the RQ (`testing.library.FAST_RETRY`)."""

from __future__ import annotations

import pytest

from varadhi.core.policies import Endpoint, RetryPolicy
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.library import Consumer
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import produce_ids, subscription_spec, wait_for

pytestmark = pytest.mark.kafka

#: A first retry 300 ms after the failure, the next 600 ms later: both within the default 2 s
#: window of the first failure; the third (1.2 s later, 2.1 s after it) is not.
RETRY = RetryPolicy(min_backoff_ms=300, max_backoff_ms=5_000, jitter=0.0, max_attempts=10)


def _subscription(catalog, unique_name, url: str, retry: RetryPolicy = RETRY) -> tuple[str, str]:
    topic = unique_name("lib-inplace")
    TopicService(catalog).create(topic, 1)
    spec = subscription_spec(unique_name("lib"), topic, Endpoint(url), shards=1, retry=retry)
    SubscriptionService(catalog).create(spec)
    return spec.name, topic


def test_a_retry_due_within_the_window_waits_in_the_member_never_before_its_due_time(
    settings, catalog, unique_name
):
    """k-0 fails twice (500), then succeeds: both retries wait in the member, nothing is
    written to the RQ, k's later messages wait behind it, another key goes on meanwhile."""
    ids = ["k-0", "k-1", "k-2", "o-0"]
    with TestEndpoint() as endpoint:
        endpoint.set_script("k-0", [500, 500])  # no Retry-After: the backoff alone
        name, topic = _subscription(catalog, unique_name, endpoint.url)
        produce_ids(settings, topic, ids)
        consumer = Consumer(name, settings).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] == 4, "every message", consumer)
            counts = consumer.counters()
        finally:
            consumer.stop()
        records = endpoint.records()
    assert counts["retried"] == 2 and counts["retried_in_place"] == 2, counts
    assert read_queue(settings, f"{name}.rq.0") == []
    attempts = [r for r in records if r.message_id == "k-0"]
    assert [(r.attempt, r.status) for r in attempts] == [(1, 500), (2, 500), (3, 200)]
    # Never before its due time: 300 ms, then 600 ms after each failure. One clock (this
    # process's wall clock): a failure is settled after its request arrived, and its due time
    # counts from that settling in whole ms (floored): at most 1 ms less than the backoff.
    pairs = zip(attempts, attempts[1:], strict=False)
    gaps = [later.received_ms - earlier.received_ms for earlier, later in pairs]
    assert gaps[0] >= 299 and gaps[1] >= 599, gaps
    k = [r.message_id for r in records if r.group_id == "k" and r.status == 200]
    assert k == ["k-0", "k-1", "k-2"]
    # Another key goes on meanwhile: o-0, handed out with k-0's first attempt, is delivered
    # before k-0's last one (not behind it). Not "after k-0's first attempt": both go out at
    # once, and on a loaded machine o-0's request may arrive first (it did, in a run with a core
    # kept busy). The margin is k-0's backoffs: 900 ms between its first attempt and its last.
    [o0] = [r for r in records if r.message_id == "o-0" and r.status == 200]
    assert o0.seq < attempts[-1].seq, (o0, attempts)


def test_a_retry_due_past_the_window_goes_through_the_rq(settings, catalog, unique_name):
    """A 503 with Retry-After 3 s: due after the window (2 s), so its copy goes to the RQ."""
    with TestEndpoint(retry_after_s=3) as endpoint:
        endpoint.set_script("k-0", [503])
        name, topic = _subscription(catalog, unique_name, endpoint.url)
        produce_ids(settings, topic, ["k-0", "k-1"])
        consumer = Consumer(name, settings).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] == 2, "both messages", consumer)
            counts = consumer.counters()
        finally:
            consumer.stop()
        ok = [r.message_id for r in endpoint.records() if r.status == 200]
    assert counts["retried"] == 1 and counts["retried_in_place"] == 0, counts
    [copy] = read_queue(settings, f"{name}.rq.0")
    assert copy["headers"]["varadhi-attempts"] == "1"
    assert ok == ["k-0", "k-1"]


def test_a_member_stopped_while_a_retry_waits_in_place_leaves_it_to_the_next(
    settings, catalog, unique_name
):
    """The waiting message's offset was never committed: the next member of the subscription
    delivers it, then the key's later message; nothing is lost."""
    slow = RetryPolicy(min_backoff_ms=1_500, max_backoff_ms=5_000, jitter=0.0, max_attempts=10)
    with TestEndpoint() as endpoint:
        endpoint.set_script("k-0", [503])
        name, topic = _subscription(catalog, unique_name, endpoint.url, slow)
        produce_ids(settings, topic, ["k-0", "k-1"])
        first = Consumer(name, settings).start()
        try:
            wait_for(lambda: first.counters()["retried_in_place"] == 1, "the retry", first)
        finally:
            first.stop()
        assert first.counters()["delivered"] == 0
        second = Consumer(name, settings).start()
        try:
            wait_for(lambda: second.counters()["delivered"] == 2, "both messages", second)
        finally:
            second.stop()
        ok = [r.message_id for r in endpoint.records() if r.status == 200]
    assert ok == ["k-0", "k-1"]
