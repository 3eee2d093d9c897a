"""The wire format shared by producers, shard jobs, feeders and tools.

A message on a composite topic is a Kafka record whose key is the group id (UTF-8; no key for an
ungrouped message), whose partition is chosen by `varadhi.core.routing`, and whose headers carry:

| header               | meaning                                                          |
|----------------------|------------------------------------------------------------------|
| `varadhi-msg-id`     | unique message id (the idempotency key of every delivery)        |
| `varadhi-group-id`   | the group id (absent when ungrouped)                             |
| `varadhi-produced-ms`| producer wall clock, ms since the epoch (for latency figures)    |

Records on a subscription's internal queues (RQ, DLQ) keep those and add the retry headers
below (and, when the endpoint sends the record key in a header, `varadhi-key`: their Kafka key is
the group id, not the original key). `origin` is the message's position on the main topic,
`"<storage index>:<partition>:<offset>"`; within a group the origin order is the produce order,
which is what ordered delivery preserves.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

H_MSG_ID = "varadhi-msg-id"
H_GROUP_ID = "varadhi-group-id"
H_PRODUCED_MS = "varadhi-produced-ms"

H_ORIGIN = "varadhi-origin"
H_ATTEMPTS = "varadhi-attempts"
H_DUE_MS = "varadhi-due-ms"
H_FIRST_FAILURE_MS = "varadhi-first-failure-ms"
H_LAST_FAILURE_MS = "varadhi-last-failure-ms"
H_REASON = "varadhi-reason"
H_STATUS = "varadhi-status"
# The start of the endpoint's response body to the last failed attempt (at most
# `delivery.RESPONSE_SNIPPET_BYTES`, as UTF-8 text with undecodable bytes replaced).
H_RESPONSE = "varadhi-response"
# On a DLQ record cut to the topic's size limit: the original body's size in bytes
# (`varadhi.core.queue_records`). Such a copy is never delivered.
H_TRUNCATED = "varadhi-truncated"
# An empty record a shard writes to its own RQ to wake itself up when a parked retry falls due
# while no other input arrives (Spark runs a micro-batch only when there is new data).
H_TICK = "varadhi-tick"
# On an entry a DLQ re-drive put back (and on its later RQ/DLQ copies): the re-drive's operation
# id (`varadhi.kafka.dlq`); every HTTP request of it carries `HTTP_REDRIVEN`. A later re-drive of
# the message replaces it.
H_REDRIVEN = "varadhi-redriven"
# The text form of the main-topic record's Kafka key (`varadhi.core.record_ids.text_id`), kept on
# a message's entry, state rows and RQ/DLQ copies while its endpoint has `key_header` set
# (`varadhi.core.request_shaping`): absent when the record had no key.
H_KEY = "varadhi-key"

# What only a shard writes (on its RQ/DLQ records and ticks): a main-topic record carrying one
# was forged or copied by another producer, and the shard drops it on read (`control_free`), or
# it would reach the record's RQ/DLQ copies (a forged tick made the RQ copy look like a tick, so
# its group stalled; a forged truncation mark blocked its re-drive).
CONTROL_HEADERS = frozenset(
    {
        H_ORIGIN,
        H_ATTEMPTS,
        H_DUE_MS,
        H_FIRST_FAILURE_MS,
        H_LAST_FAILURE_MS,
        H_REASON,
        H_STATUS,
        H_RESPONSE,
        H_TRUNCATED,
        H_TICK,
        H_REDRIVEN,
        H_KEY,
    }
)


def control_free(headers: dict[str, str]) -> dict[str, str]:
    """A main-topic record's headers without the shard's control headers (pure)."""
    if CONTROL_HEADERS.isdisjoint(headers):
        return headers
    return {k: v for k, v in headers.items() if k not in CONTROL_HEADERS}


# Headers of every HTTP delivery.
HTTP_MESSAGE_ID = "X-Varadhi-Message-Id"
HTTP_IDEMPOTENCY_KEY = "Idempotency-Key"
HTTP_GROUP_ID = "X-Varadhi-Group-Id"
HTTP_ATTEMPT = "X-Varadhi-Attempt"
HTTP_SOURCE = "X-Varadhi-Source"
HTTP_PRODUCED_AT = "X-Varadhi-Produced-At"
HTTP_REPLAY = "X-Varadhi-Replay"  # only on re-deliveries by `varadhi replay`
HTTP_REDRIVEN = "X-Varadhi-Redriven"  # only on messages a DLQ re-drive put back: its id


@dataclass(frozen=True, order=True)
class Origin:
    """A position on a composite topic: storage topic index, partition, offset."""

    index: int
    partition: int
    offset: int

    def encode(self) -> str:
        return f"{self.index}:{self.partition}:{self.offset}"

    @classmethod
    def decode(cls, text: str) -> Origin:
        index, partition, offset = (int(x) for x in text.split(":"))
        return cls(index, partition, offset)


# Prefix of a header value (or id, `varadhi.core.record_ids`) that is the base64 of bytes that are
# not UTF-8 text.
B64_PREFIX = "b64:"


def headers_to_dict(headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """Kafka headers as a dict of strings; never raises on what a producer wrote.

    A repeated header keeps its first value (as Spark's `varadhi.spark.columns.header_column`
    reads it). A value that is not UTF-8 becomes `b64:` + its base64 (so an RQ or DLQ copy of
    the record carries it as that text); a null value becomes "".
    """
    out: dict[str, str] = {}
    for k, v in headers or ():
        if k in out:
            continue
        data = b"" if v is None else bytes(v)
        try:
            out[k] = data.decode("utf-8")
        except UnicodeDecodeError:
            out[k] = B64_PREFIX + base64.b64encode(data).decode("ascii")
    return out


def dict_to_headers(headers: Mapping[str, str | int | None]) -> list[tuple[str, bytes]]:
    return [(k, str(v).encode("utf-8")) for k, v in headers.items() if v is not None]
