"""When a shard wakes its own query (`varadhi.spark.shard.ticks.tick_due`, pure). The tick records
themselves run in tests/integration (parked retries falling due with no new input)."""

from __future__ import annotations

from varadhi.spark.shard.ticks import REDRIVE_TICK_MS, tick_due


def test_one_tick_per_due_time_and_none_when_a_batch_started_since():
    assert not tick_due(999, 1_000, -1, redrive_waiting=False)  # not due yet
    assert tick_due(1_000, 1_000, -1, redrive_waiting=False)
    assert tick_due(1_500, 1_000, 900, redrive_waiting=False)  # the last batch was before it
    assert not tick_due(1_500, 1_000, 1_000, redrive_waiting=False)  # a batch ran since
    assert not tick_due(10**12, None, -1, redrive_waiting=False)  # nothing parked
    assert tick_due(0, 0, -1, redrive_waiting=False)  # before any batch a due time of 0 ticks


def test_a_waiting_redrive_ticks_every_interval_since_the_last_batch():
    assert not tick_due(5_000 + REDRIVE_TICK_MS - 1, None, 5_000, redrive_waiting=True)
    assert tick_due(5_000 + REDRIVE_TICK_MS, None, 5_000, redrive_waiting=True)
    # A re-drive waiting overrides the due-time rule (which would not tick here).
    assert not tick_due(5_100, 1_000, 5_000, redrive_waiting=True)
