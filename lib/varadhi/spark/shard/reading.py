"""Where a shard's query reads: how far it has read, whether it has caught up, and the moves
from one main-topic storage topic's reader layout to the next (DESIGN hazard 3).

A shard reads one main-topic storage topic T_i at a time (`varadhi.spark.layouts`). It moves to
T_i+1 only when produce has moved off T_i more than a grace period ago (`topics.sealed`:
producers poll the catalog) and it has consumed all of its partitions of T_i. Where groups would
change shards at T_i+1 (a K=1 storage topic, `routing.keeps_groups`), a shard of a grouped
subscription first records in its reader document that it waits at the boundary, and whether it
has a pending group, and moves on only when every shard of the count may (`layouts.may_cross`).
Until then its query keeps running and status says why it waits (`boundary_wait`).

`LayoutMoves.ready` decides (reads the catalog and the end offsets; writes only the shard's
waiting mark); the control loop then stops its query between batches and `LayoutMoves.move`
saves the next layout, starting from the offsets the stopped query consumed. `consumed` (the
offsets a query's last completed batch read) is pure; `EndOffsets` keeps one read_committed
consumer for the job's life (a new kafka-python consumer per idle check cost CPU the batches
need); only the driver's main loop calls it (a consumer is not thread-safe).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from varadhi.core import routing
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, key
from varadhi.kafka.settings import Settings
from varadhi.spark import layouts
from varadhi.spark.layouts import READER_KIND, Layout, drained, next_layout

log = logging.getLogger("varadhi.spark.shard.job")

Offsets = dict[str, dict[str, int]]  # topic -> partition (as text) -> offset


def consumed(progress: Any) -> Offsets | None:
    """Offsets up to which a query's last completed batch read, from its `lastProgress` (an
    object with `json`, or the document itself); None before the first batch (pure)."""
    if progress is None:
        return None
    doc = json.loads(progress.json) if hasattr(progress, "json") else progress
    sources = doc.get("sources") or []
    end = sources[0].get("endOffset") if sources else None
    if isinstance(end, str):
        end = json.loads(end)
    if not end:
        return None
    return {t: {str(p): int(o) for p, o in parts.items()} for t, parts in end.items()}


def caught_up(
    read: Offsets | None, assign: dict[str, list[int]], ends: dict[str, dict[int, int]]
) -> bool:
    """Whether a query that has read `read` (None: no batch yet) has consumed everything of
    `assign` up to `ends` (pure). Before any batch: only when every partition is empty."""
    if read is None:
        return not any(sum(v.values()) for v in ends.values())
    return all(drained({int(p): o for p, o in read.get(t, {}).items()}, ends[t]) for t in assign)


class EndOffsets:
    """The end offsets (read_committed) of partitions, through one consumer made on first use."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._consumer: KafkaConsumer | None = None

    def __call__(self, assign: dict[str, list[int]]) -> dict[str, dict[int, int]]:
        if self._consumer is None:
            self._consumer = kafka_clients.consumer(self.settings, isolation_level="read_committed")
        tps = [TopicPartition(t, p) for t, parts in assign.items() for p in parts]
        ends = self._consumer.end_offsets(tps) if tps else {}
        return {t: {p: ends[TopicPartition(t, p)] for p in parts} for t, parts in assign.items()}

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


