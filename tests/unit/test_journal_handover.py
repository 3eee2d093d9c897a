"""The delivery journal's hand-over across a shard-count change (`varadhi.spark.journal`: HandOver,
hand_over, UncommittedBatch; `varadhi.ops.change_shards_plan.drop_delivered`): pure, no services. The last
tests play a whole change: an old shard's batch delivered part of a group's retries and new
messages, crashed uncommitted, and the new shards then re-read what it read."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from kafka.errors import KafkaTimeoutError

from varadhi.core import messages as m
from varadhi.core import subscription_spec
from varadhi.core.delivery import Outcome
from varadhi.core.group_state import Entry, GroupRun, RunCounts, merge
from varadhi.core.policies import RetryPolicy
from varadhi.kafka.catalog import Snapshot
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import new_topic
from varadhi.ops.change_shards import ChangeShards, HandOverUnreadable
from varadhi.ops.change_shards_plan import carried, drop_delivered, plan_change
from varadhi.spark import checkpoints, journal, layouts
from varadhi.spark.journal import Accepted, HandOver, UncommittedBatch
from varadhi.spark.layouts import Layout
from varadhi.spark.warehouse_fs import LocalFS

NAMES = ["t.0", "t.1"]  # the main topic's storage topics, by index


def o(offset: int, partition: int = 0, index: int = 0) -> m.Origin:
    return m.Origin(index, partition, offset)


# -- offset-run sets ----------------------------------------------------------------------------


def test_runs_within_ranges_and_union():
    accepted = Accepted.of_runs([(0, 0, 0, 9), (0, 0, 20, 29), (0, 1, 5, 5), (1, 0, 0, 3)])
    assert accepted.runs() == [(0, 0, 0, 9), (0, 0, 20, 29), (0, 1, 5, 5), (1, 0, 0, 3)]
    inside = accepted.within([(0, 0, 5, 24), (0, 1, 0, 4), (1, 0, 3, 100)])
    assert inside.runs() == [(0, 0, 5, 9), (0, 0, 20, 24), (1, 0, 3, 3)]
    assert not accepted.within([(0, 0, 10, 19), (2, 0, 0, 100)])
    assert (Accepted.of([o(1)]) | Accepted.of([o(2), o(7)])).runs() == [(0, 0, 1, 2), (0, 0, 7, 7)]
    assert journal.joined(None, Accepted(), None) is None
    assert journal.joined(Accepted.of([o(1)]), None, Accepted.of([o(3)])) == Accepted.of(
        [o(1), o(3)]
    )


# -- what an uncommitted batch covered ----------------------------------------------------------


def test_a_batch_covers_from_its_start_to_its_planned_end_on_main_topic_partitions():
    batch = UncommittedBatch(
        shard=0,
        batch_id=4,
        start={"t.0": {"0": 100, "1": -2}},  # partition 1: from the beginning
        end={"t.0": {"0": 150, "1": 30, "2": 7}, "s.rq.0": {"0": 12}},
        accepted=Accepted(),
    )
    # partition 2 was not in the start positions: read from the beginning too; the RQ is not
    # the main topic (its records' origins are main-topic positions read earlier).
    assert batch.covered(NAMES) == [(0, 0, 100, 149), (0, 1, 0, 29), (0, 2, 0, 6)]
    empty = replace(batch, start={"t.0": {"0": 150}}, end={"t.0": {"0": 150}})
    assert empty.covered(NAMES) == []


# -- the documents for the new shards -----------------------------------------------------------


def crashed(shard: int, start: dict, end: dict, accepted: list[tuple[int, int, int, int]]):
    return UncommittedBatch(shard, 9, start, end, Accepted.of_runs(accepted))


def test_two_to_four_hands_each_new_shard_its_partitions_only_inside_the_covered_ranges():
    # Old shard 0 read partitions 0-1 of t.0 (0..3 partitions, 2 shards), old shard 1 2-3.
    old0 = crashed(
        0,
        {"t.0": {"0": 10, "1": 20}},
        {"t.0": {"0": 15, "1": 25}},
        # 3 and 18: retries / parked followers from before the batch (GroupState's business)
        [(0, 0, 3, 3), (0, 0, 10, 12), (0, 0, 14, 14), (0, 1, 18, 18), (0, 1, 20, 24)],
    )
    old1 = crashed(1, {"t.0": {"2": 0, "3": 0}}, {"t.0": {"2": 5, "3": 0}}, [(0, 2, 0, 1)])
    after = [{"t.0": [0]}, {"t.0": [1]}, {"t.0": [2]}, {"t.0": [3]}]
    docs, left_out = journal.hand_over([old0, old1], NAMES, after, generation=2, seq=1)
    assert left_out == 0
    assert docs == {
        0: HandOver(2, 1, ((0, 0, 10, 12), (0, 0, 14, 14)), {"t.0": {"0": 15}}),
        1: HandOver(2, 1, ((0, 1, 20, 24),), {"t.0": {"1": 25}}),
        2: HandOver(2, 1, ((0, 2, 0, 1),), {"t.0": {"2": 5}}),
    }  # new shard 3 gets none: nothing was read from its partition


def test_four_to_two_merges_the_old_shards_batches():
    olds = [crashed(i, {"t.0": {str(i): 0}}, {"t.0": {str(i): 4}}, [(0, i, 1, 2)]) for i in (0, 1)]
    docs, _ = journal.hand_over(olds, NAMES, [{"t.0": [0, 1]}, {"t.0": [2, 3]}], 0, 3)
    assert docs == {0: HandOver(0, 3, ((0, 0, 1, 2), (0, 1, 1, 2)), {"t.0": {"0": 4, "1": 4}})}


def test_a_hand_over_over_its_size_keeps_a_part_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(journal, "MAX_HANDOVER_NUMBERS", 4)  # two runs
    batch = crashed(
        0, {"t.0": {"0": 0, "1": 0}}, {"t.0": {"0": 50, "1": 50}}, [(0, 0, 0, 0), (0, 0, 2, 3)]
    )
    batch = replace(batch, accepted=batch.accepted | Accepted.of_runs([(0, 1, 5, 9)]))
    docs, left_out = journal.hand_over([batch], NAMES, [{"t.0": [0, 1]}], 0, 0)
    assert docs[0].runs == ((0, 0, 0, 0), (0, 0, 2, 3)) and left_out == 5
    assert docs[0].until == {"t.0": {"0": 50}}  # no bound for a partition it holds nothing of


def test_a_hand_over_document_round_trips_through_json():
    doc = HandOver(1, 2, ((0, 3, 5, 9),), {"t.0": {"3": 10}})
    assert HandOver.from_dict(json.loads(json.dumps(doc.to_dict()))) == doc


# -- which layouts it applies to, and until when --------------------------------------------------


def test_a_hand_over_belongs_to_its_generation_from_its_layout_on(caplog):
    doc = HandOver(1, 2, ((0, 0, 5, 9),), {"t.0": {"0": 10}}).to_dict()
    assert HandOver.of_layout(doc, 1, 2) == HandOver.from_dict(doc)
    assert HandOver.of_layout(doc, 1, 3) is not None  # the next storage topic's layout
    assert HandOver.of_layout(doc, 1, 1) is None  # an earlier era at this shard count
    assert HandOver.of_layout(doc, 2, 2) is None  # an offset reset: a new generation
    assert HandOver.of_layout(None, 1, 2) is None
    with caplog.at_level("WARNING", logger="varadhi.spark.journal"):
        assert HandOver.of_layout({"generation": 1, "seq": 2}, 1, 2) is None
    assert "not one" in caplog.text


def test_a_hand_over_applies_until_the_shard_has_read_past_every_planned_end():
    handover = HandOver(0, 0, ((0, 0, 5, 9), (0, 1, 0, 0)), {"t.0": {"0": 10, "1": 3}})
    assert handover.accepted_below({"t.0": {"0": 5, "1": 0}}) == Accepted.of_runs(handover.runs)
    assert handover.accepted_below({"t.0": {"0": 10, "1": 2}}) is not None  # partition 1 not yet
    assert handover.accepted_below({"t.0": {"0": -2}}) is not None  # from the beginning
    assert handover.accepted_below({"t.0": {"0": 10, "1": 3}}) is None
    assert handover.accepted_below({"t.0": {"0": 11, "1": 40}, "t.1": {"0": 1}}) is None
    assert HandOver(0, 0, (), {"t.0": {"0": 10}}).accepted_below({}) is None


def test_a_second_change_hands_on_what_the_first_handed_an_old_shard_and_it_has_not_read():
    # 2 -> 4 handed new shard 0 (layout generation 0, seq 1) offsets 10-14 of t.0/0; it then
    # crashed again in a batch from 10 that delivered 20-22 (it skipped 10-14, so its journal
    # names only 20-22). The 4 -> 2 change must hand on both, bounded by the furthest plan.
    layout = Layout(0, 1, 0, {"t.0": {"0": 10}})
    doc = HandOver(0, 1, ((0, 0, 10, 14),), {"t.0": {"0": 15}}).to_dict()
    earlier = carried(0, layout, {"t.0": {"0": 10}}, doc)
    assert earlier == UncommittedBatch(
        0, -1, {"t.0": {"0": 10}}, {"t.0": {"0": 15}}, Accepted.of_runs([(0, 0, 10, 14)])
    )
    again = crashed(0, {"t.0": {"0": 10}}, {"t.0": {"0": 30}}, [(0, 0, 20, 22)])
    docs, _ = journal.hand_over([earlier, again], NAMES, [{"t.0": [0, 1]}], 0, 2)
    assert docs == {0: HandOver(0, 2, ((0, 0, 10, 14), (0, 0, 20, 22)), {"t.0": {"0": 30}})}
    assert journal.hand_over([again, earlier], NAMES, [{"t.0": [0, 1]}], 0, 2)[0] == docs
    # once the old shard read past it, or for another layout era, nothing is carried
    assert carried(0, layout, {"t.0": {"0": 15}}, doc) is None
    assert carried(0, Layout(1, 0, 0), {"t.0": {"0": 10}}, doc) is None
    assert carried(0, layout, {"t.0": {"0": 10}}, None) is None


# -- the planned end of an uncommitted batch --------------------------------------------------------


def test_uncommitted_plan_has_the_planned_end_offsets(tmp_path):
    cp = tmp_path / "cp"
    (cp / "offsets").mkdir(parents=True)
    (cp / "commits").mkdir()
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1_000, "conf": {}})
    (cp / "offsets" / "0").write_text(f'v1\n{meta}\n{{"t.0":{{"0":5}}}}\n')
    (cp / "commits" / "0").write_text("v1\n{}\n")
    assert checkpoints.uncommitted_plan(str(cp), LocalFS()) is None
    (cp / "offsets" / "1").write_text(f'v1\n{meta}\n{{"t.0":{{"0":9,"1":3}},"s.rq.0":{{"0":1}}}}\n')
    assert checkpoints.uncommitted_plan(str(cp), LocalFS()) == (
        1,
        1_000,
        {"t.0": {"0": 9, "1": 3}, "s.rq.0": {"0": 1}},
    )
    assert checkpoints.uncommitted_batch(str(cp), LocalFS()) == (1, 1_000)
    (cp / "offsets" / "1").write_text("v1\n")  # a plan that says nothing
    assert checkpoints.uncommitted_plan(str(cp), LocalFS()) == (1, 0, {})


# -- change-shards refuses rather than hand over nothing ------------------------------------------


class _Catalog:
    """What `ChangeShards._uncommitted_batches` reads of the catalog: a snapshot and settings."""

    def __init__(self, warehouse: str, sub: Subscription):
        self.settings = Settings(bootstrap="127.0.0.1:1", warehouse=warehouse)
        self._snap = Snapshot({f"subscription/{sub.name}": sub.to_dict()})

    def snapshot(self) -> Snapshot:
        return self._snap


def _change_with_a_crashed_shard(tmp_path, monkeypatch, read):
    """Two old shards going to three; old shard 1 crashed in batch 4 (planned, not committed);
    `read` stands in for the journal (`journal.read_shard`)."""
    spec = subscription_spec.parse_spec(
        {
            "name": "orders-http",
            "topic": "orders",
            "endpoint": {"url": "http://127.0.0.1:9/"},
            "shards": 2,
        },
        source="test.yaml",
    )
    sub = Subscription(spec, shard_count=2, created_ms=7)
    mq = new_topic("orders", 6)
    rq, dlq = (
        new_topic("orders-http.rq", 4, internal=True),
        new_topic("orders-http.dlq", 2, internal=True),
    )
    positions = {
        s: (Layout(0, 0, 0, {}), {"orders.0": {str(p): 0 for p in range(s * 3, s * 3 + 3)}})
        for s in range(2)
    }
    plan = plan_change(sub, mq, rq, dlq, positions, 3)
    cp = Path(layouts.checkpoint_path(str(tmp_path), sub.name, 2, 1, Layout(0, 0, 0, {})))
    (cp / "offsets").mkdir(parents=True)
    (cp / "commits").mkdir()
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 50_000, "conf": {}})
    (cp / "offsets" / "4").write_text(f'v1\n{meta}\n{{"orders.0":{{"3":20,"4":20,"5":20}}}}\n')
    monkeypatch.setattr(journal, "READ_RETRY_S", 0)
    monkeypatch.setattr(journal, "read_shard", read)
    return ChangeShards(_Catalog(str(tmp_path), sub)), plan


def test_change_shards_refuses_when_an_uncommitted_batch_s_journal_cannot_be_read(
    tmp_path, monkeypatch
):
    """Right after a broker restart (or any Kafka failure) the journal of old shard 1's
    uncommitted batch cannot be read. Before, change-shards warned and handed over nothing,
    and the new shards delivered everything that batch had delivered again (the 7.4% chaos
    run). Now it refuses, in one line, with an exit code."""
    reads = []

    def unreadable(settings, name, shard, key, since_ms):
        reads.append((shard, key, since_ms))
        raise KafkaTimeoutError("journal orders-http.journal/1 not read to its end in 30 s")

    change, plan = _change_with_a_crashed_shard(tmp_path, monkeypatch, unreadable)
    with pytest.raises(HandOverUnreadable) as e:
        change._uncommitted_batches(plan)
    assert e.value.exit_code == 1 and e.value.shard == 1  # at the state step: it resumes there
    assert "old shard 1" in str(e.value) and "\n" not in str(e.value)
    assert reads == [(1, "orders-http.g0.s2.1.L0/4@7", 50_000 - journal.LOOKBACK_MS)] * 3
    with pytest.raises(HandOverUnreadable) as e:
        change._uncommitted_batches(plan, started=False)  # before the first step
    assert e.value.exit_code == 2 and "nothing was changed" in str(e.value)


def test_change_shards_reads_again_after_a_failed_journal_read(tmp_path, monkeypatch):
    calls = []

    def once_unreadable(settings, name, shard, key, since_ms):
        calls.append(shard)
        if len(calls) == 1:
            raise KafkaTimeoutError("broker restarting")
        return Accepted.of_runs([(0, 4, 0, 9)])

    change, plan = _change_with_a_crashed_shard(tmp_path, monkeypatch, once_unreadable)
    [batch] = change._uncommitted_batches(plan)
    assert (batch.shard, batch.batch_id, len(batch.accepted)) == (1, 4, 10)
    assert batch.end == {"orders.0": {"3": 20, "4": 20, "5": 20}}
    assert calls == [1, 1]  # shard 0 has no uncommitted batch: nothing read for it


# -- GroupState: the entries the crashed batch delivered ----------------------------------------------


def pending(group: str, offset: int, location: str = "held", partition: int = 0) -> dict:
    return {
        "kind": "pending",
        "group_key": group,
        "origin_index": 0,
        "origin_partition": partition,
        "origin_offset": offset,
        "location": location,
    }


def test_drop_delivered_drops_each_groups_leading_journaled_entries_only():
    table = pd.DataFrame(
        [
            pending("a", 7),  # listed out of order: origin order decides
            pending("a", 1, "rq"),
            pending("a", 4),
            pending("b", 2, "rq"),
            pending("b", 5),
            pending("c", 3, "dlq"),
            {"kind": "meta", "group_key": None, "origin_index": None},
            {"kind": "out", "group_key": "a", "origin_index": 0, "origin_partition": 0,
             "origin_offset": 1},
        ]
    )  # fmt: skip
    accepted = Accepted.of([o(1), o(4), o(5), o(3)])
    kept = drop_delivered(table, accepted)
    rows = zip(kept["group_key"], kept["origin_offset"], strict=True)
    offsets = {(g, int(x)) for g, x in rows if g}
    # a: 1 and 4 went (7 stays); b: 2 was not accepted, so 5 behind it stays too; c: gone.
    assert offsets == {("a", 7), ("b", 2), ("b", 5), ("a", 1)}  # ("a", 1): the out row
    assert list(kept["kind"]).count("pending") == 3 and "meta" in set(kept["kind"])
    assert drop_delivered(table, Accepted()) is table
    assert drop_delivered(table.iloc[:0], accepted).empty


# -- a whole change, played without services -----------------------------------------------------------

POLICY = RetryPolicy(max_attempts=5, jitter=0.0, in_place_window_ms=0)


def entry(offset: int, location: str, attempts: int = 0, group: str = "g") -> Entry:
    """A record read in the batch (`new` from the main topic, `rq` from the RQ), with its body."""
    return Entry(
        origin=o(offset),
        msg_id=f"m{offset}",
        group_id=group,
        location=location,  # type: ignore[arg-type]
        value=f"body-{offset}".encode(),
        attempts=attempts,
        source=f"t.0/0/{offset}",
    )


def deliver(queue: list[Entry], replayed: Accepted | None) -> tuple[list[str], GroupRun]:
    run = GroupRun(queue, POLICY, "block", lambda: 0, random.Random(0), RunCounts(), None, replayed)
    sent = []
    while (request := run.next_request()) is not None:
        sent.append(request.headers[m.HTTP_MESSAGE_ID])
        run.on_outcome(Outcome(200, None, "HTTP 200", None, 1.0))
    return sent, run


@pytest.fixture
def change():
    """Group g before the crash: m1 waits in the RQ (4 failed attempts), m2 is parked behind it.
    The old shard's batch read offsets 10..19 (m10..m19), delivered m1 (attempt 5), m2, then
    m10..m14 and crashed before its state commit. The new shard that reads partition 0 gets the
    old table's entries (minus what was delivered) and the hand-over, then re-reads 10..19 and
    the fed RQ record of m1."""
    table = pd.DataFrame([pending("g", 1, "rq"), pending("g", 2, "held")])
    batch = UncommittedBatch(
        0,
        3,
        {"t.0": {"0": 10}},
        {"t.0": {"0": 20}},
        Accepted.of_runs([(0, 0, 1, 2), (0, 0, 10, 14)]),
    )
    kept = drop_delivered(table, batch.accepted)
    docs, _ = journal.hand_over([batch], NAMES, [{"t.0": [0]}], 0, 0)
    return kept, docs[0]


def test_the_new_shard_sends_only_what_the_crashed_batch_did_not_deliver(change):
    kept, handover = change
    assert kept.empty  # m1 and m2 were delivered: the entries the state commit would have dropped
    state: list[Entry] = []  # what the new shard's table holds for g
    reread = [entry(x, "new") for x in range(10, 20)] + [entry(1, "rq", attempts=4)]
    counts = RunCounts()
    queue = merge(state, reread, counts)
    assert counts.duplicates == 1  # the fed RQ record of m1 matches no entry: a stale duplicate
    sent, run = deliver(queue, handover.accepted_below({"t.0": {"0": 10}}))
    assert sent == [f"m{x}" for x in range(15, 20)]
    assert [e.msg_id for e in run.delivered] == [f"m{x}" for x in range(10, 20)]  # in order


def test_after_an_offset_reset_that_rewinds_nothing_is_skipped(change):
    _, handover = change
    # The reset starts generation 1: the hand-over (generation 0) names none of its layouts.
    assert HandOver.of_layout(handover.to_dict(), generation=1, seq=0) is None
    # And within its own layouts, once the shard has committed past the batch's end, it is off.
    assert handover.accepted_below({"t.0": {"0": 20}}) is None
    sent, _ = deliver([entry(x, "new") for x in range(10, 20)], None)
    assert sent == [f"m{x}" for x in range(10, 20)]
