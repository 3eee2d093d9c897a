"""The delivery journal (`varadhi.spark.journal`) and what a replayed micro-batch does with it
(`GroupRun(replayed=...)`), without HTTP, Spark or Kafka: fakes for the producer and the
engine, a temporary folder for the checkpoint."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import replace

import pytest
from kafka.errors import KafkaTimeoutError
from kafka.future import Future

from varadhi.core import messages as m
from varadhi.core.delivery import Outcome
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import Entry, GroupRun, RunCounts, merge
from varadhi.core.policies import RetryPolicy
from varadhi.core.subscription_spec import parse_spec, spec_to_dict
from varadhi.spark import checkpoints, journal
from varadhi.spark.journal import Accepted, JournalTarget, JournalWriter
from varadhi.spark.warehouse_fs import LocalFS

POLICY = RetryPolicy(max_attempts=3, jitter=0.0, in_place_window_ms=0)
T0 = 1_800_000_000_000


def o(offset: int, partition: int = 0, index: int = 0) -> m.Origin:
    return m.Origin(index, partition, offset)


# -- the set of accepted origins --------------------------------------------------------------


def test_runs_of_groups_consecutive_offsets_per_partition():
    origins = [o(5), o(3), o(4), o(9), o(1, partition=2), o(0, index=1), o(2, partition=2)]
    assert journal.runs_of(origins) == [
        (0, 0, 3, 5),
        (0, 0, 9, 9),
        (0, 2, 1, 2),
        (1, 0, 0, 0),
    ]


def test_accepted_membership_and_size():
    accepted = Accepted.of_runs([(0, 0, 10, 19), (0, 0, 15, 30), (0, 0, 32, 32), (1, 3, 0, 0)])
    assert len(accepted) == 21 + 1 + 1
    assert all(o(x) in accepted for x in (10, 25, 30, 32))
    assert not any(o(x) in accepted for x in (9, 31, 33))
    assert o(0, 3, 1) in accepted and o(1, 3, 1) not in accepted
    assert "0:0:10" not in accepted  # only origins
    assert not Accepted() and Accepted.of([o(1)])


def test_encode_decode_round_trip_and_split(monkeypatch):
    origins = [o(x) for x in range(0, 200, 2)] + [o(x, partition=1) for x in range(50)]
    [value] = journal.encode(origins)
    assert json.loads(value)["v"] == 1
    assert Accepted.of_runs(journal.decode(value)) == Accepted.of(origins)
    monkeypatch.setattr(journal, "MAX_NUMBERS_PER_RECORD", 10)
    values = journal.encode(origins)
    assert len(values) == 21  # 101 runs, 5 per record
    runs = [r for v in values for r in journal.decode(v)]
    assert Accepted.of_runs(runs) == Accepted.of(origins)


def test_decode_skips_what_is_not_a_journal_record():
    for junk in (b"", b"\xff", b"[]", b'{"runs": [[0, 0, 1]]}', b'{"runs": [["x"]]}', None):
        assert journal.decode(junk) == []


# -- the writer -------------------------------------------------------------------------------


class FakeProducer:
    """A producer whose sends the broker acknowledges at once, or: `fail` raises from `send`,
    `refuse` answers that many sends with a failed future (the broker did not take them)."""

    def __init__(self, fail: bool = False, refuse: int = 0):
        self.sent: list[tuple[str, bytes, bytes, int]] = []
        self.flushed = 0
        self.fail = fail
        self.refuse = refuse
        self.lock = threading.Lock()

    def send(self, topic, key, value, partition):
        if self.fail:
            raise RuntimeError("broker gone")
        with self.lock:
            if self.refuse:
                self.refuse -= 1
                return Future().failure(KafkaTimeoutError("not acknowledged"))
            self.sent.append((topic, key, value, partition))
        return Future().success(None)

    def flush(self, timeout=None):
        self.flushed += 1

    def origins(self) -> Accepted:
        return Accepted.of_runs(r for _, _, v, _ in self.sent for r in journal.decode(v))


def target(interval_ms: int = 250, max_lag_ms: int = 1_000) -> JournalTarget:
    return JournalTarget("kafka:9092", "s.journal", 1, "s.g0.s1.0.L0/7", interval_ms, max_lag_ms)


def test_writer_sends_everything_by_close_under_the_batch_key():
    producer = FakeProducer()
    writer = JournalWriter(target(interval_ms=60_000), lambda _bootstrap: producer)
    for x in range(10):
        writer.accepted(o(x))
    writer.close()
    assert producer.flushed == 1  # close waits for the broker
    assert {(t, k, p) for t, k, _, p in producer.sent} == {("s.journal", b"s.g0.s1.0.L0/7", 1)}
    assert len(producer.origins()) == 10 and writer.sent_origins == 10


def test_writer_sends_every_interval_while_the_task_delivers():
    producer = FakeProducer()
    writer = JournalWriter(target(interval_ms=50), lambda _bootstrap: producer)
    writer.accepted(o(1))
    deadline = time.monotonic() + 60
    while not producer.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert producer.sent, "nothing sent within the interval"
    assert o(1) in producer.origins()
    writer.close()


def test_writer_sends_early_once_enough_messages_wait(monkeypatch):
    monkeypatch.setattr(journal, "FLUSH_MESSAGES", 5)
    producer = FakeProducer()
    writer = JournalWriter(target(interval_ms=60_000), lambda _bootstrap: producer)
    for x in range(5):
        writer.accepted(o(x))
    deadline = time.monotonic() + 60
    while not producer.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(producer.origins()) == 5
    writer.close()


def test_a_failing_journal_never_fails_the_task_and_says_what_it_did_not_journal(
    caplog, monkeypatch
):
    monkeypatch.setattr(journal, "CLOSE_TIMEOUT_S", 0.3)
    producer = FakeProducer(fail=True)
    writer = JournalWriter(target(interval_ms=60_000), lambda _bootstrap: producer)
    for x in range(3):
        writer.accepted(o(x))
    with caplog.at_level("WARNING", logger="varadhi.spark.journal"):
        writer.close()
    assert writer.unjournaled == 3
    assert "3 accepted messages not journaled" in caplog.text
    unreachable = JournalWriter(target(interval_ms=60_000), lambda _b: 1 / 0)
    unreachable.accepted(o(1))
    unreachable.close()
    assert unreachable.unjournaled == 1


def test_a_broker_down_when_the_task_starts_costs_no_journal_entry():
    """The producer cannot be made at first (the broker is down, or restarting): the writer
    keeps the entries and sends them once it can. Before, its first failure turned the journal
    off for the rest of the task."""
    producer, tries = FakeProducer(), []

    def factory(_target):
        tries.append(1)
        if len(tries) < 3:
            raise KafkaTimeoutError("broker down")
        return producer

    writer = JournalWriter(target(interval_ms=20), factory)
    for x in range(5):
        writer.accepted(o(x))
    deadline = time.monotonic() + 60
    while len(tries) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for x in range(5, 10):
        writer.accepted(o(x))
    writer.close()
    assert producer.origins() == Accepted.of([o(x) for x in range(10)])
    assert writer.unjournaled == 0 and writer.sent_origins == 10


def test_a_record_the_broker_did_not_acknowledge_is_sent_again():
    """A send the broker never acknowledged (the broker died with it in flight, or the
    producer's delivery timeout passed) is sent again. Before, futures were not looked at."""
    producer = FakeProducer(refuse=2)
    writer = JournalWriter(target(interval_ms=60_000), lambda _bootstrap: producer)
    for x in range(4):
        writer.accepted(o(x))
    writer.close()
    assert producer.origins() == Accepted.of([o(x) for x in range(4)])
    assert writer.unjournaled == 0 and writer.sent_origins == 4


# -- a replayed batch: GroupRun(replayed=...) ---------------------------------------------------


def new(offset: int, group: str = "g") -> Entry:
    return Entry(
        origin=o(offset),
        msg_id=f"m{offset}",
        group_id=group,
        location="new",
        value=f"body-{offset}".encode(),
        source=f"t.0/0/{offset}",
    )


class Recorder:
    """Where a run reports what its endpoint accepted (a JournalWriter's `accepted`)."""

    def __init__(self):
        self.origins: list[m.Origin] = []

    def accepted(self, origin: m.Origin) -> None:
        self.origins.append(origin)


def drive(run: GroupRun, status=lambda msg_id: 200) -> list[str]:
    """Play the engine (no waits: every retry goes through the RQ); returns the ids sent."""
    sent = []
    while (request := run.next_request()) is not None:
        msg_id = request.headers[m.HTTP_MESSAGE_ID]
        sent.append(msg_id)
        code = status(msg_id)
        run.on_outcome(Outcome(code, None, f"HTTP {code}", None, 1.0))
    return sent


def run_of(entries, replayed=None, counts=None, journal_=None) -> GroupRun:
    return GroupRun(
        entries,
        POLICY,
        "block",
        lambda: T0,
        random.Random(0),
        counts if counts is not None else RunCounts(),
        replayed=replayed,
        journal=journal_,
    )


def test_a_replayed_run_sends_only_what_the_crashed_run_did_not_get_accepted():
    counts, recorder = RunCounts(), Recorder()
    run = run_of([new(x) for x in range(6)], Accepted.of([o(0), o(1), o(2)]), counts, recorder)
    assert drive(run) == ["m3", "m4", "m5"]
    assert [e.msg_id for e in run.delivered] == [f"m{x}" for x in range(6)]
    assert (counts.delivered, counts.skipped_replayed, counts.attempts) == (6, 3, 3)
    assert recorder.origins == [o(3), o(4), o(5)]  # only what this run's endpoint accepted


def test_a_message_after_one_not_journaled_waits_for_it_in_order():
    # Journal entries are successes; m1 was not journaled (accepted after the last record, or
    # not at all): it is sent again, first; m2 behind it is skipped only when its turn comes.
    counts = RunCounts()
    run = run_of([new(x) for x in range(4)], Accepted.of([o(0), o(2)]), counts)
    assert drive(run) == ["m1", "m3"]
    assert [e.msg_id for e in run.delivered] == ["m0", "m1", "m2", "m3"]
    assert counts.skipped_replayed == 2


def test_a_replayed_run_follows_a_failure_as_always():
    counts = RunCounts()
    run = run_of([new(x) for x in range(4)], Accepted.of([o(0), o(2)]), counts)
    assert drive(run, status=lambda i: 503 if i == "m1" else 200) == ["m1"]
    assert [e.msg_id for e in run.delivered] == ["m0"]
    assert [out.target for out in run.outs] == ["rq"]
    # m2 stays behind m1 (its turn comes after m1's retry, in a later batch, not replayed)
    assert [e.msg_id for e in run.remaining()] == ["m1", "m2", "m3"]


def test_parked_and_retried_messages_are_skipped_by_origin():
    # A group with pending state: its head came back from the RQ (held after merge), a follower
    # was parked (held). The crashed run had delivered both.
    head = replace(new(0), location="rq", attempts=1, value=None)
    follower = replace(new(1), location="held", value=None)
    queue = merge(
        [head, follower],
        [replace(new(0), location="rq", attempts=1), replace(new(1), location="held"), new(2)],
        RunCounts(),
    )
    run = run_of(queue, Accepted.of([o(0), o(1)]))
    assert drive(run) == ["m2"]
    assert run.remaining() == []


def test_without_a_journal_nothing_is_skipped():
    run = run_of([new(0), new(1)])
    assert drive(run) == ["m0", "m1"]


class Pending(FakeProducer):
    """A producer whose sends stay unanswered until `answer()` (the broker is away)."""

    def __init__(self):
        super().__init__()
        self.futures: list[Future] = []

    def send(self, topic, key, value, partition):
        future = Future()
        with self.lock:
            self.futures.append(future)
            self.sent.append((topic, key, value, partition))
        return future

    def answer(self):
        with self.lock:
            futures, self.futures = self.futures, []
        for future in futures:
            future.success(None)


def wait_until(condition, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


class FrozenClock:
    """The journal's `time`, its `monotonic()` moved only by the test (`now`), so that no
    stall of a loaded machine moves a message past `max_lag_ms` or `LAG_GIVE_UP_S` between two
    checks; every other function is the real one."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


def test_the_writer_is_behind_while_its_records_wait_for_the_broker_and_not_for_ever(
    monkeypatch,
):
    monkeypatch.setattr(journal, "LAG_GIVE_UP_S", 60)
    clock = FrozenClock()
    monkeypatch.setattr(journal, "time", clock)
    producer = Pending()
    writer = JournalWriter(target(interval_ms=10, max_lag_ms=100), lambda _bootstrap: producer)
    writer.accepted(o(1))
    assert not writer.behind()
    clock.now += 0.2
    assert wait_until(writer.behind), "not behind while the broker does not answer"
    producer.answer()
    assert wait_until(lambda: not writer.behind())
    monkeypatch.setattr(journal, "LAG_GIVE_UP_S", 0.3)
    writer.accepted(o(2))
    clock.now += 0.2
    assert wait_until(writer.behind)
    clock.now += 0.25  # behind for 0.35 s
    assert wait_until(lambda: not writer.behind()), "still behind after LAG_GIVE_UP_S"
    producer.answer()
    monkeypatch.setattr(journal, "time", time)  # close's deadline on the real clock
    writer.close()
    assert producer.origins() == Accepted.of([o(1), o(2)]) and writer.unjournaled == 0


def test_unacknowledged_counts_what_the_broker_has_not_answered():
    producer = Pending()
    writer = JournalWriter(target(interval_ms=10), lambda _bootstrap: producer)
    for offset in (1, 2, 3):
        writer.accepted(o(offset))
    assert writer.unacknowledged() == 3  # queued, then sent and not answered
    assert wait_until(lambda: producer.sent) and writer.unacknowledged() == 3
    producer.answer()
    assert wait_until(lambda: writer.unacknowledged() == 0)
    writer.close()


def test_the_writer_is_behind_while_making_its_producer_hangs():
    """No producer can be made while the broker is down (each try blocks for the bootstrap
    timeout): the task is held back meanwhile, not only once the try has failed."""
    release, producer = threading.Event(), FakeProducer()

    def hanging(_target):
        release.wait(10)
        return producer

    writer = JournalWriter(target(interval_ms=10, max_lag_ms=100), hanging)
    writer.accepted(o(1))
    assert wait_until(writer.behind), "not behind while the producer cannot be made"
    release.set()
    assert wait_until(lambda: not writer.behind())
    writer.close()
    assert producer.origins() == Accepted.of([o(1)])


# -- which batch is a replay --------------------------------------------------------------------


def _plan(checkpoint, batch_id: int, planned_ms: int) -> None:
    offsets = checkpoint / "offsets"
    offsets.mkdir(parents=True, exist_ok=True)
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": planned_ms, "conf": {}}
    (offsets / str(batch_id)).write_text(f'v1\n{json.dumps(meta)}\n{{"t.0":{{"0":5}}}}\n')


def test_uncommitted_batch_is_the_newest_plan_without_a_commit(tmp_path):
    cp = tmp_path / "cp"
    assert checkpoints.uncommitted_batch(str(cp), LocalFS()) is None  # no checkpoint yet
    _plan(cp, 0, 1_000)
    assert checkpoints.uncommitted_batch(str(cp), LocalFS()) == (0, 1_000)
    (cp / "commits").mkdir()
    (cp / "commits" / "0").write_text("v1\n{}\n")
    assert (
        checkpoints.uncommitted_batch(str(cp), LocalFS()) is None
    )  # committed: the next batch is new
    _plan(cp, 1, 2_000)
    assert checkpoints.uncommitted_batch(str(cp), LocalFS()) == (1, 2_000)
    (cp / "offsets" / "1").write_text("v1\n")  # a plan without its metadata line
    assert checkpoints.uncommitted_batch(str(cp), LocalFS()) == (1, 0)


# -- the setting --------------------------------------------------------------------------------


def test_journal_interval_setting():
    def spec(**consumption):
        doc = {"name": "s", "topic": "t", "endpoint": {"url": "http://h/"}}
        return parse_spec({**doc, "consumption": consumption})

    assert spec().consumption.journal_interval_ms == 250
    assert spec(journal_interval="1s").consumption.journal_interval_ms == 1_000
    assert spec(journal_interval=0).consumption.journal_interval_ms == 0  # off
    assert spec_to_dict(spec(journal_interval="2s"))["consumption"]["journal_interval"] == 2_000
    with pytest.raises(InvalidArgument, match="consumption.journal_interval"):
        spec(journal_interval="-1s")


def test_journal_max_lag_setting_bounds_the_hold_back():
    def spec(**consumption):
        doc = {"name": "s", "topic": "t", "endpoint": {"url": "http://h/"}}
        return parse_spec({**doc, "consumption": consumption}).consumption

    assert spec().journal_max_lag_ms == 1_000
    assert spec(journal_max_lag="5s").journal_max_lag_ms == 5_000
    assert spec(journal_interval="1s").journal_max_lag_ms == 4_000  # unset: four intervals
    assert spec(journal_interval=0, journal_max_lag="100ms").journal_max_lag_ms == 100  # unused
    with pytest.raises(InvalidArgument, match="consumption.journal_max_lag.*twice"):
        spec(journal_interval="1s", journal_max_lag="1500ms")
    doc = {"name": "s", "topic": "t", "endpoint": {"url": "http://h/"}}
    assert spec_to_dict(parse_spec(doc))["consumption"]["journal_max_lag"] == 1_000


def test_the_hold_back_follows_the_target_s_max_lag():
    """A writer whose records the broker never acknowledges holds its task back once the
    oldest accepted message has waited `max_lag_ms`, not before."""
    producer = Pending()
    writer = JournalWriter(target(interval_ms=10, max_lag_ms=600), lambda _bootstrap: producer)
    started = time.monotonic()  # before the message is accepted: a stall after it counts too
    writer.accepted(o(1))
    assert wait_until(writer.behind)
    assert time.monotonic() - started >= 0.6
    producer.answer()
    writer.close()


def test_a_subscription_created_again_under_its_name_has_other_keys():
    assert journal.batch_key("s.g0.s1.0.L0", 3, 1_000) == "s.g0.s1.0.L0/3@1000"
    assert journal.batch_key("s.g0.s1.0.L0", 3, 1_000) != journal.batch_key("s.g0.s1.0.L0", 3, 2)


def test_a_retried_task_reads_the_batch_key_and_never_fails_on_a_read(monkeypatch):
    """`read_on_retry`: the batch's key and partition from the target, the bounded timeout; a
    read that raises gives None (the task delivers everything again), never an error."""
    target = JournalTarget("127.0.0.1:1", "s.journal", 2, "app/7@1", 250)
    calls = []

    def read(settings, topic, partition, key, since_ms, timeout_s):
        calls.append((topic, partition, key, since_ms, timeout_s))
        return Accepted.of_runs([(0, 1, 5, 9)])

    monkeypatch.setattr(journal, "read", read)
    found = journal.read_on_retry(target, 1_000)
    assert m.Origin(0, 1, 7) in found and m.Origin(0, 1, 10) not in found
    assert calls == [("s.journal", 2, "app/7@1", 1_000, journal.RETRY_READ_TIMEOUT_S)]

    def broken(*_args, **_kwargs):
        raise KafkaTimeoutError("no broker")

    monkeypatch.setattr(journal, "read", broken)
    assert journal.read_on_retry(target, 1_000) is None
    monkeypatch.setattr(journal, "read", lambda *a, **k: Accepted())
    assert journal.read_on_retry(target, 1_000) is None  # nothing journaled yet
