"""The library runtime: a subscription delivered by plain Python processes, without Spark.

`Consumer(subscription)` reads the subscription and its topics from the catalog, refuses what
it does not support (`support.unsupported`), and then, between `start()` and `stop()`, is one
member of the Kafka consumer group `varadhi-library.<subscription>`: it reads every storage
topic of the main topic and the subscription's RQ on the partitions of the slots it is given
(`assign`), and delivers through the HTTP engine the shards use (`HttpDeliverer`: one request
per message, or with `delivery.mode: batch` up to `max_messages` messages of different keys per
request, the shards' wire format and per-message answers) or through a Python `handler`
(`varadhi.library.handler`).

Threads. One thread owns the Kafka consumers, the group's (kafka-python: membership and
commits) and the fetcher (librdkafka, assigned what the group gave: `varadhi.library.fetch`):
it polls both (`_poll`), hands records to the `Scheduler`,
reads only the RQ while `max_pending` messages are held (`_full`, `fetch.Reading`), and commits (`offsets.Ledger`: the lowest
unfinished offset and, in the metadata, what finished above it). Delivery runs on another
thread (the engine's loop, `max_in_flight` requests at a time, its streams the messages handed
out: `sources`) or on `max_in_flight` handler threads; with nothing to hand out they wait to be
woken (`_await_work`), not polling. The RQ and DLQ are written by an idempotent librdkafka
producer (`varadhi.kafka.acked_producer`); a message's offset counts as
finished only once its outcome is final: delivered, or its RQ/DLQ copy acknowledged. A fourth
thread applies `dlq unsideline` re-drives to the slots the member holds (`_redrive`,
`varadhi.library.redrive`): it puts dead letters back on the RQ, where they are read as retries.

Order. Within a slot, a key's messages are handed out one at a time in origin order
(`scheduler`); a failed one whose retry falls due within `retry.in_place_window_ms` of its
first failure waits in memory as its key's head (its offset unfinished), as a shard's task
waits for it; any other retry goes to the RQ and its key waits until the copy is read back,
due and delivered. When a slot is
assigned, nothing of it is handed out before its RQ partitions were read to the end they had
then (`_caught_up`), so a key with a retry pending from before a restart or rebalance is
blocked behind its copy before any of its later messages is delivered.

Storage topics (`crossing`). A slot hands out nothing of the main topic's storage topic T_i+1
before it may cross from T_i: T_i sealed and read to its end by the slot, and, where T_i+1 moves
groups to other slots (K=1), the group's commits at the end of T_i and of the RQ with no key
blocked, or some member already reading T_i+1 (a commit on it). Until then the slot's T_i+1
partitions are paused (what a fetch brings of them anyway is sought back, never held), checked
every `CROSS_CHECK_S` (`_cross`, `crossing_state`); status shows a wait at a K=1 boundary. A storage
topic added while the member runs is followed (`_check_catalog`): it subscribes again, and the
assignor gives a topic's partitions only once every member reads it.

Block mode (`on_dead_letter: block`, `varadhi.library.blocking`). A dead letter blocks its key:
its later main-topic messages are sidelined to the DLQ behind it, and the key's blocks live in the
compacted GroupState topic (`group_state_topic`), read for each new slot before any of it is
handed out, so a restarted member or a slot's new owner holds the key blocked; the re-driven
copy's delivery lifts the block. Each offset of such a message finishes only once its DLQ record
and the key's GroupState record are acknowledged (`queue_writer`, `blocking.after_acks`).

Rebalance. When slots are revoked the member hands out nothing more of them, awaits their
deliveries in flight (bounded: `settle`) and commits what finished of them (`_revoke`:
asynchronously, as kafka-python's rebalance listener runs on its I/O thread, which must not
block; the commit reaches the broker before the member's JoinGroup);
slots the rebalance gives back go on where they were (what is read again is skipped), slots
gone wait for their deliveries in flight to end (up to the endpoint's request timeout) and are
forgotten, those ends uncommitted: the next owner delivers again what was still in flight
after the revoke's wait, and, when the revoke's commit was refused, what finished since the
last commit (`commit_interval_s`) too: at least once. A member whose session may have lapsed
(it hung) hands out nothing until the group answers or assigns it again (`fence`).

Filter, shaping, trace. A main-topic record the subscription's filter does not match
(`filters.matches`, the Python twin of the shards' Spark column) is dropped as it is read, before
it is scheduled: counted (`filtered`), traced, its offset finished; RQ records are never
filtered. Requests are built by `group_state.request_of` with the endpoint's request shaping, as
a shard's; with `key_header` a main-topic record's key, in its text form, is kept in the
shard-only header `messages.H_KEY`, which its RQ and DLQ copies carry. A message whose request
cannot be shaped (or has a bad id) is dead-lettered as malformed with the reason. With a `trace`
in the spec, every attempt and every message routed without one (filtered, malformed to the DLQ)
is an event of the subscription's trace topic, its `shard` the message's slot.

Rate limit. With `endpoint.max_rate` (HTTP only: a handler is not paced), a member holding k of
the subscription's S slots paces its one HTTP engine at k/S of the limit (`rate_limit.slot_share`,
slowed down by 429/503 as a shard's tasks are), set at each rebalance (`_rebalanced`, `shares`,
applied by the engine's thread in `_take` before it hands out anything of the new assignment). Why the
members' sum never exceeds the limit: the group's rebalance protocol is eager (kafka-python's
default for `SlotAssignor`), so every member gives up all its slots (`_revoke` closes them: none
is handed out) before any member gets the new assignment, and one generation's assignments are
disjoint; so at any time the slots messages are handed out from are disjoint among members, and
each member's rate is its own slots' part, k/S, of the limit: at most S/S in sum. During a
rebalance the members hand out nothing new (requests already sent finish), and each takes its new
share before it hands out its first message of the new generation; the pacer lets at most one
message go at the old rate's time after a share shrinks. Hazard: a member that left the group
without knowing it (it hung past its session) goes on delivering what it had handed out
at its old share until its next poll, next to the slots' new owners: the sum may
then exceed the limit, as duplicates may come (at least once).

Concurrency limit. `consumption.max_in_flight` is the subscription's: a member holding slots
of it has their parts of it in flight at most (`assign.in_flight_share`, at least 1; capped by
`Options.max_in_flight`), set at each rebalance as the rate's share is and applied by the
engine's thread in `_take` (the engine's `max_in_flight`) or, with a handler, by `_take` itself
(one call per message handed out). The argument that the members' sum stays within the limit is
the rate limit's (above): the eager rebalance, and a revoke that awaits its slots' deliveries in
flight (up to `REVOKE_WAIT_S`: one that outlasts it is in flight next to the new owner's).

Circuit. Messages are handed out through the member's circuit breaker (`_take`,
`shared_circuit.SharedCircuit.admit`: none while open, `probes` while half-open), every attempt
is counted at its settling, and a thread of its own (`_share_circuit`) ticks the circuit and
shares the counts with the other members, so it acts on the subscription's error rate.

Pause. The member reads the subscription from the catalog every `CATALOG_CHECK_S`. While it
is paused the member hands out nothing more (deliveries in flight end, their outcomes are
written and committed), pauses every partition the fetcher reads (the membership consumer goes on
polling, so it stays in the group) and reports `paused`; after a resume it resumes them and
delivers on. What it held when paused stays held, in order, and goes first.

Offset reset. A member stops (and one being started refuses) while an offset reset of the
subscription is under way (`position`): the reset commits the group's new offsets once no member
is left in it.

Runtimes. Only a subscription of `runtime: library` is run (`subscriptions.check_runtime`, at
start and with each look at the catalog: a member still running when the runtime was changed
to `spark` stops, with an error, before the shards are resumed). Any other edit of the
subscription stops it with an error too: the consumer does not follow spec changes yet.

Progress. Every `PROGRESS_S` (and when it pauses, resumes or stops) the member publishes a
document under `<subscription>/member/<member>` on the progress topic (`kafka.progress`):
its state, slots, partitions, counters and committed offsets; `varadhi status` shows them.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from kafka import ConsumerRebalanceListener, TopicPartition
from kafka.errors import (
    AuthorizationError,
    CommitFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
)

from varadhi.core import filters
from varadhi.core import messages as m
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.delivery import HttpDeliverer, Outcome
from varadhi.core.errors import InvalidArgument, KafkaUnavailable, NotAuthorized, VaradhiError
from varadhi.core.group_state import (
    OVER_LIMIT,
    out_bytes,
    with_response,
)
from varadhi.core.policies import CircuitPolicy
from varadhi.core.queue_records import MAX_REQUEST_BYTES
from varadhi.core.retry import Decision, retries_in_place
from varadhi.core.trace import Next
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.acked_producer import acked_producer
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.progress import ProgressPublisher
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import Suspension
from varadhi.library import (
    dedup_topic,
    fence,
    group_state_topic,
    intake,
    join_guard,
    position,
    redrive,
    settle,
    suspension,
)
from varadhi.library import handler as handlers
from varadhi.library.assign import SlotAssignor, slot_of
from varadhi.library.blocking import Blocking, RedriveHold
from varadhi.library.crossing_state import CrossingState, KafkaBoundary
from varadhi.library.dedup import DedupMemory
from varadhi.library.dedup_topic import DedupReader
from varadhi.library.fetch import Reading, Record
from varadhi.library.keys import OrderingKey
from varadhi.library.ledgers import Ledgers
from varadhi.library.member_trace import MemberTrace, trace_target
from varadhi.library.offsets import Ledger, decode
from varadhi.library.queue_writer import Queues, QueueWriter, retry_target
from varadhi.library.scheduler import Scheduler, Work
from varadhi.library.shared_circuit import CircuitLink, SharedCircuit
from varadhi.library.shares import Limits, Shares
from varadhi.library.sources import Desk, Messages, run_handler
from varadhi.library.support import Unsupported, unsupported

log = logging.getLogger(__name__)

#: The longest a delivery thread with nothing to hand out waits before it looks again (new work
#: wakes it at once; this is for what changes with time alone: `_await_work`).
IDLE_WAIT_S = 0.1
#: How often the subscription's catalog record is read again (a pause, a resume, an edit).
CATALOG_CHECK_S = 5.0
#: How often a member publishes its progress document (also on a pause, a resume and a stop).
PROGRESS_S = 5.0
POLL_MS = 50
#: The most records one poll of the fetcher returns.
MAX_RECORDS = 1000
#: How long the member's producer gathers RQ, DLQ, GroupState and dedup records into one
#: request. A retry waits its backoff (>= 100 ms) anyway, and a finished offset is committed
#: every `commit_interval_s`; at 1 ms every retry was a produce request of its own, and the
#: producer's Python cost about a third of a retry's CPU (bench/library.py --fail 0.1:
#: 116-118 -> 104-105 us a message).
LINGER_MS = 10
#: How often a slot that has a storage topic after its frontier looks whether it may cross.
CROSS_CHECK_S = 1.0
#: The longest a revoke waits for the revoked slots' deliveries in flight (`settle`; the
#: endpoint's request timeout when shorter): the group's rebalance waits for it.
REVOKE_WAIT_S = 5.0
#: What refusals and errors call this runtime's processes.
PROCESS = "a library member (varadhi-consumer)"


def group_id(subscription: str) -> str:
    """The Kafka consumer group of a subscription's library members."""
    return f"varadhi-library.{subscription}"


