"""Why a shard's query ended (`QueryEnd`), and what a failed query means for the shard (`judge`).

The control loop (`varadhi.spark.shard.job.ShardJob`) runs one Structured Streaming query at a time and
stops it between batches for a `QueryEnd` reason; a query can also end by itself, failed. What
the failure says is read once, as typed facts (`varadhi.kafka.jvm_errors.classify`), and `judge` turns
them into the shard's verdict, in this order:

1. the batch function refused a batch on purpose (`StopRequested`): not a failure (None);
2. a newer instance holds the shard (`Fenced`, by exact exception class): `FENCED`, exit 3;
   the shard's lease was not renewed for its TTL (`LeaseExpired`): `LEASE_EXPIRED`, the
   control loop waits for the lease (`ShardLease.await_renewal`) before anything else;
3. another instance wrote the checkpoint first (`ZombieCheckpointWriter`): `ZOMBIE`, restart
   the query (the files it wrote are valid);
4. SPARK-55271 after a batch that re-ran one an earlier run planned (`KafkaMetricsNPE`, only
   when a batch completed since the query started): `SPARK_55271`, restart the query;
5. a missing Kafka ACL (`Denied`): `DENIED`, the `NotAuthorized` error;
6. a Kafka call of the batch function failed with an error that may pass (`KafkaAway`: a
   broker away or restarting in the middle of a batch, a catalog read or an RQ/DLQ commit
   timing out): `KAFKA_AWAY`, the control loop rides it out (`ShardJob._rides_out`: for at most
   `CONTROL_OUTAGE_S` without a batch completing) and runs the batch again in a new query;
7. anything else: `FAILED`, exit 1.

Contract: the caller checks its lease before acting on any verdict but `FENCED` and
`LEASE_EXPIRED` (a query that
died after this instance lost its lease is fenced, not failed: a zombie's Spark may have found
the new holder's checkpoint files). Between batches, the control loop ends a running query for
what the catalog says (`catalog_change`) and, in a bounded run, when it is idle (`idle`).
`judge`, `catalog_change` and `idle` are pure (tests/unit/test_shard_ends.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING

from varadhi.kafka import jvm_errors

if TYPE_CHECKING:
    from varadhi.kafka.subscriptions import Subscription


class QueryEnd(StrEnum):
    """Why `QueryRun.run` stopped its query. `STOP` and `IDLE` end the run (exit 0);
    every other reason runs the control loop again (lease, pause, circuit, layout, then a new
    query)."""

    STOP = "stop"  # asked to stop (a signal), or the query ended without failing
    IDLE = "idle"  # `stop_when_idle_s`: nothing due, nothing running, all read
    RESTART = "restart"  # a known Spark failure after which the same query goes on
    CIRCUIT = "circuit"  # the circuit breaker opened, or a half-open probe decided
    PAUSED = "paused"  # `subscription pause`
    SUSPENDED = "suspended"  # endpoint health: every attempt failed for `suspend_after`
    CHANGED = "changed"  # the shard count or generation changed
    LAYOUT = "layout"  # the next main-topic storage topic's layout was saved


class RunEnd(IntEnum):
    """How `ShardJob.run` ended, as the process's exit code. A failure is raised instead (exit
    code 1 through `varadhi.jobs.runner`)."""

    STOPPED = 0  # on request (a signal; a standby asked to stop before it took over), or idle
    FENCED = 3  # a newer instance holds the shard: stopped without committing


class Verdict(StrEnum):
    """What a failed query means for the shard (see the module docstring)."""

    FENCED = "fenced"
    LEASE_EXPIRED = "lease-expired"
    ZOMBIE = "zombie"
    SPARK_55271 = "spark-55271"
    DENIED = "denied"
    KAFKA_AWAY = "kafka-away"
    FAILED = "failed"


def judge(failure: jvm_errors.Diagnosis | None, replayed: bool) -> Verdict | None:
    """The verdict on a query that ended with `failure` (None: it ended without one);
    `replayed`: a batch completed since the query started (pure)."""
    if failure is None or jvm_errors.StopRequested in failure:
        return None
    if jvm_errors.Fenced in failure:
        return Verdict.FENCED
    if jvm_errors.LeaseExpired in failure:
        return Verdict.LEASE_EXPIRED
    if jvm_errors.ZombieCheckpointWriter in failure:
        return Verdict.ZOMBIE
    if replayed and jvm_errors.KafkaMetricsNPE in failure:
        return Verdict.SPARK_55271
    if jvm_errors.Denied in failure:
        return Verdict.DENIED
    if jvm_errors.KafkaAway in failure:
        return Verdict.KAFKA_AWAY
    return Verdict.FAILED


def catalog_change(started: Subscription, current: Subscription, shard: int) -> QueryEnd | None:
    """Why the catalog's `current` subscription ends shard `shard`'s query started for
    `started`: `PAUSED`, `SUSPENDED` (unless this shard probes the suspension:
    `waits_on_suspension`), `CHANGED` (another shard count or generation: an offset reset), or
    None (pure)."""
    if current.paused:
        return QueryEnd.PAUSED
    if waits_on_suspension(current, shard):
        return QueryEnd.SUSPENDED
    if (current.shard_count, current.generation) != (started.shard_count, started.generation):
        return QueryEnd.CHANGED
    return None


def waits_on_suspension(sub: Subscription, shard: int) -> bool:
    """Whether shard `shard` must read and send nothing for `sub`'s suspension: every shard
    does, but the one that suspended it when it is to find the endpoint healthy again with its
    circuit's probes (`resume: probe`) (pure)."""
    s = sub.suspended
    return s is not None and not (s.resume == "probe" and s.shard == shard)


def idle(
    after_s: float | None,
    quiet_s: float,
    retry_waiting: bool,
    batch_running: bool,
    all_read: Callable[[], bool],
) -> bool:
    """Whether a run bounded by `stop_when_idle_s` (`after_s`; None: unbounded) ends now: no
    parked retry or DLQ re-drive waits for a tick (`retry_waiting`), no batch runs, none ended for more than `after_s` (`quiet_s`
    since the last) and the query has read all its partitions hold. `all_read` is asked last,
    only when all else holds (it asks Kafka for the end offsets)."""
    if after_s is None or retry_waiting or batch_running or quiet_s <= after_s:
        return False
    return all_read()


# How long the control loop rides out Kafka errors of its looks between batches (the catalog
# read, progress, ticks, end offsets) while the query delivers on, before it fails the shard.
# The lease bounds it too: once the lease expires, `lease.check` ends the shard as fenced.
CONTROL_OUTAGE_S = 120.0


class ControlOutage:
    """The control loop's Kafka outage between batches (pure; the clock is the caller's). A
    broker restarting, or a catalog read timing out, must not end a shard whose query delivers
    on: `ride_out(now)` records a look that failed and says whether to go on (True while looks
    have failed for at most `limit_s`; False: the caller raises the error), `ok()` ends the
    outage, `since` is when it started (the caller warns once, when `since == now`)."""

    def __init__(self, limit_s: float = CONTROL_OUTAGE_S):
        self.limit_s = limit_s
        self.since: float | None = None

    def ride_out(self, now: float) -> bool:
        if self.since is None:
            self.since = now
        return now - self.since <= self.limit_s

    def ok(self) -> None:
        self.since = None
