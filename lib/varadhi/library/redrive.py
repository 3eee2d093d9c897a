"""Re-drives (`varadhi dlq unsideline`) applied by library members.

A re-drive is the operation document `varadhi.kafka.dlq` describes (`operation/<sub>/redrive-<id>`:
its selector, the shards that applied it (`done`) and the DLQ offsets each scanned
(`scanned`)). A library member applies it for every slot it holds, slot s standing for shard s
(`assign`: slot s is shard s's partitions, its DLQ partitions among them), so `dlq list`,
`--wait` and a later re-drive read the document as they do for shards:

1. read the slot's DLQ partitions (from the DLQ's start after an offset reset) up to the end
   offsets they have when it starts (`scanned`), keeping what the selector takes and no earlier
   re-drive covers (`dlq.select_redrive`; what an operation of this pass took counts as covered
   for the next, as on a shard);
2. put each back by writing it to the slot's RQ partition of its group (as a shard would write a
   retry of it, `routing.internal_partition`) as a retry due now, attempts reset, its retry
   headers dropped and `varadhi-redriven` = the operation id (`redrive_record`), and wait for
   the broker's acknowledgements; the member reads it back as any RQ record and delivers it, each
   request carrying `X-Varadhi-Redriven`;
3. mark the slot done with its `scanned` offsets (`dlq.mark_done`).

At least once. A member that dies (or whose slot moves away) between 2 and 3 leaves the
operation pending for the slot: its next owner applies it again and writes a second copy of
each message. Two copies read back while both are held are one message (`Scheduler.add` keeps
one per origin); a copy read after the first was delivered is delivered again. Making it
exactly once would need the RQ writes and the done mark in one Kafka transaction, which the
catalog's own transactional writer does not share.

Rate. A re-drive with `rate` (messages a second for the whole subscription, split evenly among
the `shards` it was recorded for: one slot's share each) is put back in portions, one a second,
with the shards' arithmetic (`varadhi.core.redrive_pace`: `portion_size`, `pick_order`,
`plan_portion`): over any T seconds a slot puts back at most `share x (T + 1)` messages. The
member reads the slot's selection once (bodies included: memory is bounded by the selection)
and keeps it between portions (`Redriver`); after each portion it adds its progress to the
operation document (`dlq.report_progress`: `dlq list` shows what is back `redriven`, the rest
`redrive requested`), and marks the slot done after the last. A member that gets the slot
later goes on from the reported progress; the portion written but not reported before a crash
is written again (at least once). In skip mode no barriers are needed (the shards' keep a
group's newer traffic behind its re-driven messages, which skip mode does not ask for): a key's
re-driven messages still go back in their DLQ order, on one RQ partition; block mode's are below.

Block mode (`on_dead_letter: block`). A member's `Hold` (`varadhi.library.blocking.RedriveHold`)
is told around each slot's re-drives (`frozen`: the slot's blocked keys hold their new messages
instead of sidelining them to the DLQ while it is read) and before each write of copies
(`awaiting`: each key waits for its copies in origin order; a rate-capped portion's *barriers*,
the first message of each key that a later portion puts back, block their keys until then, as a
shard's `waiting for re-drive`).

The records of messages that cannot go back (no origin, no body, a truncated copy:
`dlq.redrivable`) stay parked, logged, as on a shard. A member applies nothing while the
subscription is paused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from varadhi.core import messages as m
from varadhi.core import routing
from varadhi.core.queue_records import OutRecord, out_record
from varadhi.core.redrive_pace import Pick, pick_order, plan_portion, portion_size
from varadhi.core.state_rows import OutRow, Scanned
from varadhi.kafka import dlq
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic

log = logging.getLogger(__name__)

#: How long a member waits for the broker to acknowledge a re-drive's RQ records.
ACK_TIMEOUT_S = 60.0


class Hold(Protocol):
    """What a member in block mode is told of a re-drive (the module docstring)."""

    def frozen(self, slot: int) -> contextlib.AbstractContextManager[None]: ...

    def awaiting(
        self,
        slot: int,
        copies: Sequence[tuple[dlq.Parked, OutRecord]],
        barriers: Sequence[tuple[dlq.Parked, OutRecord]],
    ) -> None: ...


def redrive_record(p: dlq.Parked, op_id: str, grouped: bool, now_ms: int, limit: int) -> OutRecord:
    """The RQ record that puts the parked message `p` back (pure): its body and own headers, a
    retry at its origin due `now_ms` with no attempts and no failure, marked with the re-drive
    `op_id` (`messages.H_REDRIVEN`). `p` must be `dlq.redrivable`."""
    headers = {k: v for k, v in p.headers.items() if k not in dlq.RETRY_HEADERS}
    headers[m.H_REDRIVEN] = op_id
    row = OutRow(
        "rq",
        dlq.group_key_of(p, grouped),
        p.group_id,
        p.msg_id,
        m.Origin.decode(p.origin),
        p.value,
        headers,
        0,
        now_ms,
        None,
        None,
        None,
        None,
    )
    return out_record(row, limit)


def rq_partition(group_key: str, slot: int, slots: int, rq_partitions: int) -> int:
    """The RQ partition of `slot` a message of `group_key` goes to, as a shard writes its
    retries (pure)."""
    owned = routing.shard_partitions(slot, slots, rq_partitions)
    return routing.internal_partition(routing.group_hash(group_key), owned)


def redrivable_once(picked: Iterable[tuple[str, dlq.Parked]]) -> list[dlq.Parked]:
    """Of what a re-drive selected, the messages that can go back, one per origin (a DLQ record
    written twice is put back once); the rest is logged and stays parked (pure but the log)."""
    out, seen = [], set()
    for _, p in picked:
        if not dlq.redrivable(p):
            where = f"{p.topic}/{p.partition}/{p.offset}"
            log.warning("DLQ record %s cannot be re-driven (truncated, no body or origin)", where)
            continue
        if p.origin not in seen:
            seen.add(p.origin)
            out.append(p)
    return out


def slot_part(offsets: Scanned, partitions: Mapping[str, Sequence[int]]) -> Scanned:
    """Of per-partition offsets (`topic -> partition -> offset`, of every slot), those of the
    slot's `partitions` (pure)."""
    out: dict[str, dict[str, int]] = {}
    for t, parts in partitions.items():
        for p in parts:
            o = offsets.get(t, {}).get(str(p))
            if o is not None:
                out.setdefault(t, {})[str(p)] = int(o)
    return out


