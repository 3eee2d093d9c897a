"""Batched delivery (`delivery.mode: batch`) against a real HTTP server on loopback.

First the engine alone (`HttpDeliverer` with a batch policy driving `GroupRun`s, as a shard's
delivery task does; no Kafka): per-message answers of a 207, retries in place, dead letters,
per-group order, batch limits, and malformed answers. Then a shard end to end (real Kafka,
Delta and Spark): per-message failures go through the RQ and the DLQ, order per group holds, a
malformed 207 fails its whole request.

Group order in batch mode is what it is in single mode: a request carries at most one message
per group, so the endpoint's records show each group's messages in separate requests, and a
group's first successes in produce order.
"""

from __future__ import annotations

import json
import random
import signal
import time
import uuid
from collections import defaultdict
from typing import Any

import pytest

from varadhi.core import messages as m
from varadhi.core.batching import BATCH_SIZE_HEADER
from varadhi.core.delivery import HttpDeliverer
from varadhi.core.group_state import Entry, GroupRun, RunCounts
from varadhi.core.messages import H_TICK
from varadhi.core.policies import DeliveryPolicy, Endpoint, RetryPolicy
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import Record, TestEndpoint
from varadhi.testing.harness import read_queue

# Retries in place (in the task) after 50 ms, at most 3 attempts.
IN_PLACE = RetryPolicy(
    max_attempts=3, backoff="fixed", min_backoff_ms=50, jitter=0.0, in_place_window_ms=2_000
)


@pytest.fixture
def endpoint():
    started: list[TestEndpoint] = []

    def make(**kw: Any) -> TestEndpoint:
        ep = TestEndpoint(**kw)
        ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        ep.stop()


def group_runs(groups: int, per_group: int, policy: RetryPolicy = IN_PLACE, ungrouped=False):
    """`GroupRun`s over new entries `g<i>.<n>` (body `body <id>`), as a delivery task has them."""
    counts = RunCounts()
    runs = []
    for g in range(groups):
        entries = [
            Entry(
                origin=m.Origin(0, g, n),
                msg_id=f"g{g}.{n:02d}",
                group_id=None if ungrouped else f"g{g}",
                location="new",
                value=f"body g{g}.{n:02d}".encode(),
                source=f"orders.0/{g}/{n}",
            )
            for n in range(per_group)
        ]
        runs.append(GroupRun(entries, policy, "block", clock, random.Random(1), counts))
    return runs, counts


def clock() -> int:
    return int(time.time() * 1000)


def deliver(url: str, runs, max_in_flight: int = 8, **policy: Any):
    delivery = DeliveryPolicy(mode="batch", **policy)
    with HttpDeliverer(Endpoint(url=url), max_in_flight, delivery) as http:
        return http.run(runs, linger_s=IN_PLACE.in_place_window_ms / 1000)


def first_successes(records: list[Record]) -> dict[str, list[str]]:
    """Per group, the ids of the first 2xx of each message, in arrival order."""
    seen: set[str] = set()
    out: dict[str, list[str]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r.seq):
        if r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            out[r.group_id].append(r.message_id)
    return out


def batches(records: list[Record]) -> dict[int, list[Record]]:
    out: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        out[r.batch].append(r)
    return out


# -- the engine --------------------------------------------------------------------------------


def test_per_message_answers_retry_dead_letter_and_keep_group_order(endpoint):
    """20 groups of 6 in batches of at most 8. A 207 fails some messages: one is retried in
    place (503, then 200), one is dead-lettered (404: its group stops behind it, block mode),
    one is retried until its attempts are used up (500 x3). Every other message arrives once."""
    ep = endpoint()
    ep.set_script("g3.01", [503])
    ep.set_script("g5.02", [404])
    ep.set_script("g7.00", [500, 500, 500])
    runs, counts = group_runs(20, 6)
    stats = deliver(ep.url, runs, max_messages=8)

    records = ep.records()
    per_request = batches(records)
    assert stats.requests == len(per_request) and all(r.batch is not None for r in records)
    for entries in per_request.values():
        groups = [r.group_id for r in entries]
        assert len(groups) <= 8 and len(set(groups)) == len(groups), "one message per group"
    assert any(len(e) == 8 for e in per_request.values())
    assert 207 in stats.by_status  # mixed answers came as multi-status

    expected = {f"g{g}": [f"g{g}.{n:02d}" for n in range(6)] for g in range(20)}
    expected["g5"] = expected["g5"][:2]  # g5.02 dead-lettered: the rest waits behind it
    expected["g7"] = []  # g7.00 dead-lettered after 3 attempts
    assert {g: ids for g, ids in first_successes(records).items()} == {
        g: ids for g, ids in expected.items() if ids
    }
    attempts = defaultdict(list)
    for r in sorted(records, key=lambda r: r.seq):
        attempts[r.message_id].append((r.attempt, r.status))
    assert attempts["g3.01"] == [(1, 503), (2, 200)]
    assert attempts["g5.02"] == [(1, 404)] and "g5.03" not in attempts
    assert attempts["g7.00"] == [(1, 500), (2, 500), (3, 500)] and "g7.01" not in attempts
    # A failed message's group sent nothing more until its retry succeeded.
    seq = {(r.message_id, r.attempt): r.seq for r in records}
    assert seq[("g3.02", 1)] > seq[("g3.01", 2)]

    assert counts.delivered == 120 - 4 - 6
    outs = {(o.target, o.entry.msg_id, o.entry.reason) for run in runs for o in run.outs}
    assert outs == {
        ("dlq", "g5.02", "fatal response 404"),
        ("dlq", "g7.00", "retries exhausted after 3 attempts: HTTP 500"),
    }


