"""The delivery trace: every attempt of a message, and where the message went next. Pure.

A subscription whose spec has a `trace` section keeps, in its trace topic
(`<subscription>.trace`, time-retained for `trace.retention`), one `TraceEvent` per

- attempt: a request the shard sent for the message, with when, which shard, the attempt's
  number, the HTTP status or the error without one, the latency, the start of the answer, and
  where the message went next (`Next`): `delivered`; `retry` (sent again from the same task);
  `rq` (written to the retry queue); `dlq` (parked in the dead-letter queue);
- step without a request (`kind` "routed"): `filtered` (the subscription's filter dropped it),
  `deduplicated` (delivered within the dedup window), `dlq` (malformed, behind a blocked group
  over its limit, or too large for the retry queue), `rq` (a retry waiting in a task moved to the
  retry queue), `delivered` (accepted by a crashed run of the same micro-batch: not sent again).

An event also carries the message's group, the re-drive that sent it again (`redriven`: the
operation id, `varadhi dlq unsideline`) and, for a routed step, the reason.

Events are keyed by message id: `partition_of` picks the trace topic's partition from the id
alone, so `varadhi trace` reads one partition. Writers pack the events of one partition into one
Kafka record (`encode`: a JSON document, at most `MAX_EVENTS_PER_RECORD` events), which keeps the
cost per traced message small; readers unpack them (`decode`) and keep the events of the id they
look for (`of_message`), ordered by time.

The trace is a record of what happened, not part of delivery: an event that cannot be written
(Kafka away for longer than the writer waits) is dropped and counted, never a reason to hold a
message back (`varadhi.kafka.trace`).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

log = logging.getLogger(__name__)

Next = Literal["delivered", "retry", "rq", "dlq", "filtered", "deduplicated"]
Kind = Literal["attempt", "routed"]

# The start of an answer an attempt event keeps (the retry headers keep 1 KiB; a trace keeps
# every attempt, so less).
ANSWER_CHARS = 256
MAX_EVENTS_PER_RECORD = 500
VERSION = 1


def topic_name(subscription: str) -> str:
    """The trace topic of a subscription (user names hold no dot: no clash with any topic)."""
    return f"{subscription}.trace"


def partition_of(msg_id: str, partitions: int) -> int:
    """The trace topic partition of a message's events: CRC-32 of its id's UTF-8 bytes, so every
    writer (executors, drivers, any process) and every reader agree without sharing state."""
    return zlib.crc32(msg_id.encode("utf-8", "surrogatepass")) % max(partitions, 1)


class TraceEvent(NamedTuple):
    """One step of one message (module docstring). `at_ms`: ms since the epoch when the step
    ended (the attempt's answer came, the message was routed). A named tuple: made for every
    attempt on the delivery path, and written as a JSON array (`encode`), both cheap."""

    msg_id: str
    at_ms: int
    kind: Kind
    next: Next
    shard: int | None = None
    group_id: str | None = None
    attempt: int | None = None  # 1 for the first attempt of the message (per re-drive)
    status: int | None = None
    error: str | None = None  # an attempt without an HTTP answer: its error kind
    latency_ms: float | None = None
    answer: str | None = None  # the start of the answer's body
    reason: str | None = None
    redriven: str | None = None  # the re-drive operation that sent the message again
    source: str | None = None  # "topic/partition/offset" of the copy that was delivered

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON object, without its null fields."""
        return {k: v for k, v in self._asdict().items() if v is not None}


def encode(events: Iterable[TraceEvent]) -> list[tuple[bytes, int]]:
    """Record values for `events` with how many events each holds (pure):
    `{"v": 1, "fields": [names], "events": [[values], ...]}`, at most `MAX_EVENTS_PER_RECORD`
    events each. Each event is an array of its fields' values in the order `fields` names, so a
    reader of another version matches them by name (`decode`)."""
    out: list[tuple[bytes, int]] = []
    chunk: list[TraceEvent] = []
    for event in events:
        chunk.append(event)
        if len(chunk) >= MAX_EVENTS_PER_RECORD:
            out.append((_value(chunk), len(chunk)))
            chunk = []
    if chunk:
        out.append((_value(chunk), len(chunk)))
    return out


def _value(events: list[TraceEvent]) -> bytes:
    doc = {"v": VERSION, "fields": TraceEvent._fields, "events": events}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(value: bytes | None) -> list[TraceEvent]:
    """The events of one record value; [] (with a warning) for anything else. Fields this
    version does not know (a newer writer's) are ignored, missing ones are null (pure)."""
    try:
        doc = json.loads(value or b"")
        names = doc["fields"]
        known = [(i, name) for i, name in enumerate(names) if name in _FIELDS]
        return [TraceEvent(**{name: item[i] for i, name in known}) for item in doc["events"]]
    except (ValueError, TypeError, KeyError, IndexError) as e:
        log.warning("skipping a trace record that is not one: %s", e)
        return []


_FIELDS = frozenset(TraceEvent._fields)


def of_message(events: Iterable[TraceEvent], msg_id: str) -> list[TraceEvent]:
    """The events of message `msg_id`, oldest first (pure; a stable sort: events of one time
    keep the order they were written in)."""
    return sorted((e for e in events if e.msg_id == msg_id), key=lambda e: e.at_ms)


class Tracer:
    """Makes the events of one delivery task (or driver) and hands each to `sink`.

    `shard` is stamped on every event; `clock` returns ms since the epoch. The callers pass what
    they know of the message as plain values, so this module needs no delivery types."""

    def __init__(
        self, sink: Callable[[TraceEvent], None], shard: int | None, clock: Callable[[], int]
    ):
        self.sink = sink
        self.shard = shard
        self.clock = clock

    def attempt(
        self,
        msg_id: str,
        group_id: str | None,
        attempt: int,
        status: int | None,
        error: str | None,
        latency_ms: float,
        answer: bytes,
        next_step: Next,
        detail: str | None = None,
        redriven: str | None = None,
        source: str | None = None,
    ) -> None:
        """An attempt's event; `detail` (why an attempt without an answer failed, curl's text)
        becomes its reason. Positional: this runs for every attempt."""
        text = (
            answer[: ANSWER_CHARS * 4].decode("utf-8", "replace")[:ANSWER_CHARS] if answer else None
        )
        self.sink(
            TraceEvent(
                msg_id,
                self.clock(),
                "attempt",
                next_step,
                self.shard,
                group_id,
                attempt,
                status,
                error,
                round(latency_ms, 3),
                text,
                detail,
                redriven,
                source,
            )  # fmt: skip
        )

    def routed(
        self,
        msg_id: str,
        group_id: str | None,
        next_step: Next,
        reason: str | None = None,
        redriven: str | None = None,
        source: str | None = None,
    ) -> None:
        self.sink(
            TraceEvent(
                msg_id=msg_id,
                at_ms=self.clock(),
                kind="routed",
                next=next_step,
                shard=self.shard,
                group_id=group_id,
                reason=reason,
                redriven=redriven,
                source=source,
            )
        )
