"""The feeders of a shard-count change: its `feed` step (`varadhi.ops.change_shards`).

A feeder copies every record of one old RQ or DLQ storage topic (read_committed, ticks skipped)
to the new one the change added, into the partitions of the group's new shard
(`internal_target` over the operation's recorded `route_by`, the shard's own rule), each
distinct record once: what the target already holds (an earlier run's copy, a re-sent `out` row)
is not written again. Feeders never call the endpoint and never touch GroupState. One runs once
the change has reached its `feed` step (`feeder_source`, `check_feeder`), in the process of
`ChangeShards.execute` or as a job of its own (`varadhi.jobs.feeder`), and marks itself done in
the operation document (the change is done with its last feeder). `feed_if_empty` marks the
feeder of an empty source done without Spark; `feed` is the bounded Spark batch that copies.

Why new shards may read the new RQ while feeders still run (seed 000 lets them wait): here an RQ
record is matched to its GroupState entry by (origin, attempts) and a group's delivery order
comes from `origin` (its main-topic position), never from RQ positions (see
`varadhi.core.group_state`). A record that arrives late only fills in the body of an entry that kept
its place; its group waits for it meanwhile. A record that matches no `rq` entry (already
consumed by an old shard, superseded by a later attempt, or a duplicate of a re-sent `out` row)
is dropped as a stale duplicate. So order holds without a barrier, and a feeder that copied a
record twice (two feeders of one source at once) does no harm.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pandas as pd
from kafka import TopicPartition

from varadhi.core.errors import InvalidArgument
from varadhi.core.faults import crash_point
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.topics import StorageTopic
from varadhi.ops.change_shards_plan import (
    OPERATION,
    internal_target,
    operation_name,
    require_op,
    touched,
)


def feeder_source(op: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The recorded feeder for `source`, if the operation has reached its feed step (pure)."""
    match = [f for f in op.get("feeders", []) if f["source"] == source]
    if not match:
        listed = ", ".join(f["source"] for f in op.get("feeders", [])) or "none"
        raise InvalidArgument(
            f"{source} is not a feeder source of this change (sources: {listed})", field="source"
        )
    if op["step"] not in ("feed", "done"):
        raise InvalidArgument(
            f"the change is at step {op['step']}; feeders run once it reaches `feed`",
            field="source",
        )
    return match[0]


def check_feeder(catalog: Catalog, name: str, source: str) -> dict[str, Any]:
    """The recorded feeder of `name` for `source`, or `InvalidArgument` (before any Spark)."""
    snap = catalog.snapshot()
    subscriptions.from_snapshot(snap, name)  # must exist
    return feeder_source(require_op(snap, name), source)


def source_records(catalog: Catalog, name: str, source: str) -> int:
    """How many records (aborted and tick records included) old storage topic `source` holds:
    the sum over its partitions of the high watermark minus the log start offset. Raises
    `InvalidArgument` as `check_feeder` does."""
    snap = catalog.snapshot()
    f = feeder_source(require_op(snap, name), source)
    sub = subscriptions.from_snapshot(snap, name)
    queue = topics.from_snapshot(
        snap, sub.spec.rq_topic if f["queue"] == "rq" else sub.spec.dlq_topic
    )
    partitions = queue.storage(queue.index_of(source)).partitions
    parts = [TopicPartition(source, p) for p in range(partitions)]
    consumer = kafka_clients.consumer(catalog.settings, enable_auto_commit=False)
    try:
        first, ends = consumer.beginning_offsets(parts), consumer.end_offsets(parts)
    finally:
        consumer.close()
    return sum(max(ends[tp] - first[tp], 0) for tp in parts)


def feed_if_empty(catalog: Catalog, name: str, source: str, held: int | None = None) -> bool:
    """Mark the feeder of `source` done, with 0 records, when old storage topic `source` holds
    no record at all (`source_records` is 0, so aborted and tick records count as records
    here; `held` is that count if the caller read it already), and return True; otherwise
    change nothing and return False (`feed` copies). A feeder of an empty RQ or DLQ, the
    common case for a healthy subscription, then starts no Spark session and runs no Spark job.

    Safe like `feed` reading up to the end it finds: from the change's fence on, nothing writes
    to the old storage topics, so an empty source stays empty. Raises `InvalidArgument` as
    `check_feeder` does."""
    if (source_records(catalog, name, source) if held is None else held) > 0:
        return False
    _mark_fed(catalog, name, source, 0)
    return True


