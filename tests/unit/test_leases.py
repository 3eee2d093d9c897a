"""Lease expiry, renewal, standby takeover and what status says of them (pure, fake clocks)."""

from __future__ import annotations

import copy

import pytest

from varadhi.cli.status import standby_text
from varadhi.core.errors import Fenced, InvalidArgument, LeaseExpired
from varadhi.kafka import leases
from varadhi.kafka.catalog import Snapshot, key
from varadhi.kafka.leases import Lease, Seen, holder_expired, may_take_over, observe, renewal_due
from varadhi.kafka.progress import standbys_of
from varadhi.ops.status import shard_state

TTL = 15_000
OWNER = "orders-http/s2/0"


class FakeCatalog:
    """The catalog's read and atomic read-modify-write, in memory."""

    settings = None
    timeout_s = 1.0

    def __init__(self):
        self.entries: dict[str, dict] = {}
        self.writes = 0

    def get(self, kind, name):
        return copy.deepcopy(self.entries.get(key(kind, name)))

    def mutate(self, change):
        changes = change(Snapshot(copy.deepcopy(self.entries)))
        for k, v in changes.items():
            self.writes += 1
            if v is None:
                self.entries.pop(k, None)
            else:
                self.entries[k] = copy.deepcopy(v)
        return changes

    def close(self):
        pass


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeLease(Lease):
    def _writer(self):
        return self.catalog


def make(catalog, clock, ttl=TTL, instance=None):
    return FakeLease(
        catalog, OWNER, ttl, clock=clock, wall_ms=lambda: int(clock() * 1000), instance=instance
    )


# -- the pure decisions ------------------------------------------------------------------------


def doc(epoch=1, renewed=0, ttl=TTL, **more):
    return {"epoch": epoch, "instance": "a", "renewed_ms": renewed, "ttl_ms": ttl, **more}


def test_an_observation_starts_again_at_every_change():
    seen = observe(None, doc(renewed=1), 10.0)
    assert observe(seen, doc(renewed=1), 14.0) == Seen(doc(renewed=1), 10.0)
    assert observe(seen, doc(renewed=2), 14.0) == Seen(doc(renewed=2), 14.0)
    assert observe(seen, None, 14.0) == Seen(None, 14.0)


def test_a_standby_takes_over_only_a_renewing_lease_seen_unchanged_for_its_ttl():
    assert not may_take_over(None, 100.0)
    assert not may_take_over(Seen(None, 0.0), 100.0)  # nobody took it: wait for an active one
    assert not may_take_over(Seen(doc(), 10.0), 24.9)
    assert may_take_over(Seen(doc(), 10.0), 25.0)
    assert may_take_over(Seen(doc(ttl=3_000), 10.0), 13.0)  # the holder's TTL counts
    # A clean stop (an operator's) and a lease without a heartbeat (change-shards' fence, an
    # older version) are never taken over.
    assert not may_take_over(Seen(doc(stopped_ms=5), 0.0), 1e6)
    no_ttl = {"epoch": 3, "instance": "change-shards", "acquired_ms": 0}
    assert not may_take_over(Seen(no_ttl, 0.0), 1e6)


def test_renewals_every_third_of_the_ttl_keep_a_standby_out_even_when_some_are_late():
    """The active renews every TTL/3, once 14 s late (two renewals missed); a standby polling
    every half second never sees the lease unchanged for a TTL. Once renewals stop, it takes
    over within TTL + one poll of the last renewal."""
    renewals = [t for t in range(0, 121, 5) if not 35 < t < 49] + [49]
    seen, renewed = None, 0
    for tick in range(0, 241):
        t = tick / 2
        renewed = max((r for r in renewals if r <= t), default=0) * 1000
        seen = observe(seen, doc(renewed=renewed), t)
        assert not may_take_over(seen, t), t
    # The holder dies after its renewal at 120 s.
    t = 120.0
    while not may_take_over(seen, t):
        assert t < 120.0 + 10 * TTL / 1000, "no take-over within 10 TTLs of the last renewal"
        t += 0.5
        seen = observe(seen, doc(renewed=renewed), t)
    assert t == 120.0 + TTL / 1000