def member_id() -> str:
    """A name for this member in progress documents: host, process id and a random suffix (two
    consumers of one process differ), without "/"."""
    host = socket.gethostname().replace("/", "_") or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Options:
    """`ordering_key`: see `keys`. `max_pending`: messages read and not finished per process
    (delivering, waiting behind their key, waiting for an RQ copy): polling stops at it.
    `max_in_flight`: this process's own cap on concurrent requests (in batch mode each of up
    to `delivery.max_messages` messages) or handler calls, below its share of the
    subscription's `consumption.max_in_flight` (`assign.in_flight_share`; None: its share only).
    `commit_interval_s`: how often finished offsets are committed: what finished since the
    last commit is delivered again after a kill or a hang (its share of the duplicates); 0.2 s
    cost 2-12% more CPU per message than 1 s (18-21% with 10% of attempts failing: larger
    commit metadata; `bench/library.py --commit-interval`), and cut that share of a chaos
    run's duplicates three- to five-fold; 0.1 s halved it again (0.80-0.93% -> 0.30-0.47% of a
    chaos run's messages) at no cost that showed above the machine's noise, where 0.05 s cost
    4-6 us a message at 14,000 a second (docs/testing.md). `session_timeout_ms`: how
    long the group waits for a silent member (killed, or hung) before its slots move to the
    others (None: kafka-python's 45 s; the broker bounds it, 6 s to 30 min by default); its
    heartbeat goes every third of it, at most every 3 s."""

    ordering_key: OrderingKey = field(default_factory=OrderingKey)
    max_pending: int = 10_000
    max_in_flight: int | None = None
    commit_interval_s: float = 0.1
    session_timeout_ms: int | None = None


