"""`ShardJob.run` before its control loop, with fakes for Spark, the catalog and the lease: every
way out of it puts back the SIGINT/SIGTERM handlers it installed and closes the lease, a standby
that took the lease and then failed included. The real runs are tests/integration's."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from varadhi import shard as shard_module
from varadhi import warehouse_fs
from varadhi.errors import InvalidArgument, KafkaUnavailable
from varadhi.settings import Settings
from varadhi.shard import ShardJob
from varadhi.shard_ends import RunEnd


class FakeLease:
    """The `ShardLease` calls `run` makes before its control loop; `heartbeat_fails` makes
    `start_heartbeat` raise as an unreachable catalog does."""

    heartbeat_fails = False

    def __init__(self, *_args):
        self.instance, self.epoch, self.closed = "i-1", None, False

    def take(self, _owner):
        self.epoch = 1

    def start_heartbeat(self):
        if self.heartbeat_fails:
            raise KafkaUnavailable("the catalog did not answer")

    def close(self):
        self.closed = True


class FakeCatalog:
    def ensure_segment_roll(self):
        pass

    def close(self):
        pass


@pytest.fixture
def job(monkeypatch):
    """A standby `ShardJob` of shard 0 of one that takes the lease at once; its second catalog
    read (after the takeover) finds shard 0 beyond the shard count."""
    monkeypatch.setattr(ShardJob, "spark", property(lambda _self: None))  # no JVM to guard
    monkeypatch.setattr(warehouse_fs, "for_path", lambda *_a, **_k: None)
    monkeypatch.setattr(warehouse_fs, "check_writable", lambda *_a: None)
    leases: list[FakeLease] = []
    monkeypatch.setattr(
        shard_module, "ShardLease", lambda *a: leases.append(FakeLease(*a)) or leases[-1]
    )
    made = ShardJob("orders-http", 0, settings=Settings.from_env(), standby=True)
    made.catalog = FakeCatalog()
    made.leases = leases
    reads = iter([1, 0])  # the shard count each `_load` sees

    def load():
        count = next(reads)
        if made.shard >= count:
            raise InvalidArgument(f"shard {made.shard} is outside 0..{count - 1} of orders-http")
        return SimpleNamespace(shard_count=count), None, None, None

    monkeypatch.setattr(made, "_load", load)
    monkeypatch.setattr(made, "_stand_by", lambda lease: lease.take("orders-http/s1/0") or True)
    saved = handlers()
    yield made
    for sig, handler in saved.items():  # a failing test must not leave its handlers to others
        signal.signal(sig, handler)


def handlers():
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def test_a_standby_that_took_the_lease_and_then_fails_to_read_the_catalog_restores_signals(job):
    before = handlers()
    with pytest.raises(InvalidArgument, match="outside 0..-1"):
        job.run()
    assert handlers() == before
    assert job.leases[0].closed


@pytest.mark.parametrize("standby", [True, False])
def test_a_heartbeat_that_cannot_start_restores_signals_and_closes_the_lease(
    job, monkeypatch, standby
):
    monkeypatch.setattr(FakeLease, "heartbeat_fails", True)
    monkeypatch.setattr(job, "_load", lambda: (SimpleNamespace(shard_count=1), None, None, None))
    job.standby = standby
    before = handlers()
    with pytest.raises(KafkaUnavailable):
        job.run()
    assert handlers() == before
    assert job.leases[0].closed


def test_a_standby_asked_to_stop_before_it_took_the_lease_restores_signals(job, monkeypatch):
    monkeypatch.setattr(job, "_stand_by", lambda _lease: False)
    before = handlers()
    assert job.run() is RunEnd.STOPPED
    assert handlers() == before
