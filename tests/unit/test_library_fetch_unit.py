"""`varadhi.library.fetch.Fetcher`'s bookkeeping over a stand-in librdkafka consumer (the real
one: tests/integration/test_library_fetch.py): what it does with records it should not get."""

from __future__ import annotations

from kafka import TopicPartition

from varadhi.kafka.settings import Settings
from varadhi.library.fetch import Fetcher

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
