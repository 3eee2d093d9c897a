"""The library member's librdkafka producer (`varadhi.kafka.acked_producer`) against the real
broker: writes acknowledged through `Ack`s, in order within a partition; a write to a
partition that does not exist refused with a typed error; `flush` and `close`.
(Over TLS, SASL and OAUTHBEARER, and with a refused password: tests/integration/
test_kafka_mechanisms.py.)"""

from __future__ import annotations

import threading
import time

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError

from varadhi.kafka.acked_producer import acked_producer
from varadhi.kafka.settings import Settings

pytestmark = pytest.mark.kafka

#: One generous deadline for the local broker's acknowledgements on a loaded machine.
ACK_S = 60


@pytest.fixture
def topic(settings, unique_name):
    name = unique_name("acked")
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
    try:
        admin.create_topics([NewTopic(name, 2, 1)])
    finally:
        admin.close()
    return name


def _read(settings, topic: str, partition: int, count: int) -> list:
    consumer = KafkaConsumer(bootstrap_servers=settings.bootstrap, consumer_timeout_ms=20_000)
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        out = []
        for record in consumer:
            out.append(record)
            if len(out) == count:
                break
        return out
    finally:
        consumer.close()


def test_writes_are_acknowledged_through_their_acks_in_order(settings, topic):
    producer = acked_producer(settings, **{"linger.ms": 10})
    acknowledged: list[int] = []
    done = threading.Event()
    try:
        acks = []
        for n in range(200):
            ack = producer.send(
                topic, key=b"k", value=str(n).encode(), partition=1, headers=[("h", b"%d" % n)]
            )
            ack.add_callback(lambda _meta, n=n: acknowledged.append(n))
            acks.append(ack)
        acks[-1].add_callback(lambda _meta: done.set())
        producer.flush(ACK_S)
        assert done.is_set() and sorted(acknowledged) == list(range(200))
        acks[0].get(0)  # acknowledged already: returns at once
    finally:
        producer.close(ACK_S)
    records = _read(settings, topic, 1, 200)
    assert [r.value for r in records] == [str(n).encode() for n in range(200)]
    assert records[7].key == b"k" and records[7].headers == [("h", b"7")]


def test_a_write_to_a_partition_that_does_not_exist_is_refused_with_its_topic(settings, topic):
    producer = acked_producer(settings)
    refused: list[BaseException] = []
    try:
        ack = producer.send(topic, value=b"x", partition=7)
        ack.add_errback(refused.append)
        with pytest.raises(KafkaError, match=f"{topic}: _UNKNOWN_PARTITION"):
            ack.get(ACK_S)
        producer.flush(ACK_S)  # nothing left to wait for
    finally:
        producer.close(ACK_S)
    assert len(refused) == 1 and isinstance(refused[0], KafkaError)


def test_close_flushes_what_was_sent_and_the_producer_ends_its_thread(settings, topic):
    producer = acked_producer(settings, **{"linger.ms": 50})
    acks = [producer.send(topic, value=b"%d" % n, partition=0) for n in range(20)]
    producer.close(ACK_S)
    for ack in acks:
        ack.get(0)  # close waited for every acknowledgement
    assert producer._closed and not producer._thread.is_alive()
    assert len(_read(settings, topic, 0, 20)) == 20


def test_close_does_not_wait_for_writes_that_no_broker_takes():
    """Nothing listens at the bootstrap server (loopback, refused): close gives up on the
    pending write after its own timeout instead of librdkafka's message timeout (librdkafka's
    close waited for it: 2 minutes by default, the member's stop with it)."""
    producer = acked_producer(Settings(bootstrap="127.0.0.1:9"), **{"message.timeout.ms": 90_000})
    producer.send("any-topic", value=b"x", partition=0)
    started = time.monotonic()
    producer.close(0.5)
    # Far below the 90 s message timeout it would wait out, with room for a loaded machine.
    assert time.monotonic() - started < 45
    assert producer._closed
