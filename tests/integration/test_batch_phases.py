"""The two phases of a micro-batch (`varadhi.spark.batch`) against a real HTTP endpoint, without Spark:
what phase 1 delivers on its own partition and what it forwards, and phase 2 finishing the
forwarded groups in order with their pending state."""

from __future__ import annotations

import time

import pandas as pd
import pyarrow as pa

from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.core.state_rows import Kind, state_row
from varadhi.core.subscription_spec import parse_spec
from varadhi.spark import batch
from varadhi.spark.batch import (
    BatchContext,
    ForwardRule,
    chained,
    deliver_records,
    parked_within,
    process_partition,
    ran_parked,
)
from varadhi.spark.shard.commit import stat_rows
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.micro_batch import RECORDS  # the Arrow types phase 1 reads

MQ = "orders.0"


class TaskClock:
    """The task's clock (`batch._now_ms`, epoch ms), made to read `first_ms` at its first
    reading and to run in real time after it: a record due `d` ms after that is found exactly
    `d` ms early, however long a loaded machine took to start the task. `offset`: real minus
    task time (ms), to compare the endpoint's stamps."""

    def __init__(self, first_ms: int):
        self.first_ms = first_ms
        self.offset: float | None = None

    def __call__(self) -> int:
        real = time.time() * 1000
        if self.offset is None:
            self.offset = real - self.first_ms
        return int(real - self.offset)


def _ctx(url: str, **extra) -> BatchContext:
    spec = parse_spec({"name": "s", "topic": "orders", "endpoint": {"url": url}, **extra})
    return BatchContext(spec=spec, mq_indexes={MQ: 0}, now_ms=0, seed=1)


def _record(offset: int, group: str, kind: str = "mq", value: bytes | None = b"{}", **extra):
    headers = {m.H_MSG_ID: f"{group}-{offset}", m.H_GROUP_ID: group, **extra}
    return {
        "kind": kind,
        "group_key": group,
        "group_id": headers[m.H_GROUP_ID],
        "msg_id": headers[m.H_MSG_ID],
        "topic": MQ if kind == "mq" else "s-rq.0",
        "partition": 0,
        "offset": offset,
        "value": value,
        "kheaders": [{"key": k, "value": v.encode()} for k, v in headers.items()],
    }


