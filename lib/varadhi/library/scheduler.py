"""Which message may be delivered next: one key in order, different keys concurrently (pure,
no I/O, not thread-safe: the runtime holds a lock around it).

Every message read and not finished is a `Work` in its key's queue, ordered by origin (its
position on the main topic, the produce order). Only a queue's head is ever handed out
(`take`), and only one at a time per key, so a key's messages reach the endpoint strictly in
order while any number of keys, of one partition or many, are delivered at once. A queue is
per slot and key (`assign`): the member holding the slot holds every copy of the key.

A head that failed and went to the retry queue stays at the head as a *placeholder* (no body,
location `rq`, its attempt count) until its copy is read back from the RQ, so the key's later
messages wait behind it (DESIGN hazard 1). The copy joins the key its message left, found by
its origin (its record key is the group id, which need not be the ordering key). A copy read back before its due time waits in the
queue until then, never written again (hazard 2). Two copies of one origin (a main-topic record
read again after a restart, an RQ copy of an earlier attempt) are one message: the copy with
more attempts stays and the other is finished unsent (`add` returns it). A copy of an older
origin than a head in flight or waiting for its RQ copy (a re-driven dead letter, in skip mode)
queues right behind that head: a head is never displaced.

A key blocked behind a dead letter (`on_dead_letter: block`, `varadhi.library.blocking`) has a
*block*: a placeholder with location `dlq` at the dead letter's origin (`to_dlq`, `park`). It
holds up its key as an RQ placeholder does, but only a copy from the RQ (a re-drive's, or a retry
of one) replaces it: a main-topic record of its origin is a duplicate (`live`). The runtime asks
`blocked_before` whether a main-topic message it reads lies behind a block (it is then sidelined
to the DLQ, never queued), and takes back what was held behind a new block (`to_dlq`,
`spill_blocked`). `await_copy` places an RQ placeholder where a re-drive puts a message back, so
the key waits for every re-driven copy in origin order.

Unordered messages (no key) get a queue of their own each.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, replace

from varadhi.core import messages as m
from varadhi.core.group_state import Entry

QueueKey = tuple[int, str]


@dataclass(slots=True, eq=False)
class Work:
    """One copy of a message: its entry, where it was read (`topic`, `partition`, `offset`),
    the slot it belongs to and its ordering key (None: unordered)."""

    entry: Entry
    topic: str
    partition: int
    offset: int
    slot: int
    key: str | None
    dedup_id: str | None = None  # with a dedup window, its id (`varadhi.library.dedup`)

    @property
    def group_key(self) -> str:
        """The key of its queue, and of its RQ/DLQ partition (`~<message id>` when
        unordered, as the shards key an ungrouped message)."""
        return self.key if self.key is not None else f"~{self.entry.msg_id}"

    @property
    def queue(self) -> QueueKey:
        return (self.slot, self.group_key)


def _placeholder(work: Work) -> bool:
    return work.entry.location in ("rq", "dlq")


def _block(work: Work) -> bool:
    return work.entry.location == "dlq"


def live(work: Work) -> bool:
    """Whether `work` is a main-topic copy (never attempted, not re-driven), not an RQ one."""
    return work.entry.attempts == 0 and m.H_REDRIVEN not in work.entry.headers


class Scheduler:
    """The queues of one process (see the module docstring). Times are ms since the epoch."""

    def __init__(self) -> None:
        self._queues: dict[QueueKey, list[Work]] = {}
        self._ready: deque[QueueKey] = deque()
        self._timed: list[tuple[int, int, QueueKey]] = []
        self._seq = itertools.count()
        self._busy: set[QueueKey] = set()
        self._closed: set[int] = set()
        self.in_flight: dict[int, int] = {}  # slot -> heads handed out
        # (slot, origin) of a placeholder -> its ordering key: an RQ copy joins the key its
        # message left, even when the copy's own key reads differently (`add`)
        self._awaited: dict[tuple[int, object], str | None] = {}
        self.pending = 0  # messages held (placeholders not counted)

    def add(self, work: Work) -> list[Work]:
        """Queue a copy; returns the copies that are finished unsent because another copy of
        the same origin stays (see the module docstring)."""
        origin = work.entry.origin
        awaited = (work.slot, origin)
        if not live(work) and awaited in self._awaited:
            work.key = self._awaited.pop(awaited)
        q = self._queues.setdefault(work.queue, [])
        # A head in flight or waiting for its RQ copy stays first, even when a copy of an older
        # origin arrives (a re-drive's): that copy goes right behind it.
        fixed = bool(q) and (work.queue in self._busy or _placeholder(q[0]))
        if fixed and q[0].entry.origin == origin:
            i = 0
        else:
            i = bisect.bisect_left(q, origin, lo=1 if fixed else 0, key=lambda w: w.entry.origin)
        if i < len(q) and q[i].entry.origin == origin:
            known = q[i]
            if _block(known) and live(work):  # only an RQ copy (a re-drive's) lifts a block
                return [work]
            keep_new = (
                not (i == 0 and work.queue in self._busy)
                and work.entry.attempts >= known.entry.attempts
                and (_placeholder(known) or work.entry.attempts > known.entry.attempts)
            )
            if not keep_new:
                return [work]
            q[i] = work
            if _placeholder(known):
                self.pending += 1
                if i == 0:
                    self._schedule(work.queue)
                return []
            return [known]
        q.insert(i, work)
        self.pending += 1
        if i == 0 and work.queue not in self._busy:
            self._schedule(work.queue)
        return []

    def take(self, now_ms: int) -> Work | None:
        """A head to deliver now, marked in flight until `done`, `to_rq` or `release`."""
        while self._timed and self._timed[0][0] <= now_ms:
            self._ready.append(heapq.heappop(self._timed)[2])
        while self._ready:
            k = self._ready.popleft()
            q = self._queues.get(k)
            if not q or k in self._busy or k[0] in self._closed or _placeholder(q[0]):
                continue
            head = q[0]
            if head.entry.due_ms > now_ms:
                heapq.heappush(self._timed, (head.entry.due_ms, next(self._seq), k))
                continue
            self._busy.add(k)
            self.in_flight[k[0]] = self.in_flight.get(k[0], 0) + 1
            return head
        return None

    def next_due_ms(self) -> int | None:
        """When the earliest head waiting for its due time falls due (None: none waits)."""
        return self._timed[0][0] if self._timed else None

    def done(self, work: Work) -> None:
        """`work` (a head handed out) finished: delivered, or dead-lettered and skipped."""
        q = self._end(work)
        if q is not None:
            q.pop(0)
            self.pending -= 1
            self._next(work.queue, q)

    def to_rq(self, work: Work) -> None:
        """`work` (a head handed out) went to the RQ with its attempts: its key waits for the
        copy to come back."""
        q = self._end(work)
        if q is not None:
            q[0] = replace(work, entry=replace(work.entry, location="rq", value=None))
            self._awaited[(work.slot, work.entry.origin)] = work.key
            self.pending -= 1

    def retry_in_place(self, work: Work) -> None:
        """`work` (a head handed out) failed and waits here for its retry, due at its entry's
        `due_ms`: it stays its key's head, with its body, and is handed out again once due
        (`take`), never before."""
        q = self._end(work)
        if q is not None:
            self._schedule(work.queue)

    def to_dlq(self, work: Work) -> list[Work] | None:
        """`work` (a head handed out, with a key) was dead-lettered in block mode: it stays as
        its key's block. Returns the main-topic messages held behind it, taken out of the
        queue in order: the caller sidelines them (`live`; RQ copies and placeholders stay).
        None: `work` is no longer its key's head (its slot was dropped meanwhile)."""
        q = self._end(work)
        if q is None:
            return None
        q[0] = replace(work, entry=replace(work.entry, location="dlq", value=None))
        self._awaited[(work.slot, work.entry.origin)] = work.key
        self.pending -= 1
        return self._spill(work.queue, q)

    def park(self, work: Work) -> None:
        """Place a block (a bodiless `work`, location `dlq`) read from the GroupState topic at
        its origin; nothing if its key holds that origin already."""
        q = self._queues.setdefault(work.queue, [])
        i = bisect.bisect_left(q, work.entry.origin, key=lambda w: w.entry.origin)
        if i < len(q) and q[i].entry.origin == work.entry.origin:
            return
        q.insert(i, work)
        self._awaited[(work.slot, work.entry.origin)] = work.key

    def await_copy(self, work: Work) -> None:
        """A re-drive puts `work`'s message (bodiless, location `rq`) back through the RQ: its
        key waits at its origin for the copy. A block there becomes that wait; a message held
        there already stays."""
        q = self._queues.setdefault(work.queue, [])
        i = bisect.bisect_left(q, work.entry.origin, key=lambda w: w.entry.origin)
        if i < len(q) and q[i].entry.origin == work.entry.origin:
            if _block(q[i]):
                q[i] = work
            return
        if i == 0 and q and work.queue in self._busy:
            i = 1  # a head in flight stays first
        q.insert(i, work)
        self._awaited[(work.slot, work.entry.origin)] = work.key

    def blocked_before(self, queue: QueueKey, origin: m.Origin) -> bool:
        """Whether a block of `queue` lies before `origin`."""
        for w in self._queues.get(queue, ()):
            if w.entry.origin >= origin:
                return False
            if _block(w):
                return True
        return False

    def spill_blocked(self, slot: int) -> list[Work]:
        """The main-topic messages of `slot` held behind a block, taken out of their queues in
        order (after a re-drive held them: the caller sidelines them)."""
        out: list[Work] = []
        for k, q in list(self._queues.items()):
            if k[0] == slot:
                out.extend(self._spill(k, q))
        return out

    def _spill(self, k: QueueKey, q: list[Work]) -> list[Work]:
        first = next((i for i, w in enumerate(q) if _block(w)), None)
        if first is None:
            return []
        out = [w for w in q[first + 1 :] if live(w) and not _placeholder(w)]
        if out:
            q[first + 1 :] = [w for w in q[first + 1 :] if not live(w) or _placeholder(w)]
            self.pending -= len(out)
        return out

    def release(self, work: Work) -> None:
        """`work` (a head handed out) was not delivered (the runtime stops): it stays first."""
        q = self._end(work)
        if q is not None:
            self._schedule(work.queue)

    def close(self, slots: set[int]) -> None:
        """Hand out nothing more of `slots` (revoked); `drop` them once none is in flight."""
        self._closed |= slots

    def reopen(self, slots: set[int]) -> None:
        """Hand out `slots` again (given back by the rebalance that revoked them)."""
        self._closed -= slots
        self._ready.extend(k for k in self._queues if k[0] in slots)

    def is_closed(self, slot: int) -> bool:
        """Whether `slot` hands out nothing now (revoked, or reading its RQ first)."""
        return slot in self._closed

    def busy(self, slots: set[int]) -> int:
        return sum(self.in_flight.get(s, 0) for s in slots)

    def drop(self, slots: set[int]) -> None:
        """Forget every queue of `slots` (their records are read again by their next owner)."""
        for k in [k for k in self._queues if k[0] in slots]:
            self.pending -= sum(1 for w in self._queues.pop(k) if not _placeholder(w))
            self._busy.discard(k)
        for s in slots:
            self.in_flight.pop(s, None)
        self._awaited = {k: v for k, v in self._awaited.items() if k[0] not in slots}
        self._closed -= slots

    def _end(self, work: Work) -> list[Work] | None:
        """Mark `work`'s key no longer in flight; its queue, if `work` is still its head."""
        k = work.queue
        if k not in self._busy:
            return None
        self._busy.discard(k)
        self.in_flight[k[0]] -= 1
        q = self._queues.get(k)
        return q if q and q[0] is work else None

    def _next(self, k: QueueKey, q: list[Work]) -> None:
        if q:
            self._schedule(k)
        else:
            del self._queues[k]

    def _schedule(self, k: QueueKey) -> None:
        self._ready.append(k)
