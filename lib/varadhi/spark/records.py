"""A shard's Structured Streaming source and the records each micro-batch hands to delivery.

- `Source.of` (pure): what one query of a shard reads for a reader layout, from the shard's
  assignment: its partitions of the layout's main-topic storage topic and of the current RQ
  storage topics (`assign`), where it starts on each (`startingOffsets`: carried over from the
  previous layout, -2 = earliest), and the Kafka source options (`options`);
- `batch_records`: a micro-batch's Kafka records with their kind, group key and ids
  (`DELIVERY_COLUMNS`: those of its columns the delivery tasks read; with `endpoint.key_header`,
  also the key's text form, `KEY_TEXT`);
- `filter_records`: without the main-topic records the subscription's filter drops, counted in
  the Spark plan.

Hazard: the source reads read_committed and fails on data loss; both are part of the shard's
guarantees (an aborted RQ/DLQ transaction is never delivered; a lost offset range is an error,
not a silent skip).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from pyspark import SparkContext
from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from varadhi.core import filters
from varadhi.core.messages import H_GROUP_ID, H_MSG_ID
from varadhi.core.state_rows import Kind
from varadhi.kafka import subscriptions, topics
from varadhi.spark.batch import KEY_TEXT
from varadhi.spark.columns import (
    filter_column,
    group_id_column,
    group_key_column,
    header_column,
    msg_id_column,
    text_id_column,
)
from varadhi.spark.dedup import dedup_id
from varadhi.spark.layouts import Layout


@dataclass(frozen=True)
class Source:
    """What one query of a shard reads: `assign` (storage topic -> partitions),
    `starting` (storage topic -> partition -> offset) and how many main-topic partitions."""

    assign: dict[str, list[int]]
    starting: dict[str, dict[str, int]]
    mq_partitions: int

    @classmethod
    def of(
        cls, sub, mq: topics.CompositeTopic, rq: topics.CompositeTopic, layout: Layout, shard: int
    ) -> Source:
        """The source of shard `shard` of `sub` for `layout` (pure): the layout's main-topic
        storage topic and every RQ storage topic from `sub.rq_from` (earlier ones are drained
        into the current ones by feeders), the partitions the shard owns of each."""
        mq_st = mq.storage(layout.mq_index)
        mq_parts = subscriptions.owned_partitions(sub, mq, layout.mq_index, shard)
        assign: dict[str, list[int]] = {}
        if mq_parts:
            assign[mq_st.name] = mq_parts
        for i, st in enumerate(rq.storage_topics):
            if i < sub.rq_from:  # drained into the current RQ storage topics by feeders
                continue
            parts = subscriptions.internal_partitions(sub, rq, i, shard)
            if parts:
                assign[st.name] = parts
        starting = {
            t: {str(p): int(layout.starting_offsets.get(t, {}).get(str(p), -2)) for p in parts}
            for t, parts in assign.items()
        }
        return cls(assign, starting, len(mq_parts))

    def options(self, kafka: dict[str, str], limit: int) -> dict[str, str]:
        """The Kafka source's options (pure): `kafka` (the connection's, from
        `kafka_clients.spark_options`), then the assignment, read_committed, and at most
        `limit` records a micro-batch."""
        return {
            **kafka,
            "assign": json.dumps(self.assign),
            "startingOffsets": json.dumps(self.starting),
            "includeHeaders": "true",
            "failOnDataLoss": "true",
            "kafka.isolation.level": "read_committed",
            "maxOffsetsPerTrigger": str(limit),
        }


# The columns of `batch_records` a delivery task reads (`varadhi.spark.batch.deliver_records`), in
# the order it gets them: `key` (read by filters) and `dedup_id` (by the de-duplication window)
# are used in the Spark plan only (`PLAN_ONLY_COLUMNS`), so they never cost an Arrow conversion.
# A subscription whose endpoint sends the record key in a header (`endpoint.key_header`) also
# hands its tasks the key's text form, last (`KEY_TEXT`); no other pays for that column.
DELIVERY_COLUMNS = (
    "kind",
    "group_key",
    "group_id",
    "msg_id",
    "topic",
    "partition",
    "offset",
    "value",
    "kheaders",
)
PLAN_ONLY_COLUMNS = ("key", "dedup_id")


def delivery_records(
    records: DataFrame, concurrency: int, partitions_read: int, paced: bool = False
) -> DataFrame:
    """A micro-batch's records (`batch_records`, filtered, de-duplicated) as the delivery tasks
    read them: only `DELIVERY_COLUMNS`, in `concurrency` partitions. The Kafka partitions read
    (`partitions_read`) are coalesced when there are at least as many: a group's records stay in
    one task, in order, with no shuffle. Fewer are spread by group key, and so are the records of
    a `paced` subscription (`endpoint.max_rate`) always: each of its tasks may send an equal part
    of the shard's share (`varadhi.core.rate_limit`), so a task holding most of the records holds
    the shard below its share. Coalesced, the main topic's partitions could all go to one task and
    the RQ's to the other: `bench/rate_limit.py` saw a shard send half its share for a whole
    batch. At the rates a limit allows, the shuffle's cost does not matter.

    The plan-only columns are dropped rather than the delivery columns selected. Each batch
    builds this through Py4J, and a drop of two names costs about 5 round trips where a select
    of nine cost about 40 (`bench/batch_plan.py`)."""
    records = records.drop(*PLAN_ONLY_COLUMNS)  # a name the frame lacks is ignored
    if paced or concurrency > partitions_read:
        return records.repartition(concurrency, "group_key")
    return records.coalesce(concurrency)


def batch_records(df: DataFrame, sub, mq: topics.CompositeTopic) -> DataFrame:
    """The batch's Kafka records with `kind` (`Kind.MQ`, `Kind.RQ`), `group_key` (what orders
    them) and the text forms of their ids (`group_id`, `msg_id`: `varadhi.core.record_ids`). Every
    string column is valid UTF-8 whatever the producer wrote, so Arrow never fails to convert a
    batch.

    A shard's query applies this to its stream, once per query (Spark then analyses these
    expressions once, not in every micro-batch); replay applies it to its read. The columns are
    built once per process (`_record_columns`; building them cost some 2,000 Py4J round trips
    each time). The two headers the ids read are looked up once, in a first projection, and
    each id is computed once, in a second, instead of in every expression that reads it, so the
    plan and the code Spark generates for it in every micro-batch stay small
    (docs/benchmarks.md, "Latency")."""
    mq_names = tuple(st.name for st in mq.storage_topics)
    dedup = bool(sub.spec.dedup_window_ms)
    key_text = sub.spec.endpoint.shaping.key_header is not None
    projections = _record_columns(
        bool(sub.spec.grouped), mq_names, dedup, key_text, SparkContext._gateway
    )
    for columns in projections:
        df = df.select(*columns)
    return df


@functools.lru_cache(maxsize=32)
def _record_columns(
    grouped: bool, mq_names: tuple[str, ...], dedup: bool, key_text: bool, _gateway: object
) -> tuple[tuple, ...]:
    """`batch_records`' projections, in order (Spark columns are plans' building blocks, not
    bound to a DataFrame, so they are reused). `_gateway`: the JVM they live in (a new one,
    after a gateway restart, gets its own).

    Each step's results are columns of the next, not expressions repeated in it: the two headers
    are looked up once, then each id is computed once, then the group key reads the ids. Spark
    keeps a projection apart when collapsing it would repeat an expensive expression, so the
    generated code holds each id expression once (three `text_id_column`s, not six): Spark
    generates that code again for every micro-batch."""
    msg_header, group_header = "_varadhi_msg_header", "_varadhi_group_header"
    kafka = ("topic", "partition", "offset", "key", "value", "headers")
    # `key_text`: the key's text form is computed once, in the first step, and the group id
    # reads it from there (so the generated code still holds one text id of the key).
    key = (KEY_TEXT,) if key_text else ()
    looked_up = (
        *kafka,
        header_column(H_MSG_ID).alias(msg_header),
        header_column(H_GROUP_ID).alias(group_header),
        *([text_id_column(F.col("key")).alias(KEY_TEXT)] if key_text else []),
    )
    ids = (
        *kafka,
        *key,
        msg_id_column(F.col(msg_header)).alias("msg_id"),
        group_id_column(F.col(group_header), F.col(KEY_TEXT) if key_text else None).alias(
            "group_id"
        ),
    )
    records = (
        F.when(F.col("topic").isin(list(mq_names)), F.lit(Kind.MQ.value))
        .otherwise(F.lit(Kind.RQ.value))
        .alias("kind"),
        group_key_column(grouped, F.col("group_id"), F.col("msg_id")).alias("group_key"),
        "group_id",
        "msg_id",
        "topic",
        "partition",
        "offset",
        "key",
        "value",
        F.col("headers").alias("kheaders"),
        *key,
        *([dedup_id().alias("dedup_id")] if dedup else []),
    )
    return looked_up, ids, records


# The most filtered messages a traced batch names (`filter_records`' `traced`): the rest are
# counted, not traced.
MAX_TRACED_FILTERED = 10_000


def filter_records(
    records: DataFrame, filt: filters.Filter | None, traced: bool = False
) -> tuple[DataFrame, Observation | None]:
    """`records` (as `batch_records` makes them) without the main-topic ("mq") records `filt` does
    not match, and an Observation whose `filtered` metric counts those records once a Spark job
    has computed the result (None without a filter: `records` unchanged). RQ records are never
    filtered: they are retries of messages the filter accepted earlier. `traced` (the
    subscription's delivery trace is on): the Observation's `traced` metric also lists the
    first `MAX_TRACED_FILTERED` of them as (msg_id, group_id) structs.

    The filter is part of the Spark plan, before any Python stage: a filtered record costs no
    Python work and no Arrow transfer. Hazard: `Observation.get` blocks until the first job over
    the returned DataFrame has finished; read it only after that job succeeded."""
    if filt is None:
        return records, None
    observed = Observation()  # a unique name: one per batch, never shared between queries
    main = F.col("kind") == F.lit(Kind.MQ.value)
    keep = "_varadhi_keep"
    dropped = main & ~F.col(keep)
    metrics = [F.count_if(dropped).alias("filtered")]
    if traced:
        ids = F.when(dropped, F.struct("msg_id", "group_id"))
        metrics.append(F.slice(F.collect_list(ids), 1, MAX_TRACED_FILTERED).alias("traced"))
    kept = (
        records.withColumn(keep, filter_column(filt, F.col("key"), F.col("kheaders")))
        .observe(observed, *metrics)
        .where(~main | F.col(keep))
        .drop(keep)
    )
    return kept, observed
