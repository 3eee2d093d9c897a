"""`varadhi.library.fetch.Fetcher`'s bookkeeping over a stand-in librdkafka consumer (the real
one: tests/integration/test_library_fetch.py): what it does with records it should not get;
`Reading`'s routing between the RQ's fetcher and the main topic's."""

from __future__ import annotations

import pytest
from kafka import TopicPartition

from varadhi.kafka.settings import Settings
from varadhi.library.fetch import Fetcher, Reading

#: Nothing connects: the stand-in consumer answers.
SETTINGS = Settings(bootstrap="127.0.0.1:9")


class _Message:
    def __init__(self, topic: str, partition: int, offset: int):
        self._where = (topic, partition, offset)

    def error(self):
        return None

    def topic(self):
        return self._where[0]

    def partition(self):
        return self._where[1]

    def offset(self):
        return self._where[2]

    def key(self):
        return b"k"

    def value(self):
        return b"v"

    def headers(self):
        return None


class _Consumer:
    """Hands out `queued` at the first consume; records seeks."""

    def __init__(self, queued):
        self.queued = list(queued)
        self.seeks = []

    def consume(self, count, timeout):
        out, self.queued = self.queued[:count], self.queued[count:]
        return out

    def failure(self):
        return None

    def incremental_assign(self, partitions):
        pass

    def pause(self, partitions):
        pass

    def seek(self, partition):
        self.seeks.append((partition.topic, partition.partition, partition.offset))


def test_a_paused_partitions_records_that_come_all_the_same_are_read_again_not_lost():
    t0, t1 = TopicPartition("t", 0), TopicPartition("t", 1)
    consumer = _Consumer([_Message("t", 0, 5), _Message("t", 1, 7), _Message("t", 0, 6)])
    fetch = Fetcher(consumer, SETTINGS)
    fetch.assign({t0: 5, t1: 7})
    fetch.pause(t0)
    got = fetch.poll(50, 100)
    assert {tp: [r.offset for r in rs] for tp, rs in got.items()} == {t1: [7]}
    assert consumer.seeks == [("t", 0, 5)]  # from its first record, after the resume


def test_records_of_a_partition_not_assigned_are_dropped():
    t0 = TopicPartition("t", 0)
    consumer = _Consumer([_Message("t", 0, 1), _Message("u", 0, 2)])
    fetch = Fetcher(consumer, SETTINGS)
    fetch.assign({t0: 1})
    got = fetch.poll(50, 100)
    assert {tp: [r.offset for r in rs] for tp, rs in got.items()} == {t0: [1]}
    assert consumer.seeks == []


class _Timed(_Consumer):
    """Also records each consume's timeout, and closes."""

    def __init__(self, queued):
        super().__init__(queued)
        self.timeouts = []
        self.closed = False

    def consume(self, count, timeout):
        self.timeouts.append(timeout)
        return super().consume(count, timeout)

    def close(self):
        self.closed = True


def _reading(main_queued=(), rq_queued=()):
    main, rq = _Timed(main_queued), _Timed(rq_queued)
    reading = Reading(Fetcher(main, SETTINGS), Fetcher(rq, SETTINGS), "s.rq.0")
    reading.assign({TopicPartition("t", 0): 0, TopicPartition("s.rq.0", 0): 0})
    return reading, main, rq


def test_a_full_member_reads_the_rq_alone_and_the_main_topics_records_wait_unread():
    """At `max_pending` (`main=False`) the main topic's consumer is not asked at all: its
    records stay in its queue (neither dropped nor fetched again), the RQ's come."""
    reading, main, rq = _reading([_Message("t", 0, 0)], [_Message("s.rq.0", 0, 3)])
    got = reading.poll(50, 100, main=False)
    assert {tp: [r.offset for r in rs] for tp, rs in got.items()} == {
        TopicPartition("s.rq.0", 0): [3]
    }
    assert main.timeouts == [] and main.seeks == [] and len(main.queued) == 1


def test_a_poll_takes_the_rqs_records_first_then_the_main_topics_within_the_limit():
    main_records = [_Message("t", 0, n) for n in range(5)]
    reading, main, rq = _reading(main_records, [_Message("s.rq.0", 0, 7)])
    got = reading.poll(50, 3)
    assert [r.offset for r in got[TopicPartition("s.rq.0", 0)]] == [7]
    assert [r.offset for r in got[TopicPartition("t", 0)]] == [0, 1]  # 3 in all
    assert main.timeouts == [0]  # records were had: nothing waited for


def test_with_nothing_from_the_rq_the_wait_is_the_main_topics():
    reading, main, rq = _reading()
    assert reading.poll(50, 10) == {}
    assert rq.timeouts == [0, 0] and main.timeouts == [0, 0.05]


def test_calls_go_to_the_fetcher_of_the_partitions_topic():
    reading, main, rq = _reading()
    t0, r0 = TopicPartition("t", 0), TopicPartition("s.rq.0", 0)
    reading.pause(t0, r0)
    assert reading.paused() == {t0, r0} and not reading.reading()
    reading.seek(r0, 9)
    assert rq.seeks == [("s.rq.0", 0, 9)] and main.seeks == []
    assert reading.assignment() == {t0, r0}
    reading.close()
    assert main.closed and rq.closed


def test_the_first_fetcher_is_closed_when_the_second_cannot_be_made(monkeypatch):
    from varadhi.kafka import clients

    made = []

    def fetch_consumer(settings, **config):
        if made:
            raise clients.KafkaUnavailable("refused")
        made.append(_Timed([]))
        return made[-1]

    monkeypatch.setattr(clients, "fetch_consumer", fetch_consumer)
    with pytest.raises(clients.KafkaUnavailable, match="refused"):
        Reading.of(SETTINGS, "member", "s.rq.0")
    assert made[0].closed
