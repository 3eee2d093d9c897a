"""The batch-commit protocol (`varadhi.spark.shard.commit`) against in-memory fakes, with a crash
injected at every step of a three-batch scenario.

The fakes model what survives a crash (`World`: the committed state table, Kafka's committed
transactions, what the endpoint accepted, the delivery journal, the dedup window, the catalog's
re-drives) apart from what a process holds (the state copy, an open Kafka transaction). Every
port call is a step, before and after it; `Crasher` raises at step k. After the crash a new
"process" loads the state copy again and Spark runs the crashed batch again (it never committed
its offsets), then the following batches. The outcome must equal one clean run, except for the
duplicates the protocol documents: endpoint deliveries made after a task's last journal record,
and the batch's RQ/DLQ records once more when the crash fell after their Kafka transaction
committed and before the batch returned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pandas as pd
import pytest

from varadhi.core.state_rows import STAT_COLUMNS, TaskStats, stat_row
from varadhi.spark.shard.commit import BatchCommit, changes, sum_counts

APP = "sub.g1.s1.shard-0.L0"


class Crash(Exception):
    """The process died (`os._exit` in `varadhi.core.faults`)."""


class Crasher:
    """Counts steps; raises `Crash` at step `at` (never when None). Also the protocol's `crash`
    port, so its named crash points are steps too."""

    def __init__(self, at: int | None = None):
        self.at = at
        self.steps: list[str] = []

    def __call__(self, name: str) -> None:
        self.steps.append(name)
        if len(self.steps) - 1 == self.at:
            raise Crash(name)


@dataclass
class World:
    """What outlives a process."""

    table: list[dict] = field(default_factory=list)  # the committed GroupState rows
    txns: set[tuple[str, int]] = field(default_factory=set)  # Delta txnAppId/txnVersion seen
    stamp: str = ""  # the last commit's userMetadata
    kafka: list[tuple[str, str, int]] = field(default_factory=list)  # committed RQ/DLQ records
    endpoint: list[str] = field(default_factory=list)  # every message the endpoint accepted
    journal: dict[int, set[str]] = field(default_factory=dict)  # batch -> accepted messages
    dedup: dict[int, frozenset[str]] = field(default_factory=dict)  # batch -> remembered ids
    redrives: dict[str, str] = field(default_factory=dict)  # op id -> DLQ message it re-drives
    redrives_done: set[str] = field(default_factory=set)


class FakeState:
    """`StatePort` over `World.table`: a copy loaded at process start, replaced by `commit`
    idempotently per (app_id, batch_id), as `varadhi.spark.state_store.StateStore` does in Delta."""

    def __init__(self, world: World, step: Crasher, writer: str):
        self.world, self.step, self.writer = world, step, writer
        self.rows = [dict(r) for r in world.table]

    def meta(self):
        self.step("state.meta")
        meta = [r for r in self.rows if r["kind"] == "meta"]
        return (meta[0]["app_id"], meta[0]["batch_id"]) if meta else (None, None)

    def pending(self):
        self.step("state.pending")
        out: dict[str, list[dict]] = {}
        for r in self.rows:
            if r["kind"] == "pending":
                out.setdefault(r["group_key"], []).append(dict(r))
        return out

    def outs(self, app_id, batch_id):
        self.step("state.outs")
        rows = [
            r
            for r in self.rows
            if r["kind"] == "out" and (r["app_id"], r["batch_id"]) == (app_id, batch_id)
        ]
        return pd.DataFrame(rows, columns=["kind", "group_key", "msg_id", "target"])

    def commit(self, touched, new_rows, app_id, batch_id):
        self.step("state.commit")
        kept = [
            r
            for r in self.rows
            if (r["kind"] == "pending" and r["group_key"] not in touched) or r["kind"] == "redrive"
        ]
        new = [{k: v for k, v in r.items() if not pd.isna(v)} for r in new_rows.to_dict("records")]
        rows = kept + new + [{"kind": "meta", "app_id": app_id, "batch_id": batch_id}]
        stamp = f"{self.writer}/{app_id}/{batch_id}"
        if (app_id, batch_id) not in self.world.txns:  # Delta skips a txnVersion seen before
            self.world.txns.add((app_id, batch_id))
            self.world.table, self.world.stamp = [dict(r) for r in rows], stamp
        self.step("state.committed")
        if self.world.stamp == stamp:
            self.rows = rows
            return True
        self.rows = [dict(r) for r in self.world.table]
        return False


class FakeSender:
    """`OutSender`: one transaction per call; records become visible only at its commit (an
    open transaction dies with its process)."""

    def __init__(self, world: World, step: Crasher, batch_id: int):
        self.world, self.step, self.batch_id = world, step, batch_id

    def send(self, outs):
        self.step("send.begin")
        open_tx = []
        for row in outs.to_dict("records"):
            open_tx.append((row["target"], row["msg_id"], self.batch_id))
            self.step("send.record")
        self.step("send.commit")
        self.world.kafka.extend(open_tx)
        self.step("send.committed")


class FakeLease:
    def __init__(self, step: Crasher):
        self.step = step

    def check(self):
        self.step("lease.check")


# What the endpoint answers each message, attempt after attempt.
ANSWERS = {"b1": ["fail", "ok"], "c1": ["dead", "ok"]}


@dataclass
class Input:
    """A micro-batch as the Kafka source reads it: main-topic messages (group, id), and the
    ids of the RQ records it holds (retries due now)."""

    mq: list[tuple[str, str]]
    rq: list[str] = field(default_factory=list)
    redrive: str | None = None  # a re-drive requested in the catalog before this batch


class FakeWork:
    """`BatchWork` with a tiny delivery model: per group, its pending rows in order then its new
    messages; a `rq` head waits for its RQ record, a `dlq` head blocks; the endpoint's answers
    come from `ANSWERS` (default `ok`). Accepted messages are journaled one by one; a batch run
    again skips what its journal holds (`BatchContext.replayed`)."""

    def __init__(self, world: World, step: Crasher, state: FakeState, batch_id: int, inp: Input):
        self.world, self.step, self.state = world, step, state
        self.batch_id, self.input = batch_id, inp
        self.ops: list[str] = []

    def apply_redrives(self) -> bool:
        self.step("redrives.read")
        self.ops = sorted(op for op in self.world.redrives if op not in self.world.redrives_done)
        applied = {r["msg_id"] for r in self.state.rows if r["kind"] == "redrive"}
        for op in self.ops:
            if op in applied:  # committed by a crashed run: not applied twice
                continue
            msg = self.world.redrives[op]
            for r in self.state.rows:
                if r["kind"] == "pending" and r["msg_id"] == msg and r["location"] == "dlq":
                    r["location"] = "held"
            self.state.rows.append({"kind": "redrive", "msg_id": op})
        return bool(self.ops)

    def _attempt(self, msg: str, attempts: int, replayed: set[str]) -> str:
        answer = (ANSWERS.get(msg) or ["ok"])[min(attempts, len(ANSWERS.get(msg, ["ok"])) - 1)]
        if answer == "ok" and msg not in replayed:
            self.world.endpoint.append(msg)
            self.step("endpoint.accepted")
            self.world.journal.setdefault(self.batch_id, set()).add(msg)
            self.step("journal.written")
        return answer

    def deliver(self, pending):
        self.step("deliver.start")
        replayed = set(self.world.journal.get(self.batch_id, set()))
        rows: list[dict] = []
        counts = Counter()
        new_by_group: dict[str, list[str]] = {}
        for g, m in self.input.mq:
            new_by_group.setdefault(g, []).append(m)
        for g in sorted(set(pending) | set(new_by_group)):
            queue = sorted(pending.get(g, []), key=lambda r: r["origin"]) + [
                {"msg_id": m, "location": "new", "attempts": 0, "origin": int(m[1:]) * 10}
                for m in new_by_group.get(g, [])
            ]
            left: list[dict] = []
            for entry in queue:
                if left:
                    left.append(
                        dict(entry, location="held") if entry["location"] == "new" else entry
                    )
                    continue
                if entry["location"] == "dlq" or (
                    entry["location"] == "rq" and entry["msg_id"] not in self.input.rq
                ):
                    left.append(entry)
                    continue
                answer = self._attempt(entry["msg_id"], entry["attempts"], replayed)
                if answer == "ok":
                    counts["delivered"] += 1
                    rows.append({"kind": "done", "group_key": g, "msg_id": entry["msg_id"]})
                    continue
                target = "rq" if answer == "fail" else "dlq"
                counts["retried" if target == "rq" else "dead_lettered"] += 1
                rows.append(
                    {"kind": "out", "group_key": g, "msg_id": entry["msg_id"], "target": target}
                )
                left.append(dict(entry, location=target, attempts=entry["attempts"] + 1))
            if g in pending:
                rows.append({"kind": "touched", "group_key": g})
            rows += [
                {
                    "kind": "pending",
                    "group_key": g,
                    "msg_id": e["msg_id"],
                    "location": e["location"],
                    "attempts": e["attempts"],
                    "origin": e["origin"],
                }
                for e in left
            ]
        counts["records"] = len(self.input.mq) + len(self.input.rq)
        counts["skipped_replayed"] = len(replayed)
        rows.append(stat_row(TaskStats(**counts)))
        self.step("deliver.done")
        return pd.DataFrame(rows, columns=COLUMNS, dtype=object)  # ints stay ints

    def after_delivery(self, result):
        self.step("dedup.remember")
        done = frozenset(result.loc[result["kind"] == "done", "msg_id"])
        self.world.dedup.setdefault(self.batch_id, done)  # idempotent per batch (txnVersion)
        return [{"deduplicated": 0}]

    def finish_redrives(self):
        self.step("redrives.finish")
        applied = {r["msg_id"] for r in self.state.rows if r["kind"] == "redrive"}
        for op in self.ops:
            if op in applied:
                self.world.redrives_done.add(op)
                self.step("redrives.marked")
        self.state.rows = [r for r in self.state.rows if r["kind"] != "redrive"]


COLUMNS = ["kind", "group_key", "msg_id", "location", "attempts", "origin", "target"]
COLUMNS += ["app_id", "batch_id", "reason", *(name for name, _ in STAT_COLUMNS)]

# Batch 0: a delivers, b1 fails (RQ), c1 is dead-lettered (its group blocks).
# Batch 1: b1's RQ record comes back and succeeds, b2 waited behind it; c1 is re-driven and
# delivered; a goes on. Batch 2: healthy, writes nothing.
SCENARIO = [
    Input(mq=[("a", "a1"), ("b", "b1"), ("c", "c1"), ("a", "a2")]),
    Input(mq=[("b", "b2"), ("a", "a3")], rq=["b1"], redrive="op1"),
    Input(mq=[("d", "d4")]),
]


@dataclass
class Run:
    world: World
    outcomes: list  # per batch, the Outcome of its last (successful) run
    crashed_in: int | None = None  # batch the crash fell in
    crash_step: str | None = None
    sent_before_crash: int = 0  # RQ/DLQ records committed to Kafka when the crash hit
    unjournaled: set[str] = field(default_factory=set)  # accepted, not journaled at the crash
    committed_before_crash: bool = False  # the crashed batch's state commit was in the table


def run_scenario(crash_at: int | None) -> tuple[Run, Crasher]:
    world = World()
    crasher = Crasher(crash_at)
    run = Run(world, [])
    process = 0
    state = FakeState(world, crasher, f"p{process}")
    for batch_id, inp in enumerate(SCENARIO):
        if inp.redrive:
            world.redrives[inp.redrive] = "c1"
        while True:
            began = len(world.endpoint)
            work = FakeWork(world, crasher, state, batch_id, inp)
            protocol = BatchCommit(
                state, FakeSender(world, crasher, batch_id), FakeLease(crasher), "t", crasher
            )
            try:
                run.outcomes.append(protocol.run(APP, batch_id, work, started=0.0))
                break
            except Crash as e:
                run.crashed_in, run.crash_step = batch_id, str(e)
                run.sent_before_crash = len(world.kafka)
                journaled = world.journal.get(batch_id, set())
                run.unjournaled = set(world.endpoint[began:]) - journaled
                run.committed_before_crash = (APP, batch_id) in world.txns
                process += 1  # a new process: its copy comes from the table, Spark re-runs
                state = FakeState(world, crasher, f"p{process}")
    return run, crasher


CLEAN, CLEAN_STEPS = run_scenario(None)


def pending_of(world: World) -> set[tuple]:
    return {
        (r["group_key"], r["msg_id"], r["location"], r["attempts"])
        for r in world.table
        if r["kind"] == "pending"
    }


def test_one_clean_run_delivers_retries_dead_letters_and_redrives():
    w = CLEAN.world
    assert Counter(w.endpoint) == Counter(["a1", "a2", "b1", "a3", "b2", "c1", "d4"])
    assert w.kafka == [("rq", "b1", 0), ("dlq", "c1", 0)]
    assert pending_of(w) == set()
    assert w.redrives_done == {"op1"}
    assert [r for r in w.table if r["kind"] == "meta"] == [
        {"kind": "meta", "app_id": APP, "batch_id": 1}
    ]
    assert [o.resent for o in CLEAN.outcomes] == [False, False, False]
    assert CLEAN.outcomes[0].counts == TaskStats(
        delivered=2, retried=1, dead_lettered=1, records=4
    ).counters() | {"deduplicated": 0}
    assert set(CLEAN.outcomes[0].pending) == {"b", "c"}
    assert CLEAN.outcomes[1].pending == {}
    # The healthy batch writes nothing: no state commit, no Kafka transaction.
    steps = CLEAN_STEPS.steps
    last = len(steps) - 1 - steps[::-1].index("state.meta")
    assert "state.commit" not in steps[last:] and "send.begin" not in steps[last:]
    assert steps[last:].count("lease.check") == 1  # and the final check (the first is before)


def test_a_batch_committed_already_only_re_sends_its_records():
    world = World()
    crasher = Crasher()
    state = FakeState(world, crasher, "p0")
    work = FakeWork(world, crasher, state, 0, SCENARIO[0])
    BatchCommit(state, FakeSender(world, crasher, 0), FakeLease(crasher), "t", crasher).run(
        APP, 0, work, 0.0
    )
    again = FakeWork(world, crasher, FakeState(world, crasher, "p1"), 0, SCENARIO[0])
    before = len(crasher.steps)
    outcome = BatchCommit(
        again.state, FakeSender(world, crasher, 0), FakeLease(crasher), "t", crasher
    ).run(APP, 0, again, 0.0)
    assert outcome.resent
    assert "deliver.start" not in crasher.steps[before:]
    assert world.kafka == [("rq", "b1", 0), ("dlq", "c1", 0)] * 2


@pytest.mark.parametrize("at", range(len(CLEAN_STEPS.steps)))
def test_a_crash_at_any_step_then_the_re_run_equals_one_clean_run(at):
    run, crasher = run_scenario(at)
    w, clean = run.world, CLEAN.world
    assert run.crash_step == CLEAN_STEPS.steps[at]
    # Nothing lost: the same state, re-drives, dedup window and records sent.
    assert pending_of(w) == pending_of(clean)
    assert w.redrives_done == clean.redrives_done
    assert w.dedup == clean.dedup
    assert set(w.kafka) == set(clean.kafka)
    assert set(w.endpoint) == set(clean.endpoint)
    # Endpoint duplicates: only messages accepted after the last journal record before the crash.
    again = Counter(w.endpoint) - Counter(clean.endpoint)
    assert set(again) <= run.unjournaled, (run.crash_step, again)
    # RQ/DLQ duplicates: only the crashed batch's records, once more, and only when the crash
    # fell after their transaction committed (the re-run finds the batch committed: step 2).
    extra = Counter(w.kafka) - Counter(clean.kafka)
    batch_outs = Counter(r for r in clean.kafka if r[2] == run.crashed_in)
    committed_then = Counter(w.kafka[: run.sent_before_crash])
    if extra:
        assert extra == batch_outs, (run.crash_step, extra)
        assert batch_outs <= committed_then
        assert run.outcomes[run.crashed_in].resent
    else:
        assert not batch_outs or not (batch_outs <= committed_then)
    # The re-run only re-sends (step 2) exactly when the crash followed the state commit.
    assert run.outcomes[run.crashed_in].resent == run.committed_before_crash


def test_every_protocol_step_is_crashed_at():
    """The named crash points of `varadhi.core.faults` and every port call are among the steps."""
    steps = set(CLEAN_STEPS.steps)
    assert {"after_delivery", "after_state_commit", "after_send"} <= steps
    assert {"state.commit", "state.committed", "send.record", "send.commit"} <= steps
    assert {"endpoint.accepted", "journal.written", "redrives.marked", "lease.check"} <= steps


def test_changes_stamp_out_rows_with_the_batch_and_sum_counts_adds_up():
    result = pd.DataFrame(
        [
            {"kind": "touched", "group_key": "g"},
            {"kind": "pending", "group_key": "g", "msg_id": "m"},
            {"kind": "out", "group_key": "g", "msg_id": "m"},
            {"kind": "done", "group_key": "h", "msg_id": "n"},
        ],
        columns=["kind", "group_key", "msg_id", "app_id", "batch_id"],
        dtype=object,
    )
    touched, rows = changes(result, APP, 7)
    assert touched == {"g"}
    assert list(rows["kind"]) == ["pending", "out"]
    assert rows.iloc[1][["app_id", "batch_id"]].tolist() == [APP, 7]
    assert pd.isna(rows.iloc[0]["batch_id"])
    assert sum_counts([{"a": 1, "200": 2}, {"a": 2, "200": 1, "503": 1}]) == {
        "a": 3,
        "200": 3,
        "503": 1,
    }
