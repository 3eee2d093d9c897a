"""The two phases of a micro-batch (`varadhi.batch`) against a real HTTP endpoint, without Spark:
what phase 1 delivers on its own partition and what it forwards, and phase 2 finishing the
forwarded groups in order with their pending state."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from varadhi import messages as m
from varadhi.batch import (
    BatchContext,
    ForwardRule,
    deliver_records,
    process_partition,
)
from varadhi.batch_commit import stat_rows
from varadhi.group_state import Entry
from varadhi.state_rows import Kind, state_row
from varadhi.subscriptions import parse_spec
from varadhi.testing.endpoint import TestEndpoint

MQ = "orders.0"


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


# What Spark hands phase 1 (`mapInArrow`): the Arrow types of `shard_query.DELIVERY_COLUMNS`.
RECORDS = pa.schema(
    [
        ("kind", pa.string()),
        ("group_key", pa.string()),
        ("group_id", pa.string()),
        ("msg_id", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("value", pa.binary()),
        ("kheaders", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
    ]
)


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


def test_a_replayed_batch_sends_only_what_its_journal_lacks_and_journals_the_rest(monkeypatch):
    """A batch run again after a crash (`BatchContext.replayed`): the messages the crashed run
    journaled are delivered without a request, in their groups' order; what this run's endpoint
    accepts is journaled under the batch's key (`BatchContext.journal`)."""
    from dataclasses import replace

    from varadhi import journal

    sent: list[tuple[str, bytes, bytes, int]] = []

    class Producer:
        def send(self, topic, key, value, partition):
            sent.append((topic, key, value, partition))

        def flush(self, timeout=None):
            pass

    monkeypatch.setattr(journal, "_producer", lambda _bootstrap: Producer())
    records = [_record(offset, group) for offset, group in enumerate("abababab")]
    with TestEndpoint() as endpoint:
        ctx = replace(
            _ctx(endpoint.url),
            journal=journal.JournalTarget("kafka:9092", "s.journal", 0, "s.g0.s1.0.L0/3", 250),
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
    assert {(t, k, p) for t, k, _, p in sent} == {("s.journal", b"s.g0.s1.0.L0/3", 0)}
    journaled = journal.Accepted.of_runs(r for *_, v, _ in sent for r in journal.decode(v))
    assert journaled == journal.Accepted.of(m.Origin(0, 0, x) for x in (3, 6, 7))
