"""The Delta outbox: rows appended to a Delta table reach Kafka once each, in the router's
partitions, and a batch that Spark replays after a crash is not sent again (real Spark, Delta and
Kafka)."""

from __future__ import annotations

import os
import time
import uuid

import pytest
from kafka import KafkaConsumer, TopicPartition

from varadhi.core import routing
from varadhi.core.messages import H_GROUP_ID, H_MSG_ID, headers_to_dict
from varadhi.kafka.topics import TopicService
from varadhi.outbox.delta import MARKER_TOPIC, DeltaOutbox

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

GROUPS = [f"g{i}" for i in range(6)]


@pytest.fixture(scope="session")
def spark():
    from varadhi.spark.session import get_spark

    return get_spark("varadhi-tests")


@pytest.fixture
def topic(catalog):
    """A fresh composite topic with 4 partitions; returns its name."""
    name = f"dox-{uuid.uuid4().hex[:8]}"
    TopicService(catalog).create(name, 4)
    return name


@pytest.fixture
def make_outbox(spark, catalog, settings, tmp_path):
    """make_outbox(name=None, checkpoint="ckpt") -> a DeltaOutbox on tmp_path/outbox, closed
    after the test. A second outbox with the same name stands for the query after a restart."""
    made: list[DeltaOutbox] = []
    default_name = f"dox-{uuid.uuid4().hex[:8]}"

    def make(name: str | None = None, checkpoint: str = "ckpt") -> DeltaOutbox:
        outbox = DeltaOutbox(
            spark,
            str(tmp_path / "outbox"),
            name=name or default_name,
            settings=settings,
            catalog=catalog,
            checkpoint=str(tmp_path / checkpoint),
        )
        made.append(outbox)
        return outbox

    yield make
    for outbox in made:
        outbox.close()


def read_committed(bootstrap: str, storage: str) -> list:
    """Every committed record of a Kafka topic (read_committed), by partition then offset."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(storage, p) for p in sorted(consumer.partitions_for_topic(storage))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records = []
        deadline = time.monotonic() + 120
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"timed out reading {storage}"
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        return sorted(records, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()


def append(spark, outbox: DeltaOutbox, rows: list[tuple]) -> None:
    """One append = one Delta commit, written as one file (so a group's rows keep their order)."""
    from varadhi.outbox.delta import SCHEMA

    outbox.append(spark.createDataFrame(rows, SCHEMA).coalesce(1))


def messages(topic: str, tag: str, n: int) -> list[tuple]:
    return [
        (topic, GROUPS[i % len(GROUPS)], f"{tag}-{i}", {"tag": tag}, f"{tag}:{i}".encode())
        for i in range(n)
    ]


def run(outbox: DeltaOutbox) -> None:
    query = outbox.start(available_now=True)
    assert query.awaitTermination(120), "the outbox query did not finish"
    assert query.exception() is None, query.exception()


def test_appended_rows_arrive_once_each_in_the_routers_partitions(
    spark, topic, make_outbox, bootstrap
):
    outbox = make_outbox()
    outbox.create_table()
    first = messages(topic, "a", 30)
    loose = (topic, None, None, {"x": "y", "nothing": None}, b"ungrouped")  # id made for it
    second = messages(topic, "b", 30) + [loose]
    append(spark, outbox, first)
    append(spark, outbox, second + [("no-such-topic", "g0", "lost", None, b"x")])
    run(outbox)

    records = read_committed(bootstrap, f"{topic}.0")
    ids = [headers_to_dict(r.headers)[H_MSG_ID] for r in records]
    assert len(ids) == len(set(ids)) == 61  # each exactly once
    assert set(m[2] for m in first + second) - set(ids) == {None}
    for r in records:
        headers = headers_to_dict(r.headers)
        if r.key is None:
            assert r.value == b"ungrouped" and H_GROUP_ID not in headers
            assert headers["x"] == "y" and "nothing" not in headers
            assert len(headers[H_MSG_ID]) == 32
            continue
        group = r.key.decode()
        assert headers[H_GROUP_ID] == group
        assert headers["tag"] == r.value.decode().split(":")[0]
        assert r.partition == routing.route_group(group, 4, 1)
    for g in GROUPS:  # order per group: append order, then row order within the append
        got = [r.value for r in records if r.key == g.encode()]
        assert got == [m[4] for m in first + second if m[1] == g]

    rejected = spark.read.format("delta").load(outbox.rejected_path).collect()
    assert [(r.message_id, r.reason) for r in rejected] == [
        ("lost", "topic 'no-such-topic' does not exist")
    ]
    assert sum(r.sent for r in outbox.results) == 61
    assert not any(r.skipped for r in outbox.results)


def test_a_replayed_batch_is_skipped_and_later_batches_still_flow(
    spark, topic, make_outbox, bootstrap, tmp_path
):
    outbox = make_outbox()
    outbox.create_table()
    append(spark, outbox, messages(topic, "a", 20))
    run(outbox)
    assert len(read_committed(bootstrap, f"{topic}.0")) == 20
    last = outbox.results[-1].batch_id

    # A crash after the Kafka commit and before Spark's checkpoint commit: the batch's offsets are
    # in the checkpoint, its commit record is not, so the restarted query runs it again.
    commits = tmp_path / "ckpt" / "commits"
    for f in (commits / str(last), commits / f".{last}.crc"):
        if f.exists():
            os.remove(f)
    restarted = make_outbox()  # a new process: it learns the last committed batch from Kafka
    append(spark, restarted, messages(topic, "b", 10))
    run(restarted)

    replayed = [r for r in restarted.results if r.batch_id == last]
    assert replayed and replayed[0].skipped, list(restarted.results)
    records = read_committed(bootstrap, f"{topic}.0")
    ids = [headers_to_dict(r.headers)[H_MSG_ID] for r in records]
    assert len(ids) == len(set(ids)) == 30  # no duplicate, and the new rows arrived
    marker = read_committed(bootstrap, MARKER_TOPIC)
    assert any(r.key == outbox.name.encode() for r in marker)