class Consumer:
    """One member of a subscription's library consumer group (see the module docstring).

    `start()` raises `Unsupported` (naming each feature), `NotFound`, or `KafkaUnavailable`
    before it starts anything. `stop()` ends deliveries in flight, commits and leaves the
    group; a failure (a write to the RQ/DLQ refused, say) stops the consumer too, and
    `health()` says why. Not restartable: make a new one."""

    def __init__(
        self,
        subscription: str,
        settings: Settings | None = None,
        handler: handlers.Handler | None = None,
        options: Options | None = None,
    ):
        self.name = subscription
        self.settings = settings or Settings.from_env()
        self.handler = handler
        self.options = options or Options()
        if self.options.max_pending < 1:
            raise InvalidArgument(
                f"must be >= 1, got {self.options.max_pending}", field="max_pending"
            )
        self._lock = threading.Condition()
        self._sched = Scheduler()
        self._ledgers = Ledgers()  # per partition held: its offsets and its last commit
        self._catch_up: dict[int, dict[TopicPartition, int]] = {}  # slot -> RQ end offsets
        # which storage topics of the main topic each slot reads (`crossing_state`; from start)
        self._crossing: CrossingState | None = None
        self._revoked: set[TopicPartition] = set()  # by the listener, for `_rebalanced`
        self._lost: set[TopicPartition] = set()  # revoked after the member left the group
        self._assigned: set[TopicPartition] | None = None  # the last assignment, unprocessed
        self._stopping = threading.Event()
        self._paused = False  # paused or suspended (`suspension.holds`): hand out, read nothing
        self._suspended: Suspension | None = None  # the subscription's, as last seen
        self._pause_asked = False  # the subscription is paused, as last seen
        self._next_publish = 0.0  # monotonic time of the next progress document
        self._next_member_poll = 0.0  # monotonic time of the membership consumer's next poll
        self.member = member_id()
        self._state = "new"
        self._error: str | None = None
        self._failure: BaseException | None = None  # what ended it (`failure`)
        self._threads: list[threading.Thread] = []
        self._rng = random.Random()
        self._trace = MemberTrace(None, 0)  # its own from `start` (`member_trace`)
        # its shares of `endpoint.max_rate` and `consumption.max_in_flight` (from start)
        self._shares: Shares | None = None
        self._blocking: Blocking | None = None  # on_dead_letter: block
        # the spec's circuit from `start` (`shared_circuit`: on the subscription's error rate)
        self._circuit = SharedCircuit(CircuitPolicy(enabled=False))
        self._circuit_link: CircuitLink | None = None
        # `dedup_window` (`varadhi.library.dedup`): the ids delivered within it, from its topic
        self._dedup_topic: str | None = None
        self._dedup: DedupMemory | None = None
        self._dedup_reader: DedupReader | None = None
        self._counts = dict.fromkeys(
            (
                "read",
                "filtered",
                "delivered",
                "attempts",
                "failures",
                "retried",
                "retried_in_place",
                "dead_lettered",
                "duplicates",
                "sidelined",
                "skipped_finished",
                "deduplicated",
                "commits",
                "rebalances",
            ),
            0,
        )

    # -- public API -------------------------------------------------------------------------
    def start(self) -> Consumer:
        if self._state != "new":
            raise VaradhiError(f"consumer of {self.name} was started already")
        self._state = "starting"
        catalog = Catalog(self.settings)
        try:
            snap = catalog.snapshot()
            sub = subscriptions.from_snapshot(snap, self.name)
            subscriptions.check_runtime(sub, "library", PROCESS)
            under_way = position.reset_under_way(snap, self.name)
            if under_way is not None:
                raise InvalidArgument(under_way, field="subscription")
            main = topics.from_snapshot(snap, sub.spec.topic)
            rq = topics.from_snapshot(snap, sub.spec.rq_topic)
            dlq = topics.from_snapshot(snap, sub.spec.dlq_topic)
            change = snap.get(DocKind.OPERATION, f"{self.name}/{OpKind.CHANGE_SHARDS}")
            missing = unsupported(sub, rq, dlq, change)
            if missing:
                raise Unsupported(self.name, missing)
            limits = topics.max_message_bytes(
                catalog, [rq.produce_topic.name, dlq.produce_topic.name]
            )
            traced = trace_target(self.settings, self.name, sub.spec.trace)
            if sub.spec.on_dead_letter == "block":
                group_state_topic.ensure_topic(self.settings, self.name, dlq)
            if sub.spec.dedup_window_ms:
                self._dedup_topic = dedup_topic.ensure_topic(
                    self.settings, self.name, int(sub.spec.dedup_window_ms), dlq
                )
            self._progress = ProgressPublisher(
                self.settings, self.name, None, PROGRESS_S, member=self.member
            )
        except BaseException:
            self._state = "failed"
            catalog.close()
            raise
        self._catalog, self._sub = catalog, sub
        self._circuit = SharedCircuit(sub.spec.circuit_breaker)
        self._paused = sub.paused or suspension.holds(sub.suspended)
        self._suspended, self._pause_asked = sub.suspended, sub.paused
        self._spec = sub.spec
        self._crossing = CrossingState(main, sub.shard_count, sub.spec.grouped)
        self._intake = intake.Intake(
            self.name,
            sub.spec,
            rq.produce_topic.name,
            self.options.ordering_key,
            dedup=self._dedup_topic is not None,
        )
        self._rq, self._dlq = rq.produce_topic, dlq.produce_topic
        self._dlq_queue = dlq
        self._queues = Queues(
            rq.produce_topic,
            dlq.produce_topic,
            {t: min(n, MAX_REQUEST_BYTES) for t, n in limits.items()},
            sub.shard_count,
        )
        # the most this process ever has in flight: the subscription's limit, or its own cap
        self._max_in_flight = min(
            sub.spec.consumption.max_in_flight,
            self.options.max_in_flight or sub.spec.consumption.max_in_flight,
        )
        if self.handler is None:  # validates the endpoint before anything starts
            self._deliverer = HttpDeliverer(
                sub.spec.endpoint, self._max_in_flight, sub.spec.delivery
            )
        self._shares = Shares(
            Limits(
                slots=sub.shard_count,
                in_flight=sub.spec.consumption.max_in_flight,
                cap=self._max_in_flight,
                max_rate=sub.spec.endpoint.max_rate,
                http=self.handler is None,
            )
        )
        self._trace = MemberTrace(traced, sub.shard_count)
        self._producer = acked_producer(
            self.settings, **{"linger.ms": LINGER_MS, "message.max.bytes": MAX_REQUEST_BYTES}
        )
        self._writer = QueueWriter(
            self._producer, self._queues, self._ledgers.finished, self._write_failed
        )
        if sub.spec.on_dead_letter == "block":
            self._blocking = Blocking(
                self._sched,
                self._producer,
                group_state_topic.topic_name(self.name),
                self._dlq.partitions,
                sub.shard_count,
                partial(self._writer.send, "dlq"),
                self._sideline,
            )
        # Committed offsets and their metadata, end offsets: read with a consumer of the group
        # that never joins it (`_rebalanced`).
        self._offsets = kafka_clients.consumer(
            self.settings,
            group_id=group_id(self.name),
            enable_auto_commit=False,
            isolation_level="read_committed",
        )
        self._consumer = kafka_clients.consumer(
            self.settings,
            client_id=self.member,  # what Kafka's view of the group names (`status.group_members`)
            group_id=group_id(self.name),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            partition_assignment_strategy=[SlotAssignor(sub.shard_count)],
            **_session_kwargs(self.options.session_timeout_ms),
        )
        fetch = None
        try:
            # reads what the member holds: librdkafka, assigned by `_rebalanced` (`fetch`); made
            # here, so that a refusal (an OAUTHBEARER token not had) closes what was opened
            fetch = Reading.of(self.settings, self.member, self._rq.name)
            self._fetch = fetch
            # kafka-python 3.0.12 could lose a join redone for new metadata: the member then
            # held nothing, for good (`join_guard`)
            join_guard.guard(self._consumer)
            # a member whose session may have ended hands out nothing (`fence`)
            self._fenced = fence.Fence(self._consumer)
            self._loop_sleep = settle.loop_sleep(self._consumer)  # for `_revoke`
            policy = sub.spec.circuit_breaker
            # reads and writes the members' reports: the circuit's and endpoint health's evidence
            if policy.enabled or policy.suspend_after_ms is not None:
                self._circuit_link = CircuitLink(
                    self.settings, self.name, self.member, self._circuit
                )
            if self._dedup_topic is not None:  # the window's ids before anything is handed out
                memory = DedupMemory(int(sub.spec.dedup_window_ms))
                self._dedup_reader = DedupReader(self.settings, self._dedup_topic, memory)
                self._dedup_reader.catch_up(_now_ms())
                self._dedup = memory
        except BaseException:
            self._state = "failed"
            for client in (self._consumer, self._offsets):
                client.close(autocommit=False)
            if fetch is not None:
                fetch.close()
            if self._dedup_reader is not None:
                self._dedup_reader.close()
            self._producer.close(timeout=10)
            self._catalog.close()
            raise
        self._subscribe()
        self._state = "running"
        self._spawn(self._consume, "kafka")
        self._spawn(self._redrive, "redrive")
        if self._circuit_link is not None:
            self._spawn(self._share_circuit, "circuit")
        if self._dedup_reader is not None:
            self._spawn(self._follow_dedup, "dedup")
        if self.handler is None:
            self._spawn(self._deliver_http, "http")
        else:
            for i in range(self._max_in_flight):
                self._spawn(self._deliver_handler, f"handler-{i}")
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop delivering, let what is in flight end, commit, leave the group. Idempotent."""
        self._stopping.set()
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until the consumer stopped (by `stop` or a failure); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def health(self) -> dict[str, Any]:
        """`state` (new, starting, running, suspended, pausing, paused, stopping, stopped,
        failed; `suspended`: endpoint health, `suspended` says why and how it ends),
        `error` (why it failed), `member` (its name in `varadhi status`), the partitions and
        slots it holds, whether it still catches up on the RQ of a slot before reading its
        main-topic partitions, per slot the last storage topic of the main topic it reads
        (`frontier`, an index; `crossing`), what its slots wait for at a switch that moves
        groups (`waiting`, else None), and `rate_limit`: the messages a second it may send, its slots'
        share of `endpoint.max_rate` (None: no limit, or a handler delivers), and
        `max_in_flight`: the requests (or handler calls) it may have at once, its slots' share
        of `consumption.max_in_flight` (`assign.in_flight_share`). `pausing`: the
        subscription is paused and deliveries are still in flight; `paused`: none is, and
        nothing more is handed out or read until a resume."""
        crossing, shares = self._crossing, self._shares  # None before start
        with self._lock:
            parts = sorted(f"{tp.topic}/{tp.partition}" for tp in self._ledgers.partitions())
            return {
                "state": self._shown_state(),
                "error": self._error,
                "member": self.member,
                "partitions": parts,
                "slots": sorted(self._slots_of(self._ledgers.partitions())),
                "catching_up": sorted(s for s, ends in self._catch_up.items() if ends),
                "frontier": {} if crossing is None else crossing.frontiers(),
                "waiting": None if crossing is None else crossing.waiting,
                "rate_limit": None if shares is None else shares.rate,
                "max_in_flight": 0 if shares is None else shares.in_flight,
                "circuit": self._circuit.status(),
                "suspended": None if self._suspended is None else self._suspended.to_dict(),
            }

    @property
    def failure(self) -> BaseException | None:
        """The error that ended a `failed` consumer (a `VaradhiError` carries its exit code:
        `NotAuthorized` 4 for a missing ACL), else None."""
        with self._lock:
            return self._failure

    def counters(self) -> dict[str, int]:
        """Totals since start: records `read`, main-topic messages the filter dropped
        (`filtered`), messages `delivered`, `attempts` and `failures`, `retried` (written to the
        RQ), `dead_lettered` (`sidelined` among them: read behind a dead letter of their key,
        block mode), `duplicates` (copies finished unsent), `skipped_finished` (finished before
        a restart, per the commit), `commits`, `rebalances`; and now: `pending` (held),
        `in_flight`, `blocked` (keys blocked behind a dead letter), `paused` (1 while the
        subscription is paused), `suspended` (1 while it is suspended: endpoint health)."""
        with self._lock:
            out = dict(self._counts)
            out["pending"] = self._sched.pending
            out["in_flight"] = self._handed_out()
            out["blocked"] = 0 if self._blocking is None else self._blocking.count()
            out["paused"] = int(self._pause_asked)
            out["suspended"] = int(self._suspended is not None)
            return out

    def _shown_state(self) -> str:
        """`_state`, or while running `suspended`, or paused `pausing`/`paused` (under the
        lock)."""
        if self._state != "running":
            return self._state
        if self._suspended is not None and not self._pause_asked:
            return "suspended"
        if not self._paused:
            return self._state
        return "pausing" if any(self._sched.in_flight.values()) else "paused"

    # -- the Kafka thread ---------------------------------------------------------------------
    def _consume(self) -> None:
        next_commit = time.monotonic() + self.options.commit_interval_s
        next_check = time.monotonic() + CATALOG_CHECK_S
        try:
            while not self._stopping.is_set():
                # paused, it polls on (paused partitions give nothing): it stays a member; full,
                # it reads the RQ alone (a retry's copy read back can free what waits behind it)
                batches = self._poll(main=self._paused or not self._full())
                if self._assigned is not None:
                    self._transient_ok(self._rebalanced, "the new assignment is not set up")
                self._ledgers.apply_finished()
                for tp, records in batches.items():
                    self._ingest(tp, records)
                if self._paused:  # partitions a rebalance gave it since
                    self._pause_reading()
                self._caught_up()
                self._transient_ok(self._cross, "the storage-topic boundary is not checked")
                now = time.monotonic()
                if now >= next_commit:
                    self._commit()
                    next_commit = now + self.options.commit_interval_s
                if now >= next_check:
                    self._transient_ok(self._check_catalog, "the catalog is not read")
                    next_check = now + CATALOG_CHECK_S
                self._publish()
        except BaseException as e:  # noqa: BLE001 - reported through health() and the CLI
            self._fail(e)
        finally:
            self._state = "stopping" if self._state != "failed" else "failed"
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
            try:
                self._producer.flush(timeout=30)
                self._ledgers.apply_finished()
                self._commit(final=True)
            except BaseException as e:  # noqa: BLE001
                self._fail(e)
            finally:
                self._consumer.close(autocommit=False)
                self._fetch.close()
                self._offsets.close(autocommit=False)
                self._producer.close(timeout=10)
                self._catalog.close()
                if self.handler is None:
                    self._deliverer.close()
                self._trace.close()
                if self._dedup_reader is not None:
                    self._dedup_reader.close()
                if self._state != "failed":
                    self._state = "stopped"
                try:
                    self._publish(force=True)
                except BaseException as e:  # noqa: BLE001 - its last word only
                    log.info("%s: last progress document not sent (%s)", self.name, e)
                self._progress.close()

    def _poll(self, main: bool) -> dict[TopicPartition, list[Record]]:
        """One turn of reading. The membership consumer's poll runs the group's rebalances
        (it fetches nothing: every partition it is assigned is paused, `_assign`). While the
        fetcher has nothing to read (nothing assigned, or all paused), or a join is needed or
        under way (`join_guard.joining`: a poll must await it), that poll waits up to `POLL_MS`
        and nothing is read (a join revoked every partition: nothing would be handed out).
        Otherwise it polls without waiting, at most every `POLL_MS`, and takes what the
        fetcher read (the RQ's alone unless `main`), waiting up to `POLL_MS` for the first
        record."""
        now = time.monotonic()
        if not self._fetch.reading() or join_guard.joining(self._consumer):
            self._consumer.poll(timeout_ms=POLL_MS)
            self._next_member_poll = now + POLL_MS / 1000
            return {}
        if now >= self._next_member_poll:
            self._consumer.poll(timeout_ms=0)
            self._next_member_poll = now + POLL_MS / 1000
        return self._fetch.poll(POLL_MS, MAX_RECORDS, main)

    # -- re-drives ----------------------------------------------------------------------------
    def _redrive(self) -> None:
        """(Its own thread, so that reading the DLQ never holds up polling) Every
        `CATALOG_CHECK_S` (every second while a rate-capped one is under way) while not paused,
        apply the re-drives pending for the slots this member holds (`varadhi.library.redrive`:
        at least once). A Kafka error or a timeout (a read, a
        look, a write to the RQ) is logged and the re-drive tried again at the next look; any
        other error stops the member."""
        redriver = redrive.Redriver()
        hold = None
        if self._blocking is not None:
            hold = RedriveHold(self._blocking, self._lock, self._rq.name, self._intake.key_of)
        try:
            while not self._stopping.wait(1.0 if redriver.pacing else CATALOG_CHECK_S):
                with self._lock:
                    if self._paused:
                        continue
                    slots = self._slots_of(self._ledgers.partitions())
                try:
                    redriver.apply_pending(
                        self.settings,
                        self._catalog,
                        self._sub,
                        self._rq,
                        self._dlq_queue,
                        slots,
                        self._producer,
                        self._queues.rq_limit,
                        _now_ms(),
                        hold,
                    )
                except (TimeoutError, KafkaError, KafkaUnavailable) as e:
                    log.warning("%s: re-drives not applied now (%s); trying again", self.name, e)
        except BaseException as e:  # noqa: BLE001 - reported through health() and the CLI
            self._fail(e)

    def _transient_ok(self, step: Callable[[], None], what: str) -> None:
        """Run a step of the Kafka thread; a Kafka error that may pass by itself (a broker
        away or restarting: `kafka_clients.transient`) is logged and the step is tried again
        at its next turn, so the member rides out an outage; any other error stops it."""
        try:
            step()
        except Exception as e:
            if not kafka_clients.transient(e):
                raise
            log.warning("%s: %s now (%s); trying again", self.name, what, e)

    def _ingest(self, tp: TopicPartition, records) -> None:
        ledger = self._ledgers.get(tp)
        if ledger is None or self._crossing.held(tp):  # not set up yet, or past its slot's frontier
            self._read_again(tp, records)
            if ledger is not None:
                self._fetch.pause(tp)
            return
        works = []
        dropped = 0
        # Only main-topic records are filtered: what reached the RQ passed the filter already.
        keep = None if tp.topic == self._rq.name else self._spec.filter
        for r in records:
            if not self._ledgers.read(ledger, r.offset):
                self._counts["skipped_finished"] += 1
                continue
            if keep is not None and not filters.matches(keep, r.key, r.headers):
                self._ledgers.finish(ledger, r.offset)
                dropped += 1
                self._trace.filtered(tp, r, self._slot(tp))
                continue
            work = self._work(tp, r)
            if work is None:
                self._ledgers.finish(ledger, r.offset)
                continue
            works.append(work)
        with self._lock:
            self._counts["read"] += len(records)
            self._counts["filtered"] += dropped
            for work in works:
                if self._blocking is not None and not self._blocking.admit(work):
                    continue  # behind a dead letter: sidelined
                for dup in self._sched.add(work):
                    self._counts["duplicates"] += 1
                    ledger_of = self._ledgers.get(TopicPartition(dup.topic, dup.partition))
                    if ledger_of is not None:
                        self._ledgers.finish(ledger_of, dup.offset)
            self._lock.notify_all()

    def _work(self, tp: TopicPartition, r) -> Work | None:
        """A record as a `Work` (`Intake.work`; None: dropped)."""
        index = 0 if tp.topic == self._rq.name else self._crossing.index_of(tp.topic)
        return self._intake.work(tp, r, index, self._slot(tp))

    def _full(self) -> bool:
        """Whether reading the main topic waits (`intake.full`)."""
        with self._lock:
            catching_up = any(self._catch_up.values())
            return intake.full(self._sched.pending, self.options.max_pending, catching_up)

    def _read_again(self, tp: TopicPartition, records) -> None:
        """Drop `records` (polled before `tp` was set up, or past its slot's frontier): the
        partition, if still assigned, is read again from the first."""
        self._fetch.seek(tp, records[0].offset)

    def _caught_up(self) -> None:
        """Hand out a slot's messages once its RQ was read to the end it had at assignment."""
        fetch = self._fetch
        owned = fetch.assignment()
        done = set()
        for slot, ends in self._catch_up.items():
            for tp, end in list(ends.items()):
                if tp in owned and fetch.position(tp) >= end:
                    del ends[tp]
            if not ends:
                done.add(slot)
        if done:
            with self._lock:
                done -= self._slots_of(self._revoked)  # revoked since: `_rebalanced` drops it
                for slot in done:
                    del self._catch_up[slot]
                self._reopen(done)
                self._lock.notify_all()

    # -- storage topics of the main topic (`crossing`) ----------------------------------------
    def _subscribe(self) -> None:
        """Subscribe to every storage topic of the main topic and the RQ (again after a
        storage topic was added: the group rebalances, and `SlotAssignor` assigns a topic only
        once every member reads it)."""
        names = [*self._crossing.names(), self._rq.name]
        for name in names:
            self._offsets.partitions_for_topic(name)  # else its offset look-ups miss some
        # metadata before the first join, else it joins again at once (a wasted rebalance)
        join_guard.subscribe(self._consumer, names, _Listener(self))

    def _cross(self) -> None:
        """(Every `CROSS_CHECK_S` while a slot it holds has a storage topic after its
        frontier) Move each such slot's frontier over every boundary it may cross
        (`CrossingState.cross`), resume reading what it then reads, and note what a slot waits
        for at a boundary that moves groups (`CrossingState.waiting`, for status)."""
        state = self._crossing
        if state.crossed_all():
            if state.note_waiting(None):
                self._publish(force=True)
            return
        if not state.due(time.monotonic(), CROSS_CHECK_S):
            return
        mq = topics.from_snapshot(self._catalog.snapshot(), state.main.name)
        now_ms = _now_ms()
        blocked_count = None
        if self._blocking is not None:
            blocked_count = partial(group_state_topic.blocked_count, self.settings, self.name)
        boundary = KafkaBoundary(
            self._fetch, self._offsets, self._rq, self._sub.shard_count, blocked_count
        )
        moved, waiting = state.cross(mq, now_ms, boundary)
        for slot, name in moved:
            log.info("%s: slot %d now reads %s", self.name, slot, name)
        if state.note_waiting(waiting):
            self._publish(force=True)  # status shows the wait, and its end, at once
        if moved and not self._paused:
            self._resume_reading()

    def _commit(self, final: bool = False) -> None:
        """Commit each partition's position (`Ledger.position`) where it moved. While running,
        asynchronously (kafka-python 3.0.12's join was seen to stall when the member's own
        blocking calls met a rebalance); the last one, at stop, waits."""
        with self._lock:
            # revoked ones are not its own any more: `_revoke` committed them
            held = set(self._ledgers.partitions()) - self._revoked
        offsets = self._ledgers.positions(held)
        if not offsets:
            return
        if final:
            try:
                self._consumer.commit(offsets)
            except CommitFailedError as e:  # the group moved on: its new owners read again
                log.info("%s: last commit refused (%s)", self.name, e)
                return
            self._committed_done(offsets, None)
            return
        self._consumer.commit_async(offsets, callback=self._committed_done)

    def _committed_done(self, offsets, error) -> None:
        """A commit's answer (on kafka-python's thread for an asynchronous one)."""
        if isinstance(error, BaseException):
            log.info("%s: commit refused (%s); the next one tries again", self.name, error)
            return
        with self._lock:
            self._ledgers.committed(offsets)
            self._counts["commits"] += 1

    def _check_catalog(self) -> None:
        """Follow the subscription's pause and resume; stop (raise) when its runtime is no
        longer `library` (first: a runtime changed while paused ends the member before it
        would deliver on the resume), when an offset reset is under way (`position`), or on
        any other edit (not followed yet)."""
        snap = self._catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, self.name)
        subscriptions.check_runtime(sub, "library", PROCESS)
        under_way = position.reset_under_way(snap, self.name)
        if under_way is not None:  # the reset commits once every member left the group
            raise VaradhiError(under_way)
        if replace(sub, paused=self._sub.paused, suspended=self._sub.suspended) != self._sub:
            raise VaradhiError(
                f"subscription {self.name} was changed while this consumer ran; the library"
                " runtime does not follow edits yet: start it again"
            )
        sub = self._follow_suspension(sub)
        self._sub = sub
        main = topics.from_snapshot(snap, self._crossing.main.name)
        if len(main.storage_topics) != len(self._crossing.main.storage_topics):
            self._crossing.follow(main)
            self._subscribe()  # the group rebalances: the new storage topic is assigned
            log.info("%s: now reading %s too", self.name, main.storage_topics[-1].name)
        held = sub.paused or suspension.holds(sub.suspended)
        if held != self._paused:
            self._set_paused(held)

    def _follow_suspension(self, sub: subscriptions.Subscription) -> subscriptions.Subscription:
        """Endpoint health (`varadhi.library.suspension`): suspend the subscription when every
        attempt failed for `circuit_breaker.suspend_after`, end a `resume: probe` suspension
        once this member's circuit found the endpoint healthy, count failure afresh after a
        suspension ended; the subscription as it is now."""
        breaker = self._circuit.breaker
        was = self._suspended
        todo = suspension.step(
            sub.suspended,
            was is not None,
            breaker.suspension_due(),
            breaker.poll(),
            breaker.failing_since_ms is not None,
        )
        service = subscriptions.SubscriptionService(self._catalog)
        if todo.action == "suspend":
            assert todo.reason is not None
            policy = sub.spec.circuit_breaker
            sub = service.set_suspended(
                self.name,
                Suspension(todo.reason, _now_ms(), suspension.NO_SHARD, policy.resume, self.member),
            )
            how = (
                "a probe finds it healthy" if policy.resume == "probe" else "an operator resumes it"
            )
            log.warning(
                "%s: %s; subscription suspended (by %s) until %s (`varadhi subscription resume`)",
                self.name, todo.reason, sub.suspended.by if sub.suspended else "?", how,
            )  # fmt: skip
        elif todo.action == "end":
            sub = service.set_suspended(self.name, None)
            log.info("%s: a probe found the endpoint healthy; suspension ended", self.name)
        elif todo.action == "resumed":
            breaker.forget_failing()  # the wait was no attempt's failure
            log.info("%s: suspension ended; delivering again", self.name)
        with self._lock:
            self._suspended, self._pause_asked = sub.suspended, sub.paused
        if (was is None) != (sub.suspended is None):
            self._publish(force=True)
        return sub

    def _set_paused(self, paused: bool) -> None:
        """Pause: hand out nothing more (deliveries in flight end) and read nothing (every
        assigned partition paused; polling goes on). Resume: read and hand out again."""
        with self._lock:
            self._paused = paused
            self._lock.notify_all()
        if paused:
            self._pause_reading()
        else:
            self._resume_reading()
        log.info("%s: %s", self.name, "paused" if paused else "resumed")
        self._publish(force=True)

    def _pause_reading(self) -> None:
        fetch = self._fetch
        fetch.pause(*(fetch.assignment() - fetch.paused()))

    def _resume_reading(self) -> None:
        """Read again every paused partition but those past their slot's frontier."""
        fetch = self._fetch
        fetch.resume(*(tp for tp in fetch.paused() if not self._crossing.held(tp)))

    def _hold_reading(self) -> None:
        """Pause the assigned partitions past their slot's frontier (`CrossingState.held`)."""
        fetch = self._fetch
        state = self._crossing
        fetch.pause(*(tp for tp in fetch.assignment() - fetch.paused() if state.held(tp)))

    def _publish(self, force: bool = False) -> None:
        """The member's progress document (at most every `PROGRESS_S` unless forced)."""
        now = time.monotonic()
        if not force and now < self._next_publish:
            return
        self._next_publish = now + PROGRESS_S
        with self._lock:
            doc = {
                "runtime": "library",
                "member": self.member,
                "state": self._shown_state(),
                "error": self._error,
                "slots": sorted(self._slots_of(self._ledgers.partitions())),
                "partitions": sorted(
                    f"{tp.topic}/{tp.partition}" for tp in self._ledgers.partitions()
                ),
                "circuit": self._circuit.status(),
                "waiting": self._crossing.waiting,
                "committed": self._ledgers.commits(),
            }
        doc["counters"] = self.counters()
        self._progress.publish(doc, force=True)

    # -- rebalance ----------------------------------------------------------------------------
    # The listener runs on kafka-python's I/O thread, which must not block: it only closes the
    # revoked slots and notes the assignment; `_rebalanced` (the Kafka thread, after the poll)
    # does the rest.
    # Hazard: the listener runs whenever the group rebalances, also between an assignment and
    # `_rebalanced` (which sets it up after the poll), and while `_rebalanced` makes the new
    # partitions' ledgers (outside the lock). So a revoke notes and closes every revoked
    # partition, with a ledger yet or not, takes it out of an assignment not set up yet, and
    # `_rebalanced` opens nothing revoked meanwhile. (A partition revoked before its ledger was
    # in place was once kept: its slot handed out by two members at once, for good.)
    async def _revoke(self, revoked) -> None:
        """Close the revoked partitions, await their deliveries in flight (`settle`: at most
        `REVOKE_WAIT_S` or the endpoint's request timeout; kafka-python's event loop, which
        runs this, goes on meanwhile), then commit what finished of them, so that their next
        owner delivers again only what was still in flight (not all that finished since the
        last commit). The commit is asynchronous (this thread must not block); its request goes out
        before the member's JoinGroup, on the same connection to the coordinator, so the broker
        applies it before the new generation exists, and the next owner, which reads its commit
        after it is assigned, sees it. A commit refused (the group moved on without this member)
        leaves the old behaviour: the next owner starts from the last commit."""
        tps = set(revoked)
        self._close(tps)
        slots = self._slots_of(tps)
        wait_s = min(REVOKE_WAIT_S, self._spec.endpoint.request_timeout_ms / 1000)
        await settle.settled(lambda: self._in_flight(slots), self._loop_sleep, wait_s)
        self._ledgers.apply_finished()
        offsets = self._ledgers.positions(tps)
        if offsets:
            self._consumer.commit_async(offsets, callback=self._committed_done)

    def _in_flight(self, slots: set[int]) -> bool:
        with self._lock:
            return self._sched.busy(slots) > 0

    def _close(self, tps: set[TopicPartition]) -> None:
        with self._lock:
            self._sched.close(self._slots_of(tps))
            self._revoked |= tps
            if self._assigned is not None:  # taken back before `_rebalanced` set it up
                self._assigned -= tps

    def _lose(self, lost) -> None:
        """The member was put out of the group (it missed its session: it hung, or polled for
        none of `max.poll.interval.ms`): other members held these partitions meanwhile, so
        what this member holds of them is stale (a key waiting for an RQ copy that another
        member delivered, a ledger behind their commit). They are revoked, and forgotten even
        if the member gets them again: it reads them from the commit as a new owner would."""
        with self._lock:
            self._lost |= set(lost)
        self._close(set(lost))  # no commit: the group gave them to others meanwhile

    def _assign(self, assigned) -> None:
        # the membership consumer never fetches: the fetcher reads (`_poll`)
        self._consumer.pause(*assigned)
        self._fenced.joined()
        with self._lock:
            self._assigned = set(assigned)

    def _rebalanced(self) -> None:
        """After a rebalance: slots given back are handed out again; slots gone wait for their
        deliveries in flight (their outcomes are written; their offsets are not committed: the
        next owner delivers what finished since the last commit again) and are forgotten; new
        partitions get their ledger from their commit and its metadata, and a new slot reads
        its RQ to the end before its main-topic partitions."""
        with self._lock:
            assigned, self._assigned = self._assigned or set(), None
            # lost partitions are forgotten even when assigned again: others held them since
            gone = (self._revoked - assigned) | self._lost
            self._revoked, self._lost = set(), set()
        if gone:
            slots = self._slots_of(gone)
            deadline = time.monotonic() + self._spec.endpoint.request_timeout_ms / 1000 + 10
            with self._lock:
                while self._sched.busy(slots) and time.monotonic() < deadline:
                    self._lock.wait(0.05)
                self._sched.drop(slots)
                if self._blocking is not None:
                    self._blocking.drop(slots)
                for tp in gone:
                    self._ledgers.forget(tp)
                for slot in slots:
                    self._catch_up.pop(slot, None)
                self._crossing.forget(slots)
            self._fetch.unassign(gone)
        new = [tp for tp in assigned if self._ledgers.get(tp) is None]
        rq_tps = [tp for tp in new if tp.topic == self._rq.name]
        # The member's own consumer is not asked: its blocking calls made between a revoke and
        # the next assignment were seen to stall kafka-python 3.0.12's join for good.
        offsets = self._offsets
        ledgers = {}
        try:
            blocked = {}  # in block mode, the new slots' GroupState records
            if self._blocking is not None:
                blocked = group_state_topic.read_slots_of(
                    self.settings, self.name, self._slots_of(new), self._sub.shard_count, self._dlq
                )
            ends = offsets.end_offsets(rq_tps) if rq_tps else {}
            starts: dict[TopicPartition, int | None] = {}  # where the fetcher reads from
            for tp in new:
                committed = offsets.committed(tp, metadata=True)
                if committed is None or committed.offset < 0:
                    ledgers[tp] = (Ledger(0), None)  # reading starts at the log's start
                    starts[tp] = None
                else:
                    offset, metadata = committed.offset, committed.metadata or ""
                    ledgers[tp] = (Ledger(offset, decode(offset, metadata)), (offset, metadata))
                    starts[tp] = offset
            self._fetch.assign(starts)  # read from the next poll on, by this thread
        except BaseException:
            with self._lock:  # set it up at the next turn, unless a newer one came meanwhile
                if self._assigned is None:
                    self._assigned = assigned
            raise
        with self._lock:
            # revoked while this ran: installed all the same (the next call forgets them as
            # gone), but never opened
            revoked_since = self._slots_of(self._revoked)
            for tp, (ledger, position) in ledgers.items():
                self._ledgers.install(tp, ledger, position)
            for tp in rq_tps:
                self._catch_up.setdefault(self._slot(tp), {})[tp] = ends.get(tp, 0)
            self._crossing.open(self._slots_of(new))  # at the first storage topic
            for slot, found in blocked.items():  # before any of the slot is handed out
                assert self._blocking is not None
                self._blocking.load(slot, found)
            # the rate's and concurrency's shares: set before any of the new slots is handed out
            self._shares.rebalanced(self._slots_of(assigned))
            # a slot hands out nothing before its RQ was read to the end (`_caught_up`)
            self._sched.close(set(self._catch_up) | revoked_since)
            given_back = self._slots_of(assigned - set(new))
            self._reopen(given_back - set(self._catch_up) - revoked_since)
            self._counts["rebalances"] += 1
        self._hold_reading()
        self._crossing.look_now()  # new slots look at their boundaries at once

    def _reopen(self, slots: set[int]) -> None:
        """(Under the lock) Hand out `slots` again."""
        self._sched.reopen(slots)
        if self._blocking is not None:
            self._blocking.reopened(slots)

    def _slot(self, tp: TopicPartition) -> int:
        if tp.topic == self._rq.name:
            return slot_of(tp.partition, self._rq.partitions, self._sub.shard_count)
        return self._crossing.slot(tp.topic, tp.partition)

    def _slots_of(self, tps) -> set[int]:
        return {self._slot(tp) for tp in tps}

    # -- delivery -----------------------------------------------------------------------------
    def _take(self) -> Work | None:
        """The next message to deliver (None: none now, or stopping or paused); the pacer takes
        the share the last rebalance gave first (`Pacer` is not thread-safe: only the engine's
        thread touches it; with a handler there is none)."""
        with self._lock:
            if self._stopping.is_set() or self._paused:
                return None
            in_flight = self._shares.apply()
            if in_flight is not None:
                self._deliverer.max_in_flight = in_flight
            if self.handler is not None and self._handed_out() >= self._shares.in_flight:
                return None  # each handler call is one message handed out
            return self._next_work()

    def _handed_out(self) -> int:
        """(Under the lock) Messages handed out and not settled."""
        return sum(self._sched.in_flight.values())

    def _next_work(self) -> Work | None:
        """(Under the lock; not paused) The next message, if the circuit lets one go and the
        member's group session has not lapsed (`fence`: its slots may be others' now)."""
        if self._fenced():
            return None
        return self._circuit.admit(lambda: self._take_fresh(_now_ms()))

    def _take_fresh(self, now: int) -> Work | None:
        """(Under the lock) The scheduler's next message, after finishing unsent those whose id
        the dedup window says was delivered (`varadhi.library.dedup`)."""
        while True:
            work = self._sched.take(now)
            dedup = self._dedup
            if work is None or dedup is None or work.dedup_id is None:
                return work
            if not self._crossing.is_main(work.topic):  # a retry or re-drive: not delivered yet
                return work
            if not dedup.seen(work.dedup_id, now):
                return work
            self._sched.done(work)
            self._counts["deduplicated"] += 1
            self._ledgers.finished((TopicPartition(work.topic, work.partition), work.offset))
            self._trace.routed(work, "deduplicated", None)

    def _follow_dedup(self) -> None:
        """(Its own thread) The dedup topic's tail: the ids the members deliver."""
        assert self._dedup_reader is not None
        try:
            self._dedup_reader.run(self._stopping)
        except BaseException as e:  # noqa: BLE001 - reported through health() and the CLI
            self._fail(e)

    def _share_circuit(self) -> None:
        """(Its own thread) The circuit's ticks and the members' shared counts
        (`shared_circuit.CircuitLink`); a transition is published at once."""
        assert self._circuit_link is not None
        try:
            self._circuit_link.run(self._stopping, self._circuit_moved)
        except BaseException as e:  # noqa: BLE001 - reported through health() and the CLI
            self._fail(e)

    def _circuit_moved(self, state: str) -> None:
        log.warning("%s: circuit %s", self.name, state)
        with self._lock:
            self._lock.notify_all()  # handler threads waiting for work look again
        self._publish(force=True)

    def _desk(self) -> Desk:
        """What a delivery thread needs of this member (`sources`)."""
        return Desk(
            self._take, self._await_work, self._stopping, self._settle_invalid, self._settle
        )

    def _deliver_http(self) -> None:
        source = Messages(self._desk(), self._spec.endpoint.shaping, self._spec.retry, self._rng)
        try:
            self._deliverer.run(source, pacer=self._shares.pacer, idle=source.idle)
        except BaseException as e:  # noqa: BLE001
            self._fail(e)

    def _await_work(self, seconds: float | None = None) -> Work | None:
        """The next message to hand out (`_take`), waiting for one: woken by every change that
        may give one (the `notify_all`s: records read, a key freed, a slot opened, a resume, the
        circuit moving, a stop), at a head's due time, and at least every `IDLE_WAIT_S` for what
        changes with time alone (a fence lifting, a circuit's open time ending). None once
        stopping, or after `seconds` (None: no limit). The look and the wait are under one hold
        of the lock, so no wake-up is lost between them."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            while not self._stopping.is_set():
                work = self._take()
                if work is not None:
                    return work
                wait = IDLE_WAIT_S
                due = self._sched.next_due_ms()
                if due is not None:
                    wait = min(wait, max(0.001, (due - _now_ms()) / 1000))
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    wait = min(wait, left)
                self._lock.wait(wait)
        return None

    def _deliver_handler(self) -> None:
        assert self.handler is not None
        try:
            run_handler(self._desk(), self.handler, self._spec.retry, self._rng)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)

    def _settle_invalid(self, work: Work) -> None:
        """A message that cannot be delivered (no body, too large, a header it cannot carry):
        dead-lettered at once, unsent, as the shards do."""
        e = work.entry
        now = _now_ms()
        e.first_failure_ms = e.first_failure_ms or now
        e.last_failure_ms = now
        e.reason = e.invalid
        self._trace.routed(work, "dlq", e.reason, redriven=e.headers.get(m.H_REDRIVEN))
        with self._lock:
            parked = self._dead_letter(work)  # (it counts what it sidelines: not inline)
            self._counts["dead_lettered"] += parked
            self._lock.notify_all()
        self._circuit.ended(work, None)
        if self._blocking is None:
            self._writer.send("dlq", work)

    def _dead_letter(self, work: Work) -> bool:
        """(Under the lock) `work`, a head handed out, goes to the DLQ: its key goes on (skip
        mode: the caller writes its DLQ record after the lock) or is blocked behind it
        (`Blocking`, which writes it, in order with what it sidelines; False: not recorded,
        its slot was revoked)."""
        if self._blocking is not None:
            return self._blocking.dead_letter(work)
        self._sched.done(work)
        return True

    def _sideline(self, work: Work, also: list) -> None:
        """(Under the lock, `Blocking`) `work`, read behind a dead letter of its key, goes to
        the DLQ unsent, as a shard dead-letters a blocked group's messages over its limit."""
        e = work.entry
        now = _now_ms()
        e.reason = f"{e.invalid}; {OVER_LIMIT}" if e.invalid else OVER_LIMIT
        e.first_failure_ms = e.last_failure_ms = now
        self._counts["dead_lettered"] += 1
        self._counts["sidelined"] += 1
        self._trace.routed(work, "dlq", e.reason)
        self._writer.send("dlq", work, also)

    def _settle(self, work: Work, decision: Decision, outcome: Outcome) -> None:
        """Act on an attempt's decision: finish, retry in place (`retry.retries_in_place`: due
        within `in_place_window_ms` of the message's first failure, it waits in memory as its
        key's head, its offset unfinished), write to the RQ (the key waits for it) or to the
        DLQ (the key goes on in skip mode, is blocked behind it in block mode); trace the
        attempt. A handler's `outcome` has no
        status, and its decision's reason as its detail."""
        e = work.entry
        now = _now_ms()
        e.attempts += 1
        self._circuit.ended(work, decision.action != "success")
        with self._lock:
            self._counts["attempts"] += 1
            if decision.action == "success":
                self._counts["delivered"] += 1
                lifted = [] if self._blocking is None else self._blocking.delivered(work)
                lifted += self._remember_delivered(work, now)
                self._sched.done(work)
                self._lock.notify_all()
                self._writer.finish_after(work, lifted)
        if decision.action == "success":
            self._trace.attempt(work, outcome, "delivered")
            return
        with self._lock:
            self._counts["failures"] += 1
        e.first_failure_ms = e.first_failure_ms or now
        e.last_failure_ms = now
        e.reason = decision.reason
        e.status = outcome.status
        e.headers = with_response(e.headers, outcome.body)
        target: Next = "dlq"
        if decision.action == "retry":
            e.due_ms = decision.due_ms or now
            if retries_in_place(self._spec.retry, e.first_failure_ms, e.due_ms):
                target = "retry"
            else:
                target, why = retry_target(out_bytes(e), self._queues.rq_limit)
                if why is not None:
                    e.reason = f"{e.reason}; {why}"
        with self._lock:
            if target == "retry":
                self._counts["retried"] += 1
                self._counts["retried_in_place"] += 1
                self._sched.retry_in_place(work)
            elif target == "rq":
                self._counts["retried"] += 1
                self._sched.to_rq(work)
            else:
                parked = self._dead_letter(work)  # (it counts what it sidelines: not inline)
                self._counts["dead_lettered"] += parked
            self._lock.notify_all()
        self._trace.attempt(work, outcome, target)
        if target == "rq" or (target == "dlq" and self._blocking is None):
            self._writer.send(target, work)

    def _remember_delivered(self, work: Work, now: int) -> list:
        """(Under the lock) With a dedup window, `work`'s id as delivered at `now`: remembered
        here and written to the dedup topic for every member; the write's future (its offset
        finishes once it is acknowledged)."""
        if self._dedup is None or work.dedup_id is None:
            return []
        self._dedup.remember(work.dedup_id, now)
        assert self._dedup_topic is not None
        key = work.dedup_id.encode("utf-8", "surrogateescape")
        return [self._producer.send(self._dedup_topic, key=key, value=dedup_topic.encode(now))]

    def _write_failed(self, error: BaseException) -> None:
        self._fail(error, "Write")

    def _fail(self, error: BaseException, operation: str = "Describe or Read") -> None:
        """Stop, failed with `error` (the first one is kept: `failure`, health's `error`). A
        missing ACL becomes the `NotAuthorized` naming it (exit 4): Read on the group, or
        `operation` on a topic (a produce's is Write)."""
        if isinstance(error, GroupAuthorizationFailedError):
            principal = kafka_clients.principal(self.settings)
            error = NotAuthorized("Read", "Group", group_id(self.name), principal)
        elif isinstance(error, AuthorizationError):
            error = kafka_clients.refused(self.settings, error, operation)
        elif isinstance(error, KafkaError):
            error = VaradhiError(f"Kafka: {kafka_clients.failure(self.settings, error)}")
        log.error("%s: consumer stops: %s", self.name, error, exc_info=error)
        with self._lock:
            if self._error is None:
                self._error = str(error) or type(error).__name__
                self._failure = error
            self._state = "failed"
            self._stopping.set()
            self._lock.notify_all()

    def _spawn(self, target: Callable[[], None], label: str) -> None:
        t = threading.Thread(
            target=target, name=f"varadhi-consumer-{self.name}-{label}", daemon=True
        )
        self._threads.append(t)
        t.start()


class _Listener(ConsumerRebalanceListener):
    def __init__(self, consumer: Consumer):
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked):  # awaited on kafka-python's event loop
        await self.consumer._revoke(revoked)

    def on_partitions_lost(self, lost):
        self.consumer._lose(lost)

    def on_partitions_assigned(self, assigned):
        self.consumer._assign(assigned)


def _session_kwargs(session_timeout_ms: int | None) -> dict[str, int]:
    """kafka-python's session timeout and a heartbeat interval below a third of it (none: its
    defaults)."""
    if session_timeout_ms is None:
        return {}
    return {
        "session_timeout_ms": session_timeout_ms,
        "heartbeat_interval_ms": max(1, min(3_000, session_timeout_ms // 3)),
    }


def _now_ms() -> int:
    return int(time.time() * 1000)
