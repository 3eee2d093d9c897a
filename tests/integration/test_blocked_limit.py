"""A group blocked behind a dead letter keeps a bounded state (`blocked.max_held`), against the
real broker, Delta and an HTTP endpoint, with one in-process shard: what goes over the limit is
dead-lettered in order, and a re-drive of the group delivers everything once, in produce order.
The decisions themselves are unit-tested in tests/unit/test_group_state.py."""

from __future__ import annotations

import pytest

from varadhi.cli import main as cli
from varadhi.core.group_state import OVER_LIMIT
from varadhi.kafka import dlq
from varadhi.ops import status
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

MAX_HELD = 5


def state_of(spark, settings, name: str) -> list[tuple[str, str]]:
    """(message id, location) of the shard's pending rows, in produce order."""
    path = f"{settings.warehouse}/{name}/state/s1/shard-0"
    frame = spark.read.format("delta").load(path).toPandas()
    rows = frame[frame["kind"] == "pending"].sort_values("origin_offset")
    return list(zip(rows["msg_id"], rows["location"], strict=True))


def test_a_blocked_group_stays_bounded_and_a_redrive_delivers_all_in_order(
    settings, spark, make_subscription, catalog
):
    ids = [f"g{i:02d}" for i in range(30)]
    with TestEndpoint(script={"g00": [404]}) as endpoint:
        # Small micro-batches: the group goes over its limit in one and stays over it in the
        # next ones, where only the mark is left to keep it blocked.
        spec = make_subscription(
            endpoint.url,
            blocked={"max_held": MAX_HELD},
            consumption={"trigger_interval": "100ms", "max_messages_per_batch": 8},
        )
        produce(settings, spec.topic, [("g", i) for i in ids] + [("other", "o1")])
        job = run_until_idle(settings, spark, spec.name, idle_s=2)
        assert job.stats.batches >= 3
        assert delivered(endpoint, "g") == [] and delivered(endpoint, "other") == ["o1"]
        # The head, MAX_HELD bodies behind it, and the overflow mark; the rest went to the DLQ,
        # in order, with their reason.
        bounded = [("g00", "dlq"), *((i, "held") for i in ids[1:6]), ("g06", "dlq")]
        assert state_of(spark, settings, spec.name) == bounded
        parked = dlq.list_parked(catalog, spec.name)
        assert [p["msg_id"] for p in parked] == ["g00", *ids[6:]]
        assert {p["reason"] for p in parked[1:]} == {OVER_LIMIT}
        assert job.stats.dead_lettered == 1 + len(ids[6:])
        shard = status.collect(catalog, spec.name)["shards"][0]
        assert shard["blocked"] == [
            {
                "group": "g",
                "head": "g00",
                "where": "dlq",
                "reason": parked[0]["reason"],
                "waiting": len(bounded),
            }
        ]

        # Re-driving the group brings back the head and everything over the limit, at their
        # places: every message is delivered once, in produce order, before later traffic.
        assert cli(["dlq", "unsideline", spec.name, "--group-ids", "g"]) == 0
        produce(settings, spec.topic, [("g", "g30")])
        run_until_idle(settings, spark, spec.name, idle_s=2)
        assert delivered(endpoint, "g") == [*ids, "g30"]
        assert state_of(spark, settings, spec.name) == []
        assert {p["state"] for p in dlq.list_parked(catalog, spec.name)} == {"redriven"}