class LayoutMoves:
    """The reader layouts of shard `shard` of subscription `name` in the catalog, and the moves
    between them (see the module docstring). `end_offsets` reads partitions' end offsets."""

    def __init__(
        self,
        catalog: Catalog,
        name: str,
        shard: int,
        end_offsets: Callable[[dict[str, list[int]]], dict[str, dict[int, int]]],
    ):
        self.catalog, self.name, self.shard = catalog, name, shard
        self._end_offsets = end_offsets

    def current(self, sub: subscriptions.Subscription) -> Layout:
        """The layout the shard reads now (`layouts.current`)."""
        snap = self.catalog.snapshot()
        return layouts.current(snap, self.name, sub.shard_count, self.shard, sub.generation)

    def ready(
        self,
        sub: subscriptions.Subscription,
        layout: Layout,
        read: Offsets | None,
        pending_groups: int,
        seal_grace_ms: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether the shard, having read `read` of `layout` with `pending_groups` blocked
        groups, moves to the next storage topic now; and, when it waits at a boundary for the
        other shards, what status says of it (else None)."""
        snap = self.catalog.snapshot()
        mq = topics.from_snapshot(snap, sub.spec.topic)
        now_ms = int(time.time() * 1000)
        if not topics.sealed(mq, layout.mq_index, now_ms, seal_grace_ms):
            return False, None
        current = mq.storage(layout.mq_index)
        parts = subscriptions.owned_partitions(sub, mq, layout.mq_index, self.shard)
        merged = layouts.merged(layout.starting_offsets, read or {})
        ends = self._end_offsets({current.name: parts})[current.name]
        mine = {int(p): o for p, o in merged.get(current.name, {}).items()}
        if parts and not drained(mine, ends):
            return False, None
        nxt = mq.storage(layout.mq_index + 1)
        if not sub.spec.grouped or routing.keeps_groups(current, nxt, sub.shard_count):
            return True, None
        if self._may_cross(snap, sub, layout, current, nxt, pending_groups):
            return True, None
        wait = layouts.boundary_wait(self.name, current, nxt, sub.shard_count, pending_groups)
        return False, wait

    def move(self, sub: subscriptions.Subscription, layout: Layout, read: Offsets | None) -> None:
        """Save the layout after `layout`, starting where the stopped query read (`read`)."""
        mq = topics.from_snapshot(self.catalog.snapshot(), sub.spec.topic)
        current, nxt = mq.storage(layout.mq_index), mq.storage(layout.mq_index + 1)
        new = next_layout(
            layout,
            layouts.merged(layout.starting_offsets, read or {}),
            nxt.name,
            subscriptions.owned_partitions(sub, mq, layout.mq_index + 1, self.shard),
        )
        owner = layouts.owner(self.name, sub.shard_count, self.shard)
        self.catalog.mutate(lambda _snap: {key(READER_KIND, owner): new.to_dict()})
        log.info(
            "%s shard %d: %s drained; now reading %s", self.name, self.shard, current.name, nxt.name
        )

    def _may_cross(self, snap, sub, layout: Layout, current, nxt, pending: int) -> bool:
        """At the end of `current`, before `nxt` where groups would change shards (a K=1
        storage topic): record in this shard's reader document that it waits there and whether
        it has a pending group, and move on only when every shard of the count may
        (`layouts.may_cross`: all of them drained `current` with no pending group, or went on
        already). A shard-count change ends the wait otherwise: it moves the pending groups and
        starts the new shards after the boundary (`varadhi.ops.change_shards`)."""
        mark = {"index": layout.mq_index, "next": nxt.name, "quiet": pending == 0}
        owner = layouts.owner(self.name, sub.shard_count, self.shard)
        if layouts.waiting(snap.get(READER_KIND, owner), layout) != mark:

            def change(now):
                recorded = layouts.current(
                    now, self.name, sub.shard_count, self.shard, sub.generation
                )
                if recorded != layout:
                    return {}  # replaced meanwhile (a shard-count change or offset reset)
                return {key(READER_KIND, owner): dict(layout.to_dict(), waiting=mark)}

            self.catalog.mutate(change)
            snap = self.catalog.snapshot()
            log.info(
                "%s shard %d: at the end of %s, waiting before %s (pending groups: %d)",
                self.name,
                self.shard,
                current.name,
                nxt.name,
                pending,
            )
        docs = {
            i: snap.get(READER_KIND, layouts.owner(self.name, sub.shard_count, i))
            for i in range(sub.shard_count)
        }
        return layouts.may_cross(docs, sub.shard_count, sub.generation, layout.mq_index)