def covers(offsets: Scanned, partitions: Mapping[str, Sequence[int]]) -> bool:
    """Whether `offsets` has an offset for every one of `partitions` (pure)."""
    return all(str(p) in offsets.get(t, {}) for t, parts in partitions.items() for p in parts)


def later(a: Scanned, b: Scanned) -> Scanned:
    """Per partition, the later of two offsets (pure)."""
    out = {t: dict(parts) for t, parts in a.items()}
    for t, parts in b.items():
        for p, o in parts.items():
            out.setdefault(t, {})[p] = max(int(o), int(out[t].get(p, 0)))
    return out


@dataclass
class _Paced:
    """A rate-capped re-drive under way on one slot: the end offsets it started with, how far
    it has put messages back (`taken`, as `redrive_pace.plan_portion` keeps it), when its last
    portion went and the fraction of a message it left, and the messages still to put back, in
    `pick_order`."""

    ends: Scanned
    taken: Scanned
    last_ms: int | None
    carry: float
    left: list[tuple[Pick, dlq.Parked]]


class Redriver:
    """A member's re-drives (the module docstring): `apply_pending` at each look. Rate-capped
    ones keep their progress here between looks; `pacing` says one is under way (then look
    every second). Not thread-safe: one thread calls it."""

    def __init__(self) -> None:
        self._paced: dict[tuple[str, int], _Paced] = {}

    @property
    def pacing(self) -> bool:
        return bool(self._paced)

    def apply_pending(
        self,
        settings,
        catalog: Catalog,
        sub: Subscription,
        rq: StorageTopic,
        dlq_topic: CompositeTopic,
        slots: Iterable[int],
        producer,
        limit: int,
        now_ms: int,
        hold: Hold | None = None,
    ) -> int:
        """Apply the re-drives pending for each of `slots` (in the order re-drives apply in):
        one without a rate completely, one with a rate its next portion, writing with
        `producer` (in block mode, telling `hold`); returns how many messages were put back.
        Raises the producer's KafkaError when a write is refused, TimeoutError when the DLQ
        cannot be read."""
        held = sorted(slots)
        under_way: set[tuple[str, int]] = set()
        back = 0
        if held:
            name = sub.name
            snap = catalog.snapshot()
            start = dlq.dlq_start(snap, name)
            docs = dlq.redrives(snap, name)
            for slot in held:
                pending = dlq.pending_for(snap, name, slot)
                if not pending:
                    continue
                partitions = dlq.dlq_partitions(sub, dlq_topic, slot)
                at = _Slot(settings, catalog, sub, rq, slot, partitions, producer, limit, hold)
                ahead: list[dlq.Applied] = []
                with contextlib.nullcontext() if hold is None else hold.frozen(slot):
                    for op_id, op in pending.items():
                        covered = dlq.applied_redrives(snap, name, (op.created_ms, op_id)) + ahead
                        if op.rate is None:
                            ends = dlq.end_offsets(settings, partitions)
                            picked = at.select(start, ends, op_id, op, covered)
                            back += at.put_back(op_id, picked, now_ms)
                            dlq.mark_done(catalog, name, [op_id], slot, scanned={op_id: ends})
                        else:
                            paced = self._paced.get((op_id, slot))
                            if paced is None:
                                paced = at.resume(docs[op_id], start, op_id, op, covered)
                            ends = paced.ends
                            n, done = at.portion(op_id, op, paced, now_ms)
                            back += n
                            if not done:
                                self._paced[(op_id, slot)] = paced
                                under_way.add((op_id, slot))
                        ahead.append(dlq.Applied(op.selector, ends))
        for gone in set(self._paced) - under_way:  # done, or its slot is no longer held
            del self._paced[gone]
        return back


