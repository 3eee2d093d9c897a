"""The kinds of the catalog's documents and of its operations, each spelled once.

A catalog key is `<kind>/<name>` (`varadhi.kafka.catalog.key`); `DocKind` names the kinds. An
`operation/...` document (a change the CLI runs in steps and a crashed run resumes) says what it
is in its `kind` field; `OpKind` names those. Both are persisted in the catalog topic: a value
never changes (a `StrEnum` member is its value wherever it is written: a key's f-string, JSON).
No imports: any module may use it (`varadhi.spark.layouts` runs on executors).
"""

from __future__ import annotations

from enum import StrEnum


class DocKind(StrEnum):
    """What a catalog document is: the `<kind>` of its key `<kind>/<name>`."""

    TOPIC = "topic"  # varadhi.kafka.topics
    SUBSCRIPTION = "subscription"  # varadhi.kafka.subscriptions
    LEASE = "lease"  # varadhi.kafka.leases
    READER = "reader"  # a shard's reader layout (varadhi.spark.layouts)
    OPERATION = "operation"  # a resumable change (OpKind)
    HANDOVER = "handover"  # a shard-count change's journal hand-over (varadhi.spark.journal)


class OpKind(StrEnum):
    """What an `operation/...` document is (its `kind` field)."""

    REPLAY = "replay"  # varadhi.ops.replay
    DELETE = "delete"  # varadhi.ops.lifecycle
    OFFSET_RESET = "offset-reset"  # varadhi.ops.offsets
    UNSIDELINE = "unsideline"  # a DLQ re-drive (varadhi.kafka.dlq)
    CHANGE_SHARDS = "change-shards"  # varadhi.ops.change_shards
