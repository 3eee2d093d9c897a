"""Leases: at most one live instance of a shard (or feeder) at a time, and failover.

An instance takes the lease by bumping its epoch in the catalog (`lease/<owner>`); a newer
instance bumps it again. The older instance sees a different epoch at its next check and must
stop without committing anything (DESIGN hazard 6). Checks are cheap (an incremental catalog
read), so a shard checks at the start of every micro-batch and right before every commit.

The lease is the outer fence; the inner one is Kafka's: shards write their RQ/DLQ records with a
transactional id per shard, so the newer instance's `init_transactions` also fences the older
instance's producer at the broker.

Expiry and standbys. A shard holds its lease with a TTL (`ttl_ms` in the document, default
`DEFAULT_TTL_MS`, `VARADHI_LEASE_TTL_MS`): a heartbeat thread renews it every TTL/3
(`renewed_ms`, one catalog write). A holder whose renewal finds another epoch is fenced. One
that has not renewed successfully for a TTL (counted from the start of its last successful
renewal, on its own monotonic clock) has an *expired* lease: Kafka did not answer, and a
standby that reaches Kafka may take the lease over, so it must deliver nothing, but nobody is
known to hold it. The heartbeat keeps trying: a renewal that finds the document still its own
makes the lease held again (the renewal is a compare-and-set like a takeover: the first write
wins), one that finds another epoch fences. A *standby* instance (`--standby`) watches the document and
takes the lease (epoch bump) only once it has seen it unchanged for its TTL on its own monotonic
clock (no clock is compared across hosts), with a compare-and-set on the document it watched:
a renewal or another standby in between wins. It never takes a lease that has no TTL (taken by
an operation such as change-shards' fence, or by an older version), one whose holder stopped
cleanly (`stopped_ms`: an operator's stop), or one nobody took yet.

Every write of a lease document goes through a catalog writer of its own (transactional id per
lease, `Catalog(writer=...)`): writes of one lease fence each other, so each is an atomic
read-modify-write of that document, and heartbeats do not fence the catalog's other writers.

The decisions are pure functions of documents and clock readings (`observe`, `may_take_over`,
`renewal_due`, `holder_expired`, `lease_view`), unit-tested with a fake clock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from varadhi.core.catalog_kinds import DocKind
from varadhi.core.errors import Fenced, InvalidArgument, KafkaUnavailable, LeaseExpired
from varadhi.kafka.catalog import Catalog, Snapshot, key

log = logging.getLogger(__name__)

KIND = DocKind.LEASE
DEFAULT_TTL_MS = 15_000
MIN_TTL_MS = 1_000


def ttl_from_env(value: float | None = None) -> int:
    """The lease TTL in ms: `value` (seconds, from a command line) or `$VARADHI_LEASE_TTL_MS`
    or `DEFAULT_TTL_MS`; refused below `MIN_TTL_MS`."""
    if value is not None:
        ttl = int(value * 1000)
    else:
        raw = os.environ.get("VARADHI_LEASE_TTL_MS", "")
        try:
            ttl = int(raw) if raw else DEFAULT_TTL_MS
        except ValueError:
            raise InvalidArgument(
                f"not a number of ms: {raw!r}", field="VARADHI_LEASE_TTL_MS"
            ) from None
    if ttl < MIN_TTL_MS:
        raise InvalidArgument(f"must be at least {MIN_TTL_MS} ms, got {ttl}", field="lease TTL")
    return ttl


def new_instance() -> str:
    """A new instance name, `host:pid:random`: what status shows as a lease's holder."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


# -- pure decisions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """What a standby saw of a lease document, and since when it has been the same (seconds on
    the standby's own monotonic clock)."""

    doc: dict[str, Any] | None
    since: float


def observe(seen: Seen | None, doc: dict[str, Any] | None, now: float) -> Seen:
    """The observation after reading `doc` at `now`: any change (a renewal, a new holder, a
    stop) starts it again (pure)."""
    if seen is not None and seen.doc == doc:
        return seen
    return Seen(doc, now)


def heartbeating(doc: dict[str, Any] | None) -> bool:
    """Whether `doc` is held by a shard instance that renews it: it has a TTL and its holder
    did not stop cleanly (pure)."""
    return bool(doc and doc.get("ttl_ms") and not doc.get("stopped_ms"))


def may_take_over(seen: Seen | None, now: float) -> bool:
    """Whether a standby may take the lease it watched: held by a renewing instance, and seen
    unchanged for at least its TTL (pure). Never a lease nobody holds, one an operation took,
    or one stopped by its holder."""
    if seen is None or not heartbeating(seen.doc):
        return False
    assert seen.doc is not None
    return (now - seen.since) * 1000 >= int(seen.doc["ttl_ms"])


def renewal_due(last_attempt: float | None, now: float, ttl_ms: int) -> bool:
    """Whether the holder renews now: every TTL/3 (pure)."""
    return last_attempt is None or (now - last_attempt) * 1000 >= ttl_ms / 3


