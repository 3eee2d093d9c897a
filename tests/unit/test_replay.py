"""Replay planning and delivery logic (`varadhi.ops.replay`) without Spark, Kafka or HTTP.

Planning: time parsing and refusals, offset ranges from Kafka's `offsetsForTimes` answers, empty
ranges, the Spark source options. Delivery: `ReplayGroup` driven by hand through the Stream
protocol (headers, retries in place answered with `Wait`, failures stop the group), and
`deliver_partition` with a fake engine that plays the delivery engine's `Wait` contract on a fake
clock and answers from a script.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections.abc import Iterable

import pandas as pd
import pytest

from varadhi.core import messages as m
from varadhi.core.delivery import Outcome, Request, Wait
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import Entry
from varadhi.core.policies import Endpoint, RetryPolicy, SubscriptionSpec
from varadhi.core.state_frames import frame_of
from varadhi.kafka.topics import add_storage, new_topic, switch_produce
from varadhi.ops.replay import (
    HTTP_REPLAY,
    MAX_REPORTED_FAILURES,
    RESULT_COLUMNS,
    TASK_COUNTS,
    NothingToReplay,
    PartitionRange,
    ReplayContext,
    ReplayGroup,
    ReplayPlan,
    ReplayResult,
    TimeRange,
    check_endpoint,
    deliver_partition,
    delivery_tasks,
    format_ms,
    plan_ranges,
    render_text,
    resolve_range,
    summarize,
)

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z
ISO_NOW = "2027-01-15T08:00:00Z"
POLICY = RetryPolicy(
    max_attempts=3, backoff="fixed", min_backoff_ms=1_000, max_backoff_ms=1_000, jitter=0.0
)


# -- time range -------------------------------------------------------------------------------


def test_format_ms_is_iso_utc():
    assert format_ms(NOW) == "2027-01-15T08:00:00.000Z"
    assert format_ms(NOW + 5) == "2027-01-15T08:00:00.005Z"


def test_range_from_iso_and_epoch_ms_with_to_defaulting_to_now():
    assert resolve_range("2027-01-15T07:00:00Z", None, NOW) == TimeRange(NOW - 3_600_000, NOW)
    assert resolve_range(str(NOW - 10), str(NOW - 5), NOW) == TimeRange(NOW - 10, NOW - 5)
    # A time without a zone is UTC; an explicit offset is honoured.
    assert resolve_range("2027-01-15T07:00:00", None, NOW).from_ms == NOW - 3_600_000
    assert resolve_range("2027-01-15T08:00:00+01:00", None, NOW).from_ms == NOW - 3_600_000


def test_to_in_the_future_is_clamped_to_now_and_from_before_the_epoch_is_the_epoch():
    assert resolve_range(str(NOW - 1), "2030-01-01T00:00:00Z", NOW) == TimeRange(NOW - 1, NOW)
    assert resolve_range("1960-01-01T00:00:00Z", None, NOW) == TimeRange(0, NOW)


@pytest.mark.parametrize(
    "from_text,to_text,field,words",
    [
        ("yesterday", None, "from", "not a time"),
        ("2027-13-01T00:00:00Z", None, "from", "not a time"),
        (ISO_NOW, "soon", "to", "not a time"),
        ("2027-01-15T09:00:00Z", None, "from", "in the future"),
        (str(NOW + 1), str(NOW + 2), "from", "in the future"),
        ("2027-01-15T07:00:00Z", "2027-01-15T06:00:00Z", "to", "is not after --from"),
        ("2027-01-15T07:00:00Z", "2027-01-15T07:00:00Z", "to", "is not after --from"),
        (ISO_NOW, None, "to", "now is not after --from"),
    ],
)
def test_bad_times_are_refused_naming_the_option(from_text, to_text, field, words):
    with pytest.raises(InvalidArgument) as e:
        resolve_range(from_text, to_text, NOW)
    assert e.value.field == field
    assert words in str(e.value)


# -- offset planning --------------------------------------------------------------------------


def two_storage_topic():
    """`orders` with orders.0 (2 partitions, produce moved off it) and orders.1 (4)."""
    topic, _ = add_storage(new_topic("orders", 2), 4)
    return switch_produce(topic, NOW - 60_000)


def ends_of(topic, value: int) -> dict:
    return {(st.name, p): value for st in topic.storage_topics for p in range(st.partitions)}


def test_ranges_come_from_offsets_for_times_with_none_meaning_the_end():
    topic = two_storage_topic()
    log_ends = ends_of(topic, 10) | {("orders.1", 3): 0}
    starts = {("orders.0", 0): 4, ("orders.0", 1): None, ("orders.1", 0): 0, ("orders.1", 2): 7}
    ends = {("orders.0", 0): 6, ("orders.0", 1): None, ("orders.1", 0): None, ("orders.1", 2): 9}
    ranges = plan_ranges(topic, starts, ends, log_ends)
    assert [(r.topic, r.partition, r.start, r.end) for r in ranges] == [
        ("orders.0", 0, 4, 6),  # records stamped in range: offsets 4 and 5
        ("orders.0", 1, 10, 10),  # nothing stamped at or after --from: empty at the end
        ("orders.1", 0, 0, 10),  # nothing stamped at or after --to: up to the end
        ("orders.1", 1, 10, 10),  # not asked about (no answer): empty
        ("orders.1", 2, 7, 9),
        ("orders.1", 3, 0, 0),  # an empty partition
    ]
    assert [r.storage_index for r in ranges] == [0, 0, 1, 1, 1, 1]
    assert sum(r.size for r in ranges) == 2 + 10 + 2


def test_answers_beyond_the_last_stable_offset_are_clamped_to_it():
    topic = new_topic("orders", 1)
    # An open transaction: the last stable offset (5) is below what a lookup may report.
    ranges = plan_ranges(topic, {("orders.0", 0): 3}, {("orders.0", 0): 8}, {("orders.0", 0): 5})
    assert [(r.start, r.end) for r in ranges] == [(3, 5)]
    ranges = plan_ranges(topic, {("orders.0", 0): 7}, {("orders.0", 0): 9}, {("orders.0", 0): 5})
    assert [(r.start, r.end) for r in ranges] == [(5, 5)]


def make_plan(ranges: Iterable[PartitionRange], tasks: int = 2) -> ReplayPlan:
    return ReplayPlan(
        "1800000000-abc123", "sub", "orders", TimeRange(NOW - 10, NOW), tuple(ranges), tasks
    )


def test_a_plan_without_offsets_is_empty():
    topic = two_storage_topic()
    plan = make_plan(plan_ranges(topic, {}, {}, ends_of(topic, 3)))
    assert plan.empty and plan.max_messages == 0
    assert plan.offsets() == {"orders.0": {}, "orders.1": {}}
    message = str(NothingToReplay("orders", NOW - 10, NOW))
    assert message == (
        "no messages between 2027-01-15T07:59:59.990Z and 2027-01-15T08:00:00.000Z on topic orders"
    )
    assert NothingToReplay.exit_code == 2


def test_kafka_options_read_exactly_the_non_empty_ranges():
    plan = make_plan(
        [
            PartitionRange(0, "orders.0", 0, 4, 6),
            PartitionRange(0, "orders.0", 1, 10, 10),
            PartitionRange(1, "orders.1", 2, 7, 9),
        ]
    )
    options = plan.kafka_options()
    assert json.loads(options["assign"]) == {"orders.0": [0], "orders.1": [2]}
    assert json.loads(options["startingOffsets"]) == {"orders.0": {"0": 4}, "orders.1": {"2": 7}}
    assert json.loads(options["endingOffsets"]) == {"orders.0": {"0": 6}, "orders.1": {"2": 9}}
    assert options["kafka.isolation.level"] == "read_committed"
    assert options["includeHeaders"] == "true"
    assert plan.offsets() == {"orders.0": {"0": [4, 6]}, "orders.1": {"2": [7, 9]}}
    assert not plan.empty and plan.max_messages == 4


def test_delivery_tasks_keep_each_task_near_the_batch_size():
    assert delivery_tasks(10, 2, 100_000) == 2
    assert delivery_tasks(250_000, 2, 100_000) == 3
    assert delivery_tasks(0, 0, 100) == 1


def spec(retry: RetryPolicy | None = None, **endpoint) -> SubscriptionSpec:
    return SubscriptionSpec(
        name="sub",
        topic="orders",
        endpoint=Endpoint(url="http://127.0.0.1:9/", **endpoint),
        retry=retry or RetryPolicy(),
    )


def test_an_endpoint_that_sets_the_replay_header_itself_is_refused():
    check_endpoint(spec(headers=(("X-Team", "a"),)))
    with pytest.raises(InvalidArgument, match="could not be told from live traffic"):
        check_endpoint(spec(headers=(("x-varadhi-replay", "no"),)))


# -- one group's replay -----------------------------------------------------------------------


class Clock:
    def __init__(self, now: int = NOW):
        self.now = now

    def __call__(self) -> int:
        return self.now


def ok() -> Outcome:
    return Outcome(200, None, "HTTP 200", None, 1.0)


def http(status: int, retry_after: str | None = None) -> Outcome:
    return Outcome(status, None, f"HTTP {status}", retry_after, 1.0)


def entry(offset: int, group: str | None = "g", index: int = 0, partition: int = 0, **kw) -> Entry:
    return Entry(
        origin=m.Origin(index, partition, offset),
        msg_id=kw.pop("msg_id", f"{group}-{index}-{offset}"),
        group_id=group,
        location="new",
        value=kw.pop("value", f"body-{offset}".encode()),
        headers={m.H_PRODUCED_MS: "123"},
        source=f"orders.{index}/{partition}/{offset}",
        **kw,
    )


def group(entries, clock=None, policy=POLICY) -> ReplayGroup:
    return ReplayGroup(entries, policy, "1800000000-abc123", clock or Clock(), random.Random(1))


def test_requests_carry_the_normal_headers_and_the_replay_id_in_origin_order():
    g = group([entry(5, index=1), entry(9), entry(3)])
    sent = []
    while (request := g.next_request()) is not None:
        sent.append(request)
        g.on_outcome(ok())
    assert [r.headers[m.HTTP_MESSAGE_ID] for r in sent] == ["g-0-3", "g-0-9", "g-1-5"]
    first = sent[0].headers
    assert first == {
        m.HTTP_MESSAGE_ID: "g-0-3",
        m.HTTP_IDEMPOTENCY_KEY: "g-0-3",
        m.HTTP_ATTEMPT: "1",
        m.HTTP_SOURCE: "orders.0/0/3",
        m.HTTP_GROUP_ID: "g",
        m.HTTP_PRODUCED_AT: "123",
        HTTP_REPLAY: "1800000000-abc123",
    }
    assert sent[0].body == b"body-3"
    assert g.done and g.failure is None and g.delivered == 3 and g.attempts == 3


def test_a_retryable_failure_waits_for_its_backoff_then_is_retried_in_place():
    clock = Clock()
    g = group([entry(1), entry(2)], clock)
    assert g.next_request().headers[m.HTTP_MESSAGE_ID] == "g-0-1"
    g.on_outcome(http(500))
    assert g.due_ms == NOW + 1_000
    assert g.next_request() == Wait(1.0) and not g.done  # waiting, not finished
    clock.now += 400
    assert g.next_request() == Wait(0.6)  # asked early: the time left
    clock.now += 599
    assert g.next_request() == Wait(0.001)
    clock.now += 1
    retry = g.next_request()
    assert retry.headers[m.HTTP_MESSAGE_ID] == "g-0-1" and retry.headers[m.HTTP_ATTEMPT] == "2"
    assert retry.headers[HTTP_REPLAY] == "1800000000-abc123"
    g.on_outcome(ok())
    assert g.next_request().headers[m.HTTP_MESSAGE_ID] == "g-0-2"  # no wait after a success
    assert (g.delivered, g.attempts) == (1, 2)


def test_retry_after_is_honoured_where_the_policy_says_so():
    clock = Clock()
    g = group([entry(1)], clock)
    g.next_request()
    g.on_outcome(http(503, retry_after="5"))
    assert g.due_ms == NOW + 5_000
    assert g.next_request() == Wait(5.0)


def test_exhausted_retries_stop_the_group_and_report_the_message():
    clock = Clock()
    g = group([entry(1), entry(2), entry(3)], clock)
    for attempt in ("1", "2", "3"):
        request = g.next_request()
        assert request.headers[m.HTTP_MESSAGE_ID] == "g-0-1"
        assert request.headers[m.HTTP_ATTEMPT] == attempt
        g.on_outcome(http(503))
        if attempt != "3":
            assert g.next_request() == Wait(1.0)
            clock.now += 1_000
    assert g.done and g.next_request() is None  # no wait after the last attempt
    assert g.failure.msg_id == "g-0-1" and g.failure.attempts == 3 and g.failure.status == 503
    assert g.failure.reason == "retries exhausted after 3 attempts: HTTP 503"
    assert g.failure.not_delivered == 2 and g.failure.origin == "0:0:1"
    assert g.failure.source == "orders.0/0/1"


def test_a_fatal_response_stops_the_group_at_once():
    g = group([entry(1), entry(2), entry(3)])
    g.next_request()
    g.on_outcome(ok())
    g.next_request()
    g.on_outcome(http(404))
    assert g.done and g.delivered == 1 and g.attempts == 2
    assert (g.failure.msg_id, g.failure.reason, g.failure.not_delivered) == (
        "g-0-2",
        "fatal response 404",
        1,
    )


def test_a_malformed_message_fails_without_a_request():
    g = group([entry(1, invalid="malformed: no value", value=None), entry(2)])
    assert g.next_request() is None and g.done and g.attempts == 0
    assert (g.failure.reason, g.failure.attempts, g.failure.not_delivered) == (
        "malformed: no value",
        0,
        1,
    )
    g = group([entry(1, msg_id="bad\r\nX-Evil: 1")])
    assert g.next_request() is None
    assert g.failure.reason.startswith("malformed: ")


# -- partitions -------------------------------------------------------------------------------


class FakeEngine:
    """Plays `HttpDeliverer.run` on the fake clock, one request at a time. Like the engine, it
    asks a stream for its next request as soon as it has handed it an outcome; requests go out in
    the order they were asked for. A stream that answers `Wait(s)` is asked again once the clock
    has moved on by `s`, and its request goes out next; when every stream with work waits, the
    clock jumps to the first one's time (recorded in `slept`, ms). Each request moves the clock
    1 ms and is answered from `script[message id]` (then 200). `sent` records every request as
    (message id, attempt, replay id, clock when sent), `waits` every `Wait` in ms."""

    def __init__(self, clock: Clock, script: dict[str, list[int]] | None = None, *_):
        self.clock = clock
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.sent: list[tuple[str, str, str, int]] = []
        self.waits: list[int] = []
        self.slept: list[int] = []
        self.runs = 0

    def run(self, streams):
        self.runs += 1
        ready: list[tuple[ReplayGroup, Request]] = []
        waiting: list[tuple[int, int, ReplayGroup]] = []  # (wake-up ms, tie-break, stream)
        seq = itertools.count()

        def ask(stream, due_first=False):
            request = stream.next_request()
            if isinstance(request, Wait):
                ms = round(request.seconds * 1000)
                self.waits.append(ms)
                heapq.heappush(waiting, (self.clock.now + ms, next(seq), stream))
            elif request is not None:
                ready.insert(0 if due_first else len(ready), (stream, request))

        for stream in streams:
            ask(stream)
        while ready or waiting:
            while waiting and waiting[0][0] <= self.clock.now:
                ask(heapq.heappop(waiting)[2], due_first=True)
            if not ready:
                self.slept.append(waiting[0][0] - self.clock.now)
                self.clock.now = waiting[0][0]
                continue
            stream, request = ready.pop(0)
            h = request.headers
            msg = h[m.HTTP_MESSAGE_ID]
            self.sent.append((msg, h[m.HTTP_ATTEMPT], h[HTTP_REPLAY], self.clock.now))
            self.clock.now += 1
            answers = self.script.get(msg)
            stream.on_outcome(http(answers.pop(0) if answers else 200))
            ask(stream)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def kafka_row(topic, partition, offset, group, msg_id, value=b"v"):
    headers = [{"key": m.H_MSG_ID, "value": msg_id.encode()}]
    if group is not None:
        headers.append({"key": m.H_GROUP_ID, "value": group.encode()})
    return {
        "kind": "mq",
        "group_key": group if group is not None else f"~{msg_id}",
        "group_id": group,
        "msg_id": msg_id,
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "key": group.encode() if group is not None else None,
        "value": value,
        "kheaders": headers,
    }


def test_deliver_partition_orders_groups_by_origin_and_reports_failures():
    clock = Clock()
    engines = []

    def factory(endpoint, max_in_flight):
        assert max_in_flight == 64
        engines.append(FakeEngine(clock, {"a2": [404]}))
        return engines[-1]

    rows = [
        kafka_row("orders.1", 0, 0, "a", "a3"),  # storage topic 1 comes after 0
        kafka_row("orders.0", 1, 7, "a", "a2"),
        kafka_row("orders.0", 1, 5, "a", "a1"),
        kafka_row("orders.0", 0, 2, "b", "b1"),
        kafka_row("orders.0", 0, 3, None, "u1"),
        kafka_row("orders.0", 0, 4, "b", "b2", value=None),  # malformed: no value
    ]
    frames = [pd.DataFrame(rows[:3]), pd.DataFrame(rows[3:])]
    ctx = ReplayContext("rid", spec(), {"orders.0": 0, "orders.1": 1}, seed=7)
    (out,) = deliver_partition(iter(frames), ctx, factory, clock)
    [engine] = engines
    assert engine.runs == 1
    assert [s[0] for s in engine.sent if s[0].startswith("a")] == ["a1", "a2"]
    assert {s[2] for s in engine.sent} == {"rid"}
    stat = stat_of(out)
    assert stat == {
        "records": 6,
        "groups": 3,
        "delivered": 3,  # a1, b1, u1
        "failed": 2,  # a2 (404), b2 (malformed)
        "not_delivered": 1,  # a3
        "attempts": 4,
    }
    failures = out[out["kind"] == "failure"].set_index("msg_id")
    assert failures.loc["a2", "reason"] == "fatal response 404"
    assert failures.loc["a2", "not_delivered"] == 1 and failures.loc["a2", "status"] == 404
    assert failures.loc["b2", "reason"] == "malformed: no value"
    assert pd.isna(failures.loc["b2", "status"])

    counts, listed = summarize(out)
    assert counts["delivered"] == 3 and counts["failed"] == 2
    assert [(f["msg_id"], f["origin"], f["status"]) for f in listed] == [
        ("b2", "0:0:4", None),
        ("a2", "0:1:7", 404),
    ]


def run_partition(rows, script) -> tuple[FakeEngine, pd.DataFrame]:
    """`deliver_partition` over `rows` with POLICY (3 attempts, 1 s fixed backoff)."""
    clock = Clock()
    engines = []

    def factory(*_):
        engines.append(FakeEngine(clock, script))
        return engines[-1]

    ctx = ReplayContext("rid", spec(POLICY), {"orders.0": 0}, seed=7)
    (out,) = deliver_partition(iter([pd.DataFrame(rows)]), ctx, factory, clock)
    [engine] = engines
    assert engine.runs == 1  # every group, retries included, in one run of the engine
    return engine, out


def stat_of(out: pd.DataFrame) -> dict:
    [stat] = out.loc[out["kind"] == "stat", [f"stat_{n}" for n in TASK_COUNTS]].to_dict("records")
    return {name[len("stat_") :]: int(v) for name, v in stat.items()}


def test_a_group_waiting_for_its_retry_does_not_hold_up_the_other_groups():
    rows = [kafka_row("orders.0", 1, i, "a", f"a{i}") for i in range(3)]
    rows += [kafka_row("orders.0", 0, i, "b", f"b{i}") for i in range(1_500)]
    engine, out = run_partition(rows, {"a0": [500]})
    sent = [s[0] for s in engine.sent]
    assert [s for s in sent if s.startswith("a")] == ["a0", "a0", "a1", "a2"]
    assert [s for s in sent if s.startswith("b")] == [f"b{i}" for i in range(1_500)]
    first, retry = [(s[1], s[3]) for s in engine.sent if s[0] == "a0"]
    # a0 failed when its request completed (1 ms after it went out): it answered Wait(1 s) and
    # was asked again, and retried, only once that second had passed. Meanwhile b went on.
    assert engine.waits == [1_000]
    assert (first[0], retry[0]) == ("1", "2") and retry[1] == first[1] + 1 + 1_000
    b_during_wait = [s for s in engine.sent if s[0].startswith("b") and first[1] < s[3] < retry[1]]
    assert len(b_during_wait) == 1_000 and engine.slept == []
    assert stat_of(out) == {
        "records": 1_503,
        "groups": 2,
        "delivered": 1_503,
        "failed": 0,
        "not_delivered": 0,
        "attempts": 1_504,
    }
    assert (out["kind"] == "failure").sum() == 0


def test_exhausted_attempts_end_the_group_with_a_failure_after_waiting_each_backoff():
    rows = [kafka_row("orders.0", 0, i, "g", f"g{i}") for i in range(3)]
    engine, out = run_partition(rows, {"g1": [503, 503, 503]})
    assert [s[:2] for s in engine.sent] == [("g0", "1"), ("g1", "1"), ("g1", "2"), ("g1", "3")]
    # The only group waits, so the engine sleeps through each backoff; g2 is never sent.
    assert engine.waits == [1_000, 1_000] and engine.slept == [1_000, 1_000]
    assert stat_of(out) == {
        "records": 3,
        "groups": 1,
        "delivered": 1,
        "failed": 1,
        "not_delivered": 1,
        "attempts": 4,
    }
    [failure] = out[out["kind"] == "failure"].to_dict("records")
    assert (failure["msg_id"], failure["group_id"], failure["origin"]) == ("g1", "g", "0:0:1")
    assert (failure["attempts"], failure["status"], failure["not_delivered"]) == (3, 503, 1)
    assert failure["reason"] == "retries exhausted after 3 attempts: HTTP 503"


def test_an_empty_partition_opens_no_connection():
    def factory(*_):
        raise AssertionError("no engine for an empty task")

    (out,) = deliver_partition(iter([]), ReplayContext("rid", spec(), {}, 1), factory, Clock())
    assert stat_of(out)["records"] == 0


# -- results ----------------------------------------------------------------------------------


def test_result_document_and_text():
    plan = make_plan(
        [PartitionRange(0, "orders.0", 1, 4, 6), PartitionRange(0, "orders.0", 0, 0, 0)]
    )
    failure = {
        "group_id": "a",
        "msg_id": "a2",
        "origin": "0:1:5",
        "source": "orders.0/1/5",
        "attempts": 1,
        "status": 404,
        "reason": "fatal response 404",
        "not_delivered": 0,
    }
    counts = {
        "records": 2,
        "groups": 1,
        "delivered": 1,
        "failed": 1,
        "not_delivered": 0,
        "attempts": 2,
    }
    result = ReplayResult(plan, NOW, NOW + 5, counts, [failure])
    assert not result.ok
    doc = result.to_dict()
    assert doc["kind"] == "replay" and doc["step"] == "done"
    assert doc["offsets"] == {"orders.0": {"1": [4, 6]}}
    assert (doc["from"], doc["to"]) == ("2027-01-15T07:59:59.990Z", "2027-01-15T08:00:00.000Z")
    assert doc["failures_not_listed"] == 0
    text = render_text(doc)
    assert "replay 1800000000-abc123 of sub" in text and "orders.0: p1 4..6" in text
    assert "delivered 1 of 2 messages" in text and "message a2 of group a" in text
    assert ReplayResult(plan, NOW, NOW, {**counts, "failed": 0}).ok


def test_only_the_first_failures_are_listed_all_are_counted():
    n = MAX_REPORTED_FAILURES + 5
    rows = frame_of(
        [
            {
                "kind": "failure",
                "group_id": f"g{i}",
                "msg_id": f"m{i}",
                "origin": f"0:0:{n - i}",
                "source": "",
                "attempts": 1,
                "status": 404,
                "reason": "fatal response 404",
                "not_delivered": 0,
            }
            for i in range(n)
        ]
        + [{"kind": "stat", "stat_records": n, "stat_failed": n}],
        RESULT_COLUMNS,
    )
    counts, listed = summarize(rows)
    assert counts["failed"] == n and len(listed) == MAX_REPORTED_FAILURES
    assert listed[0]["origin"] == "0:0:1"  # origin order, not row order
    plan = make_plan([PartitionRange(0, "orders.0", 0, 0, n)])
    assert ReplayResult(plan, NOW, NOW, counts, listed).to_dict()["failures_not_listed"] == 5