def test_the_holder_counts_its_ttl_from_the_start_of_its_last_successful_renewal():
    assert not holder_expired(100.0, 114.9, TTL)
    assert holder_expired(100.0, 115.0, TTL)
    assert renewal_due(None, 0.0, TTL)
    assert not renewal_due(100.0, 104.9, TTL) and renewal_due(100.0, 105.0, TTL)


def test_ttl_setting(monkeypatch):
    monkeypatch.delenv("VARADHI_LEASE_TTL_MS", raising=False)
    assert leases.ttl_from_env() == leases.DEFAULT_TTL_MS
    assert leases.ttl_from_env(4.5) == 4_500
    monkeypatch.setenv("VARADHI_LEASE_TTL_MS", "3000")
    assert leases.ttl_from_env() == 3_000
    for bad in ("abc", "10"):
        monkeypatch.setenv("VARADHI_LEASE_TTL_MS", bad)
        with pytest.raises(InvalidArgument):
            leases.ttl_from_env()


# -- the lease ---------------------------------------------------------------------------------


def test_acquire_renew_and_expire_on_the_holders_clock():
    catalog, clock = FakeCatalog(), Clock()
    lease = make(catalog, clock)
    assert lease.acquire() == 1
    held = catalog.get("lease", OWNER)
    assert (held["ttl_ms"], held["renewed_ms"], held["instance"]) == (
        TTL,
        1_000_000,
        lease.instance,
    )
    lease.check()
    clock.t += 10.0
    lease.renew()
    assert catalog.get("lease", OWNER)["renewed_ms"] == 1_010_000
    clock.t += 14.9
    lease.check()
    assert lease.expired() is None
    clock.t += 0.1  # a TTL since the last successful renewal started: a standby may have it
    assert "not renewed" in lease.expired()
    assert lease.taken() is None  # nobody is known to hold it: expired, not fenced
    with pytest.raises(LeaseExpired, match="not renewed"):
        lease.check()
    # Kafka answers again and the document is still this instance's: the renewal holds it again.
    lease.renew()
    assert lease.expired() is None and lease.renewals == 2
    lease.check()


def test_an_expired_lease_that_another_instance_took_meanwhile_is_fenced_at_its_renewal():
    catalog, clock = FakeCatalog(), Clock()
    a, b = make(catalog, clock), make(catalog, clock)
    a.acquire()
    clock.t += TTL / 1000  # a's renewals failed for a TTL: a standby saw it unchanged, took it
    assert b.take_over(catalog.get("lease", OWNER))
    with pytest.raises(LeaseExpired):
        a.check()
    with pytest.raises(Fenced):
        a.renew()  # the heartbeat's next renewal, once Kafka answers


def test_a_normal_start_fences_at_once_and_an_operations_fence_has_no_ttl():
    catalog, clock = FakeCatalog(), Clock()
    a, b = make(catalog, clock), make(catalog, clock)
    a.acquire()
    b.acquire()
    with pytest.raises(Fenced):
        a.check()
    with pytest.raises(Fenced):
        a.renew()
    fence = FakeLease(catalog, OWNER)  # change-shards' fence step
    fence.acquire()
    assert "ttl_ms" not in catalog.get("lease", OWNER)
    with pytest.raises(Fenced):
        b.check()


def test_two_standbys_watching_one_expired_lease_only_one_takes_it():
    catalog, clock = FakeCatalog(), Clock()
    active = make(catalog, clock)
    active.acquire()
    watched = catalog.get("lease", OWNER)
    s1, s2 = make(catalog, clock), make(catalog, clock)
    assert s1.take_over(watched) and s1.epoch == 2
    assert not s2.take_over(watched)  # the document changed: s2 watches the new one
    assert catalog.get("lease", OWNER)["instance"] == s1.instance
    # The old holder, back from the dead, is fenced at its next check or renewal.
    with pytest.raises(Fenced):
        active.check()
    with pytest.raises(Fenced):
        active.renew()


def test_a_renewal_between_the_observation_and_the_takeover_wins():
    catalog, clock = FakeCatalog(), Clock()
    active = make(catalog, clock)
    active.acquire()
    watched = catalog.get("lease", OWNER)
    clock.t += 5.0
    active.renew()
    standby = make(catalog, clock)
    assert not standby.take_over(watched)
    active.check()