@dataclass(frozen=True)
class _Slot:
    """The I/O of applying re-drives to one slot."""

    settings: Any
    catalog: Catalog
    sub: Subscription
    rq: StorageTopic
    slot: int
    partitions: dict[str, list[int]]
    producer: Any
    limit: int
    hold: Hold | None

    def select(
        self, start: Scanned, ends: Scanned, op_id: str, op: dlq.Redrive, covered
    ) -> list[dlq.Parked]:
        """What `op` puts back of the slot's DLQ records from `start` to `ends`."""
        picked: list[tuple[str, dlq.Parked]] = []
        for chunk in dlq.iter_parked(self.settings, self.partitions, start, ends=ends):
            picked.extend(dlq.select_redrive(chunk, {op_id: op.selector}, covered))
        return redrivable_once(picked)

    def put_back(
        self,
        op_id: str,
        messages: Sequence[dlq.Parked],
        now_ms: int,
        barriers: Sequence[dlq.Parked] = (),
    ) -> int:
        """Write `messages` to the slot's RQ (`hold` told first, with the `barriers` of a
        rate-capped portion) and wait for the acknowledgements."""
        grouped = self.sub.spec.grouped
        records = [(p, redrive_record(p, op_id, grouped, now_ms, self.limit)) for p in messages]
        if self.hold is not None:
            held = [(p, redrive_record(p, op_id, grouped, now_ms, self.limit)) for p in barriers]
            self.hold.awaiting(self.slot, records, held)
        futures = []
        for p, record in records:
            partition = rq_partition(
                dlq.group_key_of(p, grouped), self.slot, self.sub.shard_count, self.rq.partitions
            )
            futures.append(
                self.producer.send(
                    self.rq.name,
                    key=record.key,
                    value=record.value,
                    partition=partition,
                    headers=record.headers,
                )
            )
        for future in futures:
            future.get(timeout=ACK_TIMEOUT_S)
        if messages:
            log.info(
                "%s: re-drive %s: %d parked messages of slot %d back",
                self.sub.name,
                op_id,
                len(messages),
                self.slot,
            )
        return len(messages)

    def resume(
        self, doc: Mapping[str, Any], start: Scanned, op_id: str, op: dlq.Redrive, covered
    ) -> _Paced:
        """A rate-capped re-drive on this slot from what its document says (the end offsets
        and progress the slot's earlier holder reported) or afresh; its messages read from the
        progress to the end offsets (one DLQ scan)."""
        known = slot_part(doc.get("ends", {}), self.partitions)
        ends = (
            known
            if covers(known, self.partitions)
            else dlq.end_offsets(self.settings, self.partitions)
        )
        taken = slot_part(doc.get("scanned", {}), self.partitions)
        kept = self.select(later(start, taken), ends, op_id, op, covered)
        by_place = {(p.topic, p.partition, p.offset): p for p in kept}
        order = [(t, p) for t, parts in self.partitions.items() for p in parts]
        picks = pick_order([dlq.pick_of(p, self.sub.spec.grouped) for p in kept], order)
        left = [(pk, by_place[(pk.topic, pk.partition, pk.offset)]) for pk in picks]
        return _Paced(ends, taken, None, 0.0, left)

    def portion(self, op_id: str, op: dlq.Redrive, paced: _Paced, now_ms: int) -> tuple[int, bool]:
        """Put back the next portion of a rate-capped re-drive (`redrive_pace.portion_size`
        of this slot's share of the rate) and report its progress, or mark the slot done
        after the last; (messages put back, done)."""
        rate = op.shard_rate
        assert rate is not None
        budget, carry = portion_size(rate, paced.last_ms, paced.carry, now_ms)
        if budget == 0 and paced.left:
            paced.last_ms = paced.last_ms if paced.last_ms is not None else now_ms
            paced.carry = carry
            return 0, False
        order = [(t, p) for t, parts in self.partitions.items() for p in parts]
        portion = plan_portion([pk for pk, _ in paced.left], budget, paced.taken, paced.ends, order)
        barriers = {(b.topic, b.partition, b.offset) for b in portion.barriers}
        n = self.put_back(
            op_id,
            [p for _, p in paced.left[: len(portion.take)]],
            now_ms,
            [p for pk, p in paced.left if (pk.topic, pk.partition, pk.offset) in barriers],
        )
        name = self.sub.name
        if portion.complete:
            dlq.mark_done(self.catalog, name, [op_id], self.slot, scanned={op_id: paced.ends})
            return n, True
        dlq.report_progress(self.catalog, name, {op_id: (paced.ends, portion.taken)})
        paced.taken, paced.last_ms, paced.carry = portion.taken, now_ms, carry
        paced.left = paced.left[len(portion.take) :]
        return n, False