def holder_expired(last_renewed: float, now: float, ttl_ms: int) -> bool:
    """Whether a holder must consider its lease gone: its last successful renewal *started* a
    TTL ago or more, so a standby may have seen that document unchanged for a TTL (pure)."""
    return (now - last_renewed) * 1000 >= ttl_ms


def standby_view(seen: Seen | None, now: float) -> dict[str, Any]:
    """What a standby reports about the lease it watches (pure): its holder, epoch and TTL and
    how long it has been unchanged, or why it will not be taken over."""
    doc = seen.doc if seen else None
    if seen is None:
        return {"why": "reading the lease"}
    if doc is None:
        return {"why": "no instance has taken the lease yet: waiting for one"}
    if doc.get("stopped_ms"):
        return {"why": f"{doc.get('instance')} stopped cleanly: not taken over"}
    if not doc.get("ttl_ms"):
        return {"why": f"held by {doc.get('instance')} without a heartbeat: not taken over"}
    return {
        "holder": doc.get("instance"),
        "epoch": doc.get("epoch"),
        "ttl_ms": int(doc["ttl_ms"]),
        "unchanged_s": round(now - seen.since, 1),
    }


def lease_view(doc: dict[str, Any] | None, now_ms: int) -> dict[str, Any] | None:
    """The lease as status shows it (pure): holder, epoch, TTL, ms since the last renewal,
    whether it is expired (not renewed for its TTL) or stopped. None without a document."""
    if not doc:
        return None
    renewed = doc.get("renewed_ms")
    age = max(0, now_ms - int(renewed)) if renewed is not None else None
    ttl = int(doc["ttl_ms"]) if doc.get("ttl_ms") else None
    return {
        "instance": doc.get("instance"),
        "epoch": doc.get("epoch"),
        "ttl_ms": ttl,
        "renewed_age_ms": age,
        "stopped": bool(doc.get("stopped_ms")),
        "expired": heartbeating(doc) and age is not None and ttl is not None and age >= ttl,
    }


# -- the lease ---------------------------------------------------------------------------------