def test_a_malformed_207_fails_the_whole_request_then_its_messages_are_retried(endpoint):
    """The endpoint lists one message of the batch under an id the request did not carry and
    200 for the others: not one of them counts as delivered. All are retried and then delivered,
    each twice in all; the reason names the problem."""
    ep = endpoint()
    ep.set_script("g2.00", ["malformed"])
    runs, counts = group_runs(4, 2, policy=IN_PLACE)
    deliver(ep.url, runs, max_messages=10)

    records = sorted(ep.records(), key=lambda r: r.seq)
    first = [r for r in records if r.batch == 0]
    assert sorted(r.message_id for r in first) == ["g0.00", "g1.00", "g2.00", "g3.00"]
    tries = defaultdict(list)
    for r in records:
        tries[r.message_id].append(r.attempt)
    assert {i: tries[i] for i in ("g0.00", "g1.00", "g2.00", "g3.00")} == {
        i: [1, 2] for i in ("g0.00", "g1.00", "g2.00", "g3.00")
    }
    assert all(tries[f"g{g}.01"] == [1] for g in range(4))
    assert counts.delivered == 8 and counts.failures == 4 and counts.retried_in_place == 4


def test_an_invalid_answer_ends_in_the_dlq_with_a_clear_reason(endpoint):
    """Every answer to g0.00 is a malformed 207: each fails the whole request, g1.00 with it,
    until both have used up their attempts and are dead-lettered with the reason.

    The retries are due at once (no backoff), so after each answer both streams are asked again
    for the same next batch. With a backoff, each stream's due time is read from its own clock
    call: one a millisecond later than the other misses the other's wake-up and is sent alone
    (and accepted), so whether g1.00 shared g0.00's requests would depend on the clock."""
    ep = endpoint()
    ep.set_script("g0.00", ["malformed"] * 3)
    at_once = RetryPolicy(
        max_attempts=3, backoff="fixed", min_backoff_ms=0, jitter=0.0, in_place_window_ms=2_000
    )
    runs, counts = group_runs(2, 1, policy=at_once)
    deliver(ep.url, runs, max_messages=10)

    per_request = batches(ep.records())
    assert sorted(sorted((r.message_id, r.attempt) for r in e) for e in per_request.values()) == [
        [("g0.00", n), ("g1.00", n)] for n in (1, 2, 3)
    ]
    reasons = {o.entry.msg_id: (o.target, o.entry.reason) for run in runs for o in run.outs}
    reason = (
        "retries exhausted after 3 attempts: invalid_response (HTTP 207 multi-status answer "
        "lists id 'not-sent-g0.00', which the request did not carry)"
    )
    assert reasons == {"g0.00": ("dlq", reason), "g1.00": ("dlq", reason)}
    assert counts.delivered == 0 and counts.dead_lettered == 2


def test_batch_limits_format_and_headers(endpoint):
    """max_bytes bounds the body (a message larger than it goes alone); json_array bodies are
    JSON arrays with their content type; ungrouped messages fill batches; no id twice."""
    ep = endpoint(record_headers=False)
    runs, _ = group_runs(30, 1, ungrouped=True)
    runs[1:1] = group_runs(1, 1)[0]  # a second "g0.00" (a group's), right after the first
    big = Entry(m.Origin(1, 0, 0), "big", None, "new", b"x" * 3000, source="orders.1/0/0")
    runs.append(GroupRun([big], IN_PLACE, "block", clock, random.Random(1), RunCounts()))
    stats = deliver(ep.url, runs, max_messages=100, max_bytes=1024, format="json_array")

    per_request = batches(ep.records())
    assert stats.requests == len(per_request) >= 3
    assert sum(len(e) for e in per_request.values()) == 32
    for entries in per_request.values():
        ids = [r.message_id for r in entries]
        assert len(ids) == len(set(ids))
        if "big" in ids:
            assert ids == ["big"]
        else:
            assert sum(r.body_bytes + 1 for r in entries) <= 1024


