"""The shard driver's side of the delivery trace (`varadhi.core.trace`, `varadhi.kafka.trace`).

- `target(sub)`: where a batch's delivery tasks write their events (`TraceTarget`), or None when
  the spec has no `trace` section or the trace topic cannot be made yet. The topic is made (or
  its retention set) once per run and retention (`trace.ensure_topic`); Kafka failing there is
  logged and tried again before the next batch: a batch is never held back for its trace.
- `routed(sub, ...)`: the events of messages a batch dropped before delivery, written from the
  driver: filtered (`varadhi.spark.records.filter_records`' `traced` metric) and deduplicated
  (`varadhi.spark.dedup`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from kafka.errors import KafkaError

from varadhi.core.errors import VaradhiError
from varadhi.core.trace import Next, Tracer, topic_name
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, trace
from varadhi.kafka.settings import Settings

log = logging.getLogger("varadhi.spark.shard.job")


class ShardTrace:
    """The trace of shard `shard` of subscription `name` (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        shard: int,
        ensure_topic: Callable[[Settings, str, int], int] = trace.ensure_topic,
    ):
        self.settings, self.name, self.shard = settings, name, shard
        self._ensure_topic = ensure_topic
        self._made: tuple[int, int] | None = None  # (retention ms, partitions) once made

    def target(self, sub: subscriptions.Subscription) -> trace.TraceTarget | None:
        policy = sub.spec.trace
        if policy is None:
            return None
        if self._made is None or self._made[0] != policy.retention_ms:
            try:
                partitions = self._ensure_topic(
                    self.settings, topic_name(self.name), policy.retention_ms
                )
            except (KafkaError, VaradhiError) as e:
                log.warning(
                    "%s shard %d: the delivery trace's topic cannot be made (%s); this batch is "
                    "not traced, tried again before the next one",
                    self.name,
                    self.shard,
                    e,
                )
                return None
            self._made = (policy.retention_ms, partitions)
        return trace.TraceTarget(
            bootstrap=self.settings.bootstrap,
            topic=topic_name(self.name),
            partitions=self._made[1],
            shard=self.shard,
            kafka=kafka_clients.config_of(self.settings),
        )

    def routed(
        self,
        sub: subscriptions.Subscription,
        messages: Iterable[tuple[str, str | None]],
        next_step: Next,
        reason: str,
    ) -> None:
        """Trace `messages` ((message id, group id) pairs) as routed to `next_step` without an
        attempt; nothing without a trace."""
        messages = list(messages)
        target = self.target(sub) if messages else None
        if target is None:
            return
        with trace.TraceWriter(target) as writer:
            tracer = Tracer(writer.add, self.shard, lambda: int(time.time() * 1000))
            for msg_id, group_id in messages:
                tracer.routed(msg_id, group_id, next_step, reason)
