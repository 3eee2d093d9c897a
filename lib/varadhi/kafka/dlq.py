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

A re-driven entry carries the header `varadhi-redriven` (`messages.H_REDRIVEN`) = the operation
id, which only shards write; its RQ and DLQ copies keep it, so a message parked again after a
re-drive shows which re-drive put it back (`Parked.redriven_by`), and every HTTP request of it
carries `X-Varadhi-Redriven` (`group_state.http_headers`).

A dead letter is re-driven at most once. A shard applying a re-drive reads its DLQ partitions up
to the end offsets they had when it started (`scanned`), in chunks, keeping only the records
the selector takes; the end offsets are recorded in its GroupState commit (a `redrive` row, in
the same Delta commit as the `held` entries) and then in the operation document. A DLQ record
below the `scanned` offset of an applied re-drive whose selector matches it was re-driven by
that re-drive, so a later re-drive (the same selector again, an overlapping one) skips it; a
message that failed again after its re-drive is a new DLQ record above those offsets, so it can
be re-driven again. A shard that crashed after its commit but before marking the operation done
finds its `redrive` row and only marks it done, without scanning again. Memory is bounded by
the selection (and one chunk), not by the DLQ.

DLQ records stay in Kafka (it is append-only); `list_parked` reports a record as `redriven` when
an applied re-drive covers it in that way.

A rate-capped re-drive (`rate`: messages a second for the whole subscription, split evenly
among the `shards` it was recorded for) is applied in portions, one per micro-batch
(`varadhi.core.redrive_pace`: the pace, the order and the barriers that keep each group's order
across portions). On its first portion a shard reads its DLQ partitions up to their end offsets
once and keeps what it selects (`Pick`: position, group, origin; no bodies) in memory
(`PickCache`; read again after a restart); each portion then reads only the records it takes.
Its `redrive` row carries the end offsets it started with and its progress, committed with the
portion's entries, so a shard that crashes goes on from its last committed portion: nothing is
put back twice or skipped. After each commit the progress is added to the operation document's
`scanned` (what `list_parked` shows as `redriven`; the rest below its `ends` as `redrive
requested`); once everything up to the ends is back, the row is an applied one and the shard
marks the operation done. A shard ticks (`varadhi.spark.shard.ticks`) so that a batch runs at
least every second while a re-drive waits: portions go on without new traffic.

Re-drives apply in the order they were requested (`created_ms`, then id). A record several of
them select belongs to the first: a later re-drive skips what an earlier one covers, applied or
still under way on the shard (below its end offsets), and only that, so a shard that reads its
picks again after a restart finds the same ones.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import TopicPartition

from varadhi.core import messages as m
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument, VaradhiError
from varadhi.core.group_state import Entry
from varadhi.core.record_ids import record_ids
from varadhi.core.redrive_pace import (
    Pick,
    is_taken,
    pick_order,
    plan_portion,
    portion_size,
)
from varadhi.core.state_rows import Kind, RedriveProgress, Scanned, StateRow, state_row
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key

log = logging.getLogger(__name__)

OPERATION = DocKind.OPERATION
RETRY_HEADERS = (
    m.H_ORIGIN,
    m.H_ATTEMPTS,
    m.H_DUE_MS,
    m.H_FIRST_FAILURE_MS,
    m.H_LAST_FAILURE_MS,
    m.H_REASON,
    m.H_STATUS,
    m.H_RESPONSE,
)


class RedriveNotApplied(VaradhiError):
    """Not every shard applied a re-drive within the time waited (exit 1: it stays recorded and
    running shards still apply it)."""

    def __init__(self, op_id: str, seconds: float):
        super().__init__(
            f"re-drive {op_id} not applied by every shard within {seconds:g} s "
            "(are the shards running?)"
        )
        self.op_id = op_id
        self.seconds = seconds


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

    @property
    def redriven_by(self) -> str | None:
        """The re-drive that put this message back before it was parked again (its operation
        id), or None when it was never re-driven."""
        return self.headers.get(m.H_REDRIVEN) or None

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("value")
        d.pop("headers")
        d["value_bytes"] = None if self.value is None else len(self.value)
        d["redriven_by"] = self.redriven_by
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


