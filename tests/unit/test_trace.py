"""The delivery trace's pure parts (`varadhi.core.trace`), what a group run tells it
(`GroupRun`'s `tracer`), the spec's `trace` section and `varadhi trace`'s arguments. The trace
written by a real shard and read back from Kafka: tests/integration/test_filters.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.future import Future

from varadhi.cli import build_parser
from varadhi.core import messages as m
from varadhi.core import trace
from varadhi.core.delivery import Outcome, Wait
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import OVER_LIMIT, Entry, GroupRun, RunCounts
from varadhi.core.policies import BlockedPolicy, RetryPolicy, TracePolicy
from varadhi.core.subscription_spec import parse_spec, spec_from_dict, spec_to_dict
from varadhi.core.trace import TraceEvent, Tracer
from varadhi.kafka.trace import TraceTarget, TraceWriter

T0 = 1_800_000_000_000
POLICY = RetryPolicy(max_attempts=2, min_backoff_ms=1_000, jitter=0.0, in_place_window_ms=0)
IN_PLACE = replace(POLICY, in_place_window_ms=5_000)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def entry(offset: int, **kw) -> Entry:
    return Entry(
        origin=m.Origin(0, 0, offset),
        msg_id=f"m{offset}",
        group_id="g",
        location="new",
        value=b"body",
        source=f"t.0/0/{offset}",
        **kw,
    )


def traced_run(
    entries: list[Entry], policy: RetryPolicy = POLICY, **kw
) -> tuple[GroupRun, list[TraceEvent], Clock]:
    events: list[TraceEvent] = []
    clock = Clock()
    run = GroupRun(
        entries, policy, kw.pop("on_dead_letter", "block"), clock, random.Random(0), RunCounts(),
        tracer=Tracer(events.append, 3, clock), **kw,
    )  # fmt: skip
    return run, events, clock


def steps(events: list[TraceEvent]) -> list[tuple]:
    return [(e.msg_id, e.kind, e.attempt, e.status, e.next) for e in events]


def answer(run: GroupRun, outcome: Outcome) -> None:
    request = run.next_request()
    assert request is not None and not isinstance(request, Wait)
    run.on_outcome(outcome)


# -- what a group run traces ------------------------------------------------------------------


def test_every_attempt_is_traced_with_where_its_message_went_next():
    run, events, _ = traced_run([entry(1), entry(2)])
    answer(run, Outcome(200, None, "HTTP 200", None, 4.25))
    answer(run, Outcome(503, None, "HTTP 503", None, 9.5, b"busy, try later"))
    assert steps(events) == [
        ("m1", "attempt", 1, 200, "delivered"),
        ("m2", "attempt", 1, 503, "rq"),
    ]
    assert events[1].latency_ms == 9.5 and events[1].answer == "busy, try later"
    assert {(e.shard, e.group_id, e.at_ms) for e in events} == {(3, "g", T0)}
    assert events[0].source == "t.0/0/1"


def test_a_failure_without_an_answer_keeps_its_error_and_curls_reason():
    run, events, _ = traced_run([entry(1, attempts=1)])
    answer(run, Outcome(None, "connection_error", "Failed to connect", None, 2.0))
    [e] = events
    assert (e.attempt, e.status, e.error, e.reason, e.next) == (
        2, None, "connection_error", "Failed to connect", "dlq",
    )  # fmt: skip


def test_a_retry_in_place_is_traced_as_retry_and_its_move_to_the_rq_as_routed():
    run, events, clock = traced_run([entry(1)], IN_PLACE)
    answer(run, Outcome(500, None, "HTTP 500", None, 1.0))
    assert isinstance(run.next_request(), Wait)
    run.stop_waiting()  # the task ran out of other work: through the RQ after all
    assert steps(events) == [("m1", "attempt", 1, 500, "retry"), ("m1", "routed", None, None, "rq")]
    assert "waited in place" in events[1].reason


def test_messages_routed_without_an_attempt_are_traced_with_the_reason():
    bad = entry(1, invalid="malformed: no value")
    run, events, _ = traced_run([bad, entry(2)], on_dead_letter="skip")
    answer(run, Outcome(200, None, "HTTP 200", None, 1.0))
    assert steps(events) == [
        ("m1", "routed", None, None, "dlq"),
        ("m2", "attempt", 1, 200, "delivered"),
    ]
    assert events[0].reason == "malformed: no value"

    replayed = traced_run([entry(3)], replayed={m.Origin(0, 0, 3)})
    assert replayed[0].next_request() is None
    assert steps(replayed[1]) == [("m3", "routed", None, None, "delivered")]


def test_messages_over_a_blocked_groups_limit_are_traced_as_dead_letters():
    entries = [entry(1, attempts=1)] + [entry(n) for n in range(2, 6)]
    run, events, _ = traced_run(entries, blocked=BlockedPolicy(max_held=2))
    answer(run, Outcome(400, None, "HTTP 400", None, 1.0))  # fatal: the group blocks
    run.remaining()
    dead = [(e.msg_id, e.next, e.reason) for e in events if e.kind == "routed"]
    assert dead == [(f"m{n}", "dlq", OVER_LIMIT) for n in (4, 5)]


def test_a_redriven_message_carries_its_redrive_into_the_trace():
    run, events, _ = traced_run([entry(1, headers={m.H_REDRIVEN: "op-7"})])
    answer(run, Outcome(200, None, "HTTP 200", None, 1.0))
    assert events[0].redriven == "op-7"


def test_a_run_without_a_tracer_traces_nothing_and_behaves_the_same():
    run = GroupRun([entry(1)], POLICY, "block", Clock(), random.Random(0), RunCounts())
    answer(run, Outcome(200, None, "HTTP 200", None, 1.0))
    assert [e.msg_id for e in run.delivered] == ["m1"]


# -- records, partitions, reading back ------------------------------------------------------


def test_records_round_trip_and_hold_at_most_their_share_of_events():
    events = [
        TraceEvent(f"id-{n}", T0 + n, "attempt", "delivered", shard=0, attempt=1, status=200)
        for n in range(trace.MAX_EVENTS_PER_RECORD + 3)
    ]
    records = trace.encode(events)
    assert [n for _, n in records] == [trace.MAX_EVENTS_PER_RECORD, 3]
    assert [e for value, _ in records for e in trace.decode(value)] == events


def test_a_record_that_is_not_one_is_skipped_and_unknown_fields_are_ignored():
    assert trace.decode(b"not json") == []
    assert trace.decode(b'{"v": 1}') == []
    newer = (
        b'{"v":2,"fields":["x","next","msg_id","at_ms","kind"],"events":[[1,"dlq","a",1,"routed"]]}'
    )
    assert trace.decode(newer) == [TraceEvent("a", 1, "routed", "dlq")]


def test_a_messages_events_are_found_by_its_id_alone_oldest_first():
    a = [TraceEvent("a", t, "attempt", "rq") for t in (30, 10, 20)]
    assert [e.at_ms for e in trace.of_message(a + [TraceEvent("b", 5, "routed", "dlq")], "a")] == [
        10, 20, 30,
    ]  # fmt: skip
    # Known values: CRC-32 of the UTF-8 bytes, so any process agrees (non-ASCII ids too).
    assert [trace.partition_of(i, 6) for i in ("order-1", "order-2", "grüße", "")] == [
        0xE0B37FEF % 6, 0x79BA2E55 % 6, 0x346E49ED % 6, 0,
    ]  # fmt: skip
    assert trace.partition_of("anything", 1) == 0


def test_an_answer_is_cut_to_its_start():
    events: list[TraceEvent] = []
    Tracer(events.append, 0, lambda: T0).attempt(
        "a", None, 1, 500, None, 1.0, ("é" * 1000).encode(), "rq"
    )
    assert events[0].answer == "é" * trace.ANSWER_CHARS


# -- the spec and the command -----------------------------------------------------------------


def spec(**trace_section) -> dict:
    doc = {"name": "s", "topic": "t", "endpoint": {"url": "http://127.0.0.1:9/"}}
    return {**doc, **trace_section}


def test_the_trace_section_is_optional_takes_a_retention_and_round_trips():
    assert parse_spec(spec()).trace is None
    assert parse_spec(spec(trace={})).trace == TracePolicy()
    week = parse_spec(spec(trace={"retention": "7d"}))
    assert week.trace == TracePolicy(retention_ms=7 * 86_400_000)
    assert spec_from_dict(spec_to_dict(week)).trace == week.trace
    assert spec_from_dict(spec_to_dict(parse_spec(spec()))).trace is None
    assert parse_spec(spec(trace=False)).trace is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"retention": "10m"}, "at least 3600000ms"),
        ({"retention": "91d"}, "at most 90d"),
        ({"retention": "7"}, "has no unit"),
        ({"keep": "7d"}, r"unknown key\(s\) keep"),
    ],
)
def test_a_bad_trace_section_names_the_field(section, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        parse_spec(spec(trace=section))
    assert e.value.field.startswith("trace")


def test_the_trace_command_needs_a_message_id():
    args = build_parser().parse_args(["trace", "s", "--message-id", "m1", "--since", "2026-12-01"])
    assert (args.name, args.message_id, args.since, args.output) == (
        "s",
        "m1",
        "2026-12-01",
        "text",
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["trace", "s"])


# -- the writer (a stand-in for Kafka's producer: what it is given, and what it refuses) ------


class Producer:
    """Takes every record (`fail`: refuses each with the error), answering at once."""

    def __init__(self, fail: Exception | None = None):
        self.fail = fail
        self.sent: list[tuple[str, int, bytes]] = []

    def send(self, topic, value=None, partition=None):
        if self.fail is not None:
            return Future().failure(self.fail)
        self.sent.append((topic, partition, value))
        return Future().success(None)

    def flush(self, timeout=None):
        pass


def events_of(n: int) -> list[TraceEvent]:
    return [TraceEvent(f"id-{i}", T0, "attempt", "delivered", shard=0) for i in range(n)]


def test_the_writer_sends_each_event_to_its_messages_partition_by_close():
    producer = Producer()
    writer = TraceWriter(TraceTarget("kafka:9092", "s.trace", 4, 0), lambda _t: producer)
    for e in events_of(50):
        writer.add(e)
    writer.close()
    assert (writer.added, writer.sent, writer.dropped) == (50, 50, 0)
    for topic, partition, value in producer.sent:
        assert topic == "s.trace"
        assert {trace.partition_of(e.msg_id, 4) for e in trace.decode(value)} == {partition}
    assert sorted(e.msg_id for *_, v in producer.sent for e in trace.decode(v)) == sorted(
        e.msg_id for e in events_of(50)
    )


def test_events_kafka_does_not_take_are_dropped_and_counted_never_raised(caplog):
    refusing = TraceWriter(
        TraceTarget("kafka:9092", "s.trace", 4, 0),
        lambda _t: Producer(KafkaTimeoutError("no broker")),
    )
    for e in events_of(10):
        refusing.add(e)
    with caplog.at_level("WARNING", logger="varadhi.kafka.trace"):
        refusing.close()
    assert (refusing.sent, refusing.dropped) == (0, 10)
    assert "10 of 10 events not written" in caplog.text

    def no_producer(_target):
        raise KafkaTimeoutError("no broker to bootstrap from")

    unreachable = TraceWriter(TraceTarget("kafka:9092", "s.trace", 4, 0), no_producer)
    for e in events_of(3):
        unreachable.add(e)
    unreachable.close()
    assert (unreachable.sent, unreachable.dropped) == (0, 3)
