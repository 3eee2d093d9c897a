"""Re-drive decisions (pure): what an applied re-drive covers, what a new one takes, list states."""

import pytest

from varadhi.kafka.catalog import Snapshot, key
from varadhi.kafka.dlq import (
    Applied,
    Parked,
    Selector,
    applied_redrives,
    merged_scanned,
    redrive_rows,
    redrive_state,
    select_redrive,
)

DLQ = "s-dlq.0"


def parked(msg_id, group="g", offset=0, partition=0, last_failure_ms=1_000, origin=None):
    return Parked(
        msg_id=msg_id,
        group_id=group,
        origin=origin or f"0:0:{offset}",
        reason="fatal response 404",
        status=404,
        attempts=1,
        first_failure_ms=last_failure_ms,
        last_failure_ms=last_failure_ms,
        topic=DLQ,
        partition=partition,
        offset=offset,
        value=b"body",
    )


def doc(selector: Selector, done=(), scanned=None, created_ms=5_000, legacy=False):
    d = {
        "kind": "unsideline",
        "selector": selector.to_dict(),
        "created_ms": created_ms,
        "done": list(done),
    }
    if not legacy:
        d["scanned"] = scanned or {}
    return d


def test_an_applied_redrive_covers_what_it_matched_below_its_scan_end():
    applied = Applied(Selector(group_ids=("g",)), {DLQ: {"0": 2}})
    assert applied.covers(parked("a", offset=0))
    assert applied.covers(parked("b", offset=1))
    assert not applied.covers(parked("c", offset=2))  # dead-lettered (again) after the scan
    assert not applied.covers(parked("d", group="h", offset=0))  # not selected
    assert not applied.covers(parked("e", offset=0, partition=1))  # not scanned (other shard)


def test_repeating_a_selector_takes_only_what_was_not_redriven():
    sel = Selector(group_ids=("g",))
    first = [parked("a", offset=0), parked("x", group="h", offset=1), parked("b", offset=2)]
    assert [p.msg_id for _, p in select_redrive(first, {"r1": sel}, [])] == ["a", "b"]
    applied = [Applied(sel, {DLQ: {"0": 3}})]
    # the same selector again: nothing, except `a` dead-lettered again after its re-drive
    again = first + [parked("a", offset=3, last_failure_ms=9_000)]
    taken = select_redrive(again, {"r2": sel}, applied)
    assert [(op_id, p.msg_id, p.offset) for op_id, p in taken] == [("r2", "a", 3)]
    # an overlapping selector takes the message the first one did not select
    since = Selector(failed_since_ms=0)
    assert [p.msg_id for _, p in select_redrive(first, {"r3": since}, applied)] == ["x"]


def test_failed_since_repeated_is_covered_like_group_ids():
    sel = Selector(failed_since_ms=500)
    records = [parked("a", offset=0), parked("b", group="h", offset=1, last_failure_ms=100)]
    assert [p.msg_id for _, p in select_redrive(records, {"r": sel}, [])] == ["a"]
    assert select_redrive(records, {"r": sel}, [Applied(sel, {DLQ: {"0": 2}})]) == []


def test_a_record_is_taken_by_the_first_of_several_pending_redrives_that_matches_it():
    records = [parked("a", offset=0), parked("b", group="h", offset=1)]
    ops = {"r1": Selector(group_ids=("h",)), "r2": Selector(failed_since_ms=0)}
    taken = select_redrive(records, ops, [])
    assert [(op_id, p.msg_id) for op_id, p in taken] == [("r2", "a"), ("r1", "b")]


def test_applied_redrives_from_the_catalog_include_legacy_documents():
    g = Selector(group_ids=("g",))
    snap = Snapshot(
        {
            key("operation", "s/redrive-1-a"): doc(g, done=[0], scanned={DLQ: {"0": 4}}),
            key("operation", "s/redrive-2-b"): doc(g),  # requested, applied by no shard yet
            key("operation", "s/redrive-3-c"): doc(g, done=[0], legacy=True, created_ms=2_000),
            key("operation", "s/redrive-4-d"): doc(g, legacy=True),  # legacy, not applied
            key("operation", "other/redrive-5-e"): doc(g, done=[0], scanned={DLQ: {"0": 9}}),
        }
    )
    applied = applied_redrives(snap, "s")
    assert applied == [Applied(g, {DLQ: {"0": 4}}), Applied(g, {}, 2_000)]
    legacy = applied[1]
    assert legacy.covers(parked("a", offset=7, last_failure_ms=2_000))
    assert not legacy.covers(parked("a", offset=7, last_failure_ms=2_001))


def test_list_state_of_a_record():
    g = Selector(group_ids=("g",))
    done = {"r": doc(g, done=[0], scanned={DLQ: {"0": 2}})}
    assert redrive_state(parked("a", offset=1), done, 1) == "redriven"
    assert redrive_state(parked("a", offset=2), done, 1) == "parked"  # failed again since
    assert redrive_state(parked("x", group="h"), done, 1) == "parked"
    half = {"r": doc(g, done=[0], scanned={DLQ: {"0": 2}})}
    assert redrive_state(parked("b", partition=1), half, 2) == "redrive requested"
    assert redrive_state(parked("b", offset=5), half, 2) == "parked"  # its shard applied it
    legacy = {"r": doc(g, done=[0], legacy=True, created_ms=5_000)}
    assert redrive_state(parked("a"), legacy, 1) == "redriven"
    assert redrive_state(parked("a"), legacy, 2) == "redrive requested"
    assert redrive_state(parked("a", last_failure_ms=6_000), legacy, 1) == "parked"


