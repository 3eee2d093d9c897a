"""The library runtime's pure parts: ordering keys, offset bookkeeping, the scheduler, the slot
spread, the handler's decisions and the refusal of unsupported features."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from varadhi.core import filters
from varadhi.core import messages as m
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import Entry
from varadhi.core.policies import (
    CircuitPolicy,
    DeliveryPolicy,
    Endpoint,
    RequestShaping,
    RetryPolicy,
    SubscriptionSpec,
)
from varadhi.kafka.subscriptions import Subscription, Suspension
from varadhi.kafka.topics import CompositeTopic, StorageTopic
from varadhi.library import handler, offsets
from varadhi.library.assign import in_flight_share, spread
from varadhi.library.keys import OrderingKey, ordering_key
from varadhi.library.scheduler import Scheduler, Work
from varadhi.library.support import unsupported

# -- ordering keys ---------------------------------------------------------------------------


def test_the_default_key_is_the_group_id_header_else_the_record_key():
    rule = OrderingKey.parse("group-id")
    assert ordering_key(rule, b"k", {m.H_GROUP_ID: "g"}, b"{}") == "g"
    assert ordering_key(rule, b"k", {}, b"{}") == "k"
    assert ordering_key(rule, None, {}, b"{}") is None


def test_record_key_header_and_json_pointer_keys():
    headers = {m.H_GROUP_ID: "g", "tenant": "t1"}
    assert ordering_key(OrderingKey.parse("record-key"), b"\xff", headers, None) == "b64:/w=="
    assert ordering_key(OrderingKey.parse("header:tenant"), None, headers, None) == "t1"
    assert ordering_key(OrderingKey.parse("header:absent"), b"k", headers, None) is None
    rule = OrderingKey.parse("json:/order/customer")
    assert ordering_key(rule, None, {}, b'{"order": {"customer": "c9"}}') == "c9"
    assert ordering_key(rule, None, {}, b'{"order": {"customer": 42}}') == "42"
    assert ordering_key(rule, None, {}, b'{"order": {"customer": "42"}}') == "42"
    assert ordering_key(rule, None, {}, b'{"order": {"customer": {"b": 1, "a": 2}}}') == (
        '{"a":2,"b":1}'
    )
    for body in (b"not json", b"[]", b'{"order": null}', b'{"order": {"customer": null}}', None):
        assert ordering_key(rule, None, {}, body) is None
    escaped = OrderingKey.parse("json:/a~1b/~0c/1")
    assert ordering_key(escaped, None, {}, b'{"a/b": {"~c": ["x", "y"]}}') == "y"
    assert ordering_key(escaped, None, {}, b'{"a/b": {"~c": ["x"]}}') is None


@pytest.mark.parametrize("text", ["", "key", "header:", "json:a", "json:/a~2", "group"])
def test_a_bad_ordering_key_names_the_option(text):
    with pytest.raises(InvalidArgument, match="ordering-key"):
        OrderingKey.parse(text)


# -- offsets ---------------------------------------------------------------------------------


def test_the_commit_is_the_lowest_unfinished_offset_and_the_metadata_what_finished_above():
    ledger = offsets.Ledger(100)
    for o in range(100, 110):
        assert ledger.read(o)
    for o in (101, 102, 105, 106, 107, 109):
        ledger.finish(o)
    committed, meta = ledger.position()
    assert committed == 100
    restored = offsets.decode(committed, meta)
    assert [o for o in range(100, 112) if restored.finished(o)] == [101, 102, 105, 106, 107, 109]
    # after a restart, the finished ones are skipped and the rest delivered again
    again = offsets.Ledger(committed, restored)
    assert [o for o in range(100, 112) if again.read(o)] == [100, 103, 104, 108, 110, 111]


def test_nothing_finished_above_needs_no_metadata():
    ledger = offsets.Ledger(0)
    for o in range(5):
        ledger.read(o)
    assert ledger.position() == (0, "")
    for o in range(5):
        ledger.finish(o)
    assert ledger.position() == (5, "")


def test_a_restored_span_not_yet_read_again_is_kept_in_the_next_commit():
    ledger = offsets.Ledger(10)
    for o in range(10, 20):
        ledger.read(o)
    for o in range(11, 20):
        if o != 15:
            ledger.finish(o)
    committed, meta = ledger.position()
    again = offsets.Ledger(committed, offsets.decode(committed, meta))
    assert again.read(10)
    again.finish(10)  # the head finishes before 15 is read again
    committed2, meta2 = again.position()
    assert committed2 == 15
    third = offsets.Ledger(committed2, offsets.decode(committed2, meta2))
    assert [o for o in range(15, 22) if third.read(o)] == [15, 20, 21]


def test_metadata_never_exceeds_its_limit_and_forgets_the_tail_instead():
    """Parallel Consumer's failure (#647/#831): an offset map too large to commit stalls. Here
    the runs that do not fit are dropped (their finished records come again), never a stall."""
    unfinished = list(range(0, 20_000, 2))  # every other record unfinished: 10,000 runs
    meta = offsets.encode(0, 20_000, unfinished, max_bytes=200)
    assert 0 < len(meta) <= 200
    restored = offsets.decode(0, meta)
    assert restored.span > 0 and not restored.finished(0) and restored.finished(1)
    assert all(not restored.finished(o) for o in range(restored.span, 20_000))
    assert all(restored.finished(o) == (o % 2 == 1) for o in range(restored.span))


def test_metadata_is_what_the_plain_definition_gives_on_random_ledgers():
    """`encode` is on every commit's path and written for speed; its output must be what the
    module docstring defines: the runs of unfinished offsets, each `gap.length` in base 36, as
    many as fit with the whole span's field, the span cut at the first run that does not."""

    def b36(n: int) -> str:
        digits = ""
        while True:
            n, r = divmod(n, 36)
            digits = "0123456789abcdefghijklmnopqrstuvwxyz"[r] + digits
            if not n:
                return digits

    def plain(committed: int, upto: int, unfinished: set[int], max_bytes: int) -> str:
        span, listed = upto - committed, []
        for o in sorted(o for o in unfinished if committed <= o < upto):
            if listed and listed[-1][0] + listed[-1][1] == o:
                listed[-1][1] += 1
            else:
                listed.append([o, 1])
        if span <= 0 or listed == [[committed, span]]:
            return ""
        parts, end, whole = [], committed, b36(span)
        for first, length in listed:
            part = f"{b36(first - end)}.{b36(length)}"
            if len(",".join(["v1", whole, *parts, part])) > max_bytes:
                span = first - committed
                break
            parts.append(part)
            end = first + length
        if span <= 0 or parts == [f"0.{b36(span)}"]:
            return ""
        return ",".join(["v1", b36(span), *parts])

    rng = random.Random(7)
    for _ in range(3000):
        committed = rng.randrange(5000)
        upto = committed + rng.choice([0, 1, 2, 5, 50, 500, 3000, 60_000])
        pool = range(max(0, committed - 20), upto + 20)
        unfinished = set(rng.sample(pool, rng.randrange(min(len(pool), 3000) + 1)))
        if rng.random() < 0.5:
            unfinished.add(committed)
        limit = rng.choice([20, 40, 200, 4096])
        assert offsets.encode(committed, upto, unfinished, limit) == plain(
            committed, upto, unfinished, limit
        ), (committed, upto, limit)


