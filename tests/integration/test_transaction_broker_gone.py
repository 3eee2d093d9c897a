"""A Kafka transaction whose broker goes away inside it ends, with an error, instead of waiting
for ever, at every place the product commits one with kafka-python (`kafka.clients.end_transaction`):
the catalog, a shard's RQ/DLQ sender, the producer's `send_many`, the Delta outbox. kafka-python's
`commit_transaction` waits without a time limit, and a shard whose lease heartbeat waited so
delivered nothing more (a three-node run with a broker killed, on a loaded machine).

One broker of the module's own, SIGKILLed by each test as the commit starts and started again
(on its data) by the next."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import pytest
from kafka.admin import NewTopic
from kafka.errors import KafkaTimeoutError

from varadhi.core import faults
from varadhi.core import messages as m
from varadhi.core.errors import ConcurrentModification, KafkaUnavailable
from varadhi.core.state_rows import OutRow
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import CommitOutcomeUnknown, Message, Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.topics import TopicService
from varadhi.outbox import delta
from varadhi.outbox.delta import DeltaOutbox, DeltaOutboxError
from varadhi.spark.shard.sender import QueueSender
from varadhi.testing.local_broker import LocalBroker

pytestmark = pytest.mark.kafka

#: One generous deadline for a call that must end (it needs its own timeouts: the commit's bound
#: below, then a look for the broker), on a loaded machine.
DEADLINE_S = 180
#: The commit bound the components are given here (their defaults are 30-60 s).
COMMIT_S = 5


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[LocalBroker]:
    made = LocalBroker(tmp_path_factory.mktemp("broker-gone") / "kafka")
    try:
        yield made
    finally:
        made.wipe()


@pytest.fixture
def settings(broker, tmp_path) -> Settings:
    """The broker, up (a test before this one killed it), and settings for it."""
    if not broker.listening():
        broker.start()
    return Settings(bootstrap=broker.bootstrap, catalog_topic="__cat", warehouse=str(tmp_path))


class DiesAtCommit:
    """A real transactional kafka-python producer whose broker is SIGKILLed as a commit starts."""

    def __init__(self, producer: Any, broker: LocalBroker):
        self._producer = producer
        self._broker = broker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def commit_transaction(self) -> None:
        self._broker.kill()
        self._producer.commit_transaction()


def outcome_within(call: Callable[[], Any]) -> BaseException | None:
    """What `call` raised (None if nothing), once it ended; fails the test when it is still
    running DEADLINE_S later."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - the outcome the test checks
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"still waiting {DEADLINE_S} s after the broker died"
    return outcome[0]


def test_a_catalog_write_fails_instead_of_hanging(broker, settings, monkeypatch):
    catalog = Catalog(settings, timeout_s=COMMIT_S)
    try:
        catalog.mutate(lambda snap: {"topic/a": {"n": 1}})  # topic, producer, fence: all up
        crash_point = faults.crash_point

        def broker_dies(point: str) -> None:  # between the sends and the commit
            if point == "catalog_in_transaction":
                broker.kill()
            crash_point(point)

        monkeypatch.setattr(faults, "crash_point", broker_dies)
        error = outcome_within(lambda: catalog.mutate(lambda snap: {"topic/b": {"n": 2}}))
        assert isinstance(error, KafkaUnavailable | ConcurrentModification), repr(error)
    finally:
        catalog.close()  # its clients would look for the dead broker for the rest of the run


def test_a_shards_rq_send_fails_instead_of_hanging_and_the_shard_may_ride_it_out(broker, settings):
    admin = kafka_clients.admin(settings)
    admin.create_topics([NewTopic("orders.rq.0", 1, 1)])
    admin.close()
    producer = kafka_clients.producer(settings, transactional_id="t-sender", acks="all")
    producer.init_transactions()
    sender = QueueSender(
        DiesAtCommit(producer, broker),
        0,
        "orders shard 0",
        lambda: 1,
        lambda topic: 1_048_576,
        commit_timeout_s=COMMIT_S,
    )
    retry = OutRow(
        target="rq", group_key="g1", group_id="g1", msg_id="m1", origin=m.Origin(0, 0, 7),
        value=b"body", headers={}, attempts=1, due_ms=0, first_failure_ms=1,
        last_failure_ms=1, reason="HTTP 500", status=500,
    )  # fmt: skip
    where = {"rq": ("orders.rq.0", [0]), "dlq": ("orders.rq.0", [0])}
    error = outcome_within(lambda: sender.send([retry], where))
    assert isinstance(error, KafkaTimeoutError), repr(error)
    # the shard's control loop waits out what is transient, then replaces its sender
    assert kafka_clients.transient(error)
    assert outcome_within(sender.close) is None


def test_send_many_says_its_outcome_is_unknown_instead_of_hanging(broker, settings, monkeypatch):
    catalog = Catalog(settings, timeout_s=COMMIT_S)
    TopicService(catalog).create("orders", partitions=1)
    make = kafka_clients.producer

    def dies_at_commit(settings: Settings, **kwargs: Any) -> Any:
        made = make(settings, **kwargs)
        return DiesAtCommit(made, broker) if "transactional_id" in kwargs else made

    monkeypatch.setattr(kafka_clients, "producer", dies_at_commit)
    producer = Producer("orders", settings, catalog=catalog, max_block_ms=COMMIT_S * 1000)
    try:
        error = outcome_within(lambda: producer.send_many([Message(b"a", "g1")]))
        assert isinstance(error, CommitOutcomeUnknown), repr(error)
        assert "did not end in 5 s" in str(error)
    finally:
        assert outcome_within(producer.close) is None
        catalog.close()


def test_the_delta_outbox_fails_its_batch_instead_of_hanging(broker, settings, monkeypatch):
    catalog = Catalog(settings, timeout_s=COMMIT_S)
    storage = TopicService(catalog).create("outbound", partitions=1).produce_topic.name
    make = kafka_clients.producer
    monkeypatch.setattr(
        delta.kafka_clients, "producer", lambda s, **kw: DiesAtCommit(make(s, **kw), broker)
    )
    outbox = DeltaOutbox(
        None, "/unused", name="orders-outbox", catalog=catalog, send_timeout_s=COMMIT_S
    )  # no Spark: the batch is sent as the query's `foreachBatch` would
    rows = pd.DataFrame(
        {
            "storage": [storage], "partition": [0], "group_id": ["g1"],
            "message_id": ["m1"], "headers_json": [None], "value": [b"a"],
        }
    )  # fmt: skip
    try:
        error = outcome_within(lambda: outbox._send(rows, "checkpoint-1", 0))
        assert isinstance(error, DeltaOutboxError), repr(error)
        assert "its marker says whether it was sent" in str(error)
    finally:
        catalog.close()
