"""`on_dead_letter: block` in a library member: keys blocked behind a dead letter, held in the
scheduler (as blocks, `scheduler.Scheduler.to_dlq`/`park`) and in the GroupState topic
(`group_state_topic`), so that no member delivers a blocked key's later messages, across
restarts and rebalances, until `varadhi dlq unsideline` re-drives the dead letter.

What happens (the shards' semantics with `blocked.max_held: 0`, `blocked_keys`):

- a key's head is dead-lettered (`dead_letter`): the key is blocked there; its DLQ record and the
  key's new GroupState record are written, and its offset finishes once the broker acknowledged
  both (the runtime's `_send`); main-topic messages held behind it are sidelined;
- a main-topic message read behind a block (`admit`) is sidelined: dead-lettered, reason
  `blocked group over limit`, in order behind the dead letter; the first becomes the key's mark;
- a re-drive puts the messages back through the RQ: while it reads the DLQ and writes the copies
  (`frozen`, `awaiting`) the slot's blocked keys hold their new messages instead of sidelining
  them (so none lands in the DLQ behind the re-drive's end offsets), each re-driven origin
  becomes a wait for its copy (the key's later messages queue behind it), and what still lies
  behind a block afterwards is sidelined (`thaw`);
- the copy of a blocked origin is delivered (`delivered`): the key's record is rewritten
  without it (a tombstone once nothing blocks it) before the copy's offset finishes, so a
  restart never finds a lifted block, nor loses one.

Every write of a key's record goes out in the order its blocks changed (under the runtime's lock,
one producer, one partition per key and slot). A new slot's records are read (`load`) before
anything of the slot is handed out. Unordered messages (no key) never block: a dead letter of
one is parked alone, as in skip mode.

Not thread-safe: every method is called under the runtime's lock, except `frozen`, which takes
it itself (and flushes the producer outside it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

from varadhi.core import messages as m
from varadhi.core.group_state import Entry
from varadhi.library import blocked_keys
from varadhi.library.blocked_keys import Blocks
from varadhi.library.group_state_topic import partition_of
from varadhi.library.scheduler import QueueKey, Scheduler, Work, live

#: Runtime callbacks: write a dead letter's DLQ record (its offset finishes once the broker
#: acknowledged it and the futures given); sideline a later message the same way.
Send = Callable[[Work, list], None]


class Blocking:
    """The blocked keys of one member (module docstring): `topic` the GroupState topic, of
    `partitions` partitions, of a subscription of `slots` slots; `dead_letter` and `sideline`
    the runtime's writes."""

    def __init__(
        self,
        sched: Scheduler,
        producer,
        topic: str,
        partitions: int,
        slots: int,
        dead_letter: Send,
        sideline: Send,
    ):
        self._sched = sched
        self._producer = producer
        self._topic = topic
        self._partitions = partitions
        self._slots = slots
        self._send_dead_letter = dead_letter
        self._sideline = sideline
        self._keys: dict[QueueKey, Blocks] = {}
        self._stale: dict[QueueKey, set[int]] = {}  # partitions holding an older layout's record
        self._redriving: dict[QueueKey, set[m.Origin]] = {}  # origins whose copy is awaited
        self._frozen: set[int] = set()

    def count(self) -> int:
        """Keys blocked now."""
        return len(self._keys)

    def load(self, slot: int, found: Mapping[int, Mapping[str, Blocks]]) -> None:
        """Install the blocks of a new `slot` from its GroupState partitions' records."""
        for partition, keys in found.items():
            for key, blocks in keys.items():
                qk = (slot, key)
                merged = tuple(sorted(set(self._keys.get(qk, ())) | set(blocks)))
                self._keys[qk] = merged
                if partition != partition_of(key, slot, self._slots, self._partitions):
                    self._stale.setdefault(qk, set()).add(partition)
                for b in blocks:
                    self._park(qk, b)

    def drop(self, slots: set[int]) -> None:
        """Forget `slots` (gone in a rebalance): their next owner reads their records."""
        for d in (self._keys, self._stale, self._redriving):
            for qk in [qk for qk in d if qk[0] in slots]:
                del d[qk]
        self._frozen -= slots

    def admit(self, work: Work) -> bool:
        """Whether `work`, just read, may be queued; False: it lay behind a block and was
        sidelined (with the key's new mark, if it is one)."""
        qk = work.queue
        if (
            work.key is None
            or work.slot in self._frozen
            or self._sched.is_closed(work.slot)  # sidelined once it opens (`reopened`), if kept
            or not live(work)
            or not self._sched.blocked_before(qk, work.entry.origin)
        ):
            return True
        self._sideline_one(work)
        return False

    def dead_letter(self, work: Work) -> bool:
        """`work` (a head handed out) was dead-lettered: write its DLQ record, block its key
        there, and sideline what was held behind it. False: not recorded, because its slot
        was revoked meanwhile (its next holder, maybe this member, delivers it again)."""
        if self._sched.is_closed(work.slot):
            self._sched.release(work)
            return False
        if work.key is None:  # unordered: parked alone
            self._sched.done(work)
            self._send_dead_letter(work, [])
            return True
        spilled = self._sched.to_dlq(work)
        if spilled is None:  # not its key's head any more (its slot was dropped)
            return False
        qk, e = work.queue, work.entry
        self._redriving.get(qk, set()).discard(e.origin)
        self._send_dead_letter(
            work,
            self._write(qk, blocked_keys.dead_lettered(self._keys.get(qk, ()), e.origin, e.msg_id)),
        )
        for w in spilled:
            self._sideline_one(w)
        return True

    def reopened(self, slots: set[int]) -> None:
        """`slots` hand out again (read their RQ to the end, or given back by a rebalance):
        sideline what they read behind a block while closed."""
        for slot in slots - self._frozen:
            for w in self._sched.spill_blocked(slot):
                self._sideline_one(w)

    def delivered(self, work: Work) -> list:
        """`work` was delivered: the futures of its key's record, rewritten when `work` lifted
        one of its blocks (its offset finishes once they are acknowledged)."""
        qk, origin = work.queue, work.entry.origin
        waiting = self._redriving.get(qk)
        if waiting is not None:
            waiting.discard(origin)
            if not waiting:
                del self._redriving[qk]
        blocks = self._keys.get(qk, ())
        if not any(b.origin == origin for b in blocks):
            return []
        return self._write(qk, blocked_keys.delivered(blocks, origin))

    @contextlib.contextmanager
    def frozen(self, lock, slot: int) -> Iterator[None]:
        """While a re-drive of `slot` reads its DLQ and writes the copies: the slot's blocked
        keys hold what they read (nothing is sidelined behind the re-drive's end offsets); the
        sidelining under way is acknowledged first. Afterwards, what still lies behind a block
        is sidelined."""
        with lock:
            self._frozen.add(slot)
        try:
            self._producer.flush()
            yield
        finally:
            with lock:
                self._frozen.discard(slot)
                if not self._sched.is_closed(slot):  # else when it opens (`reopened`)
                    self.reopened({slot})

    def awaiting(self, slot: int, copies: list[Work], barriers: list[Work]) -> None:
        """A re-drive of `slot` is about to write `copies` (bodiless Works at their origins and
        keys) to the RQ: each key waits for them in origin order, a block among them lifted once
        its copy is delivered. `barriers`: for a rate-capped re-drive, the first message of
        each key that a later portion puts back: the key is blocked there until then."""
        for w in copies:
            self._sched.await_copy(w)
            if w.key is not None:
                self._redriving.setdefault(w.queue, set()).add(w.entry.origin)
        for w in barriers:
            if w.key is None:
                continue
            qk, e = w.queue, w.entry
            self._sched.park(w)
            self._write(qk, blocked_keys.held_back(self._keys.get(qk, ()), e.origin, e.msg_id))

    def _sideline_one(self, work: Work) -> None:
        qk, e = work.queue, work.entry
        blocks = self._keys.get(qk, ())
        after = blocked_keys.sidelined(blocks, e.origin, e.msg_id, self._redriving.get(qk, ()))
        if after == blocks:
            self._sideline(work, [])
            return
        for b in set(after) - set(blocks):  # the key's new mark: it waits there too
            self._park(qk, b)
        self._sideline(work, self._write(qk, after))

    def _park(self, qk: QueueKey, block: blocked_keys.Block) -> None:
        entry = Entry(block.origin, block.msg_id, None, "dlq")
        self._sched.park(Work(entry, "", -1, -1, qk[0], qk[1]))

    def _write(self, qk: QueueKey, blocks: Blocks) -> list:
        """Record `qk`'s new blocks (in memory and on the GroupState topic, tombstoning a record
        of an older layout); the futures of the writes."""
        slot, key = qk
        if blocks:
            self._keys[qk] = blocks
        else:
            self._keys.pop(qk, None)
            self._redriving.pop(qk, None)
        raw = blocked_keys.key_bytes(key)
        home = partition_of(key, slot, self._slots, self._partitions)
        futures = [
            self._producer.send(
                self._topic, key=raw, value=blocked_keys.encode(blocks), partition=home
            )
        ]
        for p in self._stale.pop(qk, ()):
            futures.append(self._producer.send(self._topic, key=raw, value=None, partition=p))
        return futures


