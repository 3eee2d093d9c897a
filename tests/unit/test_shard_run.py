"""`ShardJob.run` before its control loop, with fakes for Spark, the catalog and the lease: every
way out of it puts back the SIGINT/SIGTERM handlers it installed and closes the lease, a standby
that took the lease and then failed included. Then `QueryRun` watching a query between batches
with fake looks. The real runs are tests/integration's."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from varadhi.core.errors import InvalidArgument, KafkaUnavailable
from varadhi.kafka.settings import Settings
from varadhi.spark import warehouse_fs
from varadhi.spark.shard import job as shard_module
from varadhi.spark.shard import query_run
from varadhi.spark.shard.ends import ControlOutage, QueryEnd, RunEnd
from varadhi.spark.shard.gate import BatchGate
from varadhi.spark.shard.job import ShardJob
from varadhi.spark.shard.parts import Loaded
from varadhi.spark.shard.progress import ShardProgress
from varadhi.spark.shard.query_run import QueryRun


class FakeLease:
    """The `ShardLease` calls `run` makes before its control loop; `heartbeat_fails` makes
    `start_heartbeat` raise as an unreachable catalog does."""

    heartbeat_fails = False

    def __init__(self, *_args):
        self.instance, self.epoch, self.closed = "i-1", None, False

    def prepare(self, _owner):
        pass

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
        return Loaded(SimpleNamespace(shard_count=count), None, None, None)

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
    monkeypatch.setattr(
        job, "_load", lambda: Loaded(SimpleNamespace(shard_count=1), None, None, None)
    )
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


@pytest.fixture
def steps(job, monkeypatch):
    """A normal start of `job` whose steps record themselves: the catalog read (in the start-up
    reads' thread), the Spark session, the warehouse check, the lease's `prepare`/`take`, and
    the control loop (`_hold`, which returns at once)."""
    seen: list[str] = []
    job.standby = False

    def load():
        seen.append("catalog read")
        return Loaded(SimpleNamespace(shard_count=1), None, None, None)

    def spark(_self):
        seen.append("Spark session")

    monkeypatch.setattr(job, "_load", load)
    monkeypatch.setattr(ShardJob, "spark", property(spark))
    monkeypatch.setattr(warehouse_fs, "check_writable", lambda *_a: seen.append("warehouse"))
    monkeypatch.setattr(FakeLease, "prepare", lambda _s, _o: seen.append("prepare"))
    take = FakeLease.take
    monkeypatch.setattr(FakeLease, "take", lambda s, o: seen.append("take") or take(s, o))
    monkeypatch.setattr(job, "_hold", lambda *_a: seen.append("hold") or RunEnd.STOPPED)
    return seen


def test_the_lease_is_taken_after_the_read_the_session_and_the_warehouse_check(job, steps):
    assert job.run() is RunEnd.STOPPED
    order = steps.index
    # the lease's writer is connected while the session starts, in either order
    assert order("catalog read") < order("prepare") < order("warehouse")
    assert order("catalog read") < order("Spark session") < order("warehouse")
    assert order("warehouse") < order("take") < order("hold")
    assert job.leases[0].closed


def test_a_refused_catalog_read_starts_nothing_and_takes_no_lease(job, steps, monkeypatch):
    def refused():
        steps.append("catalog read")
        raise InvalidArgument("shard 0 is outside 0..-1 of orders-http")

    monkeypatch.setattr(job, "_load", refused)
    with pytest.raises(InvalidArgument, match="outside"):
        job.run()
    assert steps == ["catalog read"]  # no session, no lease writer, no check, no lease
    assert job.leases[0].closed


def test_a_session_that_fails_to_start_takes_no_lease(job, steps, monkeypatch):
    def no_session(_self):
        raise InvalidArgument("no Kafka connector and Delta jars for Spark")

    monkeypatch.setattr(ShardJob, "spark", property(no_session))
    with pytest.raises(InvalidArgument, match="jars"):
        job.run()
    assert "warehouse" not in steps and "take" not in steps
    assert job.leases[0].closed


class RunningQuery:
    isActive = True


@pytest.fixture
def run(monkeypatch):
    """A `QueryRun` with only the parts `_watch` and `run` use: the gate, progress, a label;
    `_watch` does not sleep."""
    monkeypatch.setattr(query_run.time, "sleep", lambda _s: None)
    parts = SimpleNamespace(
        gate=BatchGate("orders-http shard 0"),
        progress=ShardProgress(Settings.from_env(), "orders-http", 0, circuit=None),
        label="orders-http shard 0",
    )
    return QueryRun(parts, None, None)


def looks(run, monkeypatch, *answers):
    """`run._look` gives `answers` in turn (an exception is raised)."""
    queue = list(answers)

    def look(*_args):
        answer = queue.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(run, "_look", look)
    return queue


def test_the_control_loop_rides_out_kafka_errors_while_the_query_runs(run, monkeypatch):
    """A broker restarting made a catalog read time out between batches, and the shard failed
    (exit 1) although its query delivered on: now it tries again at its next look."""
    from kafka.errors import KafkaTimeoutError

    left = looks(
        run,
        monkeypatch,
        KafkaUnavailable("timed out reading the catalog topic"),
        KafkaTimeoutError("no metadata"),
        None,
        QueryEnd.STOP,
    )
    assert run._watch(RunningQuery(), None, None) is QueryEnd.STOP
    assert left == []


def test_a_kafka_error_after_the_look_stopped_the_query_fails_the_shard(run, monkeypatch):
    query = RunningQuery()
    error = KafkaUnavailable("the layout could not be saved")

    def stopped_then_failed(*_args):
        query.isActive = False
        raise error

    monkeypatch.setattr(run, "_look", stopped_then_failed)
    with pytest.raises(KafkaUnavailable):
        run._watch(query, None, None)


class EndedQuery:
    isActive = False


def ended_with(run, monkeypatch) -> list[bool]:
    """What `_ended` is told of the query's batches (`replayed`), in turn."""
    seen: list[bool] = []

    def ended(_query, _inputs, replayed):
        seen.append(replayed)
        return QueryEnd.RESTART

    monkeypatch.setattr(run, "_ended", ended)
    return seen


def test_a_batch_that_ended_before_the_watch_began_counts_as_completed(run, monkeypatch):
    """CI, after a broker outage: a query's re-run batch completed while its start was still
    being reported, then the query ended with SPARK-55271 (`ends.judge` restarts it only after
    a completed batch). The watch, begun later, counted no batch and the shard exited 1."""
    gate = run.parts.gate
    gate.open("checkpoint")
    gate.started()
    gate.run(7, lambda: False, lambda: None)  # before `_watch` begins
    seen = ended_with(run, monkeypatch)
    assert run._watch(EndedQuery(), None, None) is QueryEnd.RESTART
    assert seen == [True]


def test_a_query_that_ended_before_any_batch_of_its_own_counts_none(run, monkeypatch):
    gate = run.parts.gate
    gate.open("checkpoint")
    gate.run(6, lambda: False, lambda: None)  # the previous query's
    gate.open("checkpoint")
    gate.started()
    seen = ended_with(run, monkeypatch)
    run._watch(EndedQuery(), None, None)
    assert seen == [False]


def test_an_outage_longer_than_the_limit_fails_the_shard(run, monkeypatch):
    monkeypatch.setattr(query_run, "ControlOutage", lambda: ControlOutage(limit_s=0))
    clock = iter(range(100))
    monkeypatch.setattr(query_run.time, "monotonic", lambda: next(clock))
    looks(run, monkeypatch, KafkaUnavailable("down"), KafkaUnavailable("still down"))
    with pytest.raises(KafkaUnavailable, match="still down"):
        run._watch(RunningQuery(), None, None)


def test_control_outage_rides_out_up_to_its_limit_and_starts_again_after_ok():
    outage = ControlOutage(limit_s=10)
    assert outage.ride_out(100) and outage.since == 100
    assert outage.ride_out(110) and not outage.ride_out(110.5)
    outage.ok()
    assert outage.since is None and outage.ride_out(200) and outage.since == 200


def test_an_authorization_error_between_batches_fails_the_shard_at_once(run, monkeypatch):
    from kafka.errors import TopicAuthorizationFailedError

    looks(run, monkeypatch, TopicAuthorizationFailedError("catalog"), QueryEnd.STOP)
    with pytest.raises(TopicAuthorizationFailedError):
        run._watch(RunningQuery(), None, None)


@pytest.mark.parametrize(
    ("name", "transient"),
    [
        ("KafkaTimeoutError", True),
        ("KafkaConnectionError", True),
        ("NotLeaderForPartitionError", True),
        ("TopicAuthorizationFailedError", False),
        ("SaslAuthenticationFailedError", False),
    ],
)
def test_which_kafka_errors_are_ridden_out(name, transient):
    import kafka.errors

    from varadhi.kafka.clients import transient as is_transient

    assert is_transient(getattr(kafka.errors, name)("x")) is transient
    assert is_transient(KafkaUnavailable("timed out"))
    assert not is_transient(ValueError("not Kafka"))


def test_the_progress_after_a_query_says_what_its_last_batch_read(run, monkeypatch):
    """A pause or stop seen between batches ends the query before another look records what its
    last batch read: the next progress document (`paused`, `stopped`) must still say it, or
    status counts that batch's records as lag (5 read of 10 showed lag 10 while paused)."""
    progress = run.parts.progress
    progress.where["consumed"] = {"orders.0": {"0": 0}}  # as of the look before the last batch
    done = {"sources": [{"endOffset": {"orders.0": {"0": 5}}}]}  # its last batch's progress
    query = SimpleNamespace(isActive=False, lastProgress=done)
    source = SimpleNamespace(assign={"orders.0": [0]})
    monkeypatch.setattr(run, "_prepare", lambda: (None, source, 10))
    monkeypatch.setattr(run, "_start", lambda *_a: query)
    monkeypatch.setattr(run, "_watch", lambda *_a: QueryEnd.PAUSED)
    assert run.run() is QueryEnd.PAUSED
    assert progress.where["consumed"] == {"orders.0": {"0": 5}}


class PausedCatalog:
    """A catalog whose subscription is paused for `looks` reads, then resumed."""

    def __init__(self, looks: int):
        self.looks = looks

    def snapshot(self):
        self.looks -= 1
        return self.looks >= 0


def test_a_paused_shard_keeps_reporting_paused_while_it_waits(job, monkeypatch):
    """A paused shard published `paused` once and then nothing while it waited: after a minute
    status showed it `silent` (issue 30), though its lease was renewed and docs/operations.md
    tells operators to wait for `paused`. Every look while paused reports it again (the
    publisher's rate limit keeps that to one document every few seconds)."""
    published: list[str] = []
    monkeypatch.setattr(job._progress, "publish", lambda state, **_k: published.append(state))
    job.catalog = PausedCatalog(looks=3)
    monkeypatch.setattr(
        shard_module.subscriptions,
        "from_snapshot",
        lambda paused, _name: SimpleNamespace(paused=paused),
    )
    lease = SimpleNamespace(check=lambda: None)
    assert job._wait_while(lease, job._still_paused, interval=lambda: 0) is False
    assert published == ["paused", "paused", "paused"]


class CheckedLease:
    """The lease calls a failed query's verdict makes: still this instance's, not expired."""

    epoch, ttl_ms = 1, 15_000

    def check(self):
        pass

    def fence_reason(self, _error):
        return None

    def expired(self):
        return None


class FailedQuery:
    """A query that ended with `error` (pyspark's `exception()`; no JVM to ask)."""

    isActive = False

    def __init__(self, error):
        self._error = error

    def exception(self):
        return self._error


# What CI's broker-outage test met (shortened): a broker killed while a batch ran; the lease check
# before the batch's state commit read the catalog and timed out inside the batch function.
BATCH_MET_KAFKA_AWAY = (
    "[FOREACH_BATCH_USER_FUNCTION_ERROR] An error occurred in the user provided function in "
    "foreach batch sink. Reason: An exception was raised by the Python Proxy. Return Message: "
    'Traceback (most recent call last):\n  File "/x/varadhi/spark/shard/commit.py", line 165, in '
    'run\n    self.lease.check()\n  File "/x/varadhi/kafka/catalog.py", line 247, in _catch_up\n'
    "kafka.errors.KafkaTimeoutError: KafkaTimeoutError: Failed to get offsets by timestamps in "
    "35000 ms\n"
)


def test_a_batch_that_met_kafka_away_is_ridden_out_not_a_failed_shard(run):
    """CI: a broker killed in the middle of a batch made the batch's lease check time out
    reading the catalog; the query failed and the shard exited 1 (`query failed: ...`) instead
    of riding the outage out as it does between batches. Now the failed query's verdict is
    `KAFKA_AWAY`: `_ended` raises `KafkaUnavailable`, which the control loop rides out (the
    batch, not committed, runs again in the next query)."""
    run.parts.name, run.parts.shard, run.parts.lease = "orders-http", 0, CheckedLease()
    run.parts.circuit = SimpleNamespace(state="closed")
    inputs = SimpleNamespace(sub=SimpleNamespace(shard_count=2), circuit="closed")
    with pytest.raises(KafkaUnavailable, match="KafkaTimeoutError: Failed to get offsets") as e:
        run._ended(FailedQuery(RuntimeError(BATCH_MET_KAFKA_AWAY)), inputs, replayed=False)
    outage = ControlOutage()
    assert ShardJob._rides_out(e.value, CheckedLease(), outage)
    # Any other failure of a batch function still fails the shard.
    other = BATCH_MET_KAFKA_AWAY.replace("kafka.errors.KafkaTimeoutError", "ValueError")
    with pytest.raises(Exception, match="query failed") as failed:
        run._ended(FailedQuery(RuntimeError(other)), inputs, replayed=False)
    assert not isinstance(failed.value, KafkaUnavailable)