def _batch(records: list[dict]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(records, schema=RECORDS)


def _rows(frames) -> pd.DataFrame:
    """A phase's output (Arrow batches from phase 1, frames from phase 2) as one frame."""
    return pd.concat(
        [f.to_pandas() if isinstance(f, pa.RecordBatch) else f for f in frames], ignore_index=True
    )


def _stat(result: pd.DataFrame) -> dict:
    [stat] = stat_rows(result)
    return stat


def test_phase_one_delivers_healthy_groups_and_forwards_the_rest():
    records = [
        _record(0, "a"),
        _record(1, "b"),
        _record(2, "a"),
        _record(3, "b", value=None),  # malformed, of a blocked group: forwarded as it is
        _record(9, "c", kind="rq"),
    ]
    rule = ForwardRule(rq=True, blocked=frozenset({"b"}))
    with TestEndpoint() as endpoint:
        result = _rows(deliver_records(iter([_batch(records)]), _ctx(endpoint.url), rule))
        delivered = [r.message_id for r in endpoint.records()]

    assert delivered == ["a-0", "a-2"]
    fwd = result[result["kind"] == "fwd"]
    assert list(fwd["group_key"]) == ["b", "b", "c"]
    assert list(fwd["location"]) == ["new", "new", "rq"]
    assert fwd["value"].iloc[0] == b"{}"  # bodies travel with forwarded rows
    assert fwd["reason"].iloc[1] == "malformed: no value"
    stat = _stat(result)
    assert (stat["records"], stat["routed"], stat["delivered"], stat["groups"]) == (5, 4, 2, 1)
    assert stat["forwarded"] == 3


def test_phase_two_finishes_forwarded_groups_in_order_with_their_pending_state():
    """Group b waits for its retry (attempt 1 at origin 1); the retry and a newer record come
    forwarded, with a malformed record between them: the retry goes first, the malformed record is
    dead-lettered in its place (and skipped), then the newer one."""
    retry = _record(7, "b", kind="rq")
    retry["kheaders"] += [
        {"key": m.H_ORIGIN, "value": m.Origin(0, 0, 1).encode().encode()},
        {"key": m.H_ATTEMPTS, "value": b"1"},
    ]
    with TestEndpoint() as endpoint:
        ctx = _ctx(endpoint.url, on_dead_letter="skip")
        phase_one = _rows(
            deliver_records(
                iter([_batch([_record(2, "b", value=None), _record(3, "b"), retry])]),
                ctx,
                ForwardRule(rq=True, blocked=frozenset({"b"})),
            )
        )
        waiting = Entry(
            origin=m.Origin(0, 0, 1), msg_id="b-1", group_id="b", location="rq", attempts=1
        )
        pending = {"b": [state_row(Kind.PENDING, "b", waiting)]}
        forwarded = phase_one[phase_one["kind"] == "fwd"]
        result = _rows(process_partition(iter([forwarded]), ctx, pending))
        delivered = [(r.message_id, r.attempt) for r in endpoint.records()]

    assert delivered == [("b-1", 2), ("b-3", 1)]
    outs = result[result["kind"] == "out"]
    assert list(outs["msg_id"]) == ["b-2"] and list(outs["target"]) == ["dlq"]
    assert list(result.loc[result["kind"] == "touched", "group_key"]) == ["b"]
    assert not (result["kind"] == "pending").any()  # b is healthy again
    assert _stat(phase_one)["records"] == 3 and _stat(result)["records"] == 0  # counted once
    assert _stat(result)["delivered"] == 2


def test_a_replayed_batch_sends_only_what_its_journal_lacks_and_journals_the_rest(
    settings, unique_name, read_records
):
    """A batch run again after a crash (`BatchContext.replayed`): the messages the crashed run
    journaled are delivered without a request, in their groups' order; what this run's endpoint
    accepts is journaled under the batch's key (`BatchContext.journal`), on the real broker.
    (With a stand-in producer whose sends were never acknowledged, the task waited out the
    journal's 60 s close timeout.)"""
    from dataclasses import replace

    from varadhi.spark import journal

    topic = journal.topic_name(unique_name("s"))
    journal.ensure_topic(settings, topic, 1)
    records = [_record(offset, group) for offset, group in enumerate("abababab")]
    with TestEndpoint() as endpoint:
        ctx = replace(
            _ctx(endpoint.url),
            journal=journal.JournalTarget(settings.bootstrap, topic, 0, "s.g0.s1.0.L0/3", 250),
            # a's first three and b's first one were accepted before the crash; b-5 was too,
            # but b-3 was not (accepted after the last journal record): b-5 waits its turn.
            replayed=journal.Accepted.of(m.Origin(0, 0, x) for x in (0, 2, 4, 1, 5)),
        )
        result = _rows(deliver_records(iter([_batch(records)]), ctx, ForwardRule()))
        delivered = [r.message_id for r in endpoint.records()]

    assert sorted(delivered) == ["a-6", "b-3", "b-7"]
    assert delivered.index("b-3") < delivered.index("b-7")
    stat = _stat(result)
    assert (stat["delivered"], stat["skipped_replayed"], stat["attempts"]) == (8, 5, 3)
    sent = read_records(topic, isolation="read_uncommitted")
    assert {(r.key, r.partition) for r in sent} == {(b"s.g0.s1.0.L0/3", 0)}
    journaled = journal.Accepted.of_runs(run for r in sent for run in journal.decode(r.value))
    assert journaled == journal.Accepted.of(m.Origin(0, 0, x) for x in (3, 6, 7))


def _rq_record(offset: int, key: str, msg_id: str, origin: int, attempts: int, due_ms: int = 0):
    """The RQ record of message `msg_id` (ungrouped: key "~" + id), retry of main-topic origin
    `origin` after `attempts` attempts."""
    record = _record(offset, key, kind="rq")
    headers = {
        m.H_MSG_ID: msg_id,
        m.H_ORIGIN: m.Origin(0, 0, origin).encode(),
        m.H_ATTEMPTS: str(attempts),
        m.H_DUE_MS: str(due_ms),
    }
    record.update(group_id=None, msg_id=msg_id, offset=offset)
    record["kheaders"] = [{"key": k, "value": v.encode()} for k, v in headers.items()]
    return record


def _mq_record(offset: int, msg_id: str) -> dict:
    """An ungrouped main-topic record (no group id; key "~" + its id)."""
    record = _record(offset, "~" + msg_id)
    record.update(group_id=None, msg_id=msg_id)
    record["kheaders"] = [{"key": m.H_MSG_ID, "value": msg_id.encode()}]
    return record


def _waiting(
    msg_id: str, origin: int, attempts: int = 1, location: str = "rq", value=None, due_ms: int = 0
):
    """A pending row of ungrouped message `msg_id` (its own group)."""
    entry = Entry(
        origin=m.Origin(0, 0, origin),
        msg_id=msg_id,
        group_id=None,
        location=location,  # type: ignore[arg-type]
        value=value,
        attempts=attempts,
        due_ms=due_ms,
    )
    return state_row(Kind.PENDING, "~" + msg_id, entry)


def test_ungrouped_phase_one_merges_rq_records_with_their_pending_entries():
    """Ungrouped, x's entry waits for its RQ record: phase 1 delivers the retry itself (one
    Spark job for the batch) and drops x's main-topic replay and an RQ record no entry waits
    for; y has a parked body in the state, so its RQ record is forwarded as before. On the code
    before (`ForwardRule(rq=True, ...)`), every RQ record was forwarded to a second job."""
    pending = {"~x": [_waiting("x", 1)], "~y": [_waiting("y", 2, location="held", value=b"{}")]}
    rule = ForwardRule.of(pending, grouped=False)
    assert (rule.local, rule.blocked, rule.rq) == (frozenset({"~x"}), frozenset({"~y"}), False)
    records = [
        _mq_record(1, "x"),  # x read again: a replay of its pending origin
        _mq_record(5, "n"),
        _rq_record(10, "~x", "x", origin=1, attempts=1),
        _rq_record(11, "~z", "z", origin=3, attempts=1),  # stale: nothing waits for it
        _rq_record(12, "~y", "y", origin=2, attempts=1),
    ]
    local = {k: pending[k] for k in rule.local}
    with TestEndpoint() as endpoint:
        ctx = _ctx(endpoint.url, grouped=False)
        result = _rows(deliver_records(iter([_batch(records)]), ctx, rule, local))
        delivered = sorted((r.message_id, r.attempt) for r in endpoint.records())

    assert delivered == [("n", 1), ("x", 2)]
    assert list(result.loc[result["kind"] == "touched", "group_key"]) == ["~x"]
    assert not (result["kind"] == "pending").any()  # x is done
    fwd = result[result["kind"] == "fwd"]
    assert list(fwd["group_key"]) == ["~y"] and list(fwd["location"]) == ["rq"]
    stat = _stat(result)
    assert (stat["delivered"], stat["duplicates"], stat["records"]) == (2, 2, 5)
    assert stat["forwarded"] == 1


def test_ungrouped_forward_rule_keeps_grouped_and_parked_groups_as_before():
    pending = {"~a": [_waiting("a", 1)], "~b": [_waiting("b", 2, location="dlq")]}
    assert ForwardRule.of({}, grouped=False) == ForwardRule()
    assert ForwardRule.of(pending, grouped=True) == ForwardRule(
        rq=True, blocked=frozenset({"~a", "~b"}), hand_over=True
    )
    rule = ForwardRule.of(pending, grouped=False)
    assert (rule.local, rule.blocked) == (frozenset({"~a"}), frozenset({"~b"}))
    assert not rule.applies(Kind.RQ, "~a") and rule.applies(Kind.MQ, "~a")
    assert rule.applies(Kind.RQ, "~b") and rule.applies(Kind.MQ, "~b")
    assert not rule.applies(Kind.RQ, "~c") and not rule.applies(Kind.MQ, "~c")


def test_ungrouped_local_entries_are_bounded_by_the_earliest_due():
    """Beyond `max_local` entries (an outage sent everything to the RQ), the groups due first
    are merged in phase 1 and the others forwarded, as on the code before."""
    pending = {f"~m{i}": [_waiting(f"m{i}", i)._replace(due_ms=1_000 - i)] for i in range(5)}
    rule = ForwardRule.of(pending, grouped=False, max_local=2)
    assert rule.local == frozenset({"~m4", "~m3"})
    assert rule.blocked == frozenset({"~m0", "~m1", "~m2"})
    assert ForwardRule.of(pending, grouped=False, max_local=5).local == frozenset(pending)


def test_parked_bodies_phase_one_gets_are_bounded():
    rows = {k: [_waiting(k[1:], 1, location="held", value=b"x" * 10)] for k in ("~a", "~b", "~c")}
    rule = ForwardRule.of(
        {k: [r._replace(value=None) for r in v] for k, v in rows.items()},
        grouped=False,
        due=list(rows),
    )
    kept, trimmed = parked_within(rows, rule, max_bytes=25)
    assert list(kept) == ["~a", "~b"] and trimmed.parked == frozenset({"~a", "~b"})
    assert trimmed.blocked == rule.blocked  # ~c stays blocked and due: phase 2 takes it


def test_phase_two_goes_on_from_phase_one_for_a_group_both_phases_see():
    """Ungrouped message x (id reused by the producer at a second origin, 4) fails again when
    its retry comes back in phase 1; its new main-topic record is forwarded. Phase 2 must start
    from phase 1's result for ~x (the retry waiting in the RQ, attempt 2), not from the state
    before the batch: the final result holds ~x's rows once, the new copy parked behind the
    retry, and the retry's RQ record."""
    pending = {"~x": [_waiting("x", 1)]}
    rule = ForwardRule.of(pending, grouped=False)
    records = [_rq_record(10, "~x", "x", origin=1, attempts=1), _mq_record(4, "x")]
    with TestEndpoint(script={"x": ["500"]}) as endpoint:
        ctx = _ctx(endpoint.url, grouped=False, retry={"in_place_window": "0s"})
        first = _rows(deliver_records(iter([_batch(records)]), ctx, rule, dict(pending)))
        is_fwd = first["kind"] == "fwd"
        forwarded = first[is_fwd]
        rest, state = chained(first[~is_fwd], set(forwarded["group_key"]), pending)
        assert [(r.location, r.attempts) for r in state["~x"]] == [("rq", 2)]
        second = _rows(process_partition(iter([forwarded]), ctx, state))
        delivered = [(r.message_id, r.attempt, r.status) for r in endpoint.records()]

    result = pd.concat([rest, second], ignore_index=True)
    assert delivered == [("x", 2, 500)]
    assert set(result.loc[result["kind"] == "touched", "group_key"]) == {"~x"}
    kept = result[result["kind"] == "pending"]
    assert [(r.origin_offset, r.location, r.attempts) for r in kept.itertuples()] == [
        (1, "rq", 2),
        (4, "held", 0),
    ]
    [out] = result[result["kind"] == "out"].itertuples()
    assert (out.msg_id, out.target, out.attempts) == ("x", "rq", 2)


def test_chained_leaves_groups_phase_one_did_not_run_to_their_pending_state():
    pending = {"~a": [_waiting("a", 1)], "~b": [_waiting("b", 2)]}
    first = pd.DataFrame(
        [
            {"kind": "touched", "group_key": "~a"},
            {
                "kind": "pending",
                "group_key": "~a",
                "location": "rq",
                "origin_index": 0,
                "origin_partition": 0,
                "origin_offset": 1,
                "attempts": 2,
                "msg_id": "a",
            },
            {
                "kind": "pending",
                "group_key": "~c",
                "location": "rq",
                "origin_index": 0,
                "origin_partition": 0,
                "origin_offset": 3,
                "attempts": 1,
                "msg_id": "c",
            },
        ]
    )
    rest, state = chained(first, {"~b", "~d"}, pending)
    assert rest is first and state == {"~b": pending["~b"]}
    rest, state = chained(first, {"~a", "~b"}, pending)
    assert list(rest["group_key"]) == ["~a", "~c"] and list(rest["kind"]) == ["touched", "pending"]
    assert state["~b"] == pending["~b"] and [r.attempts for r in state["~a"]] == [2]


def test_ungrouped_phase_one_delivers_due_parked_retries_in_its_first_task_only():
    """Ungrouped p's retry was parked (read back before its due time) and is due now: its body
    travels with phase 1 (`parked`), and the job's first task delivers it; another task forwards
    what it reads of p (here a stale copy of its RQ record) to phase 2. A group holding a dead
    letter (d) is never parked here. On the code before, a due parked retry always took a
    second Spark job."""
    body = b"body of p"
    pending = {"~p": [_waiting("p", 3, location="held")], "~d": [_waiting("d", 4, location="dlq")]}
    rule = ForwardRule.of(pending, grouped=False, due=["~p", "~d"])
    assert (rule.parked, rule.blocked, rule.local) == (
        frozenset({"~p"}),
        frozenset({"~p", "~d"}),
        frozenset(),
    )
    local = {"~p": pending["~p"]}
    parked = {"~p": [_waiting("p", 3, location="held", value=body)._replace(kind=Kind.HELD)]}
    stale = [_rq_record(20, "~p", "p", origin=3, attempts=1)]
    with TestEndpoint() as endpoint:
        ctx = _ctx(endpoint.url, grouped=False)
        first = _rows(deliver_records(iter([_batch(stale)]), ctx, rule, local, parked, True))
        other = _rows(deliver_records(iter([_batch(stale)]), ctx, rule, local, parked, False))
        delivered = [(r.message_id, r.attempt) for r in endpoint.records()]

    assert delivered == [("p", 2)]
    assert list(first.loc[first["kind"] == "touched", "group_key"]) == ["~p"]
    assert not (first["kind"].isin(["pending", "fwd"])).any()
    assert _stat(first)["duplicates"] == 1  # the stale copy, dropped where p was merged
    assert ran_parked(first, rule) == {"~p"} and ran_parked(other, rule) == set()
    assert list(other.loc[other["kind"] == "fwd", "group_key"]) == ["~p"]
    assert not (other["kind"] == "touched").any()


# -- waits in the task without a linger past its last delivery (`retry.in_place_linger: 0`) ---

NO_LINGER = {"in_place_linger": "0s"}


def test_a_task_with_nothing_else_to_deliver_sends_a_retry_through_the_rq_due_when_it_was():
    """f fails (503, Retry-After 2 s, within the 2 s window) and its task has nothing else to
    deliver: without a linger the task does not wait for the retry, which goes to the RQ due 2 s
    after the failure (Retry-After kept). On the code before, the task always lingered up to the
    window and sent it in place."""
    with TestEndpoint(script={"f": ["503"]}, retry_after_s=2) as endpoint:
        ctx = _ctx(endpoint.url, grouped=False, retry=NO_LINGER)
        result = _rows(deliver_records(iter([_batch([_mq_record(1, "f")])]), ctx, ForwardRule()))
        delivered = [(r.message_id, r.attempt, r.status) for r in endpoint.records()]

    assert delivered == [("f", 1, 503)]
    [out] = result[result["kind"] == "out"].itertuples()
    assert (out.msg_id, out.target, out.attempts) == ("f", "rq", 1)
    assert out.due_ms - out.last_failure_ms == 2_000
    [kept] = result[result["kind"] == "pending"].itertuples()
    assert (kept.location, kept.attempts, kept.due_ms) == ("rq", 1, out.due_ms)
    stat = _stat(result)
    assert (stat["retried_in_place"], stat["retried"]) == (0, 1)


def test_a_retry_still_waits_in_place_while_its_task_has_other_deliveries():
    """Grouped: f fails (503, Retry-After 1 s) while group b keeps the task busy (three answers
    of 0.8 s each, in order): f is sent again from the task, not before its due time, and
    nothing goes to the RQ."""
    records = [_record(1, "f"), *(_record(i, "b") for i in (2, 3, 4))]
    script = {"f-1": ["503"], **{f"b-{i}": ["slow"] for i in (2, 3, 4)}}
    with TestEndpoint(script=script, slow_ms=800) as endpoint:
        ctx = _ctx(endpoint.url, retry=NO_LINGER)
        result = _rows(deliver_records(iter([_batch(records)]), ctx, ForwardRule()))
        attempts = [r for r in endpoint.records() if r.message_id == "f-1"]

    assert [(r.attempt, r.status) for r in attempts] == [(1, 503), (2, 200)]
    # Due at whole ms of the task's clock, read when it read the answer: under 1 ms short at most.
    assert attempts[1].received_ms - attempts[0].received_ms > 1_000 - 1
    assert not (result["kind"].isin(["out", "pending"])).any()
    stat = _stat(result)
    assert (stat["retried_in_place"], stat["retried"], stat["delivered"]) == (1, 0, 4)


def test_an_early_rq_record_is_parked_when_its_task_has_nothing_else_to_deliver(monkeypatch):
    """Ungrouped x's RQ record is read back 1 s before its due time (within the window) and its
    task has nothing else to deliver: x is parked with its body (`held`), never sent early and
    its RQ record never written again. On the code before, the task always waited for it."""
    due_ms = 1_800_000_000_000
    monkeypatch.setattr(batch, "_now_ms", TaskClock(due_ms - 1_000))
    pending = {"~x": [_waiting("x", 1, due_ms=due_ms)]}
    rule = ForwardRule.of(pending, grouped=False)
    records = [_rq_record(10, "~x", "x", origin=1, attempts=1, due_ms=due_ms)]
    with TestEndpoint() as endpoint:
        ctx = _ctx(endpoint.url, grouped=False, retry=NO_LINGER)
        result = _rows(deliver_records(iter([_batch(records)]), ctx, rule, dict(pending)))
        delivered = endpoint.records()

    assert delivered == []
    [kept] = result[result["kind"] == "pending"].itertuples()
    assert (kept.msg_id, kept.location, kept.value, kept.due_ms) == ("x", "held", b"{}", due_ms)
    assert not (result["kind"] == "out").any()
    assert _stat(result)["waited_due"] == 0


def test_an_early_rq_record_waits_while_its_task_delivers_and_is_sent_once_due(monkeypatch):
    """The same early RQ record (due 0.3 s after it is read), its task busy with n (answered
    after 1 s): x waits and is sent once due, in this batch, never before, linger or not."""
    due_ms = 1_800_000_000_000
    clock = TaskClock(due_ms - 300)
    monkeypatch.setattr(batch, "_now_ms", clock)
    pending = {"~x": [_waiting("x", 1, due_ms=due_ms)]}
    rule = ForwardRule.of(pending, grouped=False)
    records = [_mq_record(5, "n"), _rq_record(10, "~x", "x", origin=1, attempts=1, due_ms=due_ms)]
    with TestEndpoint(script={"n": ["slow"]}, slow_ms=1_000) as endpoint:
        ctx = _ctx(endpoint.url, grouped=False, retry=NO_LINGER)
        result = _rows(deliver_records(iter([_batch(records)]), ctx, rule, dict(pending)))
        sent = {r.message_id: r for r in endpoint.records()}

    assert sorted(sent) == ["n", "x"] and sent["x"].attempt == 2
    assert clock.offset is not None and sent["x"].received_ms - clock.offset >= due_ms
    assert not (result["kind"].isin(["out", "pending"])).any()
    assert _stat(result)["waited_due"] == 1


# -- a grouped batch with a second job: phase 1 hands its waits in place over to phase 2 -------


def test_grouped_phase_one_hands_a_waiting_retry_over_to_phase_two_which_sends_it_once_due():
    """Grouped, with a pending group (z), so phase 2 runs anyway: f-1 fails (503, Retry-After
    1 s) and its task has nothing else to send. Phase 1 does not linger for the retry: it
    forwards f as it is (f-1 with its attempt and due time, f-2 behind it, bodies included),
    writes nothing to the RQ, and phase 2 sends f-1 again once due (never earlier), then f-2.
    On the code before, phase 1 lingered and retried f-1 itself."""
    pending = {"z": [_waiting("z", 99)]}
    rule = ForwardRule.of(pending, grouped=True)
    with TestEndpoint(script={"f-1": ["503"]}, retry_after_s=1) as endpoint:
        ctx = _ctx(endpoint.url)
        phase_one = _rows(
            deliver_records(iter([_batch([_record(1, "f"), _record(2, "f")])]), ctx, rule)
        )
        after_phase_one = [(r.message_id, r.attempt) for r in endpoint.records()]
        forwarded = phase_one[phase_one["kind"] == "fwd"]
        phase_two = _rows(process_partition(iter([forwarded]), ctx, {}))
        sent = [(r.message_id, r.attempt, r.status, r.received_ms) for r in endpoint.records()]

    assert after_phase_one == [("f-1", 1)]
    assert not phase_one["kind"].isin(["out", "pending"]).any()
    head, behind = forwarded.itertuples()
    assert (head.msg_id, head.location, head.attempts, head.status) == ("f-1", "new", 1, 503)
    assert head.due_ms - head.last_failure_ms == 1_000 and head.value == b"{}"
    assert (behind.msg_id, behind.location, behind.attempts) == ("f-2", "new", 0)
    assert _stat(phase_one)["forwarded"] == 2 and _stat(phase_one)["retried"] == 0

    assert [s[:3] for s in sent] == [("f-1", 1, 503), ("f-1", 2, 200), ("f-2", 1, 200)]
    assert sent[1][3] >= head.due_ms
    assert not phase_two["kind"].isin(["out", "pending"]).any()
    stat = _stat(phase_two)
    assert (stat["retried_in_place"], stat["retried"], stat["delivered"]) == (1, 0, 2)


def test_phase_one_without_a_second_job_still_lingers_for_its_retries_in_place():
    """Grouped, nothing pending: no phase 2 would run, so phase 1 keeps its linger and sends
    f-1's retry itself, as before."""
    rule = ForwardRule.of({}, grouped=True)
    assert not rule.hand_over and not ForwardRule.of({"~x": [_waiting("x", 9)]}, False).hand_over
    with TestEndpoint(script={"f-1": ["503"]}, retry_after_s=1) as endpoint:
        result = _rows(deliver_records(iter([_batch([_record(1, "f")])]), _ctx(endpoint.url), rule))
        sent = [(r.message_id, r.attempt) for r in endpoint.records()]

    assert sent == [("f-1", 1), ("f-1", 2)]
    assert not result["kind"].isin(["fwd", "out", "pending"]).any()
    assert _stat(result)["retried_in_place"] == 1
