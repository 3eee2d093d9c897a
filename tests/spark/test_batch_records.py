"""`varadhi.spark.records.batch_records`, the columns every micro-batch hands to delivery: the ids
and group keys of Kafka-shaped records of every awkward shape agree with the Python rule
(`record_ids.text_id` over `record_ids.header_value`), grouped and ungrouped, with and without
the dedup id and the key's text form (`endpoint.key_header`), and the same columns serve every
batch."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from varadhi.core import messages as m
from varadhi.core.policies import Endpoint, RequestShaping
from varadhi.core.record_ids import header_value, text_id
from varadhi.spark.batch import KEY_TEXT
from varadhi.spark.dedup import dedup_id
from varadhi.spark.records import DELIVERY_COLUMNS, _record_columns, batch_records, delivery_records

SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, "
    "headers array<struct<key:string,value:binary>>"
)
MQ, RQ = "orders.0", "orders-sub.rq.0"

# (key, headers, topic); the comments say what the ids come from.
CORPUS = [
    (b"k1", [(m.H_MSG_ID, b"m-1"), (m.H_GROUP_ID, b"g-1")], MQ),  # both headers
    (b"k2", [(m.H_MSG_ID, b"m-2")], MQ),  # group id from the key
    (None, [(m.H_MSG_ID, b"m-3")], MQ),  # no group id at all
    (b"", None, MQ),  # nothing: msg id from the position, no group id
    (b"\xff\xfe", [(m.H_GROUP_ID, b"")], RQ),  # empty group header: the key's b64 form
    (b"k", [(m.H_MSG_ID, b"\x00\x01abc"), (m.H_GROUP_ID, "größe".encode())], RQ),
    (b"k", [(m.H_GROUP_ID, b"first"), (m.H_GROUP_ID, b"second")], MQ),  # the first counts
    (b"k", [(m.H_MSG_ID, b"\xff" * 300), (m.H_GROUP_ID, b"x" * 1025)], MQ),  # sha256 forms
    (b"k", [("Varadhi-Msg-Id", b"other"), (m.H_MSG_ID, None)], MQ),  # names are exact; null
]


def sub_of(grouped: bool = True, dedup: int = 0, key_header: str | None = None):
    """What `batch_records` reads of a subscription."""
    endpoint = Endpoint("http://127.0.0.1:1/", shaping=RequestShaping(key_header=key_header))
    return SimpleNamespace(
        spec=SimpleNamespace(grouped=grouped, dedup_window_ms=dedup, endpoint=endpoint)
    )


def expected(key, headers, topic, partition, offset, grouped):
    """The Python rule for one record (`record_ids`)."""
    msg_id = text_id(header_value(headers, m.H_MSG_ID)) or f"{topic}-{partition}-{offset}"
    group_id = text_id(header_value(headers, m.H_GROUP_ID)) or text_id(key)
    group_key = (group_id if grouped else None) or f"~{msg_id}"
    return {
        "kind": "mq" if topic == MQ else "rq",
        "group_key": group_key,
        "group_id": group_id,
        "msg_id": msg_id,
    }


@pytest.fixture(scope="module")
def kafka_records(spark):
    rows = [(k, b"v%d" % i, t, i % 2, 100 + i, h) for i, (k, h, t) in enumerate(CORPUS)]
    return spark.createDataFrame(rows, SCHEMA), rows


@pytest.mark.parametrize(
    ("grouped", "dedup", "key_header"),
    [(True, 0, None), (False, 0, None), (True, 60_000, None), (False, 60_000, "X-Key")],
)
def test_ids_agree_with_the_python_rule(kafka_records, grouped, dedup, key_header):
    frame, rows = kafka_records
    sub = sub_of(grouped, dedup, key_header)
    mq = SimpleNamespace(storage_topics=[SimpleNamespace(name=MQ)])
    got = batch_records(frame, sub, mq).orderBy("offset").toPandas()
    assert list(got.columns) == [
        "kind", "group_key", "group_id", "msg_id", "topic", "partition", "offset", "key",
        "value", "kheaders", *([KEY_TEXT] if key_header else []), *(["dedup_id"] if dedup else []),
    ]  # fmt: skip
    for record, (key, value, topic, partition, offset, headers) in zip(
        got.to_dict("records"), rows, strict=True
    ):
        want = expected(key, headers, topic, partition, offset, grouped)
        if key_header:
            want[KEY_TEXT] = text_id(key)
        assert {k: record[k] for k in want} == want
        assert (record["value"], record["offset"]) == (value, offset)
    if dedup:  # the same id the dedup window computes over the Kafka source's columns
        direct = frame.select("offset", dedup_id().alias("d")).orderBy("offset").toPandas()
        assert list(got["dedup_id"]) == list(direct["d"])


def test_every_batch_reuses_the_columns(kafka_records):
    frame, _ = kafka_records
    sub = sub_of()
    mq = SimpleNamespace(storage_topics=[SimpleNamespace(name=MQ)])
    before = _record_columns.cache_info()
    for _ in range(3):
        batch_records(frame, sub, mq)
    after = _record_columns.cache_info()
    assert after.hits - before.hits >= 2
    assert after.currsize - before.currsize <= 1


@pytest.mark.parametrize(
    ("grouped", "dedup", "key_header"),
    [(True, 0, None), (False, 0, None), (True, 60_000, None), (False, 60_000, "X-Key")],
)
def test_the_projection_is_generated_code_holding_each_id_once(
    kafka_records, grouped, dedup, key_header
):
    """Spark generates each micro-batch's projection code on the driver, so its size is paid in
    every batch (docs/benchmarks.md, "Latency").

    - Every projection is part of the generated stage. An expression without code generation
      (the header look-up was a lambda over the headers) made Spark plan its projection apart
      and generate a projection in every task of every batch instead.
    - Each text id is computed once: the message header's, the group header's, the key's, and
      with de-duplication the dedup id's (over the raw headers and the value). The group key
      repeated both ids' expressions before: six, not three. The key's text form, which the
      delivery tasks get with `endpoint.key_header`, is the group id's fallback, not a fourth."""
    frame, _ = kafka_records
    sub = sub_of(grouped, dedup, key_header)
    mq = SimpleNamespace(storage_topics=[SimpleNamespace(name=MQ)])
    plan = batch_records(frame, sub, mq)._jdf.queryExecution().executedPlan().toString()
    projects = [line for line in plan.splitlines() if "Project [" in line]
    assert len(projects) >= 2, plan
    for line in projects:  # "*(n)": the operator is part of whole-stage code generation n
        assert re.match(r"[\s+\-:|]*\*\(\d+\) Project \[", line), line
    assert plan.count("sha2(") == 3 + (2 if dedup else 0), plan  # one per text id


