"""The circuit breaker end to end: a real shard (in a thread of this process), real Kafka and
Delta, and a real endpoint that goes down while messages flow and comes back.

Timeline: healthy traffic is delivered; the endpoint starts answering 503 (Retry-After: 1) to
everything and more messages arrive; the circuit opens (status shows it); while it is open new
groups produce; a half-open probe (which makes no retries in place) fails and the circuit opens
again for twice as long; the endpoint comes back and more messages arrive; the next probe closes
the circuit and the backlog drains. Judged from outside: the endpoint's request log against the
transitions the shard published to the progress topic, the RQ's due times, and `varadhi status`.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from typing import Any

import pytest

from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import progress
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import status
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import Record, TestEndpoint
from varadhi.testing.harness import read_queue, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

PROBES = 3
OPEN_FOR_MS = 1_500
MAX_OPEN_FOR_MS = 3_000
RETRY_AFTER_S = 1


def produce(settings, topic: str, produced: dict[str, list[str]], prefix: str, groups: int, n: int):
    with Producer(topic, settings) as producer:
        for i in range(n):
            for g in range(groups):
                group, msg_id = f"{prefix}{g}", f"{prefix}{g}.{i:02d}"
                producer.send(msg_id.encode(), group_id=group, message_id=msg_id)
                produced.setdefault(group, []).append(msg_id)
        producer.flush(30)


def circuit_history(read_records, settings, name: str) -> list[dict[str, Any]]:
    """Every circuit state the shard published, in order, each once (by state and since)."""
    out: list[dict[str, Any]] = []
    for r in read_records(progress.progress_topic(settings)):
        if r.key != f"{name}/0".encode():
            continue
        circuit = json.loads(r.value).get("circuit")
        key = circuit and (circuit["state"], circuit["since_ms"])
        if key and (not out or (out[-1]["state"], out[-1]["since_ms"]) != key):
            out.append(circuit)
    return out


def test_the_circuit_opens_probes_and_closes_around_an_outage(
    settings, catalog, spark, unique_name, read_records, varadhi_cli
):
    ep = TestEndpoint(mix={"503": 1}, retry_after_s=RETRY_AFTER_S)
    ep.start()
    topic, name = unique_name("cb"), unique_name("cb-sub")
    # One main-topic and one RQ partition: Spark's rate limit gives each partition with new
    # records at least one, so a probe batch reads at most PROBES + 1 records.
    TopicService(catalog).create(topic, 1)
    spec = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": ep.url},
        "rq_partitions": 1,
        "retry": {
            "max_attempts": 50,
            "backoff": "fixed",
            "min_backoff": "300ms",
            "max_backoff": "300ms",
            "jitter": 0,  # retries in place on (the default window): a probe makes none
        },
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {
            "failure_rate": 0.5,
            "min_requests": 5,
            "window": "5s",
            "open_for": f"{OPEN_FOR_MS}ms",
            "max_open_for": f"{MAX_OPEN_FOR_MS}ms",
            "probes": PROBES,
        },
    }
    SubscriptionService(catalog).create(parse_spec(spec))
    produced: dict[str, list[str]] = {}

    job = ShardJob(name, 0, settings, spark=spark, stop_when_idle_s=3.0)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(code=job.run()), daemon=True)

    def shard_circuit() -> dict[str, Any]:
        return status.collect(catalog, name)["shards"][0].get("circuit") or {}

    seen_open = []
    try:
        produce(settings, topic, produced, "a", groups=4, n=5)  # healthy traffic
        thread.start()
        wait_for(lambda: sum(r.status == 200 for r in ep.records()) >= 20, 120, "healthy run")

        ep.fail_rate = 1.0  # down: 503 to everything
        produce(settings, topic, produced, "b", groups=6, n=4)

        def opened() -> bool:
            circuit = shard_circuit()
            if circuit.get("state") == "open":
                seen_open.append(circuit)
            return bool(seen_open)

        wait_for(opened, 120, "status shows the circuit open")
        produce(settings, topic, produced, "n", groups=8, n=2)  # new groups while it is open
        wait_for(lambda: shard_circuit().get("consecutive_opens", 0) >= 2, 120, "a failed probe")
        ep.fail_rate = 0.0  # back
        produce(settings, topic, produced, "c", groups=4, n=3)
        thread.join(240)
        assert not thread.is_alive(), "the shard did not drain the backlog"
    finally:
        if thread.is_alive():
            job.request_stop()
            thread.join(60)
        ep.stop()
    assert result.get("code") == 0, f"shard run ended with {result}: {job.stats}"

    records = sorted(ep.records(), key=lambda r: r.seq)
    history = circuit_history(read_records, settings, name)
    states = [c["state"] for c in history]
    assert states[0] == "closed" and states[-1] == "closed", states
    opens = [c for c in history if c["state"] == "open"]
    assert len(opens) >= 2, states
    assert seen_open[0]["state"] == "open"

    # Open for 1.5 s, then twice as long after a failed probe, at most 3 s.
    for n, c in enumerate(opens, start=1):
        assert c["consecutive_opens"] == n
        expected = min(MAX_OPEN_FOR_MS, OPEN_FOR_MS * 2 ** (n - 1))
        assert c["open_until_ms"] - c["since_ms"] == expected

    # Every open is followed by a half-open, which ends in open or closed. Nothing reaches the
    # endpoint while open. Half-open, the shard reads at most PROBES (+1) new records, so it
    # sends at most that many messages of groups it never sent before; while the endpoint is
    # still down, a probe also retries at most PROBES parked messages that are due.
    for i, c in enumerate(history):
        if c["state"] == "closed":
            continue
        nxt = history[i + 1]
        during = [r for r in records if c["since_ms"] < r.received_ms < nxt["since_ms"]]
        seen = {r.group_id for r in records if r.received_ms <= c["since_ms"]}
        shown = [(r.message_id, r.attempt, r.status) for r in during]
        if c["state"] == "open":
            assert nxt["state"] == "half_open", states
            assert nxt["since_ms"] >= c["open_until_ms"]
            assert during == [], f"requests while open: {shown}"
        else:
            assert nxt["state"] in ("open", "closed"), states
            assert len([r for r in during if r.group_id not in seen]) <= PROBES + 1, shown
            if nxt["state"] == "open":
                assert len(during) <= 2 * PROBES + 1, shown
            # A probe's first attempts decide: no message is sent twice in one probe.
            ids = [r.message_id for r in during]
            assert len(ids) == len(set(ids)), f"a retry in place in a probe: {shown}"
    last_open = opens[-1]
    assert any(r.status == 200 for r in records if r.received_ms > last_open["open_until_ms"])

    # Every message delivered, in produce order per group, nothing dead-lettered.
    firsts: dict[str, Record] = {}
    for r in records:
        if r.status == 200:
            firsts.setdefault(r.message_id, r)
    assert set(firsts) == {i for ids in produced.values() for i in ids}
    for group, ids in produced.items():
        assert sorted(ids, key=lambda i: firsts[i].seq) == ids, group
    assert read_queue(settings.bootstrap, f"{name}.dlq.0") == []

    # No retry before its due time: each RQ record's next attempt came after its due time, and
    # each attempt at least Retry-After after the one before.
    attempts: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        attempts[r.message_id].append(r)
    retried = 0
    for rq in read_queue(settings.bootstrap, f"{name}.rq.0"):
        h = rq["headers"]
        if m.H_MSG_ID not in h:
            continue  # the shard's wake-up ticks
        n, due = int(h[m.H_ATTEMPTS]), int(h[m.H_DUE_MS])
        [following] = [r for r in attempts[h[m.H_MSG_ID]] if r.attempt == n + 1]
        assert following.received_ms >= due
        retried += 1
    assert retried > 0
    # Due times are whole milliseconds of the shard's clock, taken when it read the answer: an
    # attempt comes at least Retry-After after the one before, less under 1 ms of that rounding
    # (the endpoint stamps requests in fractions of a millisecond).
    for tries in attempts.values():
        for a, b in zip(tries, tries[1:], strict=False):
            assert b.received_ms - a.received_ms > RETRY_AFTER_S * 1000 - 1

    # Status shows the circuit per shard, in text and JSON.
    code, out, _ = varadhi_cli("status", name)
    assert code == 0 and "circuit" in out.splitlines()[1] and "closed" in out.splitlines()[2]
    code, out, _ = varadhi_cli("status", name, "--output", "json")
    assert json.loads(out)["shards"][0]["circuit"]["state"] == "closed"
