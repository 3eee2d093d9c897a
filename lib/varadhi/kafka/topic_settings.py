"""The product's topics and how they are created: the kinds of topic it makes (`TOPIC_KINDS`),
Kafka's topic-level configs (`TOPIC_CONFIGS`), and the `TopicSettings` (replication factor, topic
configs) of one kind, read from the `varadhi.topic.*` keys of the Kafka client configuration file
(`varadhi.kafka.config`, which validates them; `KafkaConfig.topics(kind)`).

`varadhi.topic.replication.factor` and `varadhi.topic.config.<topic config>` apply to every kind;
`varadhi.topic.<kind>.<...>` to one kind and win over the general ones. Unset, a topic gets the
cluster's defaults (replication factor -1, KIP-464). The catalog topic is always compacted: a
general `cleanup.policy` without `compact` does not apply to it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: The topics this product creates, and the properties that shape them (not client properties:
#: never passed to a client). `varadhi.topic.replication.factor` and
#: `varadhi.topic.config.<topic config>` apply to every kind; `varadhi.topic.<kind>.<...>` to
#: one kind and win over the general ones. Unset, a topic gets the cluster's defaults
#: (`default.replication.factor`, `min.insync.replicas`, ...): replication factor -1 (KIP-464).
TOPIC_PREFIX = "varadhi.topic."
TOPIC_KINDS = ("storage", "rq", "dlq", "catalog", "progress", "journal", "trace")
#: Kafka's topic-level configs (Kafka 4.1), for did-you-mean on a misspelt one.
TOPIC_CONFIGS = frozenset(
    [
        "cleanup.policy",
        "compression.type",
        "compression.gzip.level",
        "compression.lz4.level",
        "compression.zstd.level",
        "delete.retention.ms",
        "file.delete.delay.ms",
        "flush.messages",
        "flush.ms",
        "follower.replication.throttled.replicas",
        "index.interval.bytes",
        "leader.replication.throttled.replicas",
        "local.retention.bytes",
        "local.retention.ms",
        "max.compaction.lag.ms",
        "max.message.bytes",
        "message.timestamp.after.max.ms",
        "message.timestamp.before.max.ms",
        "message.timestamp.type",
        "min.cleanable.dirty.ratio",
        "min.compaction.lag.ms",
        "min.insync.replicas",
        "preallocate",
        "remote.log.copy.disable",
        "remote.log.delete.on.disable",
        "remote.storage.enable",
        "retention.bytes",
        "retention.ms",
        "segment.bytes",
        "segment.index.bytes",
        "segment.jitter.ms",
        "segment.ms",
        "unclean.leader.election.enable",
    ]
)
TOPIC_KEY = re.compile(
    r"varadhi\.topic\.(?:(" + "|".join(TOPIC_KINDS) + r")\.)?(replication\.factor|config\.(.+))"
)


@dataclass(frozen=True)
class TopicSettings:
    """How to create one kind of topic: the replication factor (-1: the cluster's default) and
    topic configs (only those set; the cluster's defaults for the rest)."""

    replication_factor: int = -1
    configs: tuple[tuple[str, str], ...] = ()

    def config(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The configs, with `extra` (the product's own, e.g. `cleanup.policy=compact` for the
        catalog) under them: a configured value wins."""
        return {**(extra or {}), **dict(self.configs)}

    def with_defaults(self, extra: Mapping[str, str]) -> TopicSettings:
        """These settings with `extra` configs where none is configured."""
        return TopicSettings(self.replication_factor, tuple(sorted(self.config(extra).items())))


def topic_settings(props: Mapping[str, str], kind: str) -> TopicSettings:
    """The `TopicSettings` of `kind` from resolved properties (validated by `load`)."""
    if kind not in TOPIC_KINDS:
        raise ValueError(kind)
    factor = -1
    general: dict[str, str] = {}
    specific: dict[str, str] = {}
    specific_factor = None
    for key, value in props.items():
        m = TOPIC_KEY.fullmatch(key)
        if not m or m.group(1) not in (None, kind):
            continue
        if m.group(3) is None:
            if m.group(1) is None:
                factor = int(value)
            else:
                specific_factor = int(value)
        else:
            (general if m.group(1) is None else specific)[m.group(3)] = value.strip()
    configs = {**general, **specific}
    if kind == "catalog" and "compact" not in configs.get("cleanup.policy", "compact"):
        configs.pop("cleanup.policy")  # a general delete policy never applies to the catalog
    return TopicSettings(
        specific_factor if specific_factor is not None else factor, tuple(sorted(configs.items()))
    )