def feed(spark, catalog: Catalog, name: str, source: str) -> int:
    """Copy every record of old RQ/DLQ storage topic `source` to the new one; returns how many
    distinct records `source` holds (all of them are in the new one afterwards).

    A bounded Spark batch: read `source` from its start (for a DLQ, from the offset reset's
    `dlq_start` where there is one) to its end, read_committed, skip tick records, and write
    each record (key, value and headers kept) to the partition of the new storage topic that
    its group's new shard owns (`internal_target` of `group_key_column`, the shard's own rule).
    Idempotent: a record is written only if the target partition does not already hold one
    with the same key, value and headers (compared by `_fingerprint`), so a re-run after a crash
    (before or after part of the write, or before the feeder was marked done) adds nothing
    twice. Identical records are the same retry or dead letter by the shards' own rule (origin
    and attempts), so one copy of each is enough. Marks the feeder done.

    Both topics are read (and cached) before the write, so a Kafka authorization failure in the
    write is the sink's: `NotAuthorized` Write on the new topic (Kafka's Java client names only
    the topic, not the operation). One in the reads is left to the caller to name
    (`kafka_clients.refusal`: Describe or Read).
    """
    import json

    from pyspark.sql import functions as F

    from varadhi.core.messages import H_TICK
    from varadhi.spark.columns import group_key_column

    snap = catalog.snapshot()
    op = require_op(snap, name)
    f = feeder_source(op, source)
    sub = subscriptions.from_snapshot(snap, name)
    route_by = StorageTopic.from_dict(op["route_by"])
    to = int(op["to"])
    queue = topics.from_snapshot(
        snap, sub.spec.rq_topic if f["queue"] == "rq" else sub.spec.dlq_topic
    )
    target = queue.storage(int(op[f"{f['queue']}_target_index"]))
    src_parts = queue.storage(queue.index_of(source)).partitions
    start: dict[str, int] = {}
    if f["queue"] == "dlq":  # an offset reset may have fast-forwarded the DLQ past some records
        doc = snap.get(subscriptions.KIND, name) or {}
        start = doc.get("state", {}).get("dlq_start", {}).get(source, {})
    starting = {source: {str(p): int(start.get(str(p), -2)) for p in range(src_parts)}}

    @F.pandas_udf("int")
    def partition_of(keys: pd.Series) -> pd.Series:
        return keys.map(lambda k: internal_target(k, route_by, to, target.partitions))

    kafka = kafka_clients.spark_options(catalog.settings)
    reading = kafka_clients.spark_source_options(catalog.settings)
    records = (
        spark.read.format("kafka")
        .options(**reading)
        .option("assign", json.dumps({source: list(range(src_parts))}))
        .option("startingOffsets", json.dumps(starting))
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .option("kafka.isolation.level", "read_committed")
        .load()
    )
    is_tick = F.coalesce(F.exists("headers", lambda h: h["key"] == H_TICK), F.lit(False))
    copies = (
        records.where(~is_tick)
        .select("key", "value", "headers", group_key_column(sub.spec.grouped).alias("group_key"))
        .select("key", "value", "headers", partition_of("group_key").alias("partition"))
        .withColumn("fingerprint", _fingerprint())
        .dropDuplicates(["fingerprint"])
        .persist()
    )
    there = (
        spark.read.format("kafka")
        .options(**reading)
        .option("subscribe", target.name)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .option("kafka.isolation.level", "read_committed")
        .load()
        .select(_fingerprint().alias("fingerprint"))
        .persist()
    )
    try:
        n = copies.count()
        there.count()  # read here, so that the write below reads no Kafka topic
        missing = copies.join(there, "fingerprint", "left_anti").drop("fingerprint")
        try:
            (
                missing.write.format("kafka")
                .options(**kafka)
                .option("kafka.acks", "all")
                .option("topic", target.name)
                .save()
            )
        except Exception as e:  # Kafka's Java producer names only the topic: the feeder knows
            refused = kafka_clients.refusal(catalog.settings, e, writes={target.name})
            if refused is None:
                raise
            raise refused from e
    finally:
        copies.unpersist()
        there.unpersist()
    crash_point("feeder_copied")
    _mark_fed(catalog, name, source, n)
    return n


def _fingerprint():
    """A Kafka record's identity for the feeders: SHA-256 over its partition, key, value and
    headers (as JSON with base64 bytes, so no two different records share the input)."""
    from pyspark.sql import functions as F

    headers = F.transform(
        "headers", lambda h: F.struct(h["key"].alias("k"), F.base64(h["value"]).alias("v"))
    )
    doc = F.struct(
        F.col("partition").alias("p"),
        F.base64("key").alias("k"),
        F.base64("value").alias("v"),
        headers.alias("h"),
    )
    return F.sha2(F.to_json(doc).cast("binary"), 256)


def _mark_fed(catalog: Catalog, name: str, source: str, records: int) -> None:
    def change(snap: Snapshot):
        op = require_op(snap, name)
        feeders = [
            dict(f, done=True, records=records, done_ms=int(time.time() * 1000))
            if f["source"] == source
            else f
            for f in op["feeders"]
        ]
        step = "done" if op["step"] == "feed" and all(f["done"] for f in feeders) else op["step"]
        return {key(OPERATION, operation_name(name)): touched(op, feeders=feeders, step=step)}

    catalog.mutate(change)
    crash_point("feeder_marked")


__all__ = [
    "feed",
]