@pytest.mark.parametrize("junk", ["x", "v1", "v1,zz,1.q!", "v2,5,0.1", "v1,2,0.1,5.5"])
def test_metadata_not_ours_is_ignored(junk):
    restored = offsets.decode(7, junk)
    assert restored.span == 0 and not restored.finished(8)


# -- scheduler ------------------------------------------------------------------------------


def work(offset: int, key: str | None, attempts: int = 0, due: int = 0, slot: int = 0) -> Work:
    entry = Entry(m.Origin(0, 0, offset), f"id{offset}", key, "new", b"x", attempts=attempts)
    entry.due_ms = due
    return Work(entry, "t.0", 0, offset, slot, key)


def test_one_key_in_order_and_other_keys_concurrently():
    s = Scheduler()
    for o, k in enumerate(["a", "a", "b", None, None]):
        assert s.add(work(o, k)) == []
    taken = [s.take(0) for _ in range(5)]
    assert [w.offset for w in taken if w] == [0, 2, 3, 4]  # a's second waits for its first
    s.done(taken[0])
    assert s.take(0).offset == 1
    assert s.take(0) is None


def test_a_retried_head_blocks_its_key_until_its_rq_copy_is_back_and_due():
    s = Scheduler()
    head, follower = work(0, "a"), work(1, "a")
    s.add(head)
    s.add(follower)
    assert s.take(0) is head
    head.entry.attempts = 1
    s.to_rq(head)
    assert s.take(10**12) is None  # the follower waits behind the placeholder
    stale = work(0, "a", attempts=0)
    assert s.add(stale) == [stale]  # the main-topic record read again is not the copy
    copy = work(0, "a", attempts=1, due=5_000)
    assert s.add(copy) == []
    assert s.take(4_999) is None  # never before its due time
    assert s.take(5_000) is copy
    s.done(copy)
    assert s.take(5_000) is follower


