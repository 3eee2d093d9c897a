"""Composite topics (seed 000): an ordered list of Kafka storage topics and a produce pointer.

The model and its operations are pure (`new_topic`, `add_storage`, `switch_produce`); the
`TopicService` at the bottom applies them to the catalog and creates the Kafka topics.

A storage topic's Kafka name is `<composite>.<index>`. User-facing names may not contain a dot,
so they never collide with storage topics or with a subscription's internal queues
(`<subscription>.rq`, `<subscription>.dlq`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kafka import TopicPartition
from kafka.admin import NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from varadhi.core import routing
from varadhi.core.catalog_kinds import DocKind
from varadhi.core.errors import AlreadyExists, InvalidArgument, KafkaUnavailable, NotFound
from varadhi.core.names import validate_name, validate_partitions
from varadhi.core.queue_records import QUEUE_HEADROOM_BYTES
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.topic_settings import TOPIC_CONFIGS, TopicSettings

KIND = DocKind.TOPIC


@dataclass(frozen=True)
class StorageTopic:
    name: str
    partitions: int
    k: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "partitions": self.partitions, "k": self.k}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StorageTopic:
        return cls(name=d["name"], partitions=int(d["partitions"]), k=int(d["k"]))


@dataclass(frozen=True)
class CompositeTopic:
    """`storage_topics[produce_pointer]` receives new messages. `switched_at_ms[i]` is when
    produce moved off storage topic i (None while it is, or has never been, the target)."""

    name: str
    storage_topics: tuple[StorageTopic, ...]
    produce_pointer: int = 0
    switched_at_ms: tuple[int | None, ...] = field(default=())
    internal: bool = False
    # Topic configs of its storage topics set by the product or at create (an RQ/DLQ's
    # `max.message.bytes`, `topic create --config`): every storage topic added later gets them.
    configs: tuple[tuple[str, str], ...] = ()
    replication_factor: int | None = None  # None: the cluster configuration's (varadhi.topic.*)

    @property
    def produce_topic(self) -> StorageTopic:
        return self.storage_topics[self.produce_pointer]

    def storage(self, index: int) -> StorageTopic:
        if not 0 <= index < len(self.storage_topics):
            raise InvalidArgument(
                f"storage topic index {index} is outside 0..{len(self.storage_topics) - 1}",
                field="storage_topic",
            )
        return self.storage_topics[index]

    def index_of(self, storage_name: str) -> int:
        for i, st in enumerate(self.storage_topics):
            if st.name == storage_name:
                return i
        raise KeyError(storage_name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "storage_topics": [st.to_dict() for st in self.storage_topics],
            "produce_pointer": self.produce_pointer,
            "switched_at_ms": list(self.switched_at_ms),
            "internal": self.internal,
            **({"configs": dict(self.configs)} if self.configs else {}),
            **(
                {"replication_factor": self.replication_factor}
                if self.replication_factor is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompositeTopic:
        sts = tuple(StorageTopic.from_dict(s) for s in d["storage_topics"])
        switched = tuple(d.get("switched_at_ms") or [None] * len(sts))
        return cls(
            name=d["name"],
            storage_topics=sts,
            produce_pointer=int(d["produce_pointer"]),
            switched_at_ms=switched,
            internal=bool(d.get("internal", False)),
            configs=tuple(sorted((d.get("configs") or {}).items())),
            replication_factor=d.get("replication_factor"),
        )

    @property
    def kind(self) -> str:
        """The kind of topic settings (`topic_settings.TOPIC_KINDS`) its storage topics use."""
        if self.internal and self.name.rsplit(".", 1)[-1] in ("rq", "dlq"):
            return self.name.rsplit(".", 1)[-1]
        return "storage"


def storage_name(composite: str, index: int) -> str:
    return f"{composite}.{index}"


def new_topic(
    name: str,
    partitions: int,
    allow_uneven: bool = False,
    internal: bool = False,
    configs: dict[str, str] | None = None,
    replication_factor: int | None = None,
) -> CompositeTopic:
    validate_name(name, internal=internal)
    validate_partitions(partitions, allow_uneven)
    for config in configs or {}:
        if config not in TOPIC_CONFIGS:
            raise InvalidArgument(f"{config!r} is not a Kafka topic config", field="config")
    if replication_factor is not None and not (
        replication_factor == -1 or 1 <= replication_factor <= 32767
    ):
        raise InvalidArgument(
            f"must be a positive integer or -1 (the cluster's default), got {replication_factor}",
            field="replication_factor",
        )
    st = StorageTopic(storage_name(name, 0), partitions, 1)
    return CompositeTopic(
        name,
        (st,),
        0,
        (None,),
        internal,
        tuple(sorted((configs or {}).items())),
        replication_factor,
    )


@dataclass(frozen=True)
class AddStorageReport:
    """What appending a storage topic means for subscriptions."""

    storage: StorageTopic
    compatible: bool  # False when K had to be reset to 1: subscriptions may need resharding

    def describe(self) -> str:
        if self.compatible:
            return f"added {self.storage.name} with {self.storage.partitions} partitions, K={self.storage.k}"
        return (
            f"added {self.storage.name} with {self.storage.partitions} partitions, K=1: the partition "
            "count is not a multiple of the previous base count, so this is a partition change; "
            "groups move to other partitions, so the shards of a grouped subscription stop at the "
            "end of the previous storage topic until none of them has a pending group or until "
            "`subscription change-shards` (see `varadhi status`); subscriptions whose shard count "
            "does not divide it need `subscription change-shards`"
        )


def add_storage(
    topic: CompositeTopic, partitions: int, allow_uneven: bool = False
) -> tuple[CompositeTopic, AddStorageReport]:
    validate_partitions(partitions, allow_uneven)
    last = topic.storage_topics[-1]
    k = routing.next_k(last.partitions, last.k, partitions)
    compatible = not (k == 1 and partitions != last.partitions // last.k)
    st = StorageTopic(storage_name(topic.name, len(topic.storage_topics)), partitions, k)
    updated = replace(
        topic,
        storage_topics=topic.storage_topics + (st,),
        switched_at_ms=topic.switched_at_ms + (None,),
    )
    return updated, AddStorageReport(st, compatible)


def switch_produce(topic: CompositeTopic, now_ms: int) -> CompositeTopic:
    """Move the produce pointer one step; at the last storage topic it stays (seed 000)."""
    if topic.produce_pointer >= len(topic.storage_topics) - 1:
        return topic
    switched = list(topic.switched_at_ms)
    switched[topic.produce_pointer] = now_ms
    return replace(topic, produce_pointer=topic.produce_pointer + 1, switched_at_ms=tuple(switched))


# Producers learn of a switch within a second and give up on a record after 30 s
# (producer.KAFKA_DEFAULTS), so nothing reaches a storage topic later than this after the switch.
SEAL_GRACE_MS = int(os.environ.get("VARADHI_SEAL_GRACE_MS", "35000"))


def sealed(topic: CompositeTopic, index: int, now_ms: int, grace_ms: int) -> bool:
    """Storage topic `index` takes no more writes: produce moved off it over `grace_ms` ago.

    Producers learn of a switch by polling the catalog (every second by default), so for a short
    moment after a switch they may still write to the old topic; readers that must see all of it
    before reading the next one wait for the grace period (see DESIGN hazard 3).
    """
    if index >= topic.produce_pointer:
        return False
    at = topic.switched_at_ms[index]
    return at is None or now_ms - at >= grace_ms


def from_snapshot(snapshot: Snapshot, name: str) -> CompositeTopic:
    doc = snapshot.get(KIND, name)
    if doc is None:
        raise NotFound("topic", name)
    return CompositeTopic.from_dict(doc)


# -- I/O ----------------------------------------------------------------------------------


def settings_for(
    settings: kafka_clients.HasKafka,
    kind: str,
    configs: dict[str, str] | None = None,
    replication_factor: int | None = None,
) -> TopicSettings:
    """How to create a topic of `kind`: the cluster configuration's `varadhi.topic.*` settings
    with the topic's own on top (`configs`, `replication_factor`). A `max.message.bytes` the
    product needs (an RQ/DLQ's) is a minimum: a larger configured one stays."""
    base = kafka_clients.config_of(settings).topics(kind)
    merged = dict(base.configs)
    for name, value in (configs or {}).items():
        if name == "max.message.bytes" and name in merged:
            value = str(max(int(merged[name]), int(value)))
        merged[name] = value
    factor = base.replication_factor if replication_factor is None else replication_factor
    return TopicSettings(factor, tuple(sorted(merged.items())))


def ensure_kafka_topic(
    admin: Any,
    name: str,
    partitions: int,
    ts: TopicSettings,
    what: str = "Kafka topic",
    wait_s: float = kafka_clients.TOPIC_CONFIGS_WAIT_S,
) -> bool:
    """Create one Kafka topic with `ts`, or accept an existing (pre-created) one that fits:
    its partition count is `partitions`, its replication factor at least a configured one, and
    its `max.message.bytes` at least a required one (an RQ/DLQ's); otherwise `InvalidArgument`
    saying what differs. True when this call created it.

    Hazard: a topic another client created a moment before exists, but the answering broker
    may describe it without partitions until its metadata catches up; it is described again
    for up to `wait_s` before its partition count is judged."""
    configs = dict(ts.configs)
    try:
        admin.create_topics(
            [NewTopic(name, partitions, ts.replication_factor, topic_configs=configs)]
        )
        return True
    except TopicAlreadyExistsError:
        pass
    deadline = time.monotonic() + wait_s
    existing = admin.describe_topics([name])[0]
    while not existing["partitions"] and time.monotonic() < deadline:
        time.sleep(0.2)
        existing = admin.describe_topics([name])[0]
    count = len(existing["partitions"])
    if count != partitions:
        raise InvalidArgument(
            f"{what} {name} already exists with {count} partitions, not {partitions}; "
            "delete it or choose another name",
            field="name",
        ) from None
    replicas = min(
        (len(p.get("replica_nodes") or p.get("replicas") or ()) for p in existing["partitions"]),
        default=0,
    )
    if ts.replication_factor != -1 and replicas < ts.replication_factor:
        raise InvalidArgument(
            f"{what} {name} already exists with replication factor {replicas}, less than the "
            f"configured {ts.replication_factor}; add replicas (kafka-reassign-partitions) or "
            "delete it",
            field="name",
        )
    needed = int(configs.get("max.message.bytes", 0))
    if needed:
        found = kafka_clients.topic_configs(admin, None, [name], ["max.message.bytes"])[name][
            "max.message.bytes"
        ]
        if int(found) < needed:
            raise InvalidArgument(
                f"{what} {name} already exists with max.message.bytes {found}, less than the "
                f"{needed} it needs; raise it (kafka-configs --alter --entity-type topics "
                f"--entity-name {name} --add-config max.message.bytes={needed}) or delete it",
                field="name",
            )
    return False


def create_kafka_topics(
    catalog: Catalog, storages: Sequence[StorageTopic], topic: CompositeTopic | None = None
) -> None:
    """Create the Kafka topics of `topic` (its kind, configs and replication factor; a plain
    storage topic without it). Idempotent: an existing topic that fits is accepted."""
    ts = settings_for(
        catalog.settings,
        topic.kind if topic else "storage",
        dict(topic.configs) if topic else None,
        topic.replication_factor if topic else None,
    )
    try:
        admin = kafka_clients.admin(catalog.settings, client_id="varadhi-admin")
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot reach Kafka at {catalog.settings.bootstrap}: {e}") from e
    try:
        for st in storages:
            ensure_kafka_topic(admin, st.name, st.partitions, ts)
    finally:
        admin.close()


def queue_configs(catalog: Catalog, main: CompositeTopic) -> dict[str, str]:
    """The topic configs of a subscription's RQ and DLQ storage topics: a `max.message.bytes`
    that takes every record of `main` (the largest of its storage topics' effective limits)
    plus the headers a shard adds (`queue_records.QUEUE_HEADROOM_BYTES`)."""
    limits = max_message_bytes(catalog, [st.name for st in main.storage_topics])
    return {"max.message.bytes": str(max(limits.values()) + QUEUE_HEADROOM_BYTES)}


def max_message_bytes(catalog: Catalog, names: Sequence[str]) -> dict[str, int]:
    """Each Kafka topic's effective `max.message.bytes` (its own setting or the broker's
    default): the largest record batch the broker accepts on it."""
    try:
        admin = kafka_clients.admin(catalog.settings, client_id="varadhi-admin")
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot reach Kafka at {catalog.settings.bootstrap}: {e}") from e
    try:
        found = kafka_clients.topic_configs(admin, catalog.settings, names, ["max.message.bytes"])
    finally:
        admin.close()
    return {n: int(found[n]["max.message.bytes"]) for n in names}


def end_offsets(catalog: Catalog, storages: Sequence[StorageTopic]) -> dict[str, list[int]]:
    """Log-end offsets of every partition of `storages`: storage name -> [offset per partition]."""
    try:
        consumer = kafka_clients.consumer(
            catalog.settings,
            client_id="varadhi-offsets",
            enable_auto_commit=False,
        )
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot reach Kafka at {catalog.settings.bootstrap}: {e}") from e
    try:
        tps = [TopicPartition(st.name, p) for st in storages for p in range(st.partitions)]
        ends = consumer.end_offsets(tps) if tps else {}
        return {
            st.name: [ends[TopicPartition(st.name, p)] for p in range(st.partitions)]
            for st in storages
        }
    finally:
        consumer.close()


class TopicService:
    """Topic commands against the catalog and Kafka. Validation happens before any side effect."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def get(self, name: str) -> CompositeTopic:
        return from_snapshot(self.catalog.snapshot(), name)

    def list(self) -> list[CompositeTopic]:
        return [CompositeTopic.from_dict(d) for d in self.catalog.snapshot().items(KIND).values()]

    def create(
        self,
        name: str,
        partitions: int,
        allow_uneven: bool = False,
        internal: bool = False,
        configs: dict[str, str] | None = None,
        replication_factor: int | None = None,
    ) -> CompositeTopic:
        topic = new_topic(name, partitions, allow_uneven, internal, configs, replication_factor)
        if self.catalog.snapshot().get(KIND, name) is not None:
            raise AlreadyExists("topic", name)
        create_kafka_topics(self.catalog, topic.storage_topics, topic)

        def change(snap: Snapshot):
            if snap.get(KIND, name) is not None:
                raise AlreadyExists("topic", name)
            return {key(KIND, name): topic.to_dict()}

        self.catalog.mutate(change)
        return topic

    def add_storage(
        self, name: str, partitions: int, allow_uneven: bool = False
    ) -> AddStorageReport:
        current = self.get(name)
        planned, report = add_storage(current, partitions, allow_uneven)
        create_kafka_topics(self.catalog, [report.storage], current)

        def change(snap: Snapshot):
            now = from_snapshot(snap, name)
            if len(now.storage_topics) != len(current.storage_topics):
                raise InvalidArgument(
                    f"topic {name} changed while adding a storage topic; run the command again"
                )
            return {key(KIND, name): planned.to_dict()}

        self.catalog.mutate(change)
        return report

    def switch_produce(self, name: str) -> CompositeTopic:
        result: dict[str, CompositeTopic] = {}

        def change(snap: Snapshot):
            now = from_snapshot(snap, name)
            if now.produce_pointer >= len(now.storage_topics) - 1:
                raise InvalidArgument(
                    f"topic {name} already produces to its last storage topic "
                    f"({now.produce_topic.name}); add a storage topic first"
                )
            result["topic"] = switch_produce(now, int(time.time() * 1000))
            return {key(KIND, name): result["topic"].to_dict()}

        self.catalog.mutate(change)
        return result["topic"]

    def describe(self, name: str) -> dict[str, Any]:
        return self.describe_many([name])[0]

    def describe_many(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """`describe` of each topic in `names`, in order, with one end-offsets request."""
        snap = self.catalog.snapshot()
        found = [from_snapshot(snap, name) for name in names]
        ends = end_offsets(self.catalog, [st for t in found for st in t.storage_topics])
        docs = []
        for topic in found:
            doc = topic.to_dict()
            for st in doc["storage_topics"]:
                st["end_offsets"] = ends[st["name"]]
                st["messages"] = sum(ends[st["name"]])
            doc["produce_topic"] = topic.produce_topic.name
            docs.append(doc)
        return docs
