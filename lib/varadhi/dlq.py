"""The dead-letter queue: browse parked messages and re-drive (unsideline) them.

Browsing reads the subscription's DLQ storage topics with kafka-python (read_committed), so it
needs no Spark. Re-driving is an operation recorded in the catalog
(`operation/<subscription>/redrive-<id>`); each shard applies it at its next micro-batch, between
batches of its own, so no other writer ever touches its GroupState:

- every parked message of the shard that matches the selector goes back into the shard's state
  as a `held` entry at its original position (origin), with its attempts reset;
- in block mode the group's `dlq` entry is replaced by it, so the group unblocks as soon as the
  re-driven messages are delivered, in their original order, and the group's live traffic, which
  queued behind them, follows;
- the shard marks the operation done for itself once that state is committed.

DLQ records stay in Kafka (it is append-only); `list_parked` reports a message as `redriven` when
a completed re-drive selected it after its last failure.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from . import messages as m
from . import subscriptions, topics
from .catalog import Catalog, Snapshot, key
from .errors import InvalidArgument

OPERATION = "operation"
RETRY_HEADERS = (
    m.H_ORIGIN,
    m.H_ATTEMPTS,
    m.H_DUE_MS,
    m.H_FIRST_FAILURE_MS,
    m.H_LAST_FAILURE_MS,
    m.H_REASON,
    m.H_STATUS,
)


@dataclass(frozen=True)
class Parked:
    msg_id: str
    group_id: str | None
    origin: str
    reason: str | None
    status: int | None
    attempts: int
    first_failure_ms: int | None
    last_failure_ms: int | None
    topic: str
    partition: int
    offset: int
    value: bytes | None = field(repr=False, default=None)
    headers: dict[str, str] = field(repr=False, default_factory=dict)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("value")
        d.pop("headers")
        d["value_bytes"] = None if self.value is None else len(self.value)
        return d


@dataclass(frozen=True)
class Selector:
    """Which parked messages a re-drive takes: any of the ids, or a failure-time range."""

    group_ids: tuple[str, ...] = ()
    message_ids: tuple[str, ...] = ()
    failed_since_ms: int | None = None
    failed_until_ms: int | None = None

    def validate(self) -> Selector:
        if self.failed_until_ms is not None and self.failed_since_ms is None:
            raise InvalidArgument("--failed-until needs --failed-since", field="failed_until")
        if not (self.group_ids or self.message_ids or self.failed_since_ms is not None):
            raise InvalidArgument(
                "say which messages to re-drive: --group-ids, --message-ids or --failed-since",
                field="selector",
            )
        if (
            self.failed_until_ms is not None
            and self.failed_since_ms is not None
            and self.failed_until_ms < self.failed_since_ms
        ):
            raise InvalidArgument("--failed-until is before --failed-since", field="failed_until")
        return self

    def matches(self, p: Parked) -> bool:
        if self.group_ids and p.group_id in self.group_ids:
            return True
        if self.message_ids and p.msg_id in self.message_ids:
            return True
        if self.failed_since_ms is not None and p.last_failure_ms is not None:
            until = self.failed_until_ms if self.failed_until_ms is not None else 2**63
            return self.failed_since_ms <= p.last_failure_ms <= until
        return False

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Selector:
        return cls(
            tuple(d.get("group_ids") or ()),
            tuple(d.get("message_ids") or ()),
            d.get("failed_since_ms"),
            d.get("failed_until_ms"),
        )


def parse_time_ms(text: str, field_name: str) -> int:
    """ISO-8601 (`2026-11-25T10:00:00Z`, a naive time is UTC) or ms since the epoch."""
    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidArgument(
            f"{text!r} is not a time: use ISO-8601 like 2026-11-25T10:00:00Z or ms since the epoch",
            field=field_name,
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def parked_from_record(
    topic: str, partition: int, offset: int, key_: bytes | None, value, headers
) -> Parked:
    h = m.headers_to_dict(headers)
    group = h.get(m.H_GROUP_ID) or (key_.decode("utf-8", "replace") if key_ else None)
    return Parked(
        msg_id=h.get(m.H_MSG_ID, f"{topic}-{partition}-{offset}"),
        group_id=group,
        origin=h.get(m.H_ORIGIN, ""),
        reason=h.get(m.H_REASON),
        status=_int(h.get(m.H_STATUS)),
        attempts=_int(h.get(m.H_ATTEMPTS)) or 0,
        first_failure_ms=_int(h.get(m.H_FIRST_FAILURE_MS)),
        last_failure_ms=_int(h.get(m.H_LAST_FAILURE_MS)),
        topic=topic,
        partition=partition,
        offset=offset,
        value=value,
        headers=h,
    )


def _int(v: str | None) -> int | None:
    try:
        return None if v in (None, "") else int(v)
    except ValueError:
        return None


def read_parked(
    settings,
    partitions: dict[str, Sequence[int]],
    start: dict[str, dict[str, int]] | None = None,
    timeout_s: float = 30,
) -> list[Parked]:
    """Every record of the given DLQ partitions (storage topic -> partitions), oldest first,
    from `start` (an offset reset's fast-forward of the DLQ) or the beginning."""
    tps = [TopicPartition(t, p) for t, parts in partitions.items() for p in parts]
    if not tps:
        return []
    consumer = KafkaConsumer(
        bootstrap_servers=settings.bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        for tp in tps:
            offset = (start or {}).get(tp.topic, {}).get(str(tp.partition))
            if offset is not None and offset >= 0:
                consumer.seek(tp, min(int(offset), ends[tp]))
        out: list[Parked] = []
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError("timed out reading the DLQ")
            for tp, records in consumer.poll(timeout_ms=200).items():
                for r in records:
                    out.append(
                        parked_from_record(
                            tp.topic, tp.partition, r.offset, r.key, r.value, r.headers
                        )
                    )
        return out
    finally:
        consumer.close()


def dlq_partitions(
    sub, dlq: topics.CompositeTopic, shard: int | None = None
) -> dict[str, list[int]]:
    """DLQ partitions to read: all of them (browsing), or those `shard` owns in the storage topics
    the current shards own (`dlq_from` on; older ones are drained by feeders)."""
    if shard is None:
        return {st.name: list(range(st.partitions)) for st in dlq.storage_topics}
    return {
        st.name: subscriptions.internal_partitions(sub, dlq, i, shard)
        for i, st in enumerate(dlq.storage_topics)
        if i >= sub.dlq_from
    }


def dlq_start(snapshot: Snapshot, name: str) -> dict[str, dict[str, int]]:
    """Where the DLQ starts for browsing and re-driving, after an offset reset fast-forwarded it."""
    doc = snapshot.get("subscription", name) or {}
    return doc.get("state", {}).get("dlq_start", {})


def redrives(snapshot: Snapshot, name: str) -> dict[str, dict[str, Any]]:
    """The subscription's re-drive operations: id -> document."""
    prefix = f"{name}/redrive-"
    return {
        k[len(name) + 1 :]: v for k, v in snapshot.items(OPERATION).items() if k.startswith(prefix)
    }


def pending_for(snapshot: Snapshot, name: str, shard: int) -> dict[str, Selector]:
    """Re-drives that `shard` has not applied yet: op id -> selector (pure)."""
    return {
        op_id: Selector.from_dict(doc["selector"])
        for op_id, doc in redrives(snapshot, name).items()
        if shard not in doc.get("done", [])
    }


def list_parked(
    catalog: Catalog, name: str, group_id: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    dlq = topics.from_snapshot(snap, sub.spec.dlq_topic)
    ops = redrives(snap, name)
    rows = []
    for p in read_parked(catalog.settings, dlq_partitions(sub, dlq), dlq_start(snap, name)):
        if group_id is not None and p.group_id != group_id:
            continue
        row = p.summary()
        row["state"] = "parked"
        for doc in ops.values():
            sel = Selector.from_dict(doc["selector"])
            if sel.matches(p) and int(doc["created_ms"]) >= (p.last_failure_ms or 0):
                complete = len(doc.get("done", [])) >= sub.shard_count
                row["state"] = "redriven" if complete else "redrive requested"
        rows.append(row)
    return rows[-limit:] if limit else rows


def request_unsideline(catalog: Catalog, name: str, selector: Selector) -> str:
    """Record a re-drive for every shard to apply; returns its operation id."""
    selector.validate()
    op_id = f"redrive-{int(time.time())}-{uuid.uuid4().hex[:6]}"

    def change(snap: Snapshot):
        subscriptions.from_snapshot(snap, name)  # must exist
        doc = {
            "kind": "unsideline",
            "selector": selector.to_dict(),
            "created_ms": int(time.time() * 1000),
            "done": [],
        }
        return {key(OPERATION, f"{name}/{op_id}"): doc}

    catalog.mutate(change)
    return op_id


def mark_done(catalog: Catalog, name: str, op_ids: Iterable[str], shard: int) -> None:
    def change(snap: Snapshot):
        out = {}
        for op_id in op_ids:
            doc = snap.get(OPERATION, f"{name}/{op_id}")
            if doc is not None and shard not in doc.get("done", []):
                out[key(OPERATION, f"{name}/{op_id}")] = dict(
                    doc, done=sorted({*doc.get("done", []), shard})
                )
        return out

    catalog.mutate(change)


def redrive_rows(parked: Iterable[Parked], grouped: bool) -> list[dict[str, Any]]:
    """Parked messages as `held` state rows at their origin, attempts reset (pure)."""
    rows = []
    seen = set()
    for p in parked:
        try:
            origin = m.Origin.decode(p.origin)
        except ValueError:
            continue
        if origin in seen or p.value is None:
            continue
        seen.add(origin)
        headers = {k: v for k, v in p.headers.items() if k not in RETRY_HEADERS}
        group_key = p.group_id if (grouped and p.group_id) else f"~{p.msg_id}"
        rows.append(
            {
                "kind": "pending",
                "group_key": group_key,
                "group_id": p.group_id,
                "origin_index": origin.index,
                "origin_partition": origin.partition,
                "origin_offset": origin.offset,
                "msg_id": p.msg_id,
                "location": "held",
                "value": p.value,
                "headers": json.dumps(headers, sort_keys=True),
                "attempts": 0,
                "due_ms": 0,
                "source": f"{p.topic}/{p.partition}/{p.offset}",
            }
        )
    return rows