class Lease:
    """One instance's hold on `lease/<owner>`. Without `ttl_ms` it only fences (an operation's
    `acquire`); with it, `start_heartbeat` keeps it and `check` also fails once it expired."""

    def __init__(
        self,
        catalog: Catalog,
        owner: str,
        ttl_ms: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        instance: str | None = None,
    ):
        self.catalog = catalog
        self.owner = owner
        self.ttl_ms = ttl_ms
        self.instance = instance or new_instance()
        self.epoch: int | None = None
        self._clock = clock
        self._wall_ms = wall_ms
        self._writer_catalog: Catalog | None = None
        self._renewed_at: float | None = None  # start of the last successful write (monotonic)
        self._taken: str | None = None  # the heartbeat found another holder
        self.renewals = 0  # successful renewals so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- writes (each an atomic read-modify-write under this lease's own writer) -------------
    def _writer(self) -> Catalog:
        if self._writer_catalog is None:
            self._writer_catalog = Catalog(self.catalog.settings, writer=f"lease.{self.owner}")
        return self._writer_catalog

    def _doc(self, epoch: int, now_ms: int) -> dict[str, Any]:
        doc: dict[str, Any] = {"epoch": epoch, "instance": self.instance, "acquired_ms": now_ms}
        if self.ttl_ms:
            doc.update(ttl_ms=self.ttl_ms, renewed_ms=now_ms)
        return doc

    def prepare(self) -> None:
        """Read the catalog through this lease's own writer, ahead of `acquire`: its clients'
        connections and the catalog read, which `acquire` would otherwise do first. Reads only:
        the writer's transactional producer, whose start fences the writer of an instance
        holding the lease, starts with the first write."""
        self._writer().snapshot()

    def acquire(self) -> int:
        """Take the lease from whoever had it; returns the new epoch."""
        started = self._clock()

        def change(snap: Snapshot):
            current = snap.get(KIND, self.owner) or {"epoch": 0}
            return {key(KIND, self.owner): self._doc(int(current["epoch"]) + 1, self._wall_ms())}

        written = self._write(change)
        self._held(int(written[key(KIND, self.owner)]["epoch"]), started)
        return self.epoch  # type: ignore[return-value]

    def take_over(self, expected: dict[str, Any] | None) -> bool:
        """Take the lease only if its document is still `expected` (what the standby watched
        expire); False when anything wrote it meanwhile (a renewal, another standby)."""
        started = self._clock()

        def change(snap: Snapshot):
            current = snap.get(KIND, self.owner)
            if current != expected or current is None:
                return {}
            return {key(KIND, self.owner): self._doc(int(current["epoch"]) + 1, self._wall_ms())}

        written = self._write(change)
        if not written:
            return False
        self._held(int(written[key(KIND, self.owner)]["epoch"]), started)
        return True

    def renew(self) -> None:
        """Write `renewed_ms` now; raises `Fenced` when another instance has the lease."""
        started = self._clock()

        def change(snap: Snapshot):
            current = snap.get(KIND, self.owner)
            if not self._mine(current):
                raise Fenced(f"lease {self.owner}", self.epoch or 0, _epoch(current))
            assert current is not None
            return {key(KIND, self.owner): dict(current, renewed_ms=self._wall_ms())}

        self._write(change)
        self._renewed_at = started
        self.renewals += 1

    def stop(self) -> None:
        """Mark a clean stop (an operator's): standbys do not take the lease over. Does nothing
        when the lease is no longer this instance's."""
        self.stop_heartbeat()

        def change(snap: Snapshot):
            current = snap.get(KIND, self.owner)
            if not self._mine(current):
                return {}
            assert current is not None
            return {key(KIND, self.owner): dict(current, stopped_ms=self._wall_ms())}

        self._write(change)

    def _write(self, change):
        writer = self._writer()
        try:
            return writer.mutate(change)
        finally:
            if not self.ttl_ms:  # an operation's fence: no heartbeat will use the writer again
                self.close()

    def _mine(self, doc: dict[str, Any] | None) -> bool:
        return bool(
            doc
            and self.epoch is not None
            and int(doc["epoch"]) == self.epoch
            and doc.get("instance") == self.instance
        )

    def _held(self, epoch: int, started: float) -> None:
        """Record the new epoch and wait until the shared catalog shows it (the write went
        through this lease's own writer), so the next `check` does not see the old epoch."""
        self.epoch, self._renewed_at, self._taken = epoch, started, None
        deadline = time.monotonic() + self.catalog.timeout_s
        while _epoch(self.catalog.get(KIND, self.owner)) < epoch:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"the catalog did not show lease {self.owner} in time")
            time.sleep(0.01)

    # -- the holder's side -----------------------------------------------------------------
    def taken(self) -> str | None:
        """Why this instance no longer holds the lease, as its heartbeat found: another
        instance took it. None otherwise. Final."""
        return self._taken

    def expired(self) -> str | None:
        """Why this instance must deliver nothing now though nobody is known to hold the lease:
        no renewal succeeded for a TTL (Kafka did not answer). None while renewed; it ends when
        a renewal succeeds."""
        if (
            self.ttl_ms
            and self._renewed_at is not None
            and holder_expired(self._renewed_at, self._clock(), self.ttl_ms)
        ):
            return f"not renewed for {self.ttl_ms} ms: a standby may take it"
        return None

    def check(self) -> None:
        """Raise `Fenced` when another instance has taken the lease since `acquire` (the
        heartbeat found it, or the catalog shows it), `LeaseExpired` when it has not been
        renewed for its TTL."""
        if self._taken:
            raise Fenced(f"lease {self.owner} ({self._taken})", self.epoch or 0, -1)
        if self.expired():
            assert self.ttl_ms
            raise LeaseExpired(self.owner, self.ttl_ms)
        doc = self.catalog.get(KIND, self.owner)
        current = _epoch(doc)
        if self.epoch is None or current != self.epoch:
            raise Fenced(f"lease {self.owner}", self.epoch or 0, current)

    def start_heartbeat(self) -> None:
        """Renew every TTL/3 in a daemon thread until `stop_heartbeat`. A renewal that finds
        another holder marks the lease taken (`check` raises `Fenced`); one that fails otherwise
        (Kafka unreachable) is retried at the next interval, also once the lease expired
        (`check` raises `LeaseExpired` until one succeeds)."""
        if not self.ttl_ms or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"lease-{self.owner}", daemon=True
        )
        self._thread.start()

    def _heartbeat(self) -> None:
        assert self.ttl_ms
        last_attempt = self._clock()
        while not self._stop.wait(min(1.0, self.ttl_ms / 6000)):
            if not renewal_due(last_attempt, self._clock(), self.ttl_ms):
                continue
            last_attempt = self._clock()
            if not self.beat():
                return

    def beat(self) -> bool:
        """One renewal of the heartbeat: False once it found another holder (the lease is
        `taken`), True otherwise, also when Kafka did not answer (tried again at the next)."""
        try:
            self.renew()
        except Fenced as e:
            self._taken = f"taken: epoch {e.current}"
            log.warning("lease %s lost: %s", self.owner, e)
            return False
        except Exception as e:  # noqa: BLE001 - retried; `check` bounds how long
            log.warning("lease %s: renewal failed (%s); retrying", self.owner, e)
        return True

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def close(self) -> None:
        self._stop.set()
        if self._writer_catalog is not None:
            self._writer_catalog.close()
            self._writer_catalog = None


def _epoch(doc: dict[str, Any] | None) -> int:
    return int(doc["epoch"]) if doc else 0
