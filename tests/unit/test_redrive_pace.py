"""A rate-capped DLQ re-drive's pace, order and barriers (`varadhi.core.redrive_pace`), and a
group driven through several portions with the shard's own pure pieces (the state copy, the
re-drive's rows, `GroupRun`), with a clock the test moves. The real shard's run:
tests/integration/test_blocked_limit.py."""

from __future__ import annotations

import random

import pandas as pd

from varadhi.core import messages as m
from varadhi.core.delivery import Outcome
from varadhi.core.group_state import OVER_LIMIT, Entry, GroupRun, RunCounts, merge
from varadhi.core.policies import RetryPolicy
from varadhi.core.redrive_pace import (
    MAX_PORTION_S,
    Pick,
    is_taken,
    pick_order,
    plan_portion,
    portion_size,
)
from varadhi.core.state_copy import StateCopy
from varadhi.core.state_frames import frame_of, state_rows
from varadhi.core.state_rows import Kind, RedriveProgress, entry_of, state_row
from varadhi.kafka.dlq import Parked, barrier_rows, pick_of, redrive_rows

DLQ = "s-dlq.0"
ORDER = [(DLQ, 0), (DLQ, 1)]


def pick(offset: int, group: str = "g", origin: int | None = None, partition: int = 0) -> Pick:
    o = offset if origin is None else origin
    return Pick(DLQ, partition, offset, group, m.Origin(0, 0, o), f"{group}{o}", group)


# -- pace ---------------------------------------------------------------------------------------


def test_the_first_portion_takes_a_seconds_worth_and_the_next_ones_what_time_allows():
    assert portion_size(10, None, 0.0, 5_000) == (10, 0.0)
    assert portion_size(10, 5_000, 0.0, 5_300) == (3, 0.0)
    assert portion_size(10, 5_000, 0.0, 5_000) == (0, 0.0)  # no time, nothing
    # at most a second's worth (MAX_PORTION_S), however long the shard was away
    assert portion_size(10, 5_000, 0.0, 65_000) == (int(10 * MAX_PORTION_S), 0.0)
    assert portion_size(10, 5_000, 0.0, 4_000) == (0, 0.0)  # a clock that went back


def test_a_share_below_one_a_second_carries_its_fractions_until_a_whole_message():
    # 1 message a second over 4 shards: a quarter a second each
    n, carry = portion_size(0.25, None, 0.0, 0)
    assert (n, carry) == (0, 0.25)
    taken, last = 0, 0
    for now in range(1_000, 9_001, 1_000):  # a batch a second
        n, new_carry = portion_size(0.25, last, carry, now)
        if n:
            last, carry = now, new_carry
        taken += n
    assert taken == 2  # 8 seconds at a quarter a second (the first quarter carried)
    assert portion_size(0.25, 0, 0.9, 2_000) == (1, 0.0)  # capped at one message


def test_over_any_stretch_of_batches_a_shard_takes_no_more_than_its_rate_allows():
    rate, last, carry, total = 7.0, None, 0.0, 0
    start = now = 1_000_000
    rng = random.Random(3)
    for _ in range(200):
        n, carry = portion_size(rate, last, carry, now)
        if n or last is None:
            last = now
        total += n
        now += rng.choice([50, 300, 900, 1_000, 2_500])
    elapsed_s = (now - start) / 1000
    assert total <= rate * (elapsed_s + MAX_PORTION_S)


# -- order and progress ---------------------------------------------------------------------------


def test_picks_go_partition_by_partition_and_a_record_written_twice_goes_back_once():
    picks = [pick(5, partition=1), pick(3), pick(1), pick(9, origin=1)]
    assert [(p.partition, p.offset) for p in pick_order(picks, ORDER)] == [(0, 1), (0, 3), (1, 5)]


def test_a_portion_ends_at_its_budget_and_records_how_far_it_took():
    picks = [pick(1), pick(4, "h"), pick(6), pick(2, "k", partition=1)]
    ends = {DLQ: {"0": 10, "1": 7}}
    first = plan_portion(picks, 2, {}, ends, ORDER)
    assert [p.offset for p in first.take] == [1, 4]
    assert first.taken == {DLQ: {"0": 6}} and not first.complete
    left = [p for p in picks if not is_taken(p, first.taken)]
    assert [p.offset for p in left] == [6, 2]
    second = plan_portion(left, 1, first.taken, ends, ORDER)
    assert second.taken == {DLQ: {"0": 10, "1": 2}}  # partition 0 passed: its end
    last = plan_portion([pick(2, "k", partition=1)], 5, second.taken, ends, ORDER)
    assert last.complete and last.taken == ends and last.barriers == ()
    # nothing selected at all: done at once
    assert plan_portion([], 3, {}, ends, ORDER).complete


