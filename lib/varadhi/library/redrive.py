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

A re-drive recorded with `--rate` (under the Spark runtime: the library refuses new ones,
`dlq.request_unsideline`) is applied here all at once, without the pace; the records of
messages that cannot go back (no origin, no body, a truncated copy: `dlq.redrivable`) stay
parked, logged, as on a shard. A member applies nothing while the subscription is paused.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from varadhi.core import messages as m
from varadhi.core import routing
from varadhi.core.queue_records import OutRecord, out_record
from varadhi.core.state_rows import OutRow
from varadhi.kafka import dlq
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic, StorageTopic

log = logging.getLogger(__name__)

#: How long a member waits for the broker to acknowledge a re-drive's RQ records.
ACK_TIMEOUT_S = 60.0


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


def apply_pending(
    settings,
    catalog: Catalog,
    sub: Subscription,
    rq: StorageTopic,
    dlq_topic: CompositeTopic,
    slots: Iterable[int],
    producer,
    limit: int,
    now_ms: int,
) -> int:
    """Apply every re-drive pending for each of `slots` (in the order re-drives apply in),
    writing with `producer`; returns how many messages were put back. Raises the producer's
    KafkaError when a write is refused, TimeoutError when the DLQ cannot be read."""
    slots = sorted(slots)
    if not slots:
        return 0
    name = sub.name
    snap = catalog.snapshot()
    start = dlq.dlq_start(snap, name)
    back = 0
    for slot in slots:
        partitions = dlq.dlq_partitions(sub, dlq_topic, slot)
        ahead: list[dlq.Applied] = []
        for op_id, op in dlq.pending_for(snap, name, slot).items():
            covered = dlq.applied_redrives(snap, name, (op.created_ms, op_id)) + ahead
            scanned = dlq.end_offsets(settings, partitions)
            picked: list[tuple[str, dlq.Parked]] = []
            for chunk in dlq.iter_parked(settings, partitions, start, ends=scanned):
                picked.extend(dlq.select_redrive(chunk, {op_id: op.selector}, covered))
            messages = redrivable_once(picked)
            futures = []
            for p in messages:
                record = redrive_record(p, op_id, sub.spec.grouped, now_ms, limit)
                group_key = dlq.group_key_of(p, sub.spec.grouped)
                futures.append(
                    producer.send(
                        rq.name,
                        key=record.key,
                        value=record.value,
                        partition=rq_partition(group_key, slot, sub.shard_count, rq.partitions),
                        headers=record.headers,
                    )
                )
            for future in futures:
                future.get(timeout=ACK_TIMEOUT_S)
            dlq.mark_done(catalog, name, [op_id], slot, scanned={op_id: scanned})
            ahead.append(dlq.Applied(op.selector, scanned))
            back += len(messages)
            log.info(
                "%s: re-drive %s: %d parked messages of slot %d back",
                name,
                op_id,
                len(messages),
                slot,
            )
    return back
