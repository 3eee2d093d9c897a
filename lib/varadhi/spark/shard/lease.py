"""A shard instance's lease: take it at once or stand by for it, keep it, check it, let it go,
and decide whether a failure means the shard was fenced.

`ShardLease` is the shard driver's side of `varadhi.kafka.leases` (which holds the lease documents,
the heartbeat and the pure takeover rules, shared with feeders and operations). It is the
`varadhi.spark.shard.commit.LeasePort` of every micro-batch (`check`).

- `take(owner)`: a normal start bumps the epoch at once, fencing a running instance.
  `prepare(owner)` may come first, from another thread, while the shard checks what must be
  checked before it fences anyone: it only reads (`leases.Lease.prepare`).
- `stand_by(...)`: a `--standby` instance watches the lease while it is held and renewed,
  reporting `standby` through its own progress key, and takes it (a compare-and-set on the
  document it watched: a renewal or another standby in between wins) once it has seen it
  unchanged for its TTL (`leases.may_take_over`). It follows a shard-count change (the lease of
  this shard of the current count). A Kafka failure while watching starts the observation again:
  the lease must be seen unchanged for a whole TTL of successful reads.
- `start_heartbeat`, `check`, `taken`, `expired`: as `leases.Lease`; `check` raises `Fenced` once
  a newer instance holds the lease, `LeaseExpired` while it was not renewed for its TTL.
- `fence_reason(error)`: whether a failure ends the shard as fenced (exit 3) rather than failed:
  `Fenced` itself, or any failure after the heartbeat found the lease taken.
- `await_renewal(wait)`: an expired lease (Kafka away for a TTL, or a process frozen that long)
  is not a fence: the shard delivers nothing and waits here until the heartbeat renews it (the
  lease still its own: it goes on) or finds another holder (`Fenced`, exit 3).
- `release(clean)`: stops the heartbeat; after an operator's stop (`clean`) marks the lease
  stopped, so standbys do not take over (a crash lets it expire instead).

Hazard: nothing before `take`/`stand_by` returns may fence the active instance, so the shard
starts its transactional producer (`varadhi.spark.shard.sender`) only after it holds the lease.
The standby loop is unit-tested with an in-memory catalog and a fake clock
(tests/unit/test_shard_lease.py); the real takeover by tests/integration/test_failover.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from kafka.errors import KafkaError

from varadhi.core.errors import Fenced, KafkaUnavailable
from varadhi.kafka import leases
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.leases import Lease

log = logging.getLogger("varadhi.spark.shard.job")

# How often `await_renewal` looks at the heartbeat's work.
POLL_S = 0.5


class Publisher(Protocol):
    """Where a standby reports (`varadhi.kafka.progress.ProgressPublisher` under its standby key)."""

    def publish(self, doc: dict[str, Any], force: bool = False, flush: bool = False) -> None: ...

    def close(self) -> None: ...


class ShardLease:
    """The lease of shard `shard` of subscription `name` for this instance (`instance`), with
    TTL `ttl_ms`. `make_lease` builds the `leases.Lease` (injected in tests); `clock` is the
    standby's monotonic clock."""

    def __init__(
        self,
        catalog: Catalog,
        name: str,
        shard: int,
        ttl_ms: int,
        make_lease: Callable[..., Lease] = Lease,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.catalog, self.name, self.shard, self.ttl_ms = catalog, name, shard, ttl_ms
        self._make = make_lease
        self._clock = clock
        self.instance = leases.new_instance()
        self.held: Lease | None = None
        self._prepared: Lease | None = None  # `prepare`d for `take`
        self._label = f"{name} shard {shard}"

    def _new(self, owner: str) -> Lease:
        return self._make(self.catalog, owner, self.ttl_ms, instance=self.instance)

    # -- taking it -------------------------------------------------------------------------
    def prepare(self, owner: str) -> None:
        """Get ready to `take` the lease of `owner`: connect its writer and read the catalog
        through it (reads only, nothing fenced)."""
        lease = self._new(owner)
        self._prepared = lease
        lease.prepare()

    def take(self, owner: str) -> None:
        """Take the lease of `owner` now, from whoever has it (with what `prepare(owner)`
        connected, if it came first)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared.owner == owner:
            lease = prepared
        else:
            if prepared is not None:
                prepared.close()
            lease = self._new(owner)
        lease.acquire()
        self.held = lease

    def stand_by(
        self,
        owner_of: Callable[[], tuple[str, int]],
        publisher: Publisher,
        wait: Callable[[float], bool],
    ) -> bool:
        """Wait while the lease is held and renewed, reporting `standby` to `publisher`; take it
        once it has been unchanged for its TTL. `owner_of()` reads the lease owner and shard
        count now (it raises for a shard beyond the count); `wait(s)` sleeps and says whether the
        instance was asked to stop. True when taken (`held`), False when asked to stop first.
        Closes `publisher` after its last report (`took over` or `stopped`)."""
        lease: Lease | None = None
        seen: leases.Seen | None = None
        poll_s = min(1.0, self.ttl_ms / 5000)
        log.info("%s: standing by as %s", self._label, self.instance)
        state = "stopped"
        try:
            while True:
                try:
                    owner, shard_count = owner_of()
                    if lease is None or lease.owner != owner:
                        lease, seen = self._new(owner), None
                    now = self._clock()
                    seen = leases.observe(seen, self.catalog.get(leases.KIND, lease.owner), now)
                    if leases.may_take_over(seen, now):
                        assert seen.doc is not None
                        if lease.take_over(seen.doc):
                            log.warning(
                                "%s: the lease of %s was not renewed for %d ms; took it over "
                                "(epoch %d)",
                                self._label,
                                seen.doc.get("instance"),
                                int(seen.doc["ttl_ms"]),
                                lease.epoch,
                            )
                            state = "took over"
                            self.held = lease
                            return True
                        seen = None  # written meanwhile: watch the new document
                    publisher.publish(
                        {
                            "state": "standby",
                            "shard": self.shard,
                            "shard_count": shard_count,
                            "instance": self.instance,
                            "watching": leases.standby_view(seen, self._clock()),
                        }
                    )
                except (KafkaError, KafkaUnavailable) as e:
                    # What the catalog says is unknown: the lease must be seen unchanged for a
                    # whole TTL of successful reads again.
                    log.warning("%s: standby: %s", self._label, e)
                    seen = None
                if wait(poll_s):
                    return False
        finally:
            try:
                publisher.publish(
                    {"state": state, "shard": self.shard, "instance": self.instance},
                    force=True,
                    flush=True,
                )
            finally:
                publisher.close()

    # -- holding it (the `LeasePort`) ------------------------------------------------------
    def _lease(self) -> Lease:
        if self.held is None:
            raise RuntimeError(f"{self._label}: the lease was not taken")
        return self.held

    @property
    def epoch(self) -> int | None:
        return self.held.epoch if self.held is not None else None

    def start_heartbeat(self) -> None:
        self._lease().start_heartbeat()

    def check(self) -> None:
        """Raise `Fenced` once this instance must consider the lease gone (`Lease.check`)."""
        self._lease().check()

    def taken(self) -> str | None:
        return self._lease().taken()

    def expired(self) -> str | None:
        return self._lease().expired()

    def fence_reason(self, error: BaseException) -> str | None:
        """Why `error` ends the shard as fenced (exit 3), or None for a failure (pure but for
        the lease's state): `Fenced` itself, or any error after the lease was taken."""
        if isinstance(error, Fenced):
            return str(error)
        why = self.held.taken() if self.held is not None else None
        if why is None:
            return None
        return f"{type(error).__name__}: {error} after its lease was lost ({why})"

    def await_renewal(self, wait: Callable[[float], bool]) -> bool:
        """Deliver nothing until the heartbeat renews the lease (True: it is this instance's
        again, and not expired) or finds it taken (raises `Fenced`). `wait(seconds)` sleeps and
        says whether to stop: False then, the lease left to expire. Renewals are the
        heartbeat's (every TTL/3, each bounded by the catalog's timeout)."""
        lease = self._lease()
        seen = lease.renewals
        while lease.renewals == seen or lease.expired():
            if lease.taken():
                lease.check()  # raises Fenced
            if wait(POLL_S):
                return False
        return True

    # -- letting it go -----------------------------------------------------------------------
    def release(self, clean: bool) -> None:
        """Stop renewing; after an operator's stop (`clean`) mark the lease stopped so standbys
        do not take it over (a failure to mark it is logged: it then expires instead)."""
        lease = self._lease()
        lease.stop_heartbeat()
        if clean:
            try:
                lease.stop()
            except Exception as e:  # noqa: BLE001 - it then expires instead
                log.warning("%s: lease not marked stopped: %s", self._label, e)

    def close(self) -> None:
        for lease in (self.held, self._prepared):
            if lease is not None:
                lease.close()
        self._prepared = None
