"""A group blocked behind a dead letter keeps a bounded state (`blocked.max_held`), against the
real broker, Delta and an HTTP endpoint, with one in-process shard: what goes over the limit is
dead-lettered in order, and a rate-capped re-drive of the group delivers everything once, in
produce order, in portions, each message marked as re-driven. The decisions themselves are
unit-tested in tests/unit/test_group_state.py and tests/unit/test_redrive_pace.py."""

from __future__ import annotations

import pytest

from varadhi.cli import main as cli
from varadhi.core.group_state import OVER_LIMIT
from varadhi.core.redrive_pace import MAX_PORTION_S
from varadhi.kafka import dlq
from varadhi.ops import status
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

MAX_HELD = 5
RATE = 8  # messages a second: the 25 dead letters take several portions


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
    with TestEndpoint(script={"g00": [404]}, record_headers=True) as endpoint:
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

        # Re-driving the group at RATE messages a second brings back the head and everything
        # over the limit, at their places, a portion a batch: every message is delivered once,
        # in produce order, before later traffic (g30 waits behind what later portions take).
        assert cli(["dlq", "unsideline", spec.name, "--group-ids", "g", "--rate", f"{RATE}/s"]) == 0
        (op_id,) = dlq.redrives(catalog.snapshot(), spec.name)
        produce(settings, spec.topic, [("g", "g30")])

        def redriven() -> list[str]:
            """The ids of the requests marked as re-driven by this re-drive, in order."""
            return [
                r.message_id
                for r in endpoint.records()
                if {k.lower(): v for k, v in r.headers.items()}.get("x-varadhi-redriven") == op_id
            ]

        after_batch: list[int] = []  # re-driven requests sent so far, after each batch
        partly: list[set[str]] = []  # what `dlq list` showed after the first portion
        jobs: list[ShardJob] = []

        def portions() -> list[int]:
            return [b - a for a, b in zip([0, *after_batch], after_batch, strict=False) if b > a]

        def on_batch(_last, _summary) -> None:
            after_batch.append(len(redriven()))
            if not partly and 0 < after_batch[-1] < 25:
                partly.append({p["state"] for p in dlq.list_parked(catalog, spec.name)})
            if len(jobs) == 1 and len(portions()) == 2:
                jobs[0].request_stop()

        # The shard stops after its second portion and starts again: it goes on from the
        # progress it committed, reading its DLQ partitions once more for what is left.
        for _ in range(2):
            jobs.append(ShardJob(spec.name, 0, settings, spark=spark, stop_when_idle_s=2))
            jobs[-1].batch_hooks.append(on_batch)
            assert jobs[-1].run() == 0
            assert len(jobs) == 2 or after_batch[-1] < 25  # the first stopped part-way
        assert delivered(endpoint, "g") == [*ids, "g30"]
        assert redriven() == ["g00", *ids[6:]]  # the dead letters only, each once
        assert len(portions()) >= 3 and max(portions()) <= RATE * MAX_PORTION_S, portions()
        assert partly == [{"redriven", "redrive requested"}]
        assert state_of(spark, settings, spec.name) == []
        assert {p["state"] for p in dlq.list_parked(catalog, spec.name)} == {"redriven"}
        assert dlq.redrives(catalog.snapshot(), spec.name)[op_id]["done"] == [0]
