"""The rows of a shard's micro-batch: their kinds, their columns, and their codecs.

One schema carries four things, told apart by the `kind` column (`Kind`):

- the GroupState Delta table (`STATE_SCHEMA`, persisted: `varadhi.spark.state_store`);
- the batch's Kafka records (`varadhi.spark.records.batch_records`: `mq`, `rq`; not state rows,
  but their kinds are the same column's values);
- what the two phases of a micro-batch hand over (`fwd`, `held`; `varadhi.spark.batch`);
- what the executors return (`RESULT_SCHEMA`: the state columns plus explicit result columns).

Persisted kinds (the table holds only these):

| kind      | what it is                                                               |
|-----------|--------------------------------------------------------------------------|
| `pending` | one pending message of a non-healthy group (`varadhi.core.group_state.Entry`) |
| `out`     | an RQ/DLQ record of the table's last committed batch (the outbox)        |
| `meta`    | which batch (`app_id`, `batch_id`) the table's content belongs to        |
| `redrive` | a DLQ re-drive applied here and not yet marked done, or part-way through (`varadhi.kafka.dlq`) |

In flight only: `fwd` (a record phase 1 forwards to phase 2, with its body), `held` (a parked
body the driver adds to phase 2: a `pending` row at location `held`, renamed), `touched` (a
group whose old rows a commit replaces), `done` (a delivered id for the de-duplication window),
`stat` (one per task: its counters) and `failure` (a replay task's failed group,
`varadhi.ops.replay`).

The state columns (`STATE_COLUMNS`), and the kinds that use each:

| column                  | type   | kinds                 | meaning                                                       |
|-------------------------|--------|-----------------------|---------------------------------------------------------------|
| `kind`                  | string | all                   | a `Kind`                                                      |
| `group_key`             | string | pending out fwd held touched | the group (the group id, or `~<msg id>` when ungrouped) |
| `group_id`              | string | pending out fwd held  | the text form of the record's key (`varadhi.core.record_ids`)      |
| `origin_index`          | int    | pending out fwd held  | the message's origin (`messages.Origin`): storage topic index |
| `origin_partition`      | int    | pending out fwd held  | ... partition                                                 |
| `origin_offset`         | bigint | pending out fwd held  | ... offset                                                    |
| `msg_id`                | string | pending out fwd held redrive done | the message id; `redrive`: the operation id; `done`: the dedup id |
| `location`              | string | pending out fwd held  | `new`, `held`, `rq` or `dlq` (`group_state.Location`)         |
| `value`                 | binary | out fwd held, pending at `held` | the body (null on every other row)                  |
| `headers`               | string | pending out fwd held redrive | the message's headers as JSON (`encode_headers`); `redrive`: the end offsets its DLQ scan covered (`encode_scanned`) |
| `attempts`              | int    | pending out fwd held  | failed attempts so far                                        |
| `due_ms`                | bigint | pending out fwd held  | when the next attempt is due                                  |
| `first_failure_ms`      | bigint | pending out fwd held  | first failed attempt (null: none)                             |
| `last_failure_ms`       | bigint | pending out fwd held  | last failed attempt (null: none)                              |
| `reason`                | string | pending out fwd held  | why the last attempt failed; a never-attempted `new`/`held` entry: why it is malformed (`Entry.invalid`) |
| `status`                | int    | pending out fwd held  | the last attempt's HTTP status (null: none)                   |
| `source`                | string | pending out fwd held redrive | `topic/partition/offset` where this copy was read; `redrive`: a rate-capped re-drive's progress (`encode_progress`; null once complete) |
| `target`                | string | out                   | `rq` or `dlq`                                                 |
| `batch_id`              | bigint | out meta              | the batch that committed the row                              |
| `app_id`                | string | out meta              | the query (`txnAppId`) that committed the row                 |

The executors' extra columns (`RESULT_COLUMNS` beyond the state's, null on other kinds):
`delivered_ms` (bigint, `done`: when it was delivered) and one column per `TaskStats` field
(`stat`): `stat_<counter>` bigint for each counter, `stat_seconds` double, `stat_http`
map<string,bigint> (what the endpoint answered, `batch.http_counts`).

RQ and DLQ records carry an `out` row in Kafka headers (`retry_headers` of its typed `OutRow`,
read back by `retry_state`). Changing a persisted column's name or type is a format change: tables written
by earlier versions must still read (`StateStore` reads a table into `STATE_COLUMNS`).

The rows as pandas frames (what Spark's Arrow conversion hands over) are the business of
`varadhi.core.state_frames`. This module imports no pandas: the library runtime and the command
line use the rows' kinds and record codecs, and pandas would cost each of their starts ~0.45 s
of CPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, NamedTuple

from varadhi.core import messages as m
from varadhi.core.group_state import Entry, RunCounts


class Kind(StrEnum):
    """What a row is (the `kind` column); see the module docstring."""

    MQ = "mq"
    RQ = "rq"
    PENDING = "pending"
    OUT = "out"
    META = "meta"
    REDRIVE = "redrive"
    FWD = "fwd"
    HELD = "held"
    TOUCHED = "touched"
    DONE = "done"
    STAT = "stat"
    FAILURE = "failure"


STATE_COLUMNS = [
    ("kind", "string"),
    ("group_key", "string"),
    ("group_id", "string"),
    ("origin_index", "int"),
    ("origin_partition", "int"),
    ("origin_offset", "bigint"),
    ("msg_id", "string"),
    ("location", "string"),
    ("value", "binary"),
    ("headers", "string"),
    ("attempts", "int"),
    ("due_ms", "bigint"),
    ("first_failure_ms", "bigint"),
    ("last_failure_ms", "bigint"),
    ("reason", "string"),
    ("status", "int"),
    ("source", "string"),
    ("target", "string"),
    ("batch_id", "bigint"),
    ("app_id", "string"),
]
STATE_SCHEMA = ", ".join(f"{name} {kind}" for name, kind in STATE_COLUMNS)
COLUMN_NAMES = [name for name, _ in STATE_COLUMNS]


class StateRow(NamedTuple):
    """One row of `STATE_COLUMNS`, typed: numbers are ints or None, text is str or None (never
    NaN). Built by the encoders below and by `state_frames.state_rows` from a frame."""

    kind: str
    group_key: str | None = None
    group_id: str | None = None
    origin_index: int | None = None
    origin_partition: int | None = None
    origin_offset: int | None = None
    msg_id: str | None = None
    location: str | None = None
    value: bytes | None = None
    headers: str | None = None
    attempts: int | None = None
    due_ms: int | None = None
    first_failure_ms: int | None = None
    last_failure_ms: int | None = None
    reason: str | None = None
    status: int | None = None
    source: str | None = None
    target: str | None = None
    batch_id: int | None = None
    app_id: str | None = None

    @property
    def origin(self) -> m.Origin:
        return m.Origin(
            int(self.origin_index or 0),
            int(self.origin_partition or 0),
            int(self.origin_offset or 0),
        )


# -- entries <-> state rows ---------------------------------------------------------------------


def state_row(kind: Kind, key: str, e: Entry, target: str | None = None) -> StateRow:
    """`e` as a row of group `key` (`pending`, `out` with its `target`, or `fwd`). The body goes
    with `out` and `fwd` rows and with `held` entries only; a malformed entry's `invalid` is kept
    in `reason` (`entry_of` gives it back)."""
    keep_body = kind in (Kind.OUT, Kind.FWD) or e.location == "held"
    return StateRow(
        kind=kind,
        group_key=key,
        group_id=e.group_id,
        origin_index=e.origin.index,
        origin_partition=e.origin.partition,
        origin_offset=e.origin.offset,
        msg_id=e.msg_id,
        location=e.location,
        value=e.value if keep_body else None,
        headers=encode_headers(e.headers),
        attempts=e.attempts,
        due_ms=e.due_ms,
        first_failure_ms=e.first_failure_ms,
        last_failure_ms=e.last_failure_ms,
        reason=e.reason if e.reason is not None else e.invalid,
        status=e.status,
        source=e.source,
        target=target,
    )


def entry_of(row: StateRow) -> Entry:
    """A `pending`, `held` or `fwd` row as an Entry. A `held` or `new` entry never attempted
    that has a reason is a malformed record: it gets its `invalid` back, so it is dead-lettered,
    not sent, when its turn comes."""
    attempts = row.attempts or 0
    return Entry(
        origin=row.origin,
        msg_id=row.msg_id or "",
        group_id=row.group_id,
        location=row.location,  # type: ignore[arg-type]
        value=row.value,
        headers=decode_headers(row.headers),
        attempts=attempts,
        due_ms=row.due_ms or 0,
        first_failure_ms=row.first_failure_ms,
        last_failure_ms=row.last_failure_ms,
        reason=row.reason,
        status=row.status,
        source=row.source or "",
        invalid=row.reason if row.location in ("held", "new") and attempts == 0 else None,
    )


def read_before(source: str | None, positions: Mapping[tuple[str, int], int]) -> bool:
    """Whether a copy read at `source` (`topic/partition/offset`, the `source` column) lies
    before the offset `positions` gives its topic partition ((topic, partition) -> offset); a
    partition `positions` lacks, or a source that is not of that form, is not (pure)."""
    topic, _, rest = (source or "").rpartition("/")
    topic, _, partition = topic.rpartition("/")
    if not (topic and partition.isdigit() and rest.isdigit()):
        return False
    at = positions.get((topic, int(partition)))
    return at is not None and int(rest) < at


def encode_headers(headers: dict[str, str]) -> str:
    return json.dumps(headers, sort_keys=True)


def decode_headers(text: str | None) -> dict[str, str]:
    return json.loads(text) if isinstance(text, str) else {}


# -- the other kinds --------------------------------------------------------------------------


def meta_row(app_id: str, batch_id: int) -> StateRow:
    return StateRow(Kind.META, app_id=app_id, batch_id=batch_id)


def touched_row(key: str) -> StateRow:
    return StateRow(Kind.TOUCHED, group_key=key)


Scanned = dict[str, dict[str, int]]  # DLQ storage topic -> partition (as text) -> end offset


def redrive_row(op_id: str, scanned: Scanned, progress: RedriveProgress | None = None) -> StateRow:
    """A re-drive applied in the table: `msg_id` the operation id, `headers` its scan (the end
    offsets it covers). A rate-capped re-drive part-way through also has its `progress` (in
    `source`, `encode_progress`); a row without one is applied completely."""
    source = None if progress is None else encode_progress(progress)
    return StateRow(Kind.REDRIVE, msg_id=op_id, headers=encode_scanned(scanned), source=source)


@dataclass(frozen=True)
class RedriveProgress:
    """How far a rate-capped re-drive has got on a shard (`varadhi.core.redrive_pace`): below
    `taken` every message it selects is back; its last portion was taken at `at_ms` and left
    `carry` (a fraction of a message) for the next."""

    taken: Scanned
    at_ms: int
    carry: float


def encode_progress(progress: RedriveProgress) -> str:
    return json.dumps(asdict(progress), sort_keys=True)


def decode_progress(text: str) -> RedriveProgress:
    d = json.loads(text)
    return RedriveProgress(d["taken"], int(d["at_ms"]), float(d["carry"]))


def encode_scanned(scanned: Scanned) -> str:
    return json.dumps(scanned, sort_keys=True)


def decode_scanned(text: str) -> Scanned:
    return json.loads(text)


# -- RQ/DLQ records -----------------------------------------------------------------------------


@dataclass(frozen=True)
class OutRow:
    """An `out` row as the RQ/DLQ record it becomes, typed once where the rows leave the table
    (`state_frames.out_rows`): its `target` ("rq" or "dlq"), its group (`group_key` places the
    record on a partition, `group_id` is its key: None for an ungrouped message), and the message
    with its retry state."""

    target: str
    group_key: str
    group_id: str | None
    msg_id: str
    origin: m.Origin
    value: bytes | None
    headers: dict[str, str]
    attempts: int
    due_ms: int
    first_failure_ms: int | None
    last_failure_ms: int | None
    reason: str | None
    status: int | None

    @classmethod
    def of(cls, row: StateRow) -> OutRow:
        """The `out` state row `row` (raises TypeError for one without target, group, id,
        origin or attempts: no shard writes such a row)."""
        needed = (row.target, row.group_key, row.msg_id, row.origin_offset, row.attempts)
        if any(v is None for v in needed):
            raise TypeError(f"not an out row: {row!r:.200}")
        return cls(
            target=row.target,
            group_key=row.group_key,
            group_id=row.group_id,
            msg_id=row.msg_id,
            origin=row.origin,
            value=row.value,
            headers=decode_headers(row.headers),
            attempts=row.attempts,
            due_ms=row.due_ms or 0,
            first_failure_ms=row.first_failure_ms,
            last_failure_ms=row.last_failure_ms,
            reason=row.reason,
            status=row.status,
        )


def retry_headers(row: OutRow) -> dict[str, str | None]:
    """The headers of an `out` row's record: the message's own, its id (which keeps the group
    key of id-less messages) and the retry state (origin, attempts, due and failure times,
    reason, status; None: left out). Persisted: RQ/DLQ records written by earlier versions are
    read back by `retry_state`."""
    headers: dict[str, str | None] = dict(row.headers)
    headers.setdefault(m.H_MSG_ID, row.msg_id)
    headers.update(
        {
            m.H_ORIGIN: row.origin.encode(),
            m.H_ATTEMPTS: str(row.attempts),
            m.H_DUE_MS: str(row.due_ms),
            m.H_FIRST_FAILURE_MS: _text(row.first_failure_ms),
            m.H_LAST_FAILURE_MS: _text(row.last_failure_ms),
            m.H_REASON: row.reason,
            m.H_STATUS: _text(row.status),
        }
    )
    return headers


def retry_state(headers: dict[str, str]) -> tuple[m.Origin, int, int]:
    """(origin, attempts, due_ms) of an RQ record, from its headers (`retry_headers`). Raises
    KeyError or ValueError for a record no shard wrote (or a damaged one)."""
    return (
        m.Origin.decode(headers[m.H_ORIGIN]),
        int(headers.get(m.H_ATTEMPTS, "0")),
        int(headers.get(m.H_DUE_MS, "0")),
    )


def _text(v: int | None) -> str | None:
    return None if v is None else str(v)


# -- task counters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskStats:
    """One delivery task's counters (a `stat` row): what it read (`records`, of which `routed`
    from the main topic), how many groups ran, the group runs' `RunCounts`, its wall time and
    what its endpoint answered (`http`: `batch.http_counts`). `forwarded`: rows phase 1
    forwarded to phase 2 (`batch.ForwardRule`): records, and the entries of groups it handed
    over while they waited for a retry in place (`ForwardRule.hand_over`)."""

    records: int = 0
    routed: int = 0
    forwarded: int = 0
    groups: int = 0
    delivered: int = 0
    retried: int = 0
    retried_in_place: int = 0
    waited_due: int = 0
    dead_lettered: int = 0
    over_limit: int = 0
    duplicates: int = 0
    attempts: int = 0
    failures: int = 0
    skipped_replayed: int = 0
    seconds: float = 0.0
    http: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, counts: RunCounts, seconds: float, http: dict[str, int], **read: int) -> TaskStats:
        return cls(**asdict(counts), **read, seconds=round(seconds, 3), http=dict(http))

    def counters(self) -> dict[str, int]:
        """Every integer counter by name, the endpoint's answers flat among them (what the
        driver sums over tasks: `varadhi.spark.shard.commit.sum_counts`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_COUNTERS}
        return out | self.http


_NOT_COUNTERS = ("seconds", "http")
_STAT_TYPES = {"seconds": "double", "http": "map<string,bigint>"}
STAT_COLUMNS = [(f"stat_{f.name}", _STAT_TYPES.get(f.name, "bigint")) for f in fields(TaskStats)]
RESULT_COLUMNS = [*STATE_COLUMNS, ("delivered_ms", "bigint"), *STAT_COLUMNS]
RESULT_SCHEMA = ", ".join(f"{name} {kind}" for name, kind in RESULT_COLUMNS)
RESULT_NAMES = [name for name, _ in RESULT_COLUMNS]


def stat_row(stats: TaskStats) -> dict[str, Any]:
    return {"kind": Kind.STAT, **{f"stat_{f.name}": getattr(stats, f.name) for f in fields(stats)}}


def done_row(dedup_id: str, delivered_ms: int) -> dict[str, Any]:
    return {"kind": Kind.DONE, "msg_id": dedup_id, "delivered_ms": delivered_ms}
