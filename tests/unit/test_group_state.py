"""The per-group "deliver or follow" logic (`varadhi.core.group_state`) without HTTP, Spark or Kafka.

A test drives a `GroupRun` through the delivery engine's Stream protocol by hand: it asks for the
next request, answers it with an `Outcome` and moves a fake clock. Each DESIGN section 7 hazard
that lives in this logic has its own test: a retried head that fails again keeps its place
(hazard 1), an RQ record read before its due time is parked, never re-sent (hazard 2), stale RQ
duplicates from a replayed batch are recognised by (origin, attempts) (hazard 4); plus block vs
skip, and malformed records dead-lettered in their group's order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import replace

import pytest

from varadhi.core import messages as m
from varadhi.core.delivery import Outcome, Wait
from varadhi.core.group_state import (
    OVER_LIMIT,
    Entry,
    GroupRun,
    Out,
    RunCounts,
    http_headers,
    in_place_retry,
    merge,
    over_limit,
)
from varadhi.core.policies import BlockedPolicy, RetryPolicy
from varadhi.core.queue_records import out_record
from varadhi.core.state_rows import Kind, OutRow, entry_of, state_row
from varadhi.kafka.dlq import parked_from_record, redrive_rows

T0 = 1_800_000_000_000
# Every retry goes through the RQ (no retries in place), so the hazards of the RQ path show.
POLICY = RetryPolicy(
    max_attempts=3,
    backoff="exponential",
    min_backoff_ms=1_000,
    max_backoff_ms=8_000,
    jitter=0.0,
    in_place_window_ms=0,
)
IN_PLACE = replace(POLICY, in_place_window_ms=2_000)


class Clock:
    """A fake clock in ms since the epoch; tests move it by hand."""

    def __init__(self, now: int = T0):
        self.now = now

    def __call__(self) -> int:
        return self.now


def ok() -> Outcome:
    return Outcome(200, None, "HTTP 200", None, 1.0)


def http(status: int, retry_after: str | None = None) -> Outcome:
    return Outcome(status, None, f"HTTP {status}", retry_after, 1.0)


def new(offset: int, group: str | None = "g", body: bytes | None = None, **kw) -> Entry:
    """A main-topic record of `group` at offset `offset` of partition 0 (produce order)."""
    return Entry(
        origin=m.Origin(0, 0, offset),
        msg_id=f"m{offset}",
        group_id=group,
        location="new",
        value=body if body is not None else f"body-{offset}".encode(),
        source=f"t.0/0/{offset}",
        **kw,
    )


def rq_record(entry: Entry, offset: int = 100) -> Entry:
    """The RQ record of an `Out('rq', entry)` as the shard reads it back: same origin and
    attempt count, body at hand, read from the RQ."""
    return replace(entry, location="rq", source=f"s.rq.0/0/{offset}")


def run_of(
    entries: list[Entry],
    clock: Clock,
    on_dead_letter: str = "block",
    policy: RetryPolicy = POLICY,
    counts: RunCounts | None = None,
    hand_over: bool = False,
) -> GroupRun:
    return GroupRun(
        entries,
        policy,
        on_dead_letter,
        clock,
        random.Random(0),
        counts or RunCounts(),
        hand_over=hand_over,
    )


def drive(
    run: GroupRun,
    answer: Callable[[str, int], Outcome] | None = None,
    clock: Clock | None = None,
    step_ms: int = 0,
) -> list[tuple[str, int]]:
    """Play the engine: request after request until the run says None; a `Wait` moves `clock`
    on by its time (and is recorded as `("wait", ms)`). `answer(msg_id, attempt)` gives each
    outcome (default: 200). Returns the (msg_id, attempt) sent, in order."""
    answer = answer or (lambda _id, _n: ok())
    sent: list[tuple[str, int]] = []
    for _ in range(100):
        request = run.next_request()
        if request is None:
            return sent
        if isinstance(request, Wait):
            assert clock is not None, "a run waits for its retry, but the test has no clock"
            ms = round(request.seconds * 1000)
            clock.now += ms
            sent.append(("wait", ms))
            continue
        msg_id = request.headers[m.HTTP_MESSAGE_ID]
        attempt = int(request.headers[m.HTTP_ATTEMPT])
        sent.append((msg_id, attempt))
        if clock is not None:
            clock.now += step_ms
        run.on_outcome(answer(msg_id, attempt))
    raise AssertionError("the run never finished")


def script(answers: dict[str, Iterable[Outcome]]) -> Callable[[str, int], Outcome]:
    """Per message id, its outcomes in order; then 200."""
    queues = {k: list(v) for k, v in answers.items()}
    return lambda msg_id, _n: queues[msg_id].pop(0) if queues.get(msg_id) else ok()


def ids(entries: Iterable[Entry]) -> list[str]:
    return [e.msg_id for e in entries]


def round_trip(entries: Iterable[Entry]) -> list[Entry]:
    """Entries as a batch gets them from the state table: written as pending rows and read back
    without bodies (`StateStore.pending`); parked bodies come separately, as `held` candidates."""
    rows = [state_row(Kind.PENDING, "g", e) for e in entries]
    return [entry_of(row._replace(value=None)) for row in rows]


# -- merge ------------------------------------------------------------------------------------


def test_merge_orders_by_origin_and_drops_replayed_main_topic_records():
    counts = RunCounts()
    pending = round_trip([replace(new(1), location="rq", value=None, attempts=1)])
    queue = merge(pending, [new(3), new(2), new(1)], counts)
    assert ids(queue) == ["m1", "m2", "m3"]
    assert queue[0].location == "rq"  # the replayed copy of m1 did not replace its entry
    assert counts.duplicates == 1


def test_merge_does_not_change_the_pending_entries_it_is_given():
    pending = [replace(new(1), location="rq", value=None, attempts=1)]
    merge(pending, [rq_record(replace(new(1), attempts=1))], RunCounts())
    assert pending[0].location == "rq" and pending[0].value is None


def test_merge_accepts_an_rq_record_only_for_its_waiting_entry_and_attempt_count():
    counts = RunCounts()
    waiting = replace(new(1), location="rq", value=None, attempts=2)
    queue = merge(
        [waiting],
        [
            rq_record(replace(new(1), attempts=1), offset=10),  # stale: an earlier attempt
            rq_record(replace(new(1), attempts=2), offset=11),  # the one it waits for
            rq_record(replace(new(1), attempts=2), offset=12),  # a re-sent copy of it
            rq_record(replace(new(7), attempts=1), offset=13),  # nothing waits for it
        ],
        counts,
    )
    assert len(queue) == 1
    head = queue[0]
    assert (head.location, head.value, head.attempts) == ("held", b"body-1", 2)
    assert head.source == "s.rq.0/0/11"  # the copy that was accepted
    assert counts.duplicates == 3


def test_merge_gives_held_entries_their_parked_bodies():
    pending = round_trip(
        [
            replace(new(1), location="rq", value=None, attempts=1),
            replace(new(2), location="held"),
        ]
    )
    assert pending[1].value is None  # the state's pending rows come without bodies
    parked = replace(new(2), location="held")
    queue = merge(pending, [parked], RunCounts())
    assert [(e.msg_id, e.location, e.value) for e in queue] == [
        ("m1", "rq", None),
        ("m2", "held", b"body-2"),
    ]


# -- GroupRun: the happy path and its headers -----------------------------------------------------


def test_a_healthy_group_is_delivered_in_order_and_leaves_nothing():
    clock = Clock()
    run = run_of(merge([], [new(2), new(1), new(3)], RunCounts()), clock)
    assert drive(run) == [("m1", 1), ("m2", 1), ("m3", 1)]
    assert ids(run.delivered) == ["m1", "m2", "m3"]
    assert run.outs == [] and run.remaining() == []
    assert run.counts.delivered == 3 and run.counts.attempts == 3


def test_request_headers_carry_idempotency_key_group_attempt_and_source():
    entry = replace(new(5), attempts=2, headers={m.H_PRODUCED_MS: "123"})
    headers = http_headers(entry)
    assert headers[m.HTTP_IDEMPOTENCY_KEY] == headers[m.HTTP_MESSAGE_ID] == "m5"
    assert headers[m.HTTP_GROUP_ID] == "g"
    assert headers[m.HTTP_ATTEMPT] == "3"
    assert headers[m.HTTP_SOURCE] == "t.0/0/5"
    assert headers[m.HTTP_PRODUCED_AT] == "123"
    assert m.HTTP_GROUP_ID not in http_headers(new(6, group=None))
    assert m.HTTP_REDRIVEN not in headers  # never re-driven


def test_a_redriven_message_says_so_on_every_request_and_a_producer_cannot_forge_it():
    entry = replace(new(5), location="held", headers={m.H_REDRIVEN: "redrive-1-a"})
    assert http_headers(entry)[m.HTTP_REDRIVEN] == "redrive-1-a"
    assert http_headers(replace(entry, attempts=3))[m.HTTP_REDRIVEN] == "redrive-1-a"
    assert m.control_free({m.H_REDRIVEN: "forged", "x": "1"}) == {"x": "1"}


# -- GroupRun: retries ---------------------------------------------------------------------------


def test_a_failed_head_goes_to_the_rq_with_its_due_time_and_the_group_follows():
    clock = Clock()
    run = run_of([new(1), new(2), new(3)], clock)
    sent = drive(run, script({"m2": [http(500)]}))
    assert sent == [("m1", 1), ("m2", 1)]  # m3 is never sent behind a failed m2
    [out] = run.outs
    assert out.target == "rq"
    assert (out.entry.msg_id, out.entry.attempts, out.entry.value) == ("m2", 1, b"body-2")
    assert out.entry.due_ms == T0 + 1_000
    assert out.entry.first_failure_ms == out.entry.last_failure_ms == T0
    assert out.entry.status == 500 and "HTTP 500" in out.entry.reason
    left = run.remaining()
    assert [(e.msg_id, e.location) for e in left] == [("m2", "rq"), ("m3", "held")]
    assert left[0].value is None and left[1].value == b"body-3"


def test_a_retry_due_within_the_window_waits_in_place_and_parks_nothing():
    clock = Clock()
    counts = RunCounts()
    run = run_of([new(1), new(2), new(3)], clock, policy=IN_PLACE, counts=counts)
    sent = drive(run, script({"m2": [http(500)]}), clock)
    # m2 is sent again after its backoff, from this run; m3 still follows it.
    assert sent == [("m1", 1), ("m2", 1), ("wait", 1_000), ("m2", 2), ("m3", 1)]
    assert run.outs == [] and run.remaining() == []
    assert ids(run.delivered) == ["m1", "m2", "m3"]
    assert (counts.retried_in_place, counts.retried, counts.failures) == (1, 0, 1)


def test_a_retry_due_beyond_the_window_goes_to_the_rq_with_every_attempt_counted():
    """m2 fails at T0 (retry due T0 + 1 s: in place), then again at T0 + 1 s (retry due 2 s
    later, 3 s after its first failure: beyond the 2 s window, so through the RQ)."""
    clock = Clock()
    counts = RunCounts()
    run = run_of([new(1), new(2), new(3)], clock, policy=IN_PLACE, counts=counts)
    sent = drive(run, script({"m2": [http(500), http(503)]}), clock)
    assert sent == [("m1", 1), ("m2", 1), ("wait", 1_000), ("m2", 2)]
    [out] = run.outs
    assert (out.target, out.entry.msg_id, out.entry.attempts) == ("rq", "m2", 2)
    assert out.entry.first_failure_ms == T0 and out.entry.last_failure_ms == T0 + 1_000
    assert out.entry.due_ms == T0 + 3_000 and out.entry.status == 503
    assert [(e.msg_id, e.location) for e in run.remaining()] == [("m2", "rq"), ("m3", "held")]
    assert (counts.retried_in_place, counts.retried) == (1, 1)


def test_a_retry_in_place_goes_to_the_rq_when_the_engine_stops_its_wait():
    """The task ran out of other deliveries while m2 waited: it goes to the RQ after all, due
    when it would have been sent, and m3 follows it."""
    counts = RunCounts()
    run = stopped_in_place(Clock(), counts)
    [out] = run.outs
    assert (out.target, out.entry.msg_id, out.entry.attempts) == ("rq", "m2", 1)
    assert out.entry.due_ms == T0 + 1_000 and out.entry.value == b"body-2"
    assert [(e.msg_id, e.location) for e in run.remaining()] == [("m2", "rq"), ("m3", "held")]
    assert (counts.retried_in_place, counts.retried) == (0, 1)


def stopped_in_place(clock: Clock, counts: RunCounts, hand_over: bool = False) -> GroupRun:
    """A run of m1-m3 where m1 is delivered, m2 fails (500) and waits for its retry in place,
    and the engine then stops that wait (the task ran out of other deliveries)."""
    run = run_of([new(1), new(2), new(3)], clock, policy=IN_PLACE, counts=counts,
                 hand_over=hand_over)  # fmt: skip
    assert run.next_request().headers[m.HTTP_MESSAGE_ID] == "m1"
    run.on_outcome(ok())
    assert run.next_request().headers[m.HTTP_MESSAGE_ID] == "m2"
    run.on_outcome(http(500))
    assert run.next_request() == Wait(1.0, while_busy=True)
    run.stop_waiting()
    return run


def handed_over(clock: Clock) -> list[Entry]:
    """Phase 1's hand-over of a group (`GroupRun.hand_over`): m2's stopped wait leaves the
    queue as it is."""
    counts = RunCounts()
    run = stopped_in_place(clock, counts, hand_over=True)
    assert run.handed_over and run.next_request() is None
    assert run.outs == [] and (counts.retried, counts.retried_in_place) == (0, 0)
    return run.entries


def test_a_run_that_hands_over_stops_with_its_queue_as_it_is_not_through_the_rq():
    """With `hand_over` (phase 1 of a grouped batch that has a second job anyway), a stopped
    wait in place writes nothing to the RQ: the head keeps its attempt, due time and body, the
    messages behind it stay `new`, and the head is recognised as a retry in place."""
    clock = Clock()
    head, behind = handed_over(clock)
    assert (head.msg_id, head.location, head.attempts, head.value) == ("m2", "new", 1, b"body-2")
    assert head.due_ms == T0 + 1_000 and head.first_failure_ms == T0 and head.status == 500
    assert (behind.msg_id, behind.location, behind.attempts) == ("m3", "new", 0)
    assert in_place_retry(head) and not in_place_retry(behind)


def test_a_handed_over_retry_goes_on_waiting_in_place_and_is_sent_once_due():
    """Phase 2 gets the queue as `fwd` rows: its run waits for the head's due time (never
    earlier), counts the retry as made in place, then sends the message behind it."""
    clock, counts = Clock(), RunCounts()
    rows = [state_row(Kind.FWD, "g", e) for e in handed_over(clock)]
    queue = merge([], [entry_of(r) for r in rows], RunCounts())
    clock.now = T0 + 400
    run = run_of(queue, clock, policy=IN_PLACE, counts=counts)
    assert drive(run, clock=clock) == [("wait", 600), ("m2", 2), ("m3", 1)]
    assert run.remaining() == [] and run.outs == []
    assert (counts.retried_in_place, counts.retried, counts.waited_due) == (1, 0, 0)


def test_a_handed_over_retry_whose_wait_is_stopped_again_goes_to_the_rq_due_when_it_was():
    """Phase 2 ran out of work before the head was due: the retry goes to the RQ, due when it
    was, with its one attempt; m3 follows it. Not parked as an early RQ record would be: no RQ
    record of it exists yet."""
    clock, counts = Clock(), RunCounts()
    queue = [entry_of(state_row(Kind.FWD, "g", e)) for e in handed_over(clock)]
    run = run_of(queue, clock, policy=IN_PLACE, counts=counts)
    assert run.next_request() == Wait(1.0, while_busy=True)
    run.stop_waiting()
    [out] = run.outs
    assert (out.target, out.entry.msg_id, out.entry.attempts) == ("rq", "m2", 1)
    assert out.entry.due_ms == T0 + 1_000 and out.entry.value == b"body-2"
    assert [(e.msg_id, e.location) for e in run.remaining()] == [("m2", "rq"), ("m3", "held")]
    assert counts.retried == 1


def test_a_fatal_answer_after_a_retry_in_place_dead_letters_with_both_attempts():
    clock = Clock()
    run = run_of([new(1), new(2)], clock, policy=IN_PLACE)
    drive(run, script({"m1": [http(500), http(404)]}), clock)
    [out] = run.outs
    assert (out.target, out.entry.attempts, out.entry.reason) == ("dlq", 2, "fatal response 404")
    assert out.entry.first_failure_ms == T0


def early_rq_run(due_in_ms: int, policy: RetryPolicy, clock: Clock, counts=None) -> GroupRun:
    """A run whose head is m1's retry (attempt 2), read back from the RQ `due_in_ms` before its
    due time, with m2 behind it."""
    early = replace(
        new(1), location="rq", attempts=1, due_ms=clock.now + due_in_ms, first_failure_ms=T0
    )
    pending = [replace(early, value=None), replace(new(2), location="held")]
    queue = merge(pending, [rq_record(early)], RunCounts())
    return run_of(queue, clock, policy=policy, counts=counts)


def test_an_rq_record_read_early_waits_in_the_task_when_due_within_the_window():
    """Read back 1.5 s before its due time (window 2 s): the task waits for it, as for a retry
    in place, and sends it once due (never earlier), then its group's next message; nothing
    is parked for a later batch."""
    clock, counts = Clock(), RunCounts()
    run = early_rq_run(1_500, IN_PLACE, clock, counts)
    assert drive(run, clock=clock) == [("wait", 1_500), ("m1", 2), ("m2", 1)]
    assert run.remaining() == [] and run.outs == []
    assert (counts.waited_due, counts.retried_in_place, counts.retried) == (1, 0, 0)


def test_an_rq_record_read_early_is_parked_when_due_beyond_the_window():
    """Due 2.5 s later (window 2 s), or with retries in place off: parked as before (hazard 2),
    so a task never waits longer than the window."""
    for due_in_ms, policy in ((2_500, IN_PLACE), (1_500, POLICY)):
        clock, counts = Clock(), RunCounts()
        run = early_rq_run(due_in_ms, policy, clock, counts)
        assert drive(run, clock=clock) == []
        left = run.remaining()
        assert [(e.msg_id, e.location) for e in left] == [("m1", "held"), ("m2", "held")]
        assert left[0].value == b"body-1" and run.outs == [] and counts.waited_due == 0


def test_an_early_rq_record_whose_wait_the_engine_stops_is_parked_not_written_again():
    """The task ran out of other work and the wait would outlast the window: the retry is
    parked with its body (the state keeps it until due), not written to the RQ again."""
    clock, counts = Clock(), RunCounts()
    run = early_rq_run(1_500, IN_PLACE, clock, counts)
    assert run.next_request() == Wait(1.5, while_busy=True)
    run.stop_waiting()
    assert run.next_request() is None and run.outs == []
    left = run.remaining()
    assert [(e.msg_id, e.location, e.attempts) for e in left] == [
        ("m1", "held", 1),
        ("m2", "held", 0),
    ]
    assert left[0].value == b"body-1" and left[0].due_ms == T0 + 1_500
    assert (counts.waited_due, counts.retried) == (0, 0)


def test_retry_after_beyond_the_backoff_sets_the_due_time():
    clock = Clock()
    run = run_of([new(1)], clock)
    drive(run, script({"m1": [http(503, retry_after="7")]}))
    assert run.outs[0].entry.due_ms == T0 + 7_000
    assert "Retry-After" in run.outs[0].entry.reason


def test_hazard_1_a_retried_head_that_fails_again_keeps_its_place():
    """m1 failed, m2 waits behind it; m1 comes back from the RQ and fails again: it must stay
    ahead of m2 (order comes from origin, not from where records sit in the RQ)."""
    clock = Clock()
    first = run_of([new(1), new(2)], clock)
    drive(first, script({"m1": [http(500)]}))
    [out1] = first.outs
    state = round_trip(first.remaining())

    clock.now = out1.entry.due_ms
    queue = merge(state, [rq_record(out1.entry), replace(new(2), location="held")], RunCounts())
    second = run_of(queue, clock)
    assert drive(second, script({"m1": [http(500)]})) == [("m1", 2)]
    [out2] = second.outs
    assert (out2.target, out2.entry.msg_id, out2.entry.attempts) == ("rq", "m1", 2)
    assert out2.entry.due_ms == clock.now + 2_000  # exponential: second failure doubles
    assert out2.entry.first_failure_ms == T0  # the first failure is remembered
    state = round_trip(second.remaining())
    assert [(e.msg_id, e.location) for e in state] == [("m1", "rq"), ("m2", "held")]

    # Both RQ records of m1 come back in one batch (the second one behind the first in the RQ);
    # only the one the state waits for counts.
    clock.now = out2.entry.due_ms
    counts = RunCounts()
    queue = merge(
        state,
        [rq_record(out1.entry), rq_record(out2.entry), replace(new(2), location="held")],
        counts,
    )
    third = run_of(queue, clock, counts=counts)
    assert drive(third) == [("m1", 3), ("m2", 1)]
    assert counts.duplicates == 1
    assert third.remaining() == [] and third.outs == []


def test_hazard_2_an_rq_record_read_before_its_due_time_is_parked_not_resent():
    clock = Clock()
    first = run_of([new(1), new(2)], clock)
    drive(first, script({"m1": [http(500)]}))
    [out] = first.outs
    state = round_trip(first.remaining())

    # The shard reads the RQ record at once, long before it is due.
    clock.now = T0 + 10
    queue = merge(
        state, [rq_record(out.entry), replace(new(2), location="held"), new(3)], RunCounts()
    )
    early = run_of(queue, clock)
    assert drive(early) == []  # nothing sent, not even the followers
    assert early.outs == []  # and nothing written back to the RQ: no spinning
    parked = early.remaining()
    assert [(e.msg_id, e.location) for e in parked] == [
        ("m1", "held"),
        ("m2", "held"),
        ("m3", "held"),
    ]
    assert parked[0].value == b"body-1" and parked[0].due_ms == out.entry.due_ms
    assert parked[0].attempts == 1

    # Once due, the parked bodies come back from the state table and go out in order.
    state = round_trip(parked)
    clock.now = out.entry.due_ms
    queue = merge(state, [replace(e, location="held") for e in parked], RunCounts())
    due = run_of(queue, clock)
    assert drive(due) == [("m1", 2), ("m2", 1), ("m3", 1)]
    assert due.remaining() == []


def test_hazard_4_a_replayed_batch_duplicates_are_dropped():
    """The batch that wrote m1's RQ record is replayed after a crash: the main-topic records come
    again and the RQ record is sent twice. The group must deliver m1 and m2 once each."""
    clock = Clock()
    first = run_of([new(1), new(2)], clock)
    drive(first, script({"m1": [http(500)]}))
    [out] = first.outs
    state = round_trip(first.remaining())

    clock.now = out.entry.due_ms
    counts = RunCounts()
    queue = merge(
        state,
        [new(1), new(2), rq_record(out.entry, 5), rq_record(out.entry, 6)]
        + [replace(new(2), location="held")],
        counts,
    )
    assert counts.duplicates == 3  # two replayed main-topic records, one re-sent RQ copy
    run = run_of(queue, clock, counts=counts)
    assert drive(run) == [("m1", 2), ("m2", 1)]

    # A stale copy that turns up after m1 was delivered matches nothing.
    counts = RunCounts()
    assert merge(round_trip(run.remaining()), [rq_record(out.entry, 7)], counts) == []
    assert counts.duplicates == 1


def test_retries_exhausted_dead_letter_with_attempts_and_failure_times():
    clock = Clock()
    entry = new(1)
    sent = []
    for _ in range(POLICY.max_attempts):
        run = run_of([entry], clock)
        sent += drive(run, script({"m1": [http(500)]}))
        [out] = run.outs
        entry = replace(out.entry, location="held")
        clock.now += 5_000
    assert sent == [("m1", 1), ("m1", 2), ("m1", 3)]
    assert out.target == "dlq"
    assert out.entry.attempts == 3
    assert out.entry.reason == "retries exhausted after 3 attempts: HTTP 500"
    assert out.entry.first_failure_ms == T0
    assert out.entry.last_failure_ms == T0 + 10_000


# -- GroupRun: dead letters, block and skip ------------------------------------------------------


def test_block_a_fatal_answer_dead_letters_at_once_and_blocks_the_group():
    clock = Clock()
    run = run_of([new(1), new(2), new(3)], clock, on_dead_letter="block")
    assert drive(run, script({"m1": [http(404)]})) == [("m1", 1)]
    [out] = run.outs
    assert (out.target, out.entry.attempts, out.entry.reason) == ("dlq", 1, "fatal response 404")
    assert out.entry.status == 404 and out.entry.value == b"body-1"
    left = round_trip(run.remaining())
    assert [(e.msg_id, e.location) for e in left] == [("m1", "dlq"), ("m2", "held"), ("m3", "held")]

    # Later batches keep the group blocked, however much new traffic arrives.
    parked = [replace(new(2), location="held"), replace(new(3), location="held")]
    queue = merge(left, [*parked, new(4)], RunCounts())
    later = run_of(queue, clock, on_dead_letter="block")
    assert drive(later) == [] and later.outs == []
    assert [(e.msg_id, e.location) for e in later.remaining()] == [
        ("m1", "dlq"),
        ("m2", "held"),
        ("m3", "held"),
        ("m4", "held"),
    ]


def test_skip_a_dead_lettered_head_leaves_and_the_group_carries_on():
    clock = Clock()
    run = run_of([new(1), new(2), new(3)], clock, on_dead_letter="skip")
    assert drive(run, script({"m1": [http(404)]})) == [("m1", 1), ("m2", 1), ("m3", 1)]
    assert [(o.target, o.entry.msg_id) for o in run.outs] == [("dlq", "m1")]
    assert ids(run.delivered) == ["m2", "m3"]
    assert run.remaining() == []


# -- malformed records ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["block", "skip"])
def test_malformed_heads_are_dead_lettered_in_order_without_a_request(mode):
    clock = Clock()
    bad = replace(new(1, body=b""), value=None, invalid="malformed: no value")
    run = run_of([bad, new(2)], clock, on_dead_letter=mode)
    sent = drive(run)
    [out] = run.outs
    assert (out.target, out.entry.msg_id, out.entry.reason) == ("dlq", "m1", "malformed: no value")
    assert out.entry.attempts == 0 and out.entry.first_failure_ms == T0
    if mode == "block":
        assert sent == []
        assert [(e.msg_id, e.location) for e in run.remaining()] == [("m1", "dlq"), ("m2", "held")]
    else:
        assert sent == [("m2", 1)]
        assert run.remaining() == []


def test_a_group_id_that_cannot_be_a_header_is_dead_lettered_not_sent():
    clock = Clock()
    run = run_of([new(1, group="evil\r\nX-Injected: 1"), new(2)], clock, on_dead_letter="skip")
    sent = drive(run)
    assert sent == [("m2", 1)]
    [out] = run.outs
    assert out.target == "dlq" and out.entry.reason.startswith("malformed: ")


@pytest.mark.parametrize("mode", ["block", "skip"])
def test_a_malformed_record_behind_a_failing_head_is_dead_lettered_when_its_turn_comes(mode):
    """A record with no value (or an oversized one) that arrives while its group waits for a
    retry is parked like any follower; the state table must remember why it cannot be delivered,
    so it is dead-lettered (never sent) once it reaches the head."""
    clock = Clock()
    too_big = replace(new(3), invalid="malformed: value of 9 bytes exceeds 8")
    no_value = replace(new(2), value=None, invalid="malformed: no value")
    first = run_of([new(1), no_value, too_big, new(4)], clock, on_dead_letter=mode)
    drive(first, script({"m1": [http(500)]}))
    [out] = first.outs
    state = round_trip(first.remaining())  # must not fail on a parked record without a body
    assert [(e.msg_id, e.location) for e in state] == [
        ("m1", "rq"),
        ("m2", "held"),
        ("m3", "held"),
        ("m4", "held"),
    ]

    clock.now = out.entry.due_ms
    bodies = [replace(e, location="held") for e in first.remaining()[1:]]
    queue = merge(state, [rq_record(out.entry), *bodies], RunCounts())
    second = run_of(queue, clock, on_dead_letter=mode)
    sent = drive(second)
    dead = [(o.target, o.entry.msg_id, o.entry.reason) for o in second.outs]
    if mode == "skip":
        assert sent == [("m1", 2), ("m4", 1)]
        assert dead == [
            ("dlq", "m2", "malformed: no value"),
            ("dlq", "m3", "malformed: value of 9 bytes exceeds 8"),
        ]
    else:
        assert sent == [("m1", 2)]
        assert dead == [("dlq", "m2", "malformed: no value")]
        assert [e.location for e in second.remaining()] == ["dlq", "held", "held"]


# -- records too large for the RQ, response snippets -----------------------------------------


def test_a_retry_too_large_for_the_rq_is_dead_lettered_and_its_group_blocks():
    big = new(1, body=b"x" * 10_000)
    run = GroupRun([big, new(2)], POLICY, "block", Clock(), random.Random(0), RunCounts(), 8_000)
    assert drive(run, script({"m1": [http(500)]})) == [("m1", 1)]
    [out] = run.outs
    assert out.target == "dlq"
    assert out.entry.reason.startswith("HTTP 500; retry in")
    assert "exceeds the retry queue's 8000" in out.entry.reason
    assert [(e.msg_id, e.location) for e in run.remaining()] == [("m1", "dlq"), ("m2", "held")]


def test_a_retry_that_fits_goes_to_the_rq():
    run = GroupRun([new(1)], POLICY, "block", Clock(), random.Random(0), RunCounts(), 8_000)
    drive(run, script({"m1": [http(500)]}))
    assert [o.target for o in run.outs] == ["rq"]


def test_a_failure_keeps_the_start_of_the_response_body_and_a_later_one_replaces_it():
    run = run_of([new(1)], Clock(), policy=replace(POLICY, max_attempts=1))
    body = b'{"error": "no such order"}' + b"." * 2000
    run.on_outcome(Outcome(422, None, "HTTP 422", None, 1.0, body))
    assert run.outs[0].entry.headers[m.H_RESPONSE] == body.decode()
    again = run_of([replace(new(2), headers={m.H_RESPONSE: "old"})], Clock())
    again.on_outcome(http(503))  # no body: no snippet from an earlier attempt stays
    assert m.H_RESPONSE not in again.outs[0].entry.headers


def test_junk_in_the_produced_at_header_is_not_sent_on():
    assert m.HTTP_PRODUCED_AT not in http_headers(new(1, headers={m.H_PRODUCED_MS: "1\r\n2"}))
    assert http_headers(new(1, headers={m.H_PRODUCED_MS: "17"}))[m.HTTP_PRODUCED_AT] == "17"


# -- a blocked group's limit (`over_limit`, `BlockedPolicy`) ---------------------------------------


def dead_letters_to_redrive(outs: Iterable[Out]) -> list[Entry]:
    """What `dlq unsideline --group-ids g` gives back for these DLQ records: each written as the
    shard writes it (`out_record`), read as a DLQ browse reads it and turned into `held` state
    rows (`varadhi.kafka.dlq`), then read by a batch (`entry_of`)."""
    parked = []
    for n, out in enumerate(outs):
        record = out_record(OutRow.of(state_row(Kind.OUT, "g", out.entry, target="dlq")), None)
        parked.append(parked_from_record("s.dlq.0", 0, n, record.key, record.value, record.headers))
    rows = redrive_rows([("redrive-1-a", p) for p in parked], grouped=True)
    return [entry_of(row) for row in rows]


def blocked_run(entries: list[Entry], clock: Clock, limit: BlockedPolicy) -> GroupRun:
    return GroupRun(entries, POLICY, "block", clock, random.Random(0), RunCounts(), blocked=limit)


def test_a_blocked_group_keeps_max_held_and_dead_letters_the_rest_in_order_behind_a_mark():
    clock = Clock()
    limit = BlockedPolicy(max_held=2)
    run = blocked_run([new(i) for i in range(1, 7)], clock, limit)
    assert drive(run, script({"m1": [http(404)]})) == [("m1", 1)]
    left = run.remaining()
    assert [(e.msg_id, e.location, e.value) for e in left] == [
        ("m1", "dlq", None),
        ("m2", "held", b"body-2"),
        ("m3", "held", b"body-3"),
        ("m4", "dlq", None),  # the overflow mark: dead-lettered, kept without its body
    ]
    assert [(o.target, o.entry.msg_id) for o in run.outs] == [
        ("dlq", "m1"),
        ("dlq", "m4"),
        ("dlq", "m5"),
        ("dlq", "m6"),
    ]
    over = run.outs[1:]
    assert {(o.entry.reason, o.entry.attempts, o.entry.last_failure_ms) for o in over} == {
        (OVER_LIMIT, 0, T0)
    }
    assert [o.entry.value for o in over] == [b"body-4", b"body-5", b"body-6"]  # bodies go along
    assert (run.counts.dead_lettered, run.counts.over_limit) == (4, 3)
    assert run.remaining() == left and len(run.outs) == 4  # asking again adds nothing

    # Read back from the state table, the mark is a dead letter like the head.
    stored = round_trip(left)
    assert [(e.location, e.invalid) for e in stored] == [
        ("dlq", None),
        ("held", None),
        ("held", None),
        ("dlq", None),
    ]


def test_behind_a_mark_every_later_message_is_dead_lettered_and_none_kept():
    clock = Clock()
    limit = BlockedPolicy(max_held=2)
    pending = round_trip(
        [
            replace(new(1), location="dlq", value=None, attempts=1),
            replace(new(2), location="held"),
            replace(new(4), location="dlq", value=None, reason=OVER_LIMIT),
        ]
    )
    parked = [replace(new(2), location="held")]
    run = blocked_run(merge(pending, [*parked, new(7), new(8)], RunCounts()), clock, limit)
    assert drive(run) == []
    assert [(e.msg_id, e.location) for e in run.remaining()] == [
        ("m1", "dlq"),
        ("m2", "held"),
        ("m4", "dlq"),
    ]
    assert [(o.entry.msg_id, o.entry.reason) for o in run.outs] == [
        ("m7", OVER_LIMIT),
        ("m8", OVER_LIMIT),
    ]


def test_the_byte_limit_counts_bodies_and_leaves_no_gap():
    limit = BlockedPolicy(max_held=100, max_held_bytes=10)
    head = replace(new(1), location="dlq", value=None)
    big, small = new(2, body=b"x" * 8), new(3, body=b"y" * 3)  # 8 fits, 8 + 3 does not
    kept, spilled = over_limit([head, big, small, new(4, body=b"z")], limit, T0)
    assert [(e.msg_id, e.location) for e in kept] == [("m1", "dlq"), ("m2", "new"), ("m3", "dlq")]
    assert [e.msg_id for e in spilled] == ["m3", "m4"]  # m4 (1 byte) would fit, but follows m3


def test_max_held_zero_keeps_only_the_head_and_the_mark():
    head = replace(new(1), location="dlq", value=None)
    kept, spilled = over_limit([head, new(2), new(3)], BlockedPolicy(max_held=0), T0)
    assert [(e.msg_id, e.location) for e in kept] == [("m1", "dlq"), ("m2", "dlq")]
    assert [e.msg_id for e in spilled] == ["m2", "m3"]


def test_a_malformed_message_over_the_limit_keeps_its_own_reason_first():
    head = replace(new(1), location="dlq", value=None)
    bad = new(2, invalid="malformed: no value")
    _, [out] = over_limit([head, bad], BlockedPolicy(max_held=0), T0)
    assert out.reason == f"malformed: no value; {OVER_LIMIT}"


def test_a_group_waiting_for_a_retry_is_not_limited():
    """Only a dead letter blocks a group for an unbounded time; a head in the RQ is retried
    and dead-lettered within `max_attempts`, and the limit applies then."""
    clock = Clock()
    run = blocked_run([new(1), new(2), new(3)], clock, BlockedPolicy(max_held=1))
    assert drive(run, script({"m1": [http(500)]})) == [("m1", 1)]
    assert [(e.msg_id, e.location) for e in run.remaining()] == [
        ("m1", "rq"),
        ("m2", "held"),
        ("m3", "held"),
    ]
    assert [o.target for o in run.outs] == ["rq"]


def test_redriving_the_head_alone_delivers_up_to_the_mark_and_blocks_there():
    clock = Clock()
    limit = BlockedPolicy(max_held=1)
    first = blocked_run([new(i) for i in range(1, 5)], clock, limit)
    drive(first, script({"m1": [http(404)]}))
    left, outs = first.remaining(), first.outs
    [head] = dead_letters_to_redrive(outs[:1])  # `dlq unsideline --message-ids m1`
    bodies = [replace(e, location="held") for e in left if e.location == "held"]
    queue = merge(round_trip([head, *left[1:]]), [head, *bodies, new(5)], RunCounts())
    later = blocked_run(queue, clock, limit)
    assert drive(later) == [("m1", 1), ("m2", 1)]
    assert [(e.msg_id, e.location) for e in later.remaining()] == [("m3", "dlq")]
    assert [(o.entry.msg_id, o.entry.reason) for o in later.outs] == [("m5", OVER_LIMIT)]


def test_redriving_the_group_delivers_every_message_once_in_produce_order():
    clock = Clock()
    limit = BlockedPolicy(max_held=2)
    first = blocked_run([new(i) for i in range(1, 7)], clock, limit)
    drive(first, script({"m1": [http(404)]}))
    left = first.remaining()
    bodies = [replace(e, location="held") for e in left if e.location == "held"]
    second = blocked_run(merge(round_trip(left), [*bodies, new(7)], RunCounts()), clock, limit)
    drive(second)
    left = second.remaining()
    outs = first.outs + second.outs
    assert [o.entry.msg_id for o in outs] == ["m1", "m4", "m5", "m6", "m7"]

    redriven = dead_letters_to_redrive(outs)  # `dlq unsideline --group-ids g`
    assert {(e.location, e.attempts, e.reason) for e in redriven} == {("held", 0, None)}
    pending = [e for e in round_trip(left) if e.location == "held"]  # their dlq rows replaced
    bodies = [replace(e, location="held") for e in left if e.location == "held"]
    queue = merge(
        [*pending, *(replace(e, value=None) for e in redriven)],
        [*bodies, *redriven, new(8)],
        RunCounts(),
    )
    last = blocked_run(queue, clock, limit)
    assert [i for i, _ in drive(last)] == [f"m{i}" for i in range(1, 9)]
    assert last.remaining() == [] and last.outs == []