def test_a_head_retried_in_place_stays_first_and_goes_again_once_due_never_before():
    s = Scheduler()
    head, follower, other = work(0, "a"), work(1, "a"), work(2, "b")
    for w in (head, follower, other):
        s.add(w)
    assert s.take(0) is head
    head.entry.attempts, head.entry.due_ms = 1, 5_000
    s.retry_in_place(head)
    assert s.pending == 3  # it is still held, with its body
    assert s.take(10) is other  # other keys go on
    assert s.take(4_999) is None  # neither the retry before its due time, nor its follower
    assert s.next_due_ms() == 5_000
    assert s.take(5_000) is head and head.entry.value == b"x"
    s.done(head)
    assert s.take(5_000) is follower


def test_an_rq_copy_joins_the_key_its_message_left_whatever_its_own_key_reads():
    s = Scheduler()
    head, follower = work(0, "k1"), work(1, "k1")
    s.add(head)
    s.add(follower)
    s.take(0).entry.attempts = 1
    s.to_rq(head)
    copy = work(0, "group-of-k1", attempts=1)  # keyed by its group id, not the record key
    s.add(copy)
    assert copy.key == "k1" and s.take(0) is copy
    s.done(copy)
    assert s.take(0) is follower


def test_copies_of_one_origin_keep_the_one_with_more_attempts():
    s = Scheduler()
    older, newer = work(3, "a", attempts=1), work(3, "a", attempts=2)
    s.add(older)
    assert s.add(newer) == [older]
    assert s.take(0) is newer


def test_an_older_copy_queues_behind_a_head_in_flight_and_the_key_goes_on():
    # a re-driven dead letter (skip mode) read back while its key's newer message is in flight
    s = Scheduler()
    newer, later = work(5, "a"), work(7, "a")
    s.add(newer)
    s.add(later)
    assert s.take(0) is newer
    redriven = work(2, "a")
    assert s.add(redriven) == []
    assert s.add(work(2, "a")) != []  # a second copy of it is one message
    assert s.take(0) is None  # the key's head is still in flight
    s.done(newer)
    assert s.take(0) is redriven  # then the oldest origin first
    s.done(redriven)
    assert s.take(0) is later
    s.done(later)
    assert s.pending == 0 and s.take(0) is None


def test_an_older_copy_queues_behind_a_head_waiting_for_its_rq_copy():
    s = Scheduler()
    head = work(5, "a")
    s.add(head)
    assert s.take(0) is head
    head.entry.attempts = 1
    s.to_rq(head)
    redriven = work(2, "a")
    assert s.add(redriven) == []
    assert s.take(0) is None  # behind the placeholder
    copy = work(5, "a", attempts=1)
    assert s.add(copy) == []  # the copy takes the placeholder's place
    assert s.take(0) is copy
    s.done(copy)
    assert s.take(0) is redriven


def test_revoked_slots_hand_out_nothing_and_are_dropped():
    s = Scheduler()
    s.add(work(0, "a", slot=0))
    s.add(work(1, "b", slot=1))
    s.close({1})
    taken = s.take(0)
    assert taken.slot == 0 and s.take(0) is None
    s.drop({1})
    assert s.pending == 1


# -- slots, handler, refusals --------------------------------------------------------------------


def test_the_concurrency_limit_is_shared_by_slots_and_sums_to_the_limit():
    assert in_flight_share(64, range(4), 4) == 64  # one member holds every slot
    assert in_flight_share(64, [0, 1], 4) == in_flight_share(64, [2, 3], 4) == 32
    # uneven: the parts of all slots sum to the limit exactly, whoever holds them
    parts = [in_flight_share(10, [s], 3) for s in range(3)]
    assert parts == [3, 3, 4] and sum(parts) == 10
    assert in_flight_share(10, [0, 2], 3) == 7
    assert in_flight_share(64, [], 4) == 0  # no slot: nothing to send
    # fewer requests than slots: a member holding a slot still sends one at a time
    assert [in_flight_share(2, [s], 4) for s in range(4)] == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        in_flight_share(0, [0], 1)
    with pytest.raises(ValueError):
        in_flight_share(4, [4], 4)


def test_slots_are_spread_over_members_and_extra_members_idle():
    assert spread(["b", "a"], 4) == {"a": [0, 1], "b": [2, 3]}
    assert spread(["a", "b", "c"], 2) == {"a": [], "b": [0], "c": [1]}


