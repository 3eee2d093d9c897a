"""The rate limit's pacing, split and adaptation (`varadhi.core.rate_limit`, pure, fake clocks)."""

from __future__ import annotations

import pytest

from varadhi.core.rate_limit import (
    FLOOR,
    Pacer,
    RateGovernor,
    TaskPace,
    shard_share,
    slot_share,
    throttled,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def sent_in(pacer: Pacer, clock: Clock, seconds: float, step: float = 0.001) -> int:
    """Messages a task sends in `seconds` when it sends whenever the pacer lets it."""
    end, n = clock.t + seconds, 0
    while clock.t < end:
        if pacer.wait_s() == 0:
            pacer.spend()
            n += 1
        else:
            clock.t += step
    return n


def test_a_pacer_spaces_messages_evenly_and_never_bursts_after_a_pause():
    clock = Clock()
    pacer = Pacer(100.0, clock)
    assert sent_in(pacer, clock, 1.0) in (100, 101)
    clock.t += 30.0  # nothing sent for a while: no catch-up burst afterwards
    assert sent_in(pacer, clock, 1.0) in (100, 101)
    pacer.spend(10)  # a batched request of ten messages costs ten paces
    assert pacer.wait_s() == pytest.approx(0.1, abs=0.011)


def test_throttled_answers_halve_a_task_s_pace_down_to_the_floor_and_it_recovers():
    clock = Clock()
    pacer = Pacer(100.0, clock)
    pacer.slow_down()
    assert pacer.rate == 50.0
    for _ in range(20):
        pacer.slow_down()
    assert pacer.rate == 100.0 * FLOOR
    clock.t += 5.0
    pacer.spend()  # 10% of the starting rate back per second without a throttled answer
    assert pacer.rate == pytest.approx(55.0)
    clock.t += 60.0
    pacer.spend()
    assert pacer.rate == 100.0  # never above where it started
    with pytest.raises(ValueError):
        Pacer(0.0, clock)


def test_the_limit_is_split_among_shards_and_tasks():
    assert shard_share(300.0, 3) == 100.0
    clock = Clock()
    governor = RateGovernor(shard_share(300.0, 3), clock)
    assert governor.task_pace(4) == TaskPace(25.0, 25.0)


def test_a_throttled_batch_halves_the_shard_s_rate_which_recovers_within_ten_seconds():
    clock = Clock()
    governor = RateGovernor(100.0, clock)
    governor.observe(throttled({"status_200": 50, "status_429": 3}))
    assert governor.rate == 50.0
    governor.observe(throttled({"status_503": 1}))
    assert governor.rate == 25.0
    clock.t += 5.0
    # The next batch's tasks start at 10% of the share a second back; their ceiling is the share.
    assert governor.task_pace(1) == TaskPace(100.0, pytest.approx(75.0))
    clock.t += 5.0
    assert governor.task_pace(1) == TaskPace(100.0, 100.0)  # the whole share, never more
    clock.t += 60.0
    assert governor.task_pace(2) == TaskPace(50.0, 50.0)
    for _ in range(30):
        governor.observe(1)
    assert governor.rate == 100.0 * FLOOR


def test_throttled_counts_429_and_503_answers_only():
    assert throttled({"status_429": 2, "status_503": 3, "status_500": 7, "records": 9}) == 5
    assert throttled({}) == 0


def test_a_library_member_takes_its_slots_part_and_members_never_sum_above_the_limit():
    assert slot_share(300.0, 2, 4) == 150.0
    assert slot_share(300.0, 0, 4) == 0.0
    assert slot_share(300.0, 4, 4) == 300.0
    for slots in (1, 2, 3, 7, 12):  # any split of the slots among members: at most the limit
        for held in range(slots + 1):
            both = slot_share(100.0, held, slots) + slot_share(100.0, slots - held, slots)
            assert both == pytest.approx(100.0)
    for held, slots in ((5, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError):
            slot_share(300.0, held, slots)


def test_a_reshared_pacer_sends_at_its_new_share_and_keeps_a_slow_down():
    clock = Clock()
    pacer = Pacer(100.0, clock)
    assert sent_in(pacer, clock, 1.0) in (100, 101)
    pacer.reshare(50.0)  # a rebalance took half the member's slots
    assert sent_in(pacer, clock, 2.0) in (100, 101, 102)
    pacer.slow_down()
    assert pacer.rate == 25.0
    pacer.reshare(100.0)  # slots back: the slow-down stays, scaled
    assert pacer.rate == 50.0
    clock.t += 60.0
    pacer.spend()
    assert pacer.rate == 100.0  # recovers to the new share, never above it
    with pytest.raises(ValueError):
        pacer.reshare(0.0)


def test_a_task_started_slowed_down_recovers_to_its_ceiling_within_ten_seconds():
    """A batch planned during a slow-down (the shard's rate halved twice) must not keep it for
    its whole run: its tasks start at the slowed rate and regain 10% of the ceiling a second,
    never passing it, so in no window do they send more than the ceiling allows."""
    clock = Clock()
    pacer = TaskPace(rate=50.0, start=12.5).pacer(clock)
    assert pacer.rate == 12.5
    clock.t += 5.0
    pacer.spend()
    assert pacer.rate == pytest.approx(37.5)
    clock.t += 3.0
    pacer.spend()
    assert pacer.rate == 50.0
    for _ in range(10):  # then at most the ceiling's 50 a second, one second at a time
        assert sent_in(pacer, clock, 1.0) <= 51
    assert Pacer(100.0, clock, start=0.0).rate == 100.0 * FLOOR  # never a stop
    assert Pacer(100.0, clock, start=500.0).rate == 100.0  # never above the ceiling
