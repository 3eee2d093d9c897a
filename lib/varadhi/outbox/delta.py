"""Delta outbox for Spark pipelines: rows appended to a Delta table reach composite topics exactly
once each.

    outbox = DeltaOutbox(spark, "/lake/orders_outbox", name="orders-outbox")
    outbox.create_table()                                    # once
    outbox.append(df)            # df: topic, group_id, message_id, headers map<string,string>, value
    query = outbox.start()       # a Structured Streaming query; or start(available_now=True)
    outbox.await_termination(query)  # a missing Kafka ACL: NotAuthorized, one line naming it

The table (`SCHEMA`) has change data feed enabled; the query streams its inserts (Delta source,
`readChangeFeed`) and, per micro-batch:

1. computes each row's storage topic and partition on the executors (`mapInPandas` calling
   `producer.plan`, i.e. `routing.route_group` with the produce topic's partition count and K,
   from the catalog as read when the batch starts); rows that cannot be sent (no such topic, no
   value, a reserved `varadhi-` header, a value over `max_message_bytes`) are set aside;
2. on the driver (`foreachBatch`), sends the rows, in commit-version order, through a
   *transactional* Kafka producer whose transactional id is fixed per outbox name, and in the same
   Kafka transaction writes a marker `(checkpoint id, batch id)` to the compacted topic
   `__varadhi_delta_outbox` (key: the outbox name);
3. appends the set-aside rows, with the reason, to the Delta table `<path>_rejected`, idempotently
   per batch (`txnAppId`/`txnVersion`).

Exactly once. The messages and the marker commit atomically. A batch that Spark replays after a
crash (the Kafka transaction committed, the checkpoint did not) finds its batch id already in the
marker and is skipped; a batch whose transaction never committed is sent again, and its earlier
attempt stays aborted. `init_transactions` with the fixed transactional id fences an older instance
of the query and aborts its open transaction. The marker carries the checkpoint's query id, so a
new checkpoint (whose batch ids start at 0 again) is not mistaken for a replay. Readers get exactly
once only with `isolation.level=read_committed` (the Spark Kafka source: option
`kafka.isolation.level`); a `read_uncommitted` reader may also see records of aborted attempts.

Order: a group's rows are sent in the order of the Delta commits that added them; rows of one group
within one append keep their order when they were written by one task (e.g.
`df.repartition("group_id").sortWithinPartitions(...)`), since each data file is read in order.

Throughput is that of one Kafka producer on the driver; bound the batch size with
`max_files_per_trigger` (each batch is collected to the driver).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pandas as pd
from kafka import KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import (
    AuthorizationError,
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
)

from varadhi.core import names
from varadhi.core.errors import InvalidArgument, KafkaUnavailable, VaradhiError
from varadhi.core.messages import H_GROUP_ID, H_MSG_ID, H_PRODUCED_MS
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import RESERVED_HEADER_PREFIX, new_message_id, plan
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

SCHEMA = (
    "topic STRING, group_id STRING, message_id STRING, headers MAP<STRING, STRING>, value BINARY"
)
REJECTED_SCHEMA = (
    "topic STRING, group_id STRING, message_id STRING, headers MAP<STRING, STRING>, value BINARY, "
    "reason STRING, batch_id BIGINT, rejected_ms BIGINT"
)
MARKER_TOPIC = "__varadhi_delta_outbox"
_ROUTED_SCHEMA = (
    "topic STRING, group_id STRING, message_id STRING, headers_json STRING, value BINARY, "
    "commit_version BIGINT, position BIGINT, storage STRING, partition INT, reason STRING"
)


class DeltaOutboxError(VaradhiError):
    """A Delta outbox batch could not be committed to Kafka (it is retried when the query is)."""


@dataclass(frozen=True)
class BatchResult:
    batch_id: int
    sent: int
    rejected: int
    skipped: bool  # a replay of a batch that had been committed already


def route_frames(
    frames: Iterator[pd.DataFrame], routes: dict[str, tuple[str, int, int]], max_bytes: int
) -> Iterator[pd.DataFrame]:
    """`mapInPandas` body: add storage topic, partition and a rejection reason to each row.

    `routes` maps a composite topic name to its produce topic `(name, partitions, k)`. Pure (no
    I/O): it runs on executors. Ungrouped rows are spread by a hash of their message id."""
    import mmh3

    for frame in frames:
        storages, partitions, reasons, ids = [], [], [], []
        for topic, group, mid, headers, value in zip(
            frame["topic"],
            frame["group_id"],
            frame["message_id"],
            frame["headers_json"],
            frame["value"],
            strict=True,
        ):
            group = None if _missing(group) else group
            mid = new_message_id() if _missing(mid) or mid == "" else mid
            ids.append(mid)
            reason = _rejection(topic, group, headers, value, routes, max_bytes)
            if reason is None:
                name, count, k = routes[topic]
                spread = mmh3.hash(mid.encode("utf-8"), 0, signed=False)
                storage, partition = plan(_Produce(name, count, k), group, spread)
                storages.append(storage)
                partitions.append(partition)
            else:
                storages.append(None)
                partitions.append(None)
            reasons.append(reason)
        out = frame.copy()
        out["message_id"] = ids
        out["storage"] = storages
        out["partition"] = pd.array(partitions, dtype="Int32")
        out["reason"] = reasons
        yield out


class _Produce:
    """The one attribute of a `CompositeTopic` that `plan` reads, without shipping the catalog."""

    def __init__(self, name: str, partitions: int, k: int):
        self.produce_topic = topics.StorageTopic(name, partitions, k)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _rejection(topic, group, headers_json, value, routes, max_bytes) -> str | None:
    if _missing(topic) or topic not in routes:
        return f"topic {topic!r} does not exist"
    if _missing(value) or value is None:
        return "the value is null"
    if len(value) > max_bytes:
        return f"the value is {len(value)} bytes, more than the limit of {max_bytes}"
    if group is not None and group == "":
        return "the group id is empty (use null for an ungrouped message)"
    if not _missing(headers_json) and headers_json:
        for name in json.loads(headers_json):
            if name.startswith(RESERVED_HEADER_PREFIX):
                return (
                    f"header {name!r} is reserved (names starting with {RESERVED_HEADER_PREFIX!r})"
                )
    return None


class DeltaOutbox:
    """A Delta outbox table and the streaming query that relays it (see the module doc).

    `name` identifies the outbox: it fixes the Kafka transactional id and the marker key, so give
    each outbox table its own name and keep it across restarts. `checkpoint` defaults to
    `<warehouse>/checkpoints/delta_outbox/<name>`.
    """

    def __init__(
        self,
        spark,
        path: str,
        *,
        name: str,
        settings: Settings | None = None,
        catalog: Catalog | None = None,
        checkpoint: str | None = None,
        rejected_path: str | None = None,
        max_message_bytes: int = 1_048_576,
        max_files_per_trigger: int = 100,
        send_timeout_s: float = 60.0,
        **kafka_config: Any,
    ):
        names.validate_name(name)
        self.spark = spark
        self.path = path.rstrip("/")
        self.name = name
        self._owns_catalog = catalog is None
        self.catalog = catalog or Catalog(settings)
        self.settings = settings or self.catalog.settings
        self.checkpoint = checkpoint or f"{self.settings.warehouse}/checkpoints/delta_outbox/{name}"
        self.rejected_path = rejected_path or f"{self.path}_rejected"
        self.max_message_bytes = max_message_bytes
        self.max_files_per_trigger = max_files_per_trigger
        self.send_timeout_s = send_timeout_s
        self.transactional_id = f"varadhi-delta-outbox-{name}"
        self._kafka_config = {"linger_ms": 5, **kafka_config}
        self._producer: KafkaProducer | None = None
        self._committed: tuple[str, int] | None = None  # (checkpoint id, last batch id)
        self._checkpoint_id: str | None = None
        self._lock = threading.Lock()
        self.results: deque[BatchResult] = deque(maxlen=100)  # the latest batches, newest last

    # -- the table ---------------------------------------------------------------------------
    def create_table(self) -> None:
        """Create the outbox table (empty, change data feed on) unless it exists."""
        from delta.tables import DeltaTable

        if DeltaTable.isDeltaTable(self.spark, self.path):
            props = self.spark.sql(f"SHOW TBLPROPERTIES delta.`{self.path}`").collect()
            if not any(
                r["key"] == "delta.enableChangeDataFeed" and r["value"] == "true" for r in props
            ):
                raise InvalidArgument(
                    f"{self.path} is a Delta table without change data feed; set "
                    "delta.enableChangeDataFeed = true on it (before appending) or use a new path",
                    field="path",
                )
            return
        (
            DeltaTable.createIfNotExists(self.spark)
            .location(self.path)
            .addColumns(self.spark.createDataFrame([], SCHEMA).schema)
            .property("delta.enableChangeDataFeed", "true")
            .execute()
        )

    def append(self, df) -> None:
        """Append `df` (columns of `SCHEMA`; extra columns are refused) to the outbox table."""
        expected = [f.name for f in self.spark.createDataFrame([], SCHEMA).schema.fields]
        if sorted(df.columns) != sorted(expected):
            raise InvalidArgument(
                f"columns must be {', '.join(expected)}; got {', '.join(df.columns)}",
                field="df",
            )
        df.select(*expected).write.format("delta").mode("append").save(self.path)

    # -- the query ---------------------------------------------------------------------------
    def start(
        self,
        *,
        available_now: bool = False,
        processing_time: str = "1 second",
        query_name: str | None = None,
    ):
        """Start the relay query; `available_now=True` relays what is there, then stops."""
        self.create_table()
        stream = (
            self.spark.readStream.format("delta")
            .option("readChangeFeed", "true")
            # from the first commit, so every row keeps its own commit version (without it the
            # first batch is the table's snapshot, all rows at one version: no order between them)
            .option("startingVersion", 0)
            .option("maxFilesPerTrigger", self.max_files_per_trigger)
            .load(self.path)
        )
        writer = (
            stream.writeStream.foreachBatch(self.process_batch)
            .option("checkpointLocation", self.checkpoint)
            .queryName(query_name or f"delta-outbox-{self.name}")
        )
        writer = (
            writer.trigger(availableNow=True)
            if available_now
            else writer.trigger(processingTime=processing_time)
        )
        return writer.start()

    def await_termination(self, query, timeout_s: float | None = None) -> bool:
        """Wait for `query` (from `start`) like its `awaitTermination`: whether it has ended
        within `timeout_s` (None: until it ends). A query that failed for a missing Kafka ACL
        raises `NotAuthorized` (one line naming principal, operation and resource, exit code 4)
        instead of Spark's `StreamingQueryException`; other failures are raised as Spark's."""
        try:
            ended = (
                query.awaitTermination() if timeout_s is None else query.awaitTermination(timeout_s)
            )
        except Exception as e:
            refused = kafka_clients.refusal(self.settings, e)
            if refused is None:
                raise
            raise refused from e
        return True if ended is None else bool(ended)

    def process_batch(self, df, batch_id: int) -> BatchResult:
        """The `foreachBatch` function: relay one micro-batch of change-feed rows exactly once."""
        result = self._process(df, batch_id)
        self.results.append(result)
        return result

    def _process(self, df, batch_id: int) -> BatchResult:
        with self._lock:
            checkpoint_id = self._query_id()
            last = self._last_committed()
            if last is not None and last[0] == checkpoint_id and batch_id <= last[1]:
                log.info(
                    "delta outbox %s: batch %d was committed before (last %d); skipping the replay",
                    self.name,
                    batch_id,
                    last[1],
                )
                return BatchResult(batch_id, 0, 0, True)
            routed = self._route(df)
            ok = routed[routed["reason"].isna()]
            rejected = routed[routed["reason"].notna()]
            if len(rejected):
                self._reject(rejected, batch_id)
            self._send(ok, checkpoint_id, batch_id)
            self._committed = (checkpoint_id, batch_id)
            return BatchResult(batch_id, len(ok), len(rejected), False)

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close(timeout=5)
                self._producer = None
        if self._owns_catalog:
            self.catalog.close()

    # -- internals ---------------------------------------------------------------------------
    def _route(self, df) -> pd.DataFrame:
        from pyspark.sql import functions as F

        snapshot = self.catalog.snapshot()
        routes = {
            name: (t.produce_topic.name, t.produce_topic.partitions, t.produce_topic.k)
            for name, t in (
                (n, topics.CompositeTopic.from_dict(d))
                for n, d in snapshot.items(topics.KIND).items()
            )
            if not t.internal
        }
        max_bytes = self.max_message_bytes
        prepared = df.where(F.col("_change_type") == "insert").select(
            "topic",
            "group_id",
            "message_id",
            F.when(F.size("headers") > 0, F.to_json("headers")).alias("headers_json"),
            "value",
            F.col("_commit_version").alias("commit_version"),
            F.monotonically_increasing_id().alias("position"),
        )
        routed = prepared.mapInPandas(
            lambda frames: route_frames(frames, routes, max_bytes), _ROUTED_SCHEMA
        ).toPandas()
        return routed.sort_values(["commit_version", "position"], kind="stable")

    def _send(self, rows: pd.DataFrame, checkpoint_id: str, batch_id: int) -> None:
        producer = self._transactional_producer()
        now_ms = int(time.time() * 1000)
        marker = json.dumps(
            {"checkpoint_id": checkpoint_id, "batch_id": batch_id, "rows": len(rows)}
        ).encode()
        futures = []
        try:
            producer.begin_transaction()
            for storage, partition, group, mid, headers_json, value in zip(
                rows["storage"],
                rows["partition"],
                rows["group_id"],
                rows["message_id"],
                rows["headers_json"],
                rows["value"],
                strict=True,
            ):
                group = None if _missing(group) else group
                headers = [(H_MSG_ID, mid.encode()), (H_PRODUCED_MS, str(now_ms).encode())]
                if group is not None:
                    headers.append((H_GROUP_ID, group.encode()))
                if not _missing(headers_json) and headers_json:
                    user = json.loads(headers_json).items()
                    headers.extend((k, v.encode()) for k, v in user if v is not None)
                send = producer.send(
                    storage,
                    value=bytes(value),
                    key=None if group is None else group.encode(),
                    headers=headers,
                    partition=int(partition),
                )
                futures.append(send)
            futures.append(
                producer.send(MARKER_TOPIC, key=self.name.encode(), value=marker, partition=0)
            )
            for f in futures:  # a refused topic fails its sends by name (the commit does not)
                f.get(timeout=self.send_timeout_s)
            what = f"delta outbox {self.name}: batch {batch_id}"
            try:
                kafka_clients.end_transaction(
                    producer, commit=True, timeout_s=self.send_timeout_s, what=what
                )
            except KafkaTimeoutError as e:  # the broker's verdict unknown: not to be aborted
                self._discard(producer)
                raise DeltaOutboxError(
                    f"{e}; the batch runs again, and its marker says whether it was sent"
                ) from e
        except (KafkaError, ValueError) as e:
            self._abort(producer)
            # a missing ACL: one line naming it (a later send or the commit reports it as the
            # producer's error state, the refused topic's error in its arguments)
            denied = next((a for a in (e, *e.args) if isinstance(a, AuthorizationError)), None)
            if denied is not None:
                raise kafka_clients.refused(self.settings, denied, "Write") from e
            raise DeltaOutboxError(
                f"delta outbox {self.name}: batch {batch_id} ({len(rows)} rows) was not "
                f"committed to Kafka: {e}"
            ) from e
        except BaseException:
            self._abort(producer)
            raise

    def _reject(self, rows: pd.DataFrame, batch_id: int) -> None:
        """Append rows that cannot be sent to `<path>_rejected`, once per batch id."""
        now_ms = int(time.time() * 1000)
        records = [
            (
                None if _missing(r.topic) else r.topic,
                None if _missing(r.group_id) else r.group_id,
                r.message_id,
                json.loads(r.headers_json) if not _missing(r.headers_json) else {},
                None if _missing(r.value) else bytes(r.value),
                r.reason,
                batch_id,
                now_ms,
            )
            for r in rows.itertuples()
        ]
        log.warning(
            "delta outbox %s: %d row(s) of batch %d cannot be sent, see %s (first: %s)",
            self.name,
            len(records),
            batch_id,
            self.rejected_path,
            records[0][5],
        )
        (
            self.spark.createDataFrame(records, REJECTED_SCHEMA)
            .write.format("delta")
            .mode("append")
            .option("txnAppId", f"{self.name}-rejected-{self._query_id()}")
            .option("txnVersion", batch_id)
            .save(self.rejected_path)
        )

    def _query_id(self) -> str:
        """The streaming query's id, from `<checkpoint>/metadata`: fixed for a checkpoint, new
        for a new one (whose batch ids start at 0 again)."""
        if self._checkpoint_id is None:
            text = "".join(
                r.value for r in self.spark.read.text(f"{self.checkpoint}/metadata").collect()
            )
            self._checkpoint_id = json.loads(text)["id"]
        return self._checkpoint_id

    def _last_committed(self) -> tuple[str, int] | None:
        """The last (checkpoint id, batch id) committed by this outbox, read from the marker topic
        once per process (later batches are committed by this process, or it is fenced)."""
        if self._committed is not None:
            return self._committed
        self._transactional_producer()  # fences older instances first: their commits are done
        consumer = kafka_clients.consumer(
            self.settings,
            isolation_level="read_committed",
            enable_auto_commit=False,
            client_id=f"varadhi-delta-outbox-{self.name}-marker",
        )
        try:
            tp = TopicPartition(MARKER_TOPIC, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)
            end = consumer.end_offsets([tp])[tp]
            key = self.name.encode()
            last = None
            deadline = time.monotonic() + self.send_timeout_s
            while consumer.position(tp) < end:
                if time.monotonic() > deadline:
                    raise KafkaUnavailable(f"timed out reading {MARKER_TOPIC}")
                for records in consumer.poll(timeout_ms=200).values():
                    for record in records:
                        if record.key == key and record.value is not None:
                            last = json.loads(record.value)
        finally:
            consumer.close()
        if last is not None:
            self._committed = (last["checkpoint_id"], int(last["batch_id"]))
        return self._committed

    def _transactional_producer(self) -> KafkaProducer:
        if self._producer is None:
            self._ensure_marker_topic()
            try:
                producer = kafka_clients.producer(
                    self.settings,
                    transactional_id=self.transactional_id,
                    client_id=self.transactional_id,
                    max_block_ms=int(self.send_timeout_s * 1000),
                    **self._kafka_config,
                )
                producer.init_transactions()
            except KafkaError as e:
                raise KafkaUnavailable(
                    f"cannot start the transactional producer {self.transactional_id}: {e}"
                ) from e
            self._producer = producer
        return self._producer

    def _abort(self, producer: KafkaProducer) -> None:
        """Abort the open transaction (waiting `send_timeout_s` at most); a producer that cannot
        abort is discarded."""
        try:
            kafka_clients.end_transaction(
                producer,
                commit=False,
                timeout_s=self.send_timeout_s,
                what=f"delta outbox {self.name}",
            )
        except KafkaError as e:
            log.warning("delta outbox %s: abort failed (%s); new producer next", self.name, e)
            self._discard(producer)

    def _discard(self, producer: KafkaProducer) -> None:
        """Close `producer` and start the next batch with a new one, which fences it (and waits
        for the broker's verdict on its transaction) before the marker is read again."""
        try:
            producer.close(timeout=1)
        except KafkaError:
            pass
        self._producer = None
        self._committed = None  # re-read after re-fencing

    def _ensure_marker_topic(self) -> None:
        try:
            admin = kafka_clients.admin(self.settings, client_id="varadhi-delta-outbox-admin")
        except KafkaError as e:
            raise KafkaUnavailable(f"cannot reach Kafka at {self.settings.bootstrap}: {e}") from e
        try:
            if MARKER_TOPIC not in admin.list_topics():
                ts = kafka_clients.config_of(self.settings).topics("catalog")
                configs = ts.config({"cleanup.policy": "compact"})
                admin.create_topics(
                    [NewTopic(MARKER_TOPIC, 1, ts.replication_factor, topic_configs=configs)]
                )
        except TopicAlreadyExistsError:
            pass
        finally:
            admin.close()