@pytest.mark.parametrize(("dedup", "key_header"), [(0, None), (60_000, "X-Key")])
def test_the_delivery_tasks_get_the_delivery_columns_in_concurrency_partitions(
    kafka_records, dedup, key_header
):
    """Only a subscription with `endpoint.key_header` hands its tasks the key's text form. A paced
    subscription's (`endpoint.max_rate`) records are spread by group key even when there are as
    many Kafka partitions as tasks: each task may send only an equal part of the shard's share."""
    frame, _ = kafka_records
    sub = sub_of(dedup=dedup, key_header=key_header)
    mq = SimpleNamespace(storage_topics=[SimpleNamespace(name=MQ)])
    records = batch_records(frame, sub, mq)
    columns = [*DELIVERY_COLUMNS, *([KEY_TEXT] if key_header else [])]
    coalesced = delivery_records(records, 1, partitions_read=2)
    assert coalesced.columns == columns
    assert coalesced.rdd.getNumPartitions() == 1
    spread = delivery_records(records, 3, partitions_read=2)  # fewer partitions than tasks
    assert spread.columns == columns
    assert spread.rdd.getNumPartitions() == 3
    assert spread.count() == len(CORPUS)

    def shuffled(frame) -> bool:
        return "hashpartitioning(group_key" in frame._jdf.queryExecution().executedPlan().toString()

    paced = delivery_records(records, 2, partitions_read=2, paced=True)
    assert paced.columns == columns and paced.rdd.getNumPartitions() == 2
    assert shuffled(paced) and shuffled(spread) and not shuffled(coalesced)
