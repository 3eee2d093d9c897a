"""The Kafka records a shard (or a shard-count change) writes to a subscription's RQ and DLQ.

An `out` row of the state table, typed (`varadhi.core.state_rows.OutRow`, from the table's frame by
`state_frames.out_rows`), becomes one record: key = the text form of the group id, value = the
body, headers = the message's headers plus the retry headers of `varadhi.core.messages` (origin,
attempts, due and failure times, reason, status: `state_rows.retry_headers`).

Size. The broker refuses a record larger than the topic's `max.message.bytes`; refused after
the state commit, it would fail the batch on every replay. Retries never get that far (a group
run dead-letters a retry too large for the RQ: `varadhi.core.group_state.out_bytes`), and a dead
letter too large for the DLQ goes there as a *truncated copy*: the body cut to fit, header
`varadhi-truncated` = the original body's size, and the origin header pointing at the full
record on the main topic. A truncated copy is never delivered (`varadhi.spark.batch` dead-letters it
again if it comes back, re-drive leaves it where it is); replay re-reads the original.
"""

from __future__ import annotations

from dataclasses import dataclass

from varadhi.core import messages as m
from varadhi.core.errors import VaradhiError
from varadhi.core.state_rows import OutRow, retry_headers

# The largest request the product's producers send (their `max_request_size`): the limit of a
# record wherever the topic allows more.
MAX_REQUEST_BYTES = 16 * 1024 * 1024
# Kafka's framing of one record and its batch (varints, attributes, CRC, batch header): an upper
# bound, so that a record that passes `fits` is accepted.
RECORD_OVERHEAD_BYTES = 128
HEADER_OVERHEAD_BYTES = 10
# What an RQ/DLQ record may hold beyond its main-topic record: the headers a shard adds (origin,
# attempts, due and failure times, status, reason: `group_state.OUT_HEADERS_RESERVE_BYTES`), the
# endpoint's answer (`delivery.RESPONSE_SNIPPET_BYTES`, up to 3 bytes per byte once decoded) and
# the framing. A subscription's RQ and DLQ storage topics get the main topic's
# `max.message.bytes` plus this (`topics.queue_configs`), so they take every record it takes.
QUEUE_HEADROOM_BYTES = 8192


@dataclass(frozen=True)
class OutRecord:
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    @property
    def size(self) -> int:
        """An upper bound of the record's size as the broker counts it."""
        headers = sum(len(k.encode()) + len(v) + HEADER_OVERHEAD_BYTES for k, v in self.headers)
        return len(self.key or b"") + len(self.value or b"") + headers + RECORD_OVERHEAD_BYTES


def out_headers(row: OutRow) -> list[tuple[str, bytes]]:
    """The headers of an `out` row's record."""
    return m.dict_to_headers(retry_headers(row))


def out_record(row: OutRow, limit: int | None) -> OutRecord:
    """The record for an `out` row, fitted to `limit` bytes (None: no limit; see the module
    docstring). Raises VaradhiError for a retry that does not fit: the RQ's limit was lowered
    under a running shard."""
    key = row.group_id.encode() if row.group_id is not None else None
    record = OutRecord(key, row.value, out_headers(row))
    if limit is None or record.size <= limit:
        return record
    if row.target != "dlq":
        raise VaradhiError(
            f"a retry of message {row.msg_id} ({record.size} bytes) exceeds the RQ's "
            f"max.message.bytes ({limit}): raise it back to at least the main topic's"
        )
    return truncated(record, limit)


def truncated(record: OutRecord, limit: int) -> OutRecord:
    """`record` cut to at most `limit` bytes: the body first; if the headers alone are too
    large, every header but the product's own is dropped too (header `varadhi-truncated` says
    how large the body was)."""
    original = len(record.value or b"")
    marker = (m.H_TRUNCATED, str(original).encode())
    headers = [*record.headers, marker]
    bare = OutRecord(record.key, b"", headers)
    if bare.size > limit:
        headers = [(k, v) for k, v in headers if k.startswith("varadhi-")]
        bare = OutRecord(record.key, b"", headers)
    room = max(0, limit - bare.size)
    return OutRecord(record.key, (record.value or b"")[:room], headers)
