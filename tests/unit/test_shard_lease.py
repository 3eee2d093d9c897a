"""A shard instance's lease (`varadhi.spark.shard.lease.ShardLease`) with an in-memory catalog and a
fake clock: standing by and taking over, following a shard-count change, a Kafka failure while
watching, which failures are fences, and a clean or failed release. The real takeover between
two processes is tests/integration/test_failover.py's."""

from __future__ import annotations

import copy

import pytest
from kafka.errors import KafkaTimeoutError

from varadhi.core.errors import Fenced, InvalidArgument, LeaseExpired
from varadhi.kafka.catalog import Snapshot, key
from varadhi.kafka.leases import KIND, Lease
from varadhi.spark.shard.lease import ShardLease

TTL = 3_000
OWNER = "orders-http/s2/1"


class FakeCatalog:
    """The catalog's read and atomic read-modify-write, in memory; `fail_reads` makes the next
    reads raise as an unreachable Kafka does."""

    settings = None
    timeout_s = 1.0

    def __init__(self):
        self.entries: dict[str, dict] = {}
        self.fail_reads = 0
        self.snapshots = 0

    def snapshot(self):
        self.snapshots += 1
        return Snapshot(copy.deepcopy(self.entries))

    def get(self, kind, name):
        if self.fail_reads:
            self.fail_reads -= 1
            raise KafkaTimeoutError("catalog read timed out")
        return copy.deepcopy(self.entries.get(key(kind, name)))

    def mutate(self, change):
        changes = change(Snapshot(copy.deepcopy(self.entries)))
        for k, v in changes.items():
            self.entries[k] = copy.deepcopy(v)
        return changes

    def close(self):
        pass


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeLease(Lease):
    def _writer(self):
        return self.catalog


class Publisher:
    def __init__(self):
        self.docs: list[dict] = []
        self.closed = False

    def publish(self, doc, force=False, flush=False):
        self.docs.append(doc)

    def close(self):
        self.closed = True


def shard_lease(catalog, clock, shard=1):
    def make(catalog, owner, ttl_ms, instance=None):
        wall = lambda: int(clock() * 1000)  # noqa: E731
        return FakeLease(catalog, owner, ttl_ms, clock=clock, wall_ms=wall, instance=instance)

    return ShardLease(catalog, "orders-http", shard, TTL, make_lease=make, clock=clock)


def waiting(clock, polls: int, during=None):
    """A `wait` that advances the fake clock by each poll and asks to stop after `polls`;
    `during(n)` runs at the n-th poll (a renewal by the active instance, say)."""
    count = [0]

    def wait(seconds):
        count[0] += 1
        clock.t += seconds
        if during is not None:
            during(count[0])
        return count[0] >= polls

    return wait


def test_a_standby_takes_over_a_lease_seen_unchanged_for_its_ttl_and_says_so():
    catalog, clock = FakeCatalog(), Clock()
    active = shard_lease(catalog, clock)
    active.take(OWNER)
    standby, publisher = shard_lease(catalog, clock), Publisher()
    polls = int(TTL / 1000 / min(1.0, TTL / 5000)) + 3  # a TTL of polls, and a few more
    assert standby.stand_by(lambda: (OWNER, 2), publisher, waiting(clock, polls))
    assert standby.epoch == 2 and catalog.get(KIND, OWNER)["instance"] == standby.instance
    assert publisher.docs[0]["state"] == "standby" and publisher.docs[0]["shard_count"] == 2
    assert publisher.docs[0]["watching"]["holder"] == active.instance
    assert publisher.docs[-1] == {"state": "took over", "shard": 1, "instance": standby.instance}
    assert publisher.closed
    standby.check()
    # The active, not renewed for its TTL, delivers nothing; its heartbeat's next renewal
    # finds the new holder and fences it.
    with pytest.raises(LeaseExpired):
        active.check()
    assert active.held.beat() is False
    with pytest.raises(Fenced):
        active.check()


def test_renewals_keep_a_standby_out_until_it_is_asked_to_stop():
    catalog, clock = FakeCatalog(), Clock()
    active = shard_lease(catalog, clock)
    active.take(OWNER)
    standby, publisher = shard_lease(catalog, clock), Publisher()
    renew = lambda n: n % 2 == 0 and active.held.renew()  # noqa: E731 - every 1.2 s
    assert not standby.stand_by(lambda: (OWNER, 2), publisher, waiting(clock, 40, renew))
    assert standby.held is None and catalog.get(KIND, OWNER)["instance"] == active.instance
    assert publisher.docs[-1]["state"] == "stopped" and publisher.closed


def test_a_failed_catalog_read_starts_the_observation_again():
    catalog, clock = FakeCatalog(), Clock()
    shard_lease(catalog, clock).take(OWNER)
    standby = shard_lease(catalog, clock)
    fail_late = lambda n: n == 4 and setattr(catalog, "fail_reads", 1)  # noqa: E731
    # Reads every 0.6 s: without the failure the 6th sees the lease unchanged for its 3 s TTL;
    # after the 5th read failed, the 6th and 7th start a new observation (0 and 0.6 s).
    assert not standby.stand_by(lambda: (OWNER, 2), Publisher(), waiting(clock, 7, fail_late))
    assert standby.held is None
    assert shard_lease(catalog, clock).stand_by(lambda: (OWNER, 2), Publisher(),
                                                waiting(clock, 7))  # fmt: skip


