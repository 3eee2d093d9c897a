"""A library member's delivery trace: the events of its messages' attempts and of those routed
without one (filtered, malformed to the DLQ, sidelined, deduplicated) on the subscription's
trace topic, each event's `shard` the message's slot (`varadhi.core.trace`).

Contract. `trace_target` makes the trace topic (or sets its retention) as a shard does, and
says where events go (None: the spec has no trace, or Kafka refused the topic: this run is not
traced, logged; a trace never holds delivery back). `MemberTrace(None, ...)` traces nothing:
every method is then a no-op, so callers need no check. Any thread may record events (the
engine's, handler threads, the Kafka thread); `close` once, at the end.

Hazard. `TraceWriter.add` takes one thread at a time: every event goes through one lock here.
"""

from __future__ import annotations

import logging
import threading
import time

from kafka import TopicPartition
from kafka.errors import KafkaError

from varadhi.core.delivery import Outcome
from varadhi.core.errors import VaradhiError
from varadhi.core.group_state import trace_attempt
from varadhi.core.policies import TracePolicy
from varadhi.core.trace import Next, TraceEvent, Tracer, topic_name
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import trace as trace_topic
from varadhi.kafka.settings import Settings
from varadhi.library.intake import ids
from varadhi.library.scheduler import Work

log = logging.getLogger(__name__)


def trace_target(
    settings: Settings, subscription: str, policy: TracePolicy | None
) -> trace_topic.TraceTarget | None:
    """Where a member of `subscription` sends its trace events (None: not traced)."""
    if policy is None:
        return None
    topic = topic_name(subscription)
    try:
        partitions = trace_topic.ensure_topic(settings, topic, policy.retention_ms)
    except (KafkaError, VaradhiError) as e:
        log.warning(
            "%s: the delivery trace's topic cannot be made (%s): not traced", subscription, e
        )
        return None
    return trace_topic.TraceTarget(
        bootstrap=settings.bootstrap,
        topic=topic,
        partitions=partitions,
        shard=None,
        kafka=kafka_clients.config_of(settings),
    )


class MemberTrace:
    """See the module docstring. `slots`: the subscription's slot count."""

    def __init__(self, target: trace_topic.TraceTarget | None, slots: int):
        self._lock = threading.Lock()
        self._writer: trace_topic.TraceWriter | None = None
        self._tracers: list[Tracer] | None = None  # per slot
        if target is not None:
            self._writer = trace_topic.TraceWriter(target)
            self._tracers = [Tracer(self._add, s, _now_ms) for s in range(slots)]

    def _add(self, event: TraceEvent) -> None:
        with self._lock:
            assert self._writer is not None
            self._writer.add(event)

    def attempt(self, work: Work, outcome: Outcome, next_step: Next) -> None:
        """An attempt of `work` and where it goes next."""
        if self._tracers is not None:
            trace_attempt(self._tracers[work.slot], work.entry, outcome, next_step)

    def routed(self, work: Work, to: Next, reason: str | None, redriven: str | None = None) -> None:
        """`work` routed `to` the DLQ or dropped as a duplicate without an attempt."""
        if self._tracers is not None:
            e = work.entry
            self._tracers[work.slot].routed(
                e.msg_id, e.group_id, to, reason, redriven=redriven, source=e.source
            )

    def filtered(self, tp: TopicPartition, r, slot: int) -> None:
        """Record `r` of `tp` (in `slot`) dropped: the subscription's filter does not match."""
        if self._tracers is not None:
            msg_id, group = ids(tp, r)
            self._tracers[slot].routed(
                msg_id,
                group,
                "filtered",
                "the subscription's filter does not match it",
                source=f"{tp.topic}/{tp.partition}/{r.offset}",
            )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _now_ms() -> int:
    return int(time.time() * 1000)