@dataclass(frozen=True)
class Redrive:
    """A re-drive operation as shards apply it: what it selects, its `rate` (messages a second
    for the whole subscription; None: all at once) shared by the `shards` it was recorded for,
    and when it was requested (`created_ms`, its place in the order re-drives apply in)."""

    selector: Selector
    rate: float | None = None
    shards: int = 1
    created_ms: int = 0

    @property
    def shard_rate(self) -> float | None:
        """Each shard's share of the rate (None: no rate)."""
        return None if self.rate is None else self.rate / max(1, self.shards)

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Redrive:
        rate = doc.get("rate")
        return cls(
            Selector.from_dict(doc["selector"]),
            None if rate is None else float(rate),
            int(doc.get("shards") or 1),
            int(doc.get("created_ms") or 0),
        )


def parse_rate(text: str) -> float:
    """A re-drive's rate, `N/s` or `N` (messages a second, for the whole subscription): a
    positive finite number. Raises InvalidArgument naming `--rate` otherwise."""
    number = text.strip().removesuffix("/s").strip()
    try:
        rate = float(number)
    except ValueError:
        rate = float("nan")
    if not (0 < rate < float("inf")):
        raise InvalidArgument(
            f"--rate must be a positive number of messages a second, like 50/s or 50; got {text!r}",
            field="rate",
        )
    return rate


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
    """A DLQ record as a Parked message, its ids read as the shard reads them (their text forms,
    `varadhi.core.record_ids`), whoever wrote it."""
    h = m.headers_to_dict(headers)
    msg_id, group = record_ids(topic, partition, offset, key_, headers)
    return Parked(
        msg_id=msg_id,
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


CHUNK_RECORDS = 500


def iter_parked(
    settings,
    partitions: dict[str, Sequence[int]],
    start: dict[str, dict[str, int]] | None = None,
    timeout_s: float = 30,
    ends: Scanned | None = None,
    chunk: int = CHUNK_RECORDS,
) -> Iterator[list[Parked]]:
    """The records of the given DLQ partitions (storage topic -> partitions) in chunks of at most
    `chunk`, each partition oldest first, from `start` (an offset reset's fast-forward of the
    DLQ) or the beginning, to `ends` (default: the end offsets when the scan starts). Raises
    TimeoutError when no record arrives for `timeout_s`."""
    tps = [TopicPartition(t, p) for t, parts in partitions.items() for p in parts]
    if not tps:
        return
    consumer = kafka_clients.consumer(
        settings,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=chunk,
    )
    try:
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        if ends is None:
            stop = consumer.end_offsets(tps)
        else:
            stop = {tp: int(ends.get(tp.topic, {}).get(str(tp.partition), 0)) for tp in tps}
        for tp in tps:
            offset = (start or {}).get(tp.topic, {}).get(str(tp.partition))
            if offset is not None and offset >= 0:
                consumer.seek(tp, min(int(offset), stop[tp]))
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < stop[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError("timed out reading the DLQ")
            out: list[Parked] = []
            for tp, records in consumer.poll(timeout_ms=200, max_records=chunk).items():
                for r in records:
                    if r.offset < stop[tp]:
                        out.append(
                            parked_from_record(
                                tp.topic, tp.partition, r.offset, r.key, r.value, r.headers
                            )
                        )
            if out:
                deadline = time.monotonic() + timeout_s
                yield out
    finally:
        consumer.close()


def read_parked(
    settings,
    partitions: dict[str, Sequence[int]],
    start: dict[str, dict[str, int]] | None = None,
    timeout_s: float = 30,
) -> list[Parked]:
    """Every record of the given DLQ partitions (storage topic -> partitions), oldest first,
    from `start` (an offset reset's fast-forward of the DLQ) or the beginning."""
    return [p for chunk in iter_parked(settings, partitions, start, timeout_s) for p in chunk]


def end_offsets(settings, partitions: dict[str, Sequence[int]]) -> Scanned:
    """The (read_committed) end offsets of the given DLQ partitions."""
    tps = [TopicPartition(t, p) for t, parts in partitions.items() for p in parts]
    if not tps:
        return {}
    consumer = kafka_clients.consumer(
        settings,
        isolation_level="read_committed",
        enable_auto_commit=False,
    )
    try:
        out: Scanned = {}
        for tp, end in consumer.end_offsets(tps).items():
            out.setdefault(tp.topic, {})[str(tp.partition)] = int(end)
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
    doc = snapshot.get(DocKind.SUBSCRIPTION, name) or {}
    return doc.get("state", {}).get("dlq_start", {})


def redrives(snapshot: Snapshot, name: str) -> dict[str, dict[str, Any]]:
    """The subscription's re-drive operations: id -> document."""
    prefix = f"{name}/redrive-"
    return {
        k[len(name) + 1 :]: v for k, v in snapshot.items(OPERATION).items() if k.startswith(prefix)
    }


def pending_for(snapshot: Snapshot, name: str, shard: int) -> dict[str, Redrive]:
    """Re-drives that `shard` has not applied completely yet, in the order they apply in:
    op id -> `Redrive` (pure)."""
    pending = {
        op_id: Redrive.from_doc(doc)
        for op_id, doc in redrives(snapshot, name).items()
        if shard not in doc.get("done", [])
    }
    return dict(sorted(pending.items(), key=lambda kv: (kv[1].created_ms, kv[0])))


@dataclass(frozen=True)
class Applied:
    """What an applied re-drive covers (pure): the DLQ records below its `scanned` end offsets
    that its selector matches. A document recorded before re-drives kept `scanned` covers, once
    some shard applied it, the matches whose last failure was not after it was requested."""

    selector: Selector
    scanned: Scanned
    legacy_created_ms: int | None = None

    def covers(self, p: Parked) -> bool:
        if not self.selector.matches(p):
            return False
        if self.legacy_created_ms is not None:
            return self.legacy_created_ms >= (p.last_failure_ms or 0)
        return p.offset < int(self.scanned.get(p.topic, {}).get(str(p.partition), 0))


def applied_redrives(
    snapshot: Snapshot, name: str, before: tuple[int, str] | None = None
) -> list[Applied]:
    """Every re-drive some shard has applied (a rate-capped one: as far as it has got), as
    `Applied` (pure); with `before` (created_ms, op id), only those requested before it."""
    out = []
    for op_id, doc in redrives(snapshot, name).items():
        if before is not None and (int(doc.get("created_ms") or 0), op_id) >= before:
            continue
        selector = Selector.from_dict(doc["selector"])
        if "scanned" in doc:
            if doc["scanned"]:
                out.append(Applied(selector, doc["scanned"]))
        elif doc.get("done"):
            out.append(Applied(selector, {}, int(doc["created_ms"])))
    return out


def select_redrive(
    parked: Iterable[Parked], selectors: Mapping[str, Selector], applied: Sequence[Applied]
) -> list[tuple[str, Parked]]:
    """The records re-drives take (pure), each with the id of the first operation of
    `selectors` (op id -> selector) that matches it, leaving out those an applied re-drive
    covers (re-driven already)."""
    out = []
    for p in parked:
        op_id = next((op_id for op_id, sel in selectors.items() if sel.matches(p)), None)
        if op_id is not None and not any(a.covers(p) for a in applied):
            out.append((op_id, p))
    return out


def apply_redrives(
    settings,
    snapshot: Snapshot,
    sub,
    dlq: topics.CompositeTopic,
    shard: int,
    store,
    ops: Mapping[str, Redrive],
    picks: PickCache,
    now_ms: int,
) -> int:
    """Apply the re-drives `ops` (pending for `shard`, in order) to the shard's state copy
    `store`, between its batches: one without a rate completely, one with a rate its next
    portion; the next state commit persists them with a `redrive` row per operation. An
    operation whose row says it was applied completely (committed, not yet marked done) is not
    applied again. `picks` keeps rate-capped ones' picks between batches; `now_ms` paces them.
    Returns how many entries were added or replaced."""
    committed = store.redrives_applied()
    moving = store.redrives_in_progress()
    store.forget_redrives((set(committed) | set(moving)) - set(ops))  # done since: not needed
    picks.keep(moving.keys() & ops.keys())
    partitions = dlq_partitions(sub, dlq, shard)
    start = dlq_start(snapshot, sub.name)
    added = 0
    ahead: list[Applied] = []  # what the re-drives before the next one cover on this shard
    for op_id, op in ops.items():
        covered = applied_redrives(snapshot, sub.name, (op.created_ms, op_id)) + ahead
        if op_id in committed:
            ahead.append(Applied(op.selector, committed[op_id]))
        elif op.rate is None:
            scanned = end_offsets(settings, partitions)
            chosen: list[tuple[str, Parked]] = []
            for chunk in iter_parked(settings, partitions, start, ends=scanned):
                chosen.extend(select_redrive(chunk, {op_id: op.selector}, covered))
            added += store.redrive(redrive_rows(chosen, sub.spec.grouped))
            store.record_redrives({op_id: scanned})
            ahead.append(Applied(op.selector, scanned))
        else:
            ends, progress = moving.get(op_id) or (end_offsets(settings, partitions), None)
            portion = _Portion(settings, sub, partitions, start, op_id, op, ends, covered)
            added += portion.apply(store, progress, picks, now_ms)
            ahead.append(Applied(op.selector, ends))  # it claims what it selects below its ends
    return added


class PickCache:
    """A shard's picks (`redrive_pace.Pick`, in `pick_order`) of its rate-capped re-drives under
    way, op id -> picks, kept between batches (read again after a restart), and the progress
    each last reported to its operation document. Not thread-safe (the batch gate guards it)."""

    def __init__(self) -> None:
        self._picks: dict[str, list[Pick]] = {}
        self._reported: dict[str, Scanned] = {}

    def keep(self, op_ids: Iterable[str]) -> None:
        """Forget every operation but these."""
        keep = set(op_ids)
        for d in (self._picks, self._reported):
            for op_id in set(d) - keep:
                del d[op_id]

    def picks(self, op_id: str, read: Callable[[], list[Pick]]) -> list[Pick]:
        """The picks of `op_id`, read (`read()`) the first time."""
        if op_id not in self._picks:
            self._picks[op_id] = read()
        return self._picks[op_id]

    def unreported(self, progress: Mapping[str, Scanned]) -> dict[str, Scanned]:
        """Of `progress` (op id -> taken), what differs from what was last reported."""
        return {op: t for op, t in progress.items() if self._reported.get(op) != t}

    def reported(self, progress: Mapping[str, Scanned]) -> None:
        self._reported.update(progress)


@dataclass(frozen=True)
class _Portion:
    """The next portion of the rate-capped re-drive `op_id` on one shard (its I/O; the
    decisions are `varadhi.core.redrive_pace`'s)."""

    settings: Any
    sub: Any
    partitions: dict[str, list[int]]
    start: dict[str, dict[str, int]]
    op_id: str
    op: Redrive
    ends: Scanned
    covered: list[Applied]  # what the re-drives before it cover

    def apply(self, store, progress: RedriveProgress | None, cache: PickCache, now_ms: int) -> int:
        """Put the portion's messages back in `store` with its barriers and its `redrive` row
        (`progress` None: the first portion); returns how many entries were added."""
        taken = {} if progress is None else progress.taken
        last_ms = None if progress is None else progress.at_ms
        carry = 0.0 if progress is None else progress.carry
        rate = self.op.shard_rate
        assert rate is not None
        budget, carry = portion_size(rate, last_ms, carry, now_ms)
        if budget == 0 and progress is not None:
            return 0  # not one whole message yet: the row stays as it is
        order = [(t, p) for t, parts in self.partitions.items() for p in parts]
        picks = cache.picks(self.op_id, lambda: self._read_picks(taken, order))
        remaining = [p for p in picks if not is_taken(p, taken)]
        portion = plan_portion(remaining, budget, taken, self.ends, order)
        wanted = {(p.topic, p.partition, p.offset) for p in portion.take}
        chosen = []
        if wanted:
            for chunk in iter_parked(
                self.settings, self.partitions, self._from(taken), ends=portion.taken
            ):
                chosen.extend(
                    (self.op_id, p) for p in chunk if (p.topic, p.partition, p.offset) in wanted
                )
        added = store.redrive(redrive_rows(chosen, self.sub.spec.grouped))
        store.hold_back(barrier_rows(portion.barriers, self.op_id))
        if portion.complete:
            store.record_redrives({self.op_id: self.ends})
        else:
            step = RedriveProgress(portion.taken, now_ms, carry)
            store.record_redrives({self.op_id: self.ends}, {self.op_id: step})
        log.info(
            "re-drive %s: %d parked messages back (at most %.6g a second on this shard)%s",
            self.op_id,
            len(chosen),
            rate,
            "; complete" if portion.complete else "",
        )
        return added

    def _from(self, taken: Scanned) -> dict[str, dict[str, int]]:
        """Where reading starts: the progress, or the DLQ's start when that is later."""
        out = {t: dict(parts) for t, parts in self.start.items()}
        for t, parts in taken.items():
            for p, o in parts.items():
                out.setdefault(t, {})[p] = max(int(o), int(out.get(t, {}).get(p, 0)))
        return out

    def _read_picks(self, taken: Scanned, order: list[tuple[str, int]]) -> list[Pick]:
        """The re-drive's picks from its progress to its end offsets: one DLQ scan."""
        found: list[Pick] = []
        grouped = self.sub.spec.grouped
        for chunk in iter_parked(self.settings, self.partitions, self._from(taken), ends=self.ends):
            for _, p in select_redrive(chunk, {self.op_id: self.op.selector}, self.covered):
                if redrivable(p):
                    found.append(pick_of(p, grouped))
        return pick_order(found, order)


def finish_redrives(
    catalog: Catalog, name: str, shard: int, store, ops: Iterable[str], picks: PickCache
) -> None:
    """After the state commit: mark done the operations of `ops` whose `redrive` row says they
    were applied completely, with their scanned offsets, and drop the rows from the copy (the
    next commit); add the progress of rate-capped ones under way to their documents."""
    ops = set(ops)
    applied = {op_id: sc for op_id, sc in store.redrives_applied().items() if op_id in ops}
    if applied:
        mark_done(catalog, name, applied, shard, scanned=applied)
        store.forget_redrives(applied)
    moving = {op: v for op, v in store.redrives_in_progress().items() if op in ops}
    news = picks.unreported({op_id: progress.taken for op_id, (_, progress) in moving.items()})
    if news:
        report_progress(catalog, name, {op_id: (moving[op_id][0], t) for op_id, t in news.items()})
        picks.reported(news)


def redrive_state(p: Parked, docs: Mapping[str, dict[str, Any]], shard_count: int) -> str:
    """`parked`, `redrive requested` or `redriven` for one DLQ record (pure). A record a
    rate-capped re-drive under way will take (below the `ends` its shard started with) is
    `redrive requested` until its portion is back."""
    state = "parked"
    for doc in docs.values():
        sel = Selector.from_dict(doc["selector"])
        if not sel.matches(p):
            continue
        complete = len(doc.get("done", [])) >= shard_count
        if "scanned" not in doc:  # recorded before re-drives kept their scanned offsets
            if int(doc["created_ms"]) >= (p.last_failure_ms or 0):
                if complete:
                    return "redriven"
                state = "redrive requested"
        elif Applied(sel, doc["scanned"]).covers(p):
            return "redriven"
        elif complete:
            continue
        elif str(p.partition) in doc.get("ends", {}).get(p.topic, {}):
            if p.offset < int(doc["ends"][p.topic][str(p.partition)]):
                state = "redrive requested"  # a later portion takes it
        elif str(p.partition) not in doc["scanned"].get(p.topic, {}):
            state = "redrive requested"  # its shard has not applied it yet
    return state


def list_parked(
    catalog: Catalog, name: str, group_id: str | None = None, limit: int = 100
) -> list[dict[str, Any]]:
    """The newest `limit` (0: all) DLQ records with their re-drive state, oldest first."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    dlq = topics.from_snapshot(snap, sub.spec.dlq_topic)
    ops = redrives(snap, name)
    rows: deque[dict[str, Any]] = deque(maxlen=limit or None)
    for chunk in iter_parked(catalog.settings, dlq_partitions(sub, dlq), dlq_start(snap, name)):
        for p in chunk:
            if group_id is not None and p.group_id != group_id:
                continue
            rows.append(p.summary() | {"state": redrive_state(p, ops, sub.shard_count)})
    return list(rows)


def request_unsideline(
    catalog: Catalog, name: str, selector: Selector, rate: float | None = None
) -> str:
    """Record a re-drive for every shard (or, `runtime: library`, the member holding each slot:
    `varadhi.library.redrive`) to apply; returns its operation id. With `rate` (messages a
    second, > 0), the shards (or slots) put the messages back at that rate in all, each its
    share of it (the shard count now)."""
    selector.validate()
    if rate is not None and not (0 < rate < float("inf")):
        raise InvalidArgument(f"--rate must be a positive number, got {rate!r}", field="rate")
    op_id = f"redrive-{int(time.time())}-{uuid.uuid4().hex[:6]}"

    def change(snap: Snapshot):
        sub = subscriptions.from_snapshot(snap, name)  # must exist
        doc = {
            "kind": OpKind.UNSIDELINE,
            "selector": selector.to_dict(),
            "created_ms": int(time.time() * 1000),
            "done": [],
            "scanned": {},
        }
        if rate is not None:
            doc |= {"rate": rate, "shards": sub.shard_count, "ends": {}}
        return {key(OPERATION, f"{name}/{op_id}"): doc}

    catalog.mutate(change)
    return op_id


def mark_done(
    catalog: Catalog,
    name: str,
    op_ids: Iterable[str],
    shard: int,
    scanned: Mapping[str, Scanned] | None = None,
) -> None:
    """Mark the operations applied by `shard`, adding its scans' end offsets (`scanned`: op id
    -> end offsets of the shard's DLQ partitions) to what each covers."""

    def change(snap: Snapshot):
        out = {}
        for op_id in op_ids:
            doc = snap.get(OPERATION, f"{name}/{op_id}")
            if doc is not None and shard not in doc.get("done", []):
                new = dict(doc, done=sorted({*doc.get("done", []), shard}))
                if "scanned" in doc and scanned and op_id in scanned:
                    new["scanned"] = merged_scanned(doc["scanned"], scanned[op_id])
                out[key(OPERATION, f"{name}/{op_id}")] = new
        return out

    catalog.mutate(change)


def report_progress(
    catalog: Catalog, name: str, progress: Mapping[str, tuple[Scanned, Scanned]]
) -> None:
    """Add the progress of rate-capped re-drives under way on a shard (op id -> (the end
    offsets it started with, how far it has taken)) to their documents: `scanned` covers what
    is back, `ends` what it will take."""

    def change(snap: Snapshot):
        out = {}
        for op_id, (ends, taken) in progress.items():
            doc = snap.get(OPERATION, f"{name}/{op_id}")
            if doc is not None:
                out[key(OPERATION, f"{name}/{op_id}")] = dict(
                    doc,
                    scanned=merged_scanned(doc.get("scanned", {}), taken),
                    ends=merged_scanned(doc.get("ends", {}), ends),
                )
        return out

    catalog.mutate(change)


def merged_scanned(base: Scanned, newer: Scanned) -> Scanned:
    out = {t: dict(parts) for t, parts in base.items()}
    for t, parts in newer.items():
        out.setdefault(t, {}).update({str(p): int(o) for p, o in parts.items()})
    return out


def redrivable(p: Parked) -> bool:
    """Whether a DLQ record can go back (pure): it has a valid origin and a body and is not a
    truncated copy (replay its origin instead)."""
    try:
        m.Origin.decode(p.origin)
    except ValueError:
        return False
    return m.H_TRUNCATED not in p.headers and p.value is not None


def group_key_of(p: Parked, grouped: bool) -> str:
    """The state's group key of a parked message (pure)."""
    return p.group_id if (grouped and p.group_id) else f"~{p.msg_id}"


def pick_of(p: Parked, grouped: bool) -> Pick:
    """A redrivable parked message as a rate-capped re-drive's `Pick` (pure)."""
    return Pick(
        p.topic,
        p.partition,
        p.offset,
        group_key_of(p, grouped),
        m.Origin.decode(p.origin),
        p.msg_id,
        p.group_id,
    )


def redrive_rows(parked: Iterable[tuple[str, Parked]], grouped: bool) -> list[StateRow]:
    """Parked messages, each with the id of the re-drive that takes it, as `held` pending state
    rows at their origin, attempts reset, marked with that id (`messages.H_REDRIVEN`) (pure)."""
    rows = []
    seen = set()
    for op_id, p in parked:
        where = f"{p.topic}/{p.partition}/{p.offset}"
        if not redrivable(p):
            if m.H_TRUNCATED in p.headers:
                log.warning(
                    "DLQ record %s is a truncated copy: not re-driven; replay its origin %s",
                    where,
                    p.origin,
                )
            elif p.value is not None:
                log.warning("DLQ record %s has no valid %s: not re-driven", where, m.H_ORIGIN)
            continue
        origin = m.Origin.decode(p.origin)
        if origin in seen:
            continue
        seen.add(origin)
        headers = {k: v for k, v in p.headers.items() if k not in RETRY_HEADERS}
        headers[m.H_REDRIVEN] = op_id
        entry = Entry(origin, p.msg_id, p.group_id, "held", p.value, headers, source=where)
        rows.append(state_row(Kind.PENDING, group_key_of(p, grouped), entry))
    return rows


def barrier_rows(picks: Iterable[Pick], op_id: str) -> list[StateRow]:
    """A rate-capped re-drive's barriers (`redrive_pace.plan_portion`) as bodiless `dlq` pending
    rows at their picks' origins, where their groups stop until a later portion takes them
    (pure)."""
    reason = f"waiting for re-drive {op_id}"
    return [
        state_row(
            Kind.PENDING,
            p.group_key,
            Entry(p.origin, p.msg_id, p.group_id, "dlq", reason=reason),
        )
        for p in picks
    ]
