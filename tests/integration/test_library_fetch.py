"""The library member's fetcher (`varadhi.library.fetch.Fetcher`, librdkafka by manual
assignment) against the real broker: what it returns after a pause, a seek and an unassign,
where it reads a partition without a commit from, and its position past transaction markers
(what a member's catch-up and storage-topic crossing compare with the end offsets)."""

from __future__ import annotations

import time

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from varadhi.kafka import clients as kafka_clients
from varadhi.library.fetch import Fetcher

DEADLINE_S = 60


def make_topic(settings, name: str, partitions: int = 1) -> None:
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
    try:
        admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        admin.close()


def produce(settings, name: str, count: int, partition: int = 0, transactional: str = "") -> None:
    kwargs = {"transactional_id": transactional} if transactional else {}
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap, **kwargs)
    try:
        if transactional:
            producer.init_transactions()
            producer.begin_transaction()
        for i in range(count):
            producer.send(name, value=b"v%d" % i, key=b"k%d" % i, partition=partition)
        if transactional:
            producer.commit_transaction()
        producer.flush()
    finally:
        producer.close()


def fetcher(settings) -> Fetcher:
    member = f"test-fetch-{time.monotonic_ns()}"
    return Fetcher(kafka_clients.fetch_consumer(settings, **Fetcher.config(member)), settings)


def read(fetch: Fetcher, count: int, only: TopicPartition | None = None) -> list:
    """`count` records' (partition, offset) (of `only`, if given), polling with one deadline."""
    got: list[tuple[TopicPartition, int]] = []
    deadline = time.monotonic() + DEADLINE_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"read {len(got)} of {count}: {got}"
        for tp, records in fetch.poll(100, 1000).items():
            got += [(tp, r.offset) for r in records if only in (None, tp)]
    return got


def read_nothing_until(fetch: Fetcher, marker: TopicPartition) -> list:
    """Poll until a record of `marker` comes (the positive event that ends the wait); what
    came of other partitions meanwhile is returned."""
    others = []
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "the marker partition gave nothing"
        batches = fetch.poll(100, 1000)
        others += [(tp, r.offset) for tp, rs in batches.items() if tp != marker for r in rs]
        if marker in batches:
            return others


def test_pause_seek_and_unassign_decide_what_comes_back(settings, unique_name):
    name = unique_name("fetch")
    make_topic(settings, name, 2)
    produce(settings, name, 20, partition=0)
    produce(settings, name, 5, partition=1)
    p0, p1 = TopicPartition(name, 0), TopicPartition(name, 1)
    fetch = fetcher(settings)
    try:
        fetch.assign({p0: 5})
        assert fetch.position(p0) == 5  # nothing returned yet: where it was assigned
        got = read(fetch, 15)
        assert got == [(p0, o) for o in range(5, 20)]
        assert fetch.position(p0) == 20

        fetch.seek(p0, 3)
        assert fetch.position(p0) == 3
        assert read(fetch, 17)[:3] == [(p0, 3), (p0, 4), (p0, 5)]

        # paused: what librdkafka prefetched of p0 is dropped; after a resume it comes from the
        # position. p1, assigned meanwhile, is the event that shows the poll ran.
        fetch.seek(p0, 10)
        fetch.pause(p0)
        assert fetch.paused() == {p0}
        fetch.assign({p1: None})  # no commit: from the log's start
        assert fetch.position(p1) == 0
        assert read_nothing_until(fetch, p1) == []
        fetch.resume(p0)
        assert read(fetch, 10, only=p0) == [(p0, o) for o in range(10, 20)]

        fetch.unassign([p0])
        assert fetch.assignment() == {p1}
        produce(settings, name, 3, partition=0)
        produce(settings, name, 1, partition=1)
        assert read_nothing_until(fetch, p1) == []  # nothing of p0 any more
    finally:
        fetch.close()


def test_position_passes_transaction_markers_as_the_end_offsets_count_them(settings, unique_name):
    name = unique_name("fetch-tx")
    make_topic(settings, name)
    produce(settings, name, 10, transactional=f"{name}-tx")
    tp = TopicPartition(name, 0)
    ends = KafkaConsumer(bootstrap_servers=settings.bootstrap, isolation_level="read_committed")
    try:
        end = ends.end_offsets([tp])[tp]
    finally:
        ends.close()
    assert end == 11  # ten records and the commit marker
    fetch = fetcher(settings)
    try:
        fetch.assign({tp: 0})
        assert [o for _, o in read(fetch, 10)] == list(range(10))
        deadline = time.monotonic() + DEADLINE_S
        while fetch.position(tp) < end:  # a member's catch-up waits for exactly this
            assert time.monotonic() < deadline, f"position {fetch.position(tp)} < {end}"
            fetch.poll(100, 1000)
    finally:
        fetch.close()
