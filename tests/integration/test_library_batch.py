"""Batched delivery (`delivery.mode: batch`) by the library runtime, against the real broker and
a real HTTP endpoint: what the shards send in batch mode (docs/delivery.md), each message of a
batch settled on its own (a 207's per-message answers: a retry through the RQ, a dead letter
with its reason, a trace event per attempt, a key blocked behind its dead letter, the dedup
window remembering what a batch delivered), keys in order, and batches that carry many messages
but never two of one key."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from varadhi import Client
from varadhi.core import messages as m
from varadhi.core.batching import BATCH_SIZE_HEADER
from varadhi.core.group_state import OVER_LIMIT
from varadhi.core.policies import DeliveryPolicy, Endpoint, TracePolicy
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer, Options
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import first_successes, produce_rounds, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka


def test_batches_carry_many_keys_each_message_settled_on_its_own(
    settings, catalog, make_topic, unique_name
):
    """A backlog of 30 keys x 8 messages, delivered in batches of at most 20 by one member (4
    batches in flight). The endpoint answers g1-2 503 then 200 and g2-3 400 inside 207s: g1-2
    goes to the RQ and is delivered from it later, its key waiting; g2-3 goes to the DLQ with
    the reason (skip mode: g2 goes on); everything else is delivered once, each key in order."""
    with TestEndpoint(retry_after_s=0, record_headers=True) as endpoint:
        spec = library_spec(
            unique_name("lib"),
            make_topic(4),
            Endpoint(endpoint.url + "/hook"),
            delivery=DeliveryPolicy(mode="batch", max_messages=20, format="json_array"),
            trace=TracePolicy(3600 * 1000),
        )
        SubscriptionService(catalog).create(spec)
        endpoint.set_script("g1-2", [503, 200])
        endpoint.set_script("g2-3", [400])
        ids = produce_rounds(settings, spec.topic, 30, 0, 8)
        consumer = Consumer(spec.name, settings, options=Options(max_in_flight=4)).start()
        try:
            wait_for(
                lambda: (
                    consumer.counters()["delivered"] == len(ids) - 1
                    and consumer.counters()["pending"] == 0
                ),
                "delivery",
                consumer,
            )
        finally:
            consumer.stop()  # the trace's last events are written by now
        counts = consumer.counters()
        assert (counts["retried"], counts["dead_lettered"], counts["attempts"]) == (
            1,
            1,
            len(ids) + 1,
        )

        records = endpoint.records()
        firsts = first_successes(records)
        assert sorted(firsts) == sorted(i for i in ids if i != "g2-3")
        assert len([r for r in records if r.status == 200]) == len(ids) - 1  # none twice
        last: dict[str, int] = {}
        for r in sorted(firsts.values(), key=lambda r: r.seq):  # each key in produce order
            n = int(r.message_id.rsplit("-", 1)[1])
            assert n > last.get(r.group_id, -1), f"{r.message_id} after {last[r.group_id]}"
            last[r.group_id] = n

        batches: dict[int, list] = defaultdict(list)
        for r in records:
            assert r.batch is not None, r  # every request a batch
            batches[r.batch].append(r)
        sizes = [len(b) for b in batches.values()]
        assert max(sizes) == 20 and len(batches) < len(ids) / 4, sizes
        for b in batches.values():
            assert len({r.group_id for r in b}) == len(b)  # at most one message of a key
            assert b[0].headers[BATCH_SIZE_HEADER] == str(len(b))
            assert b[0].headers["Content-Type"] == "application/json"
        g1 = [(r.message_id, r.attempt, r.status) for r in records if r.group_id == "g1"]
        assert g1[:4] == [("g1-0", 1, 200), ("g1-1", 1, 200), ("g1-2", 1, 503), ("g1-2", 2, 200)]

        rq = read_queue(settings, f"{spec.rq_topic}.0")
        assert [(r["headers"][m.H_MSG_ID], r["headers"][m.H_ATTEMPTS]) for r in rq] == [
            ("g1-2", "1")
        ]
        dlq = read_queue(settings, f"{spec.dlq_topic}.0")
        assert [r["headers"][m.H_MSG_ID] for r in dlq] == ["g2-3"]
        assert dlq[0]["headers"][m.H_REASON] == "fatal response 400"

        client = Client(settings)
        steps = [(e["kind"], e.get("status"), e["next"]) for e in client.trace(spec.name, "g1-2")]
        assert steps == [("attempt", 503, "rq"), ("attempt", 200, "delivered")]
        assert [e["next"] for e in client.trace(spec.name, "g2-3")] == ["dlq"]


def test_block_mode_and_the_dedup_window_in_batches(settings, catalog, make_topic, unique_name):
    """Block mode: a fatal answer inside a 207 (g2-3) blocks its key, whose later messages go
    to the DLQ behind it unsent, while the other keys' batches go on. The dedup window: a
    message delivered in a batch is remembered, so a copy produced again is finished unsent."""
    with TestEndpoint() as endpoint:
        spec = library_spec(
            unique_name("lib"),
            make_topic(4),
            Endpoint(endpoint.url + "/hook"),
            delivery=DeliveryPolicy(mode="batch", max_messages=20),
            on_dead_letter="block",
            dedup_window_ms=600_000,
        )
        SubscriptionService(catalog).create(spec)
        endpoint.set_script("g2-3", [400])
        ids = produce_rounds(settings, spec.topic, 30, 0, 8)
        blocked = [f"g2-{n}" for n in range(4, 8)]
        consumer = Consumer(spec.name, settings, options=Options(max_in_flight=4)).start()
        try:
            wait_for(
                lambda: (
                    consumer.counters()["delivered"] == len(ids) - 5
                    and consumer.counters()["dead_lettered"] == 5
                ),
                "delivery",
                consumer,
            )
            produce_rounds(settings, spec.topic, 1, 0, 1)  # g0-0 again: the same message id
            wait_for(lambda: consumer.counters()["deduplicated"] == 1, "the copy", consumer)
        finally:
            consumer.stop()
        assert consumer.counters()["sidelined"] == len(blocked)
        records = endpoint.records()
        assert sorted(r.message_id for r in records) == sorted(i for i in ids if i not in blocked)
        assert max(Counter(r.batch for r in records).values()) > 1
        dlq = read_queue(settings, f"{spec.dlq_topic}.0")
        reasons = {r["headers"][m.H_MSG_ID]: r["headers"][m.H_REASON] for r in dlq}
        assert reasons == {"g2-3": "fatal response 400", **dict.fromkeys(blocked, OVER_LIMIT)}