class RedriveHold:
    """What a re-drive (`redrive.Redriver`) tells a member in block mode (`redrive.Hold`):
    `frozen` around applying re-drives to a slot, `awaiting` before writing copies. `key_of`
    gives a record's ordering key as the member reads it (its key, headers, value), so that a
    copy's wait sits in the queue of the key its copy will join."""

    def __init__(self, blocking: Blocking, lock, rq_topic: str, key_of: Callable):
        self._blocking = blocking
        self._lock = lock
        self._rq_topic = rq_topic
        self._key_of = key_of

    def frozen(self, slot: int) -> contextlib.AbstractContextManager[None]:
        return self._blocking.frozen(self._lock, slot)

    def awaiting(self, slot: int, copies: list, barriers: list) -> None:
        """`copies`, `barriers`: (parked message, its RQ record) pairs."""
        with self._lock:
            self._blocking.awaiting(
                slot,
                [self._work(slot, p, record, "rq") for p, record in copies],
                [self._work(slot, p, record, "dlq") for p, record in barriers],
            )

    def _work(self, slot: int, p, record, location: str) -> Work:
        headers = m.headers_to_dict(record.headers)
        entry = Entry(m.Origin.decode(p.origin), p.msg_id, p.group_id, location)  # type: ignore[arg-type]
        return Work(
            entry, self._rq_topic, -1, -1, slot, self._key_of(record.key, headers, record.value)
        )


def after_acks(futures: list, then: Callable[[], None], fail: Callable[[BaseException], None]):
    """Call `then` once every one of `futures` (producer sends) succeeded, at once when there is
    none; `fail` with the first error."""
    if not futures:
        then()
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one(_meta) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_callback(one)
        future.add_errback(fail)