def test_a_standby_follows_a_shard_count_change_and_refuses_a_shard_beyond_it():
    catalog, clock = FakeCatalog(), Clock()
    new_owner = "orders-http/s4/1"
    shard_lease(catalog, clock).take(new_owner)
    owners = iter([(OWNER, 2)] * 3 + [(new_owner, 4)] * 20)
    standby, publisher = shard_lease(catalog, clock), Publisher()
    assert standby.stand_by(lambda: next(owners), publisher, waiting(clock, 20))
    assert standby.held.owner == new_owner and standby.epoch == 2
    assert publisher.docs[0]["watching"] == {
        "why": "no instance has taken the lease yet: waiting for one"
    }

    def beyond():
        raise InvalidArgument("shard 5 is outside 0..3 of orders-http")

    refused = Publisher()
    with pytest.raises(InvalidArgument):
        shard_lease(catalog, clock, shard=5).stand_by(beyond, refused, waiting(clock, 5))
    assert refused.docs[-1]["state"] == "stopped" and refused.closed


def test_which_failures_are_a_fence():
    catalog, clock = FakeCatalog(), Clock()
    lease = shard_lease(catalog, clock)
    lease.take(OWNER)
    fenced = Fenced(f"lease {OWNER}", 1, 2)
    assert lease.fence_reason(fenced) == str(fenced)
    assert lease.fence_reason(KafkaTimeoutError("send timed out")) is None
    clock.t += TTL / 1000  # not renewed for a TTL: Kafka away; nobody is known to hold it
    assert lease.fence_reason(KafkaTimeoutError("send timed out")) is None
    assert lease.expired() and not lease.taken()
    with pytest.raises(LeaseExpired):
        lease.check()
    other = shard_lease(catalog, clock)
    other.take(OWNER)
    assert lease.held.beat() is False  # the heartbeat's next renewal finds it taken
    assert lease.fence_reason(KafkaTimeoutError("send timed out")) == (
        "KafkaTimeoutError: KafkaTimeoutError: send timed out after its lease was lost "
        "(taken: epoch 2)"
    )
    with pytest.raises(Fenced):
        lease.check()


def test_an_expired_lease_is_waited_for_until_renewed_or_found_taken():
    """`await_renewal`: while Kafka is away the shard delivers nothing; a renewal that finds
    the lease still its own lets it go on, one that finds another holder fences it, and a stop
    asked for meanwhile ends the wait."""
    catalog, clock = FakeCatalog(), Clock()
    lease = shard_lease(catalog, clock)
    lease.take(OWNER)
    clock.t += TTL / 1000
    waits = []

    def renewed_on_third_wait(seconds):
        waits.append(seconds)
        if len(waits) == 3:
            assert lease.held.beat()  # the heartbeat, once Kafka answers
        return False

    assert lease.await_renewal(renewed_on_third_wait) is True
    assert len(waits) == 3 and not lease.expired()
    lease.check()

    clock.t += TTL / 1000
    assert lease.await_renewal(lambda seconds: True) is False  # a stop asked for

    def taken_meanwhile(seconds):
        shard_lease(catalog, clock).take(OWNER)  # a standby that reached Kafka
        assert lease.held.beat() is False
        return False

    with pytest.raises(Fenced, match="taken"):
        lease.await_renewal(taken_meanwhile)


def test_a_clean_release_marks_the_lease_stopped_and_a_failed_one_lets_it_expire():
    catalog, clock = FakeCatalog(), Clock()
    lease = shard_lease(catalog, clock)
    lease.take(OWNER)
    lease.release(clean=False)
    assert "stopped_ms" not in catalog.get(KIND, OWNER)
    lease.release(clean=True)
    assert catalog.get(KIND, OWNER)["stopped_ms"] == 1_000_000
    lease.close()


def test_a_prepared_lease_is_read_not_written_and_take_uses_it():
    catalog, clock = FakeCatalog(), Clock()
    active = shard_lease(catalog, clock)
    active.take(OWNER)
    held = copy.deepcopy(catalog.entries)
    lease = shard_lease(catalog, clock)
    lease.prepare(OWNER)  # while the shard checks what it must before fencing anyone
    assert catalog.snapshots == 1 and catalog.entries == held  # read, nothing written
    prepared = lease._prepared
    lease.take(OWNER)
    assert lease.held is prepared and lease.epoch == 2
    with pytest.raises(Fenced):
        active.check()


def test_take_of_another_owner_than_prepared_closes_the_prepared_one():
    catalog, clock = FakeCatalog(), Clock()
    lease = shard_lease(catalog, clock)
    lease.prepare(OWNER)
    prepared = lease._prepared
    lease.take("orders-http/s3/1")  # the shard count changed in between
    assert lease.held is not prepared and lease.held.owner == "orders-http/s3/1"
    assert prepared._stop.is_set()  # closed
    assert catalog.get(KIND, OWNER) is None


def test_what_the_control_loop_rides_out_instead_of_failing():
    """A Kafka error that may pass, with the lease still renewed (a broker back from an outage
    whose catalog read times out once more), is waited out like an expired lease, within the
    control outage's limit; a fence or any other failure is not. Before, it ended the shard
    with exit 1."""
    from varadhi.spark.shard.ends import ControlOutage
    from varadhi.spark.shard.job import ShardJob

    catalog, clock = FakeCatalog(), Clock()
    lease = shard_lease(catalog, clock)
    lease.take(OWNER)
    outage = ControlOutage()
    timeout = KafkaTimeoutError("Failed to get offsets by timestamps in 35000 ms")
    assert ShardJob._rides_out(timeout, lease, outage)
    assert not ShardJob._rides_out(timeout, lease, ControlOutage(limit_s=-1.0))  # too long
    assert not ShardJob._rides_out(RuntimeError("a bug"), lease, outage)
    assert not ShardJob._rides_out(Fenced(f"lease {OWNER}", 1, 2), lease, outage)
    clock.t += TTL / 1000  # not renewed for a TTL: whatever failed, Kafka is away
    assert ShardJob._rides_out(RuntimeError("a call that timed out"), lease, outage)