def test_a_clean_stop_is_marked_and_not_taken_over_and_a_fenced_one_writes_nothing():
    catalog, clock = FakeCatalog(), Clock()
    a = make(catalog, clock)
    a.acquire()
    a.stop()
    stopped = catalog.get("lease", OWNER)
    assert stopped["stopped_ms"] == 1_000_000
    assert not may_take_over(Seen(stopped, 0.0), 1e9)
    b = make(catalog, clock)
    b.acquire()
    writes = catalog.writes
    a.stop()  # no longer its lease
    assert catalog.writes == writes


def test_the_heartbeat_marks_a_lease_taken_by_another_instance_taken():
    catalog, clock = FakeCatalog(), Clock()
    a = make(catalog, clock, ttl=1_200)
    a.acquire()
    a.start_heartbeat()
    try:
        b = make(catalog, clock, ttl=1_200)
        assert b.take_over(catalog.get("lease", OWNER))
        clock.t += 0.5  # a renewal is due (TTL/3)
        import time

        deadline = time.monotonic() + 60  # the heartbeat thread on a loaded machine
        while not a.taken() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.taken() == "taken: epoch 2"
        with pytest.raises(Fenced):
            a.check()
    finally:
        a.stop_heartbeat()


# -- what status and a standby say --------------------------------------------------------------


def view(renewed_age, ttl=TTL, stopped=False):
    d = doc(renewed=1_000_000 - renewed_age, ttl=ttl, **({"stopped_ms": 1} if stopped else {}))
    return leases.lease_view(d, 1_000_000)


def test_status_says_dead_when_the_lease_expired_and_the_progress_is_old():
    running = {"state": "running"}
    assert shard_state(running, 2_000, view(1_000)) == ("running", None)
    assert shard_state(running, 16_000, view(16_000)) == ("dead", 16_000)
    assert shard_state(running, 3_000, view(16_000)) == ("running", None)  # it still reports
    # A process that said it ended is not dead; without a heartbeat, silent after a minute.
    assert shard_state({"state": "stopped"}, 20_000, view(20_000, stopped=True)) == (
        "stopped",
        None,
    )
    assert shard_state({"state": "fenced"}, 20_000, view(20_000)) == ("fenced", None)
    assert shard_state(running, 61_000, None) == ("silent", None)
    assert shard_state({}, None, None) == ("never started", None)
    assert shard_state({}, None, view(20_000)) == ("dead", 20_000)  # died before reporting
    assert leases.lease_view(None, 0) is None


def test_standbys_are_listed_while_they_report():
    found = {
        "0": {"state": "running", "updated_ms": 990_000},
        "0/standby/h:1:a": {"state": "standby", "updated_ms": 995_000, "instance": "h:1:a"},
        "0/standby/h:2:b": {"state": "took over", "updated_ms": 999_000, "instance": "h:2:b"},
        "1/standby/h:3:c": {"state": "standby", "updated_ms": 900_000, "instance": "h:3:c"},
    }
    assert {
        s: [d["instance"] for d in docs] for s, docs in standbys_of(found, 1_000_000).items()
    } == {0: ["h:1:a"]}


def test_what_a_standby_reports():
    assert leases.standby_view(None, 0.0) == {"why": "reading the lease"}
    assert "waiting for one" in leases.standby_view(Seen(None, 0.0), 1.0)["why"]
    assert "stopped cleanly" in leases.standby_view(Seen(doc(stopped_ms=1), 0.0), 1.0)["why"]
    watching = leases.standby_view(Seen(doc(), 10.0), 13.0)
    assert watching == {"holder": "a", "epoch": 1, "ttl_ms": TTL, "unchanged_s": 3.0}
    assert standby_text({"instance": "h:1:a", "watching": watching}) == (
        "standby h:1:a: lease of a unchanged for 3s of 15s"
    )


def test_only_shards_that_held_their_lease_at_the_current_count_are_looked_for():
    """Status looks back through the progress topic for each shard's newest document; a shard
    that never held its lease at the current shard count has none, and looking for it read
    back to the subscription's creation."""
    from types import SimpleNamespace

    from varadhi.ops.status import shards_that_ran

    held = {"orders-http/s4/0", "orders-http/s4/2", "orders-http/s2/1"}  # s2: an older count
    snap = SimpleNamespace(get=lambda kind, key: {"epoch": 1} if key in held else None)
    sub = SimpleNamespace(name="orders-http", shard_count=4)
    assert shards_that_ran(snap, sub) == [0, 2]
