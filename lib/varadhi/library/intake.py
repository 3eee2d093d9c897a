"""What a library member does with the records it polls, before its scheduler sees them: whether
it reads the main topic at all now (`full`), and each record as a `Work` (`Intake.work`), as a
shard reads it.

Contract. Pure but for one log line (an RQ record without retry state, dropped). A main-topic
record loses the shards' control headers and, with `key_header`, keeps its key's text form in
`messages.H_KEY` (its RQ and DLQ copies carry it); its message id and group id are read as the
shards read them (`ids`); one without a value or over `max_message_bytes` is work all the same,
marked `invalid` (the member dead-letters it unsent). An RQ record is a retry: its origin,
attempts and due time come from its headers; it is never invalid.

Hazard. The member reads the main topic again later, not now, while it is `full`; it reads the
RQ on (a key's retry copy can free it), or a member whose held messages all wait for their keys'
retries would wait for good. `pause` is not used for it: kafka-python 3.0.12 was seen to fetch
nothing more of a partition paused and resumed under load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kafka import TopicPartition

from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.core.policies import SubscriptionSpec
from varadhi.core.record_ids import record_ids, text_id
from varadhi.core.state_rows import retry_state
from varadhi.library.dedup import dedup_id
from varadhi.library.keys import OrderingKey, ordering_key
from varadhi.library.scheduler import Work

log = logging.getLogger(__name__)


def full(pending: int, max_pending: int, catching_up: bool) -> bool:
    """Whether reading the main topic waits: `pending` messages held reached `max_pending` and
    no slot is still reading its RQ to the end it had at assignment (`catching_up`: a slot
    that does hands out nothing yet, so it must read on)."""
    return pending >= max_pending and not catching_up


def ids(tp: TopicPartition, r) -> tuple[str, str | None]:
    """A record's message id and group id, as the shards read them (`varadhi.core.record_ids`)."""
    return record_ids(tp.topic, tp.partition, r.offset, r.key, r.headers)


@dataclass(frozen=True)
class Intake:
    """The rules a member's records become work by: the subscription's `spec` (named `name` in
    log lines), the RQ topic's name `rq`, the member's `ordering` key rule, and whether a dedup
    window is on (`dedup`: each work then has its `dedup_id`)."""

    name: str
    spec: SubscriptionSpec
    rq: str
    ordering: OrderingKey
    dedup: bool

    def key_of(self, raw_key: bytes | None, headers: dict[str, str], value: bytes | None):
        """A record's ordering key (None: unordered)."""
        if not self.spec.grouped:
            return None
        return ordering_key(self.ordering, raw_key, headers, value)

    def work(self, tp: TopicPartition, r, index: int, slot: int) -> Work | None:
        """Record `r` of `tp` (a partition of the main topic's storage topic `index`, or of the
        RQ: `index` unused) in `slot` as a `Work` (None: an RQ record no shard or member wrote:
        dropped, as the shards drop it)."""
        spec = self.spec
        headers = m.headers_to_dict(r.headers)
        from_rq = tp.topic == self.rq
        if not from_rq:
            headers = m.control_free(headers)
            if spec.endpoint.shaping.key_header is not None:
                key_text = text_id(r.key)  # the RQ/DLQ copies keep it: they are keyed by group
                if key_text is not None:
                    headers[m.H_KEY] = key_text
        msg_id, group = ids(tp, r)
        if m.H_MSG_ID in headers:
            headers[m.H_MSG_ID] = msg_id
        if m.H_GROUP_ID in headers:
            headers[m.H_GROUP_ID] = group or ""
        value = None if r.value is None else bytes(r.value)
        problem = None
        if value is None:
            problem = "malformed: no value"
        elif len(value) > spec.max_message_bytes:
            problem = f"malformed: value of {len(value)} bytes exceeds {spec.max_message_bytes}"
        entry = Entry(  # an RQ copy's origin is its message's (below)
            m.Origin(0 if from_rq else index, tp.partition, r.offset),
            msg_id,
            group,
            "new",
            value,
            headers,
            source=f"{tp.topic}/{tp.partition}/{r.offset}",
            invalid=problem,
        )
        if from_rq:
            try:
                entry.origin, entry.attempts, entry.due_ms = retry_state(headers)
                first = headers.get(m.H_FIRST_FAILURE_MS, "")
                entry.first_failure_ms = int(first) if first.isdigit() else None
            except (KeyError, ValueError):
                log.warning("%s: %s has no retry state: dropped", self.name, entry.source)
                return None
            entry.invalid = None
        work = Work(
            entry, tp.topic, tp.partition, r.offset, slot, self.key_of(r.key, headers, value)
        )
        if self.dedup:  # remembered once delivered; checked on the main topic
            work.dedup_id = dedup_id(headers, value)
        return work