def test_a_group_split_by_a_portion_is_stopped_at_its_earliest_message_left():
    # g's records, DLQ order not origin order (two storage topics' worth); h is not split
    picks = [pick(1, origin=20), pick(2, "h"), pick(3, origin=40), pick(4, origin=30)]
    portion = plan_portion(picks, 2, {}, {DLQ: {"0": 5}}, ORDER)
    assert [p.origin.offset for p in portion.barriers] == [30]  # g's earliest left
    assert plan_portion(picks, 3, {}, {DLQ: {"0": 5}}, ORDER).barriers == (pick(4, origin=30),)


# -- a blocked group through several portions ------------------------------------------------------

POLICY = RetryPolicy(max_attempts=3, jitter=0.0, in_place_window_ms=0)


def parked(offset: int, origin: int, reason: str) -> Parked:
    return Parked(
        f"m{origin}", "g", f"0:0:{origin}", reason, 404, 1, 1, 1, DLQ, 0, offset, b"body", {}
    )


def pending_entries(state: StateCopy, group: str) -> list[Entry]:
    f = state.frame
    rows = state_rows(f[(f["kind"] == Kind.PENDING) & (f["group_key"] == group)])
    return [entry_of(r) for r in rows]


def deliver(state: StateCopy, live: list[Entry], batch: int) -> list[str]:
    """One batch of group `g`: its pending entries and the `live` records read, delivered in
    order by a `GroupRun` against an endpoint that accepts everything; the state keeps what is
    left. Returns the ids sent."""
    run = GroupRun(
        merge(pending_entries(state, "g"), live, RunCounts()),
        POLICY,
        "block",
        lambda: 1_000 * batch,
        random.Random(0),
        RunCounts(),
    )
    sent = []
    while (request := run.next_request()) is not None:
        sent.append(request.headers[m.HTTP_MESSAGE_ID])
        run.on_outcome(Outcome(200, None, "HTTP 200", None, 1.0))
    rows = [state_row(Kind.PENDING, "g", e) for e in run.remaining()]
    new_rows = frame_of(rows) if rows else pd.DataFrame()
    state.frame = state.committed({"g"}, new_rows, "app", batch)
    return sent


def test_a_group_redriven_in_portions_keeps_its_order_and_its_newer_traffic_behind():
    """The invariant of `redrive_pace`: m0 failed and blocked g; m1, m2 waited behind it, m3
    went over the limit (the mark) and m4..m7 after it, all to the DLQ. A re-drive of 2
    messages a portion, live traffic m8, m9 arriving between portions: everything is
    delivered once, in produce order."""

    def dead(i: int, reason: str) -> Entry:
        return Entry(m.Origin(0, 0, i), f"m{i}", "g", "dlq", reason=reason)

    def held(i: int) -> Entry:
        return Entry(m.Origin(0, 0, i), f"m{i}", "g", "held", b"body")

    blocked = [dead(0, "fatal response 404"), held(1), held(2), dead(3, OVER_LIMIT)]
    state = StateCopy(frame_of([state_row(Kind.PENDING, "g", e) for e in blocked]))
    dlq = [parked(0, 0, "fatal response 404")] + [parked(i, i, OVER_LIMIT) for i in range(3, 8)]
    picks = pick_order([pick_of(p, True) for p in dlq], ORDER)
    ends, taken = {DLQ: {"0": 8}}, {}
    live = {2: [8], 3: [9]}  # batch -> main-topic records it reads
    delivered: list[str] = []
    for batch in range(1, 6):
        portion = plan_portion([p for p in picks if not is_taken(p, taken)], 2, taken, ends, ORDER)
        chosen = [("r1", p) for p in dlq if p.offset in {t.offset for t in portion.take}]
        state.redrive(redrive_rows(chosen, grouped=True))
        state.hold_back(barrier_rows(portion.barriers, "r1"))
        taken = portion.taken
        state.record_redrives(
            {"r1": ends}, {} if portion.complete else {"r1": RedriveProgress(taken, batch, 0.0)}
        )
        reads = [
            Entry(m.Origin(0, 0, i), f"m{i}", "g", "new", b"body") for i in live.get(batch, [])
        ]
        delivered += deliver(state, reads, batch)
        if batch == 1:  # m0..m3 back and sent; g waits at m4, its earliest message left
            assert delivered == ["m0", "m1", "m2", "m3"]
            (head,) = pending_entries(state, "g")
            assert (head.msg_id, head.location, head.reason) == (
                "m4",
                "dlq",
                "waiting for re-drive r1",
            )
    assert delivered == [f"m{i}" for i in range(10)]
    assert pending_entries(state, "g") == [] and state.redrives_applied() == {"r1": ends}