def test_redrive_rows_keep_one_entry_per_origin():
    twice = [("r", parked("a", offset=0)), ("r", parked("a", offset=3, origin="0:0:0"))]
    rows = redrive_rows(twice, True)
    assert [(r.msg_id, r.location, r.attempts) for r in rows] == [("a", "held", 0)]


def test_a_redriven_entry_is_marked_with_its_redrive_and_a_later_redrive_replaces_the_mark():
    from dataclasses import replace

    from varadhi.core import messages as m
    from varadhi.core.state_rows import entry_of

    (row,) = redrive_rows([("redrive-1-a", parked("a"))], True)
    assert entry_of(row).headers[m.H_REDRIVEN] == "redrive-1-a"
    # parked again after that re-drive: the DLQ copy keeps the mark, which `dlq list` shows
    again = replace(parked("a", offset=4), headers={m.H_REDRIVEN: "redrive-1-a"})
    assert again.redriven_by == "redrive-1-a" and again.summary()["redriven_by"] == "redrive-1-a"
    assert parked("b").summary()["redriven_by"] is None
    (row,) = redrive_rows([("redrive-2-b", again)], True)
    assert entry_of(row).headers[m.H_REDRIVEN] == "redrive-2-b"


def test_scanned_offsets_merge_per_partition():
    assert merged_scanned({DLQ: {"0": 3}}, {DLQ: {"1": 4}, "s-dlq.1": {"0": 1}}) == {
        DLQ: {"0": 3, "1": 4},
        "s-dlq.1": {"0": 1},
    }


def test_a_dlq_record_of_another_producer_is_read_with_the_ids_text_forms():
    from varadhi.core import messages as m
    from varadhi.kafka.dlq import parked_from_record

    p = parked_from_record(DLQ, 1, 7, b"\xff\xfe", b"v", [("x", b"\xff"), (m.H_MSG_ID, b"a\nb")])
    assert (p.group_id, p.msg_id) == ("b64://4=", "b64:YQpi")
    assert p.headers["x"] == "b64:/w=="
    q = parked_from_record(DLQ, 1, 8, None, b"v", [])
    assert (q.group_id, q.msg_id) == (None, f"{DLQ}-1-8")


def test_truncated_copies_and_records_without_an_origin_are_not_re_driven():
    from dataclasses import replace

    from varadhi.core import messages as m

    truncated = replace(parked("a", offset=1), headers={m.H_TRUNCATED: "5000000"})
    foreign = parked("b", offset=2, origin="junk")
    fine = parked("c", offset=3)
    rows = redrive_rows([("r", p) for p in (truncated, foreign, fine)], True)
    assert [r.msg_id for r in rows] == ["c"]


def test_a_rate_is_n_a_second_positive_with_or_without_its_unit():
    from varadhi.core.errors import InvalidArgument
    from varadhi.kafka.dlq import parse_rate

    assert parse_rate("50/s") == parse_rate("50") == 50.0
    assert parse_rate("0.5/s") == 0.5
    for bad in ("0", "-3/s", "fast", "5/m", "inf", "nan", ""):
        with pytest.raises(InvalidArgument, match="--rate must be a positive number"):
            parse_rate(bad)


def test_pending_redrives_come_oldest_first_with_their_rate_shared_among_their_shards():
    from varadhi.kafka.dlq import Redrive, pending_for

    g = Selector(group_ids=("g",))
    rated = doc(g, created_ms=2_000) | {"rate": 30, "shards": 3, "ends": {}}
    snap = Snapshot(
        {
            key("operation", "s/redrive-9-b"): rated,
            key("operation", "s/redrive-1-a"): doc(g, created_ms=3_000),
            key("operation", "s/redrive-5-c"): doc(g, done=[0], created_ms=1_000),
        }
    )
    assert pending_for(snap, "s", 0) == {
        "redrive-9-b": Redrive(g, 30.0, 3, 2_000),
        "redrive-1-a": Redrive(g, None, 1, 3_000),
    }
    assert Redrive(g, 30.0, 3).shard_rate == 10.0 and Redrive(g).shard_rate is None
    # what covers a re-drive's picks: only the re-drives requested before it
    snap = Snapshot(
        {
            key("operation", "s/redrive-1-a"): doc(g, done=[0], scanned={DLQ: {"0": 4}}),
            key("operation", "s/redrive-2-b"): doc(g, done=[0], scanned={DLQ: {"0": 9}})
            | {"created_ms": 6_000},
        }
    )
    assert applied_redrives(snap, "s", (6_000, "redrive-2-b")) == [Applied(g, {DLQ: {"0": 4}})]


def test_list_state_of_a_record_a_rate_capped_redrive_is_putting_back():
    g = Selector(group_ids=("g",))
    under_way = {"r": doc(g, scanned={DLQ: {"0": 3}}) | {"rate": 5, "ends": {DLQ: {"0": 6}}}}
    assert redrive_state(parked("a", offset=2), under_way, 1) == "redriven"
    assert redrive_state(parked("a", offset=4), under_way, 1) == "redrive requested"
    assert redrive_state(parked("a", offset=6), under_way, 1) == "parked"  # after it started
    assert redrive_state(parked("a", partition=1), under_way, 1) == "redrive requested"