def test_what_a_batch_request_looks_like_on_the_wire(endpoint):
    ep = endpoint(record_headers=True)
    received: list[bytes] = []
    original = ep._deliver_batch

    def keep(h, body):
        received.append(body)
        original(h, body)

    ep._deliver_batch = keep
    runs, _ = group_runs(2, 1)
    deliver(ep.url, runs)
    (body,) = received
    lines = body.decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "id": f"g{g}.00",
            "group": f"g{g}",
            "attempt": 1,
            "source": {"topic": "orders.0", "partition": g, "offset": 0},
            "value": f"body g{g}.00",
        }
        for g in range(2)
    ]
    headers = ep.records()[0].headers
    assert headers["Content-Type"] == "application/x-ndjson"
    assert headers[BATCH_SIZE_HEADER] == "2"


# -- a shard end to end ----------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.kafka
def test_a_batching_shard_retries_dead_letters_and_keeps_group_order(
    settings, catalog, spark, endpoint
):
    """One shard, batches of 10, retries through the RQ. Scripted: a 503 then 200 (retried via
    the RQ), a 404 (dead-lettered; its group blocked behind it), and a malformed 207 for one
    message (its whole request fails and is retried). Everything else arrives once."""
    ep = endpoint()
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"bd-{suffix}", f"bds-{suffix}"
    TopicService(catalog).create(topic, 4)
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": ep.url},
        "retry": {"max_attempts": 3, "min_backoff": "100ms", "jitter": 0, "in_place_window": 0},
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {"enabled": False},
        "delivery": {"mode": "batch", "max_messages": 10},
    }
    SubscriptionService(catalog).create(parse_spec(doc))
    groups = [f"c{i}" for i in range(12)]
    produced: dict[str, list[str]] = defaultdict(list)
    with Producer(topic, settings) as producer:
        for n in range(5):
            for g in groups:
                msg_id = f"{g}.{n}"
                producer.send(f"body of {msg_id}".encode(), group_id=g, message_id=msg_id)
                produced[g].append(msg_id)
        producer.flush(30)
    ep.set_script("c1.1", [503])
    ep.set_script("c2.2", [404])
    ep.set_script("c3.0", ["malformed"])

    job = ShardJob(name, 0, settings, spark=spark, stop_when_idle_s=2.0)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = job.run()
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert code == 0, f"shard run ended with {code}: {job.stats}"

    records = sorted(ep.records(), key=lambda r: r.seq)
    assert all(r.batch is not None for r in records)
    for entries in batches(records).values():
        assert len(entries) <= 10
        assert len({r.group_id for r in entries}) == len(entries), "one message per group"
    expected = {g: ids for g, ids in produced.items()}
    expected["c2"] = ["c2.0", "c2.1"]  # c2.2 dead-lettered: c2.3, c2.4 wait behind it
    assert first_successes(records) == expected
    tries = defaultdict(list)
    for r in records:
        tries[r.message_id].append((r.attempt, r.status))
    assert tries["c1.1"] == [(1, 503), (2, 200)]
    assert tries["c2.2"] == [(1, 404)] and "c2.3" not in tries
    # The malformed answer failed every message of c3.0's request: each was sent again.
    (bad,) = [r.batch for r in records if r.message_id == "c3.0" and r.attempt == 1]
    mates = [r.message_id for r in records if r.batch == bad]
    assert len(mates) > 1
    assert all([a for a, _ in tries[i]] == [1, 2] for i in mates)
    assert job.stats.delivered == 60 - 3

    dlq = read_queue(settings.bootstrap, f"{name}.dlq.0")
    assert [(r["headers"][m.H_MSG_ID], r["headers"][m.H_REASON]) for r in dlq] == [
        ("c2.2", "fatal response 404")
    ]
    rq = [r for r in read_queue(settings.bootstrap, f"{name}.rq.0") if H_TICK not in r["headers"]]
    retried = sorted(r["headers"][m.H_MSG_ID] for r in rq)
    assert retried == sorted(["c1.1", *mates])
    invalid = [r for r in rq if r["headers"][m.H_MSG_ID] == "c3.0"]
    assert (
        "invalid_response (HTTP 207 multi-status answer lists id"
        in invalid[0]["headers"][m.H_REASON]
    )
