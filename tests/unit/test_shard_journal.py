"""The shard driver's side of the delivery journal (`varadhi.spark.shard.journal.ShardJournal`) with
the topic and the reader injected: where a batch journals, and which batch reads what a crashed
run journaled. The journal against Kafka is tests/integration/test_shard_crash.py's."""

from __future__ import annotations

from dataclasses import replace

from kafka.errors import KafkaTimeoutError

from varadhi.core import subscription_spec
from varadhi.kafka import subscriptions as subs
from varadhi.kafka.settings import Settings
from varadhi.spark import journal
from varadhi.spark.shard.journal import ShardJournal

ACCEPTED = journal.Accepted.of_runs([(0, 3, 10, 19)])


def sub_of(journal_ms: int) -> subs.Subscription:
    spec = subscription_spec.parse_spec(
        {"name": "orders-http", "topic": "orders", "endpoint": {"url": "http://127.0.0.1:1/x"}},
        source="test.yaml",
    )
    spec = replace(
        spec,
        shards=4,
        consumption=replace(spec.consumption, journal_interval_ms=journal_ms),
    )
    return subs.Subscription(spec, shard_count=4, created_ms=123)


class Reader:
    def __init__(self, result=ACCEPTED):
        self.calls: list[tuple] = []
        self.result = result

    def __call__(self, settings, topic, partition, key, since_ms):
        self.calls.append((topic, partition, key, since_ms))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def shard_journal(reader=None, partitions=2):
    created: list[tuple] = []

    def ensure(settings, topic, count):
        created.append((topic, count))
        return partitions

    j = ShardJournal(
        Settings(bootstrap="127.0.0.1:1"), "orders-http", 3, ensure, reader or Reader()
    )
    return j, created


def test_the_topic_is_made_once_and_a_batch_journals_to_the_shard_s_partition():
    sub = sub_of(250)
    j, created = shard_journal()
    j.ensure(sub)
    j.ensure(sub)
    assert created == [("orders-http.journal", 4)]
    target = j.target(sub, "app", 7)
    assert (target.topic, target.partition, target.interval_ms) == ("orders-http.journal", 1, 250)
    assert target.key == journal.batch_key("app", 7, 123)
    off, made = shard_journal()
    off.ensure(sub_of(0))
    assert made == [] and off.target(sub_of(0), "app", 7) is None


def test_only_the_query_s_first_batch_reads_and_only_when_it_is_the_one_a_crashed_run_planned():
    sub, reader = sub_of(250), Reader()
    j, _ = shard_journal(reader)
    j.ensure(sub)
    j.plan_replay("/ck/L1", (7, 50_000))
    assert j.replayed(sub, "app", 7) is ACCEPTED
    key = journal.batch_key("app", 7, 123)
    assert reader.calls == [("orders-http.journal", 1, key, 50_000 - journal.LOOKBACK_MS)]
    assert j.replayed(sub, "app", 7) is None  # once: the next batches are new
    j.plan_replay("/ck/L1", (7, 50_000))
    assert j.replayed(sub, "app", 8) is None  # not the planned batch...
    assert j.replayed(sub, "app", 7) is None  # ...and only the first batch may be it
    j.plan_replay("/ck/L1", None)  # nothing uncommitted
    assert j.replayed(sub, "app", 0) is None
    assert len(reader.calls) == 1


def test_an_unreadable_or_empty_journal_means_the_batch_is_delivered_again_whole(monkeypatch):
    monkeypatch.setattr(journal, "READ_RETRY_S", 0)
    sub = sub_of(250)
    for result in (KafkaTimeoutError("journal read timed out"), journal.Accepted()):
        reader = Reader(result)
        j, _ = shard_journal(reader)
        j.ensure(sub)
        j.plan_replay("/ck/L1", (7, 50_000))
        assert j.replayed(sub, "app", 7) is None
        assert len(reader.calls) == (3 if isinstance(result, Exception) else 1)


def test_a_re_run_reads_its_journal_again_after_a_failed_read(monkeypatch):
    """A shard restarted together with the broker: the first read fails, the broker answers
    the next. Before, the first failure had the batch delivered again whole."""
    monkeypatch.setattr(journal, "READ_RETRY_S", 0)
    sub, calls = sub_of(250), []

    def reader(settings, topic, partition, key, since_ms):
        calls.append(key)
        if len(calls) == 1:
            raise KafkaTimeoutError("broker restarting")
        return ACCEPTED

    j, _ = shard_journal(reader)
    j.ensure(sub)
    j.plan_replay("/ck/L1", (7, 50_000))
    assert j.replayed(sub, "app", 7) is ACCEPTED
    assert len(calls) == 2


def test_a_journal_topic_kafka_could_not_take_at_the_start_is_tried_again_before_each_batch():
    """A shard started while the broker is down (or restarting): `ensure` fails at the query's
    start. The next batch tries again, journals, and a re-run batch reads what a crashed run
    journaled. Before, the journal stayed off for the whole query: no batch of it journaled
    anything, and its re-run batch was delivered again whole."""
    sub, reader, calls = sub_of(250), Reader(), []

    def ensure(settings, topic, count):
        calls.append(topic)
        if len(calls) <= 2:
            raise KafkaTimeoutError("broker down")
        return 2

    j = ShardJournal(Settings(bootstrap="127.0.0.1:1"), "orders-http", 3, ensure, reader)
    j.ensure(sub)  # the query's start: Kafka is away
    j.plan_replay("/ck/L1", (7, 50_000))
    assert j.target(sub, "app", 7) is None  # still away at the first batch: tried, logged
    target = j.target(sub, "app", 7)  # back
    assert target is not None and target.partition == 1
    assert j.replayed(sub, "app", 7) is ACCEPTED
    assert len(calls) == 3
    j.target(sub, "app", 8)
    assert len(calls) == 3  # made: not asked again
