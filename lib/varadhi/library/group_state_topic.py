"""The library runtime's global GroupState: the compacted topic `<subscription>.state`.

One record per blocked key and slot (`on_dead_letter: block`): its Kafka key the ordering key,
its value the key's blocks (`varadhi.library.blocked_keys.encode`), a tombstone once nothing
blocks it. The topic has as many partitions as the subscription's DLQ, and a key's record goes
to the partition of the key's slot that its DLQ records go to (`partition_of`, the shards'
routing), so slot s's records lie in slot s's partitions: the member that gets a slot reads
those partitions to their end (`read_slots`) before it hands out any of the slot's messages,
and only the slot's owner writes them. A `change-shards` merge keeps that true (slots nest and
the DLQ keeps its partitions); a split is refused while the DLQ holds dead letters, so while any
key is blocked.

The topic is made by the first member that starts (`ensure_topic`; `subscription delete`
deletes it), compacted, with the DLQ's replication factor (the DLQ's own, else
`varadhi.topic.dlq.replication.factor`): what it records is as precious as the dead letters. An existing topic with another
partition count is refused.

Hazard: a key whose messages lie in partitions of two slots (an ordering key other than the
group id) has a record per slot; after a merge both are the one slot's and are read as one, and
the next change of that key's blocks rewrites it on its partition and tombstones the other
(`Blocking`), so neither outlives the other.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from kafka import TopicPartition
from kafka.errors import AuthorizationError

from varadhi.core import routing
from varadhi.core.errors import KafkaUnavailable
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.topic_settings import TopicSettings
from varadhi.library import blocked_keys
from varadhi.library.blocked_keys import Blocks

#: How long reading a slot's records may take before the assignment is set up again.
READ_TIMEOUT_S = 60.0


def topic_name(subscription: str) -> str:
    """The GroupState topic of a subscription (user names hold no dot: no clash)."""
    return f"{subscription}.state"


def partition_of(key: str, slot: int, slots: int, partitions: int) -> int:
    """The partition of `key`'s record in `slot`: the slot's partition its DLQ records go to
    (pure)."""
    owned = routing.shard_partitions(slot, slots, partitions)
    return routing.internal_partition(routing.group_hash(key), owned)


def ensure_topic(settings, subscription: str, dlq: topics.CompositeTopic) -> None:
    """Make the subscription's GroupState topic, compacted, with the partitions and replication
    factor of its DLQ (`dlq`), or accept an existing one with those partitions
    (`InvalidArgument` otherwise). A missing Create (or Describe) ACL is `NotAuthorized` naming
    it (exit 4)."""
    ensure_beside_dlq(
        settings,
        topic_name(subscription),
        dlq.produce_topic.partitions,
        (("cleanup.policy", "compact"),),
        dlq,
        "the GroupState topic",
    )


def ensure_beside_dlq(
    settings,
    name: str,
    partitions: int,
    configs: tuple[tuple[str, str], ...],
    dlq: topics.CompositeTopic,
    what: str,
) -> None:
    """Make a topic a library member keeps next to the subscription's DLQ (the GroupState
    topic, the dedup topic): `partitions`, `configs`, and the DLQ's replication factor (its own,
    else `varadhi.topic.dlq.replication.factor`), or accept an existing one with those
    partitions (`InvalidArgument` otherwise). A missing Create (or Describe) ACL is
    `NotAuthorized` naming it (exit 4)."""
    factor = dlq.replication_factor
    if factor is None:
        factor = kafka_clients.config_of(settings).topics("dlq").replication_factor
    admin = kafka_clients.admin(settings, client_id="varadhi-library-topic-admin")
    try:
        topics.ensure_kafka_topic(
            admin, name, partitions, TopicSettings(factor, configs), what=what
        )
    except AuthorizationError as e:
        raise kafka_clients.refused(settings, e, "Create", name) from e
    finally:
        admin.close()


def read_slots(settings, name: str, partitions: Iterable[int]) -> dict[int, dict[str, Blocks]]:
    """The records of `partitions` (partition -> key -> blocks, the latest record of each key;
    keys no longer blocked left out), read to the end offsets they have now. Raises
    `KafkaUnavailable` when that takes longer than `READ_TIMEOUT_S` (the caller tries again), a
    KafkaError on Kafka's; ValueError for a record no member wrote."""
    tps = [TopicPartition(name, p) for p in partitions]
    out: dict[int, dict[str, Blocks]] = {tp.partition: {} for tp in tps}
    if not tps:
        return out
    consumer = kafka_clients.consumer(settings, enable_auto_commit=False)
    try:
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        consumer.seek_to_beginning(*tps)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"{name}: not read to its end within {READ_TIMEOUT_S} s")
            for tp, records in consumer.poll(timeout_ms=200).items():
                for r in records:
                    if r.offset < ends[tp] and r.key is not None:
                        out[tp.partition][blocked_keys.key_text(r.key)] = blocked_keys.decode(
                            r.value
                        )
    finally:
        consumer.close(autocommit=False)
    return {p: {k: b for k, b in keys.items() if b} for p, keys in out.items()}


def read_slots_of(
    settings, subscription: str, slots: Iterable[int], slot_count: int, dlq: topics.StorageTopic
) -> dict[int, dict[int, dict[str, Blocks]]]:
    """`read_slots` of each of `slots` (slot -> its partitions' records) of a subscription of
    `slot_count` slots whose DLQ storage topic is `dlq`."""
    name = topic_name(subscription)
    return {
        s: read_slots(settings, name, routing.shard_partitions(s, slot_count, dlq.partitions))
        for s in slots
    }


def blocked_count(settings, subscription: str) -> int:
    """How many keys (per slot) the subscription's GroupState topic holds blocked now (0: it
    has no such topic)."""
    name = topic_name(subscription)
    admin = kafka_clients.admin(settings, client_id="varadhi-group-state-admin")
    try:
        if name not in admin.list_topics():
            return 0
        partitions = len(admin.describe_topics([name])[0]["partitions"])
    finally:
        admin.close()
    return sum(len(keys) for keys in read_slots(settings, name, range(partitions)).values())
