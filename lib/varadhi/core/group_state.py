"""GroupState: what a shard remembers about groups that have something pending, and the pure
"deliver or follow" logic that runs per group on executors.

Model (seed 000's GroupState, made concrete)
--------------------------------------------
A group is *healthy* when nothing of it is pending; healthy groups have no state at all, so the
common path writes nothing. A group with pending work has one `Entry` per pending message,
ordered by `origin` (its position on the main topic: storage topic index, partition, offset),
which is the group's produce order. Each entry has a `location`:

- `new`:  read from the main topic in this micro-batch (body at hand);
- `held`: body kept in the state table: a follower waiting behind its group's head, or a retry
          that was read from the RQ before its due time (hazard 2: it is parked, never re-written);
- `rq`:   a failed attempt written to the retry queue; the entry waits for that record to come
          back (it then carries the body again) and is matched by (origin, attempts), so stale
          duplicates in the RQ (from a replayed batch) are recognised and dropped (hazard 4);
- `dlq`:  dead-lettered; in `block` mode it keeps its group blocked until it is re-driven.

Only the first entry (the *head*) is ever delivered; everything behind it follows (hazard 1: a
head that fails again keeps its place, because order comes from `origin`, not from RQ offsets).

A group blocked behind a dead letter keeps only so much (`over_limit`, `BlockedPolicy`): behind
its head at most `max_held` messages (and `max_held_bytes` of bodies) stay `held`; the first one
over the limit is dead-lettered and stays as a bodiless `dlq` entry, the *overflow mark*; every
later one is dead-lettered with reason `OVER_LIMIT` and not kept. A re-drive of the group puts
them all back at their origins, so they are delivered after the head, in order.

A retry due soon after the head's first failure (`varadhi.core.retry.retries_in_place`) is first
waited for in the task: the run answers `Wait(..., while_busy=True)` and the delivery engine
sends the head again when it is due, while other groups go on; the group keeps its place, so
nothing of it is parked. Once the task has no other deliveries, the engine keeps such waits for
at most `in_place_linger` more (`varadhi.core.retry.linger_ms`, 2 s by default; `varadhi.spark.batch`
passes it as the engine's `linger_s`); a retry due later than that gets `stop_waiting` and goes
to the RQ after all, due when it was. A retry due later than the window after its first failure
goes to the RQ at once. Either way the RQ record counts every attempt made, and the group
follows it. A run made with `hand_over` (phase 1 of a grouped batch that has a second job
anyway, `varadhi.spark.batch`) does not send such a retry to the RQ when the engine stops its wait:
it stops with its queue as it is (`handed_over`), and the task forwards the queue to the second
job, where a run of it goes on waiting in place (`in_place_retry`: its head is due when it was,
never sent earlier). So a batch waits for its retries in place once, in its second job, not in
both. A retry read back from the RQ before its due time waits in the task the same way
when its wait fits the window (`varadhi.core.retry.waits_in_task`), so it costs one batch, not a
parking batch and a later one; if the engine stops that wait, or it is due later, it is parked
as `held` (never written to the RQ again).

`GroupRun` is one group's run through a micro-batch. It implements the delivery engine's Stream
protocol: the engine asks it for the next request and reports each outcome; the run decides,
with `varadhi.core.retry.decide`, whether to go on, retry later or dead-letter. Ungrouped messages get
a run of their own each (no order, full parallelism).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from varadhi.core import messages as m
from varadhi.core import request_shaping
from varadhi.core.delivery import Outcome, Request, Wait
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import BlockedPolicy, RequestShaping, RetryPolicy
from varadhi.core.retry import decide, retries_in_place, waits_in_task
from varadhi.core.trace import Next, Tracer

Location = Literal["new", "held", "rq", "dlq"]

# The reason of a message dead-lettered because its group, blocked behind a dead letter, holds
# as many messages as its `BlockedPolicy` lets it (`over_limit`).
OVER_LIMIT = "blocked group over limit"
DEFAULT_BLOCKED = BlockedPolicy()


@dataclass(slots=True)
class Entry:
    origin: m.Origin
    msg_id: str
    group_id: str | None
    location: Location
    value: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    attempts: int = 0
    due_ms: int = 0
    first_failure_ms: int | None = None
    last_failure_ms: int | None = None
    reason: str | None = None
    status: int | None = None
    source: str = ""  # "topic/partition/offset" where this copy was read, for the HTTP header
    invalid: str | None = None  # why a malformed record cannot be delivered (dead-lettered at once)


@dataclass(frozen=True)
class Out:
    """A record the shard must write to its RQ or DLQ after this micro-batch."""

    target: Literal["rq", "dlq"]
    entry: Entry


@dataclass
class RunCounts:
    delivered: int = 0
    retried: int = 0  # failed attempts written to the RQ
    retried_in_place: int = 0  # attempts sent again from the task (`retries_in_place`)
    # Retries read back from the RQ before their due time that waited for it in the task
    # (`waits_in_task`) instead of being parked.
    waited_due: int = 0
    dead_lettered: int = 0
    over_limit: int = 0  # of `dead_lettered`: behind a blocked group's limit (`over_limit`)
    duplicates: int = 0
    attempts: int = 0
    failures: int = 0
    # Delivered without a request: accepted by the endpoint in a crashed run of this same
    # micro-batch (`varadhi.spark.journal`); also counted in `delivered`.
    skipped_replayed: int = 0


class Journal(Protocol):
    """Where a run reports each message its endpoint accepted (`varadhi.spark.journal.JournalWriter`;
    while that is behind, the task's engine sends nothing new: `HttpDeliverer.run`'s `hold`)."""

    def accepted(self, origin: m.Origin) -> None: ...


def merge(pending: Iterable[Entry], candidates: Iterable[Entry], counts: RunCounts) -> list[Entry]:
    """One group's queue for this batch: its pending entries plus what the batch read.

    - a main-topic record whose origin is already pending is a replay: dropped;
    - an RQ record is accepted only when an `rq` entry with the same origin and attempt count
      waits for it (it then lends that entry its body); anything else is a stale duplicate;
    - a `held` row from the state table lends its body to the matching `held` entry.
    The result is sorted by origin (produce order).
    """
    by_origin: dict[m.Origin, Entry] = {e.origin: replace(e) for e in pending}
    for c in candidates:
        known = by_origin.get(c.origin)
        if c.location == "new":
            if known is not None:
                counts.duplicates += 1
                continue
            by_origin[c.origin] = c
        elif c.location == "rq":
            if known is None or known.location != "rq" or known.attempts != c.attempts:
                counts.duplicates += 1
                continue
            known.value, known.location, known.source = c.value, "held", c.source
            known.headers = c.headers or known.headers
        elif (
            c.location == "held"
            and known is not None
            and known.location == "held"
            and known.value is None
        ):
            known.value = c.value
            known.headers = c.headers or known.headers
    return sorted(by_origin.values(), key=lambda e: e.origin)


def over_limit(
    entries: list[Entry], policy: BlockedPolicy, now_ms: int
) -> tuple[list[Entry], list[Entry]]:
    """Bound a group blocked behind a dead letter (pure). `entries`: the group's queue in origin
    order, its head a `dlq` entry. Returns (kept, dead_lettered):

    - behind the head, messages with their bodies (`held`, `new`) are kept in order while at
      most `policy.max_held` of them, totalling at most `policy.max_held_bytes`, are;
    - the first one over either limit is dead-lettered and also kept, without its body, as a
      `dlq` entry: the *overflow mark*. The group stays blocked behind it even if its head is
      re-driven alone, so a message over the limit is never overtaken by a later one;
    - every message behind a mark (made now or in an earlier batch, or the head itself once the
      messages before it were re-driven and delivered) is dead-lettered and not kept: once a
      group overflowed, its later messages go to the DLQ until the group is re-driven. None is
      kept after a gap: order has no holes.

    Dead-lettered entries carry their bodies, reason `OVER_LIMIT` (a malformed record's own
    reason first) and failure times `now_ms`; their attempts are unchanged (0: never sent).
    Applied again to its own result it dead-letters nothing (idempotent)."""
    kept, spilled = entries[:1], []
    count = size = 0
    behind_mark = is_mark(entries[0])
    for e in entries[1:]:
        if e.location == "dlq":  # a mark from an earlier batch
            behind_mark = True
            kept.append(e)
            continue
        count += 1
        size += len(e.value or b"")
        if not behind_mark and count <= policy.max_held and size <= policy.max_held_bytes:
            kept.append(e)
            continue
        reason = f"{e.invalid}; {OVER_LIMIT}" if e.invalid else OVER_LIMIT
        out = replace(
            e, location="dlq", reason=reason, first_failure_ms=now_ms, last_failure_ms=now_ms
        )
        spilled.append(out)
        if not behind_mark:
            kept.append(replace(out, value=None, invalid=None))
            behind_mark = True
    return kept, spilled


def is_mark(entry: Entry) -> bool:
    """Whether `entry` is a blocked group's overflow mark (`over_limit`), not a dead letter of
    its own failure (pure)."""
    return entry.location == "dlq" and (entry.reason or "").endswith(OVER_LIMIT)


def in_place_retry(entry: Entry) -> bool:
    """Whether `entry` is a head handed over in the middle of its retry in place (pure): read
    from the main topic in this batch (`new`) and attempted already. Nothing else has that
    shape: a pending entry is never `new` (`GroupRun.remaining` makes it `held`) and a record
    read in this batch has no attempts yet."""
    return entry.location == "new" and entry.attempts > 0


class GroupRun:
    """Delivers one group's queue in order, following the failure (see the module docstring).

    `on_dead_letter="skip"` lets a dead-lettered head leave the queue, so the group carries on.
    `clock` returns ms since the epoch; `rng` drives backoff jitter (both injectable for tests).
    `max_out_bytes` is the largest record the RQ accepts: a retry whose record would not fit
    (`out_bytes`) is dead-lettered instead (the DLQ takes a truncated copy; see
    `varadhi.spark.shard.job.fit_record`), so a record at the main topic's size limit never fails after
    the state commit.

    `replayed` (a replayed micro-batch only): origins the endpoint accepted in a crashed run of
    this same batch (`varadhi.spark.journal`). A head found there is taken as delivered without a
    request (`skipped_replayed`); only the head is ever considered, so a later message is
    skipped only if it is journaled too, and the group keeps its order. `journal` is told the
    origin of every message the endpoint accepts.

    `blocked` bounds what a group left blocked behind a dead letter keeps (`over_limit`, in
    `remaining`).

    `tracer` (the subscription's delivery trace, `varadhi.core.trace`) is told every attempt and
    where its message went next, and every message routed without one (malformed, over the
    blocked limit, too large for the RQ, moved to the RQ after waiting in place, accepted by a
    crashed run).

    `hand_over`: when the engine stops a retry's wait in place, the run stops as it is
    (`handed_over`; its `entries` go to the batch's second job) instead of writing the retry to
    the RQ. A queue whose head is such a handed-over retry (`in_place_retry`) starts waiting in
    place again.
    """

    def __init__(
        self,
        entries: list[Entry],
        policy: RetryPolicy,
        on_dead_letter: Literal["block", "skip"],
        clock: Callable[[], int],
        rng: random.Random,
        counts: RunCounts,
        max_out_bytes: int | None = None,
        replayed: Container[m.Origin] | None = None,
        journal: Journal | None = None,
        blocked: BlockedPolicy = DEFAULT_BLOCKED,
        hand_over: bool = False,
        shaping: RequestShaping | None = None,
        tracer: Tracer | None = None,
    ):
        self.entries = entries
        self.tracer = tracer
        self.shaping = shaping
        self.hand_over = hand_over
        self.handed_over = False
        self.blocked = blocked
        self.replayed = replayed
        self.journal = journal
        self.max_out_bytes = max_out_bytes
        self.policy = policy
        self.on_dead_letter = on_dead_letter
        self.clock = clock
        self.rng = rng
        self.counts = counts
        self.outs: list[Out] = []
        self.delivered: list[Entry] = []
        self._stopped = False
        # The head waits in this task for its retry (also one handed over by phase 1).
        self._in_place = bool(entries) and in_place_retry(entries[0])
        self._early = False  # the head, read back from the RQ before its due time, waits for it

    # -- Stream protocol ------------------------------------------------------------------
    def next_request(self) -> Request | Wait | None:
        while not self._stopped and self.entries:
            head = self.entries[0]
            if head.invalid and head.location in ("new", "held"):
                now = self.clock()
                head.first_failure_ms = head.first_failure_ms or now
                head.last_failure_ms = now
                head.reason = head.invalid
                self._dead_letter(head)
                self._routed(head, "dlq", head.invalid)
                continue
            if head.location == "dlq" or head.value is None:
                return None
            if self.replayed is not None and head.origin in self.replayed:
                self.entries.pop(0)  # accepted before the crash: delivered, not sent again
                self.delivered.append(head)
                self.counts.delivered += 1
                self.counts.skipped_replayed += 1
                self._routed(head, "delivered", "accepted by a crashed run of this micro-batch")
                continue
            wait_ms = head.due_ms - self.clock()
            if wait_ms > 0:  # a retry in place waits here; so does one read back from the RQ
                if self._in_place:  # a little early, while its wait fits the window
                    return Wait(wait_ms / 1000, while_busy=True)
                if not waits_in_task(self.policy, wait_ms):
                    return None  # parked (hazard 2)
                self._early = True
                return Wait(wait_ms / 1000, while_busy=True)
            try:
                request = request_of(head, self.shaping)
            except InvalidArgument as e:  # e.g. a group or message id with CR/LF in it
                head.invalid = f"malformed: {e}"
                continue
            if self._in_place:
                self.counts.retried_in_place += 1
            if self._early:
                self.counts.waited_due += 1
                self._early = False
            return request
        return None

    def on_outcome(self, outcome: Outcome) -> None:
        head = self.entries[0]
        now = self.clock()
        head.attempts += 1
        self.counts.attempts += 1
        self._in_place = False
        decision = decide(
            self.policy,
            head.attempts,
            outcome.status,
            outcome.error,
            outcome.retry_after,
            now,
            self.rng,
            outcome.detail,
        )
        if decision.action == "success":
            self.entries.pop(0)
            self.delivered.append(head)
            self.counts.delivered += 1
            if self.journal is not None:
                self.journal.accepted(head.origin)
            self._attempted(head, outcome, "delivered")
            return
        self.counts.failures += 1
        head.first_failure_ms = head.first_failure_ms or now
        head.last_failure_ms = now
        head.reason = decision.reason
        head.status = outcome.status
        head.headers = with_response(head.headers, outcome.body)
        if decision.action == "retry":
            head.due_ms = decision.due_ms or now
            if retries_in_place(self.policy, head.first_failure_ms, head.due_ms):
                self._in_place = True
                self._attempted(head, outcome, "retry")
            else:
                self._attempted(head, outcome, self._retry_through_rq(head))
            return
        self._dead_letter(head)
        self._attempted(head, outcome, "dlq")

    def stop_waiting(self) -> None:
        """The head's wait in place would outlast the task's other deliveries by more than the
        engine lingers: send its retry through the RQ instead, due when it was going to be
        sent (with `hand_over`: stop as it is, for the second job to go on). A head read back
        from the RQ before its due time is parked instead, as one due later than the window is
        (hazard 2: an RQ record is never written again)."""
        if self._early:
            self._early = False
            self._stopped = True
            return
        self._in_place = False
        if self.hand_over:  # the second job goes on waiting (`hand_over`)
            self.handed_over = self._stopped = True
            return
        head = self.entries[0]
        self._routed(head, self._retry_through_rq(head), "waited in place longer than the task")

    def _retry_through_rq(self, head: Entry) -> Next:
        """Write the head to the RQ (its due time, attempts and failure times set); its group
        stops behind it. One too large for the RQ is dead-lettered instead. Returns where it
        went."""
        if self.max_out_bytes is not None and out_bytes(head) > self.max_out_bytes:
            head.reason = (
                f"{head.reason}; not retried: a record of about {out_bytes(head)} bytes exceeds "
                f"the retry queue's {self.max_out_bytes}"
            )
            self._dead_letter(head)
            return "dlq"
        self.outs.append(Out("rq", replace(head)))
        head.location, head.value = "rq", None
        self.counts.retried += 1
        self._stopped = True
        return "rq"

    def _attempted(self, head: Entry, outcome: Outcome, next_step: Next) -> None:
        if self.tracer is not None:
            trace_attempt(self.tracer, head, outcome, next_step)

    def _routed(self, entry: Entry, next_step: Next, reason: str | None) -> None:
        if self.tracer is not None:
            self.tracer.routed(
                entry.msg_id,
                entry.group_id,
                next_step,
                reason,
                redriven=entry.headers.get(m.H_REDRIVEN),
                source=entry.source or None,
            )

    def _dead_letter(self, head: Entry) -> None:
        """Park the head in the DLQ; in block mode its group stops behind it."""
        self.outs.append(Out("dlq", replace(head)))
        self.counts.dead_lettered += 1
        if self.on_dead_letter == "skip":
            self.entries.pop(0)
        else:
            head.location, head.value = "dlq", None
            self._stopped = True

    # -- result ---------------------------------------------------------------------------
    def remaining(self) -> list[Entry]:
        """Entries still pending after the run: bodies at hand become `held`. A group left
        blocked behind a dead letter is bounded first (`over_limit`): the messages over its
        limit join `outs` as dead letters (read `outs` after this; calling it again adds
        nothing)."""
        if self.entries and self.entries[0].location == "dlq":
            self.entries, spilled = over_limit(self.entries, self.blocked, self.clock())
            self.outs.extend(Out("dlq", e) for e in spilled)
            for e in spilled:
                self._routed(e, "dlq", e.reason)
            self.counts.dead_lettered += len(spilled)
            self.counts.over_limit += len(spilled)
        out = []
        for e in self.entries:
            if e.location == "new":
                e = replace(e, location="held")
            out.append(e)
        return out


# Room for the headers a shard adds to an RQ/DLQ record (origin, attempts, due and failure
# times, reason, status) and Kafka's per-record framing.
OUT_HEADERS_RESERVE_BYTES = 2048


def trace_attempt(tracer: Tracer, entry: Entry, outcome: Outcome, next_step: Next) -> None:
    """Tell `tracer` of `entry`'s attempt (its count already includes it), how it ended, and
    where the message goes next (`varadhi.core.trace`)."""
    tracer.attempt(
        entry.msg_id,
        entry.group_id,
        entry.attempts,
        outcome.status,
        outcome.error,
        outcome.elapsed_ms,
        outcome.body,
        next_step,
        detail=outcome.detail if outcome.status is None else None,
        redriven=entry.headers.get(m.H_REDRIVEN),
        source=entry.source or None,
    )


def out_bytes(entry: Entry) -> int:
    """An upper bound of the size of `entry`'s RQ/DLQ record: body, key, the headers it
    carries and `OUT_HEADERS_RESERVE_BYTES` (pure)."""
    headers = sum(len(k.encode()) + len(v.encode()) for k, v in entry.headers.items())
    key = len(entry.group_id.encode()) if entry.group_id else 0
    reason = len(entry.reason.encode()) if entry.reason else 0
    return len(entry.value or b"") + key + headers + reason + OUT_HEADERS_RESERVE_BYTES


def with_response(headers: dict[str, str], body: bytes) -> dict[str, str]:
    """`headers` (a new dict) with the response snippet of the last failed attempt, or without
    one when that attempt's answer had no body."""
    out = {k: v for k, v in headers.items() if k != m.H_RESPONSE}
    if body:
        out[m.H_RESPONSE] = body.decode("utf-8", "replace")
    return out


def request_of(entry: Entry, shaping: RequestShaping | None = None) -> Request:
    """The request of one delivery of `entry`: its value, `http_headers`, and the path the
    endpoint's `shaping` gives. Raises InvalidArgument for a message that cannot be sent (an id
    or header with CR/LF, a path that cannot be built): dead-letter it as malformed."""
    path = None
    if shaping is not None and shaping.path is not None:
        path = request_shaping.render_path(shaping.path, entry.headers)
    return Request(body=entry.value or b"", headers=http_headers(entry, shaping), path=path)


def http_headers(entry: Entry, shaping: RequestShaping | None = None) -> dict[str, str]:
    """The headers of a delivery: idempotency key, group, attempt number, source position, the
    re-drive that put the message back (`messages.H_REDRIVEN`), and the headers `shaping` adds
    (forwarded Kafka headers, the record key)."""
    headers = {
        m.HTTP_MESSAGE_ID: entry.msg_id,
        m.HTTP_IDEMPOTENCY_KEY: entry.msg_id,
        m.HTTP_ATTEMPT: str(entry.attempts + 1),
        m.HTTP_SOURCE: entry.source,
    }
    if entry.group_id is not None:
        headers[m.HTTP_GROUP_ID] = entry.group_id
    produced = entry.headers.get(m.H_PRODUCED_MS)
    if produced and produced.isascii() and produced.isdigit():  # another producer's may be junk
        headers[m.HTTP_PRODUCED_AT] = produced
    redriven = entry.headers.get(m.H_REDRIVEN)
    if redriven:  # only a shard writes it (`messages.control_free`)
        headers[m.HTTP_REDRIVEN] = redriven
    if shaping is not None and (shaping.forward_headers or shaping.key_header is not None):
        headers.update(request_shaping.shaped_headers(shaping, entry.headers))
    return headers