def test_handler_results_follow_the_retry_policy():
    policy = RetryPolicy(max_attempts=3, min_backoff_ms=1_000, jitter=0.0)
    rng = random.Random(1)
    assert handler.decision(policy, 1, handler.Success(), 0, rng).action == "success"
    fatal = handler.decision(policy, 1, handler.Fatal("bad"), 0, rng)
    assert (fatal.action, fatal.reason) == ("dead_letter", "fatal: bad")
    retry = handler.decision(policy, 1, handler.Retry(), 100, rng)
    assert (retry.action, retry.due_ms) == ("retry", 1_100)
    assert handler.decision(policy, 2, handler.Retry(after_ms=9_000), 0, rng).due_ms == 9_000
    last = handler.decision(policy, 3, handler.Retry(reason="down"), 0, rng)
    assert (last.action, last.reason) == ("dead_letter", "retries exhausted after 3 attempts: down")
    assert handler.decision(policy, 1, "ok", 0, rng).action == "retry"


def _sub(**spec_fields) -> tuple[Subscription, CompositeTopic, CompositeTopic]:
    spec = SubscriptionSpec("s", "t", Endpoint("http://127.0.0.1:1/"), **spec_fields)
    rq = CompositeTopic("s.rq", (StorageTopic("s.rq.0", 2, 1),), internal=True)
    dlq = CompositeTopic("s.dlq", (StorageTopic("s.dlq.0", 1, 1),), internal=True)
    return Subscription(spec, 1, 0), rq, dlq


def test_what_is_not_supported_is_named():
    sub, rq, dlq = _sub()
    found = unsupported(sub, rq, dlq)
    # block mode (the GroupState topic) and the circuit (the members' shared one): the defaults
    assert found == []
    ok = _sub(on_dead_letter="skip")
    assert unsupported(*ok) == []
    assert unsupported(*_sub(on_dead_letter="skip", circuit_breaker=CircuitPolicy(False))) == []
    paused = (replace(ok[0], paused=True), *ok[1:])
    assert unsupported(*paused) == []  # members follow pause/resume
    health = _sub(
        on_dead_letter="skip",
        circuit_breaker=CircuitPolicy(enabled=False, suspend_after_ms=60_000, resume="operator"),
    )
    assert unsupported(*health) == []  # members suspend and follow suspensions
    suspension = Suspension("every attempt to the endpoint failed for 60 s", 1, 0, "operator")
    suspended = (replace(ok[0], suspended=suspension), *ok[1:])
    assert unsupported(*suspended) == []
    # a filter, request shaping and a rate limit are honoured (docs/library.md), not refused
    shaped = Endpoint(
        "http://127.0.0.1:1/",
        max_rate=300.0,
        shaping=RequestShaping((("a", "X-A"),), path="/t/{header:tenant}", key_header="X-Key"),
    )
    filtered = replace(ok[0].spec, endpoint=shaped, filter=filters.parse({"key": {"exists": True}}))
    assert unsupported(replace(ok[0], spec=filtered), *ok[1:]) == []
    assert unsupported(*_sub(delivery=DeliveryPolicy(mode="batch", max_messages=50))) == []


def test_queues_of_a_spark_shard_count_change_are_read_once_it_is_done():
    """After a change on Spark shards, the members read the RQ/DLQ storage topic of the
    current count (`rq_from`/`dlq_from`) once the change's feeders copied the older ones."""
    sub, rq, dlq = _sub(on_dead_letter="skip")
    rq2 = replace(
        rq,
        storage_topics=(*rq.storage_topics, StorageTopic("s.rq.1", 4, 1)),
        produce_pointer=1,
        switched_at_ms=(1, None),
    )
    dlq2 = replace(
        dlq,
        storage_topics=(*dlq.storage_topics, StorageTopic("s.dlq.1", 2, 1)),
        produce_pointer=1,
        switched_at_ms=(1, None),
    )
    changed = replace(sub, rq_from=1, dlq_from=1, shard_count=2)
    assert unsupported(changed, rq2, dlq2, {"step": "done"}) == []
    assert unsupported(changed, rq2, dlq2, None) == []
    feeding = unsupported(changed, rq2, dlq2, {"step": "feed"})
    assert len(feeding) == 1 and "at step feed: its feeders have not" in feeding[0]
    # the queues before the change's activation: the shards' count does not use them yet
    found = unsupported(sub, rq2, dlq2, {"step": "state"})
    assert [f.split(" has ")[0] for f in found[:2]] == ["s.rq", "s.dlq"]
    assert "storage topics after the one the subscription's shard count uses (s.rq.0" in found[0]
