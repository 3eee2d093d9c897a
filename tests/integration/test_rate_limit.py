"""`endpoint.max_rate` in a shard against the real broker, Delta and an HTTP endpoint: the shard's
delivery tasks pace their requests at its share of the limit (docs/delivery.md, "Rate limit").
How close the shards stay to the limit, and how fast they come back after 429s, is
bench/rate_limit.py's to measure."""

from __future__ import annotations

import pytest

from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_a_shard_paces_its_deliveries_at_its_share_of_the_limit(settings, spark, make_subscription):
    """60 messages at 20 a second over 2 shards: shard 0's 30 (one group per partition... all
    of them here, one task) take at least 29 paces of 1/10 s. A lower bound only: a slower
    machine makes the span longer, never shorter (pacing never catches up with a burst)."""
    with TestEndpoint() as endpoint:
        spec = make_subscription(
            endpoint.url,
            shards=2,
            endpoint={"url": endpoint.url, "max_rate": 20},
            consumption={"trigger_interval": "100ms", "concurrency": 1},
        )
        messages = [(f"g{i % 6}", f"m{i:02d}") for i in range(60)]
        produce(settings, spec.topic, messages)
        run_until_idle(settings, spark, spec.name, shard=0)
        first = [r.received_ms for r in endpoint.records() if r.status < 300]
        assert len(first) >= 20  # the groups of shard 0's partition
        span_s = (max(first) - min(first)) / 1000
        assert span_s >= (len(first) - 1) / 10 * 0.99, (len(first), span_s)
        run_until_idle(settings, spark, spec.name, shard=1)
        assert sorted(delivered(endpoint)) == sorted(m for _, m in messages)
