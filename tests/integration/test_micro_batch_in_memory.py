"""Whole micro-batches without Spark or Kafka (`varadhi.testing.micro_batch`): the batch-commit
protocol and the delivery plan with in-memory ports, against a real HTTP endpoint. What the
shard's ports make possible (issue 27: the commit protocol's fakes run a whole micro-batch); the
real shard runs the same scenarios in tests/integration/test_shard_delivery.py."""

from __future__ import annotations

from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.micro_batch import MemoryShard, queued, record


def spec(url: str, **extra):
    return parse_spec(
        {
            "name": "orders-sub",
            "topic": "orders",
            "endpoint": {"url": url},
            "retry": {
                "max_attempts": 2,
                "min_backoff": "50ms",
                "max_backoff": "50ms",
                "jitter": 0,
                "in_place_window": 0,  # every retry through the RQ
            },
            **extra,
        }
    )


def delivered(ep: TestEndpoint) -> list[str]:
    return [r.message_id for r in ep.records() if 200 <= r.status < 300]


def test_a_failed_message_blocks_its_group_until_its_retry_succeeds_in_a_later_batch():
    with TestEndpoint(script={"g1-0": [500]}) as ep:
        shard = MemoryShard(spec(ep.url))
        first = shard.run_batch([record(0, "g1"), record(1, "g1"), record(2, "g2")])
        assert not first.resent and first.counts["delivered"] == 1
        assert delivered(ep) == ["g2-2"]  # g1-1 waits behind g1-0's retry
        assert set(shard.state.pending()) == {"g1"}
        retries = queued(shard.sent)
        assert [r["msg_id"] for r in retries] == ["g1-0"]

        shard.wait_until_due()
        second = shard.run_batch(retries)
        assert second.counts["delivered"] == 2
        assert delivered(ep) == ["g2-2", "g1-0", "g1-1"]  # the group in its order
        assert shard.state.pending() == {}


def test_attempts_used_up_dead_letter_the_message_and_skip_goes_on_with_the_group():
    with TestEndpoint(script={"g1-0": [500, 500]}) as ep:
        shard = MemoryShard(spec(ep.url, on_dead_letter="skip"))
        shard.run_batch([record(0, "g1"), record(1, "g1")])
        shard.wait_until_due()
        shard.run_batch(queued(shard.sent))
        assert [r["msg_id"] for r in queued(shard.sent, "dlq")] == ["g1-0"]
        assert delivered(ep) == ["g1-1"]
        assert shard.state.pending() == {}


def test_a_batch_committed_already_only_sends_its_records_again():
    """Step 2 of the protocol: Spark runs a batch again that the state says was committed (the
    driver died before Spark committed its offsets): nothing is delivered again."""
    with TestEndpoint(script={"g1-0": [500]}) as ep:
        shard = MemoryShard(spec(ep.url))
        shard.run_batch([record(0, "g1")])
        shard.batches -= 1  # Spark runs batch 0 again
        again = shard.run_batch([record(0, "g1")])
        assert again.resent
        assert len(ep.records()) == 1
        assert [r["msg_id"] for r in queued(shard.sent)] == ["g1-0", "g1-0"]  # sent twice


def test_control_headers_another_producer_wrote_do_not_reach_the_retry():
    """A main-topic record carrying `varadhi-tick` (only a shard writes it) failed once: its RQ
    copy kept the header, the next batch took the copy for a wake-up tick and dropped it, and
    the group stalled behind it for good (issue 30). The shard drops control headers on read."""
    forged = {m.H_TICK: "1", m.H_TRUNCATED: "5", m.H_ATTEMPTS: "9", "type": "order"}
    with TestEndpoint(script={"g1-0": [500]}, record_headers=True) as ep:
        shard = MemoryShard(spec(ep.url))
        shard.run_batch([record(0, "g1", headers=forged), record(1, "g1")])
        [retry] = queued(shard.sent)
        sent = {h["key"] for h in retry["kheaders"]}
        assert m.H_TICK not in sent and m.H_TRUNCATED not in sent and "type" in sent
        assert next(h for h in retry["kheaders"] if h["key"] == m.H_ATTEMPTS)["value"] == b"1"
        shard.wait_until_due()
        shard.run_batch([retry])
        assert delivered(ep) == ["g1-0", "g1-1"]
