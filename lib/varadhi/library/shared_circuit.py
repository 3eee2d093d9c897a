"""The library runtime's circuit breaker, on the subscription's error rate (issue 28 part 6).

Every member keeps the shards' breaker (`varadhi.core.circuit.CircuitBreaker`: the spec's
`circuit_breaker` fields, its window, thresholds, doubled open times and half-open verdict) and
feeds it, instead of a shard's micro-batches, *ticks*: every `TICK_S` what ended since the last
one. The rate is the subscription's because the members share their evidence through Kafka:

- every `REPORT_S` that it made attempts, a member publishes a `Report` on the progress topic
  (key `<subscription>/circuit/<member>`): the attempts and failures that ended since its last
  report, and `healed_ms`, when a half-open verdict last closed its circuit;
- every member reads the progress topic's tail (`CircuitLink`) and, while its circuit is closed,
  adds the other members' reported counts to its own in the tick they arrive (`tick`), so they
  enter its breaker's window as its own batches do and leave it `window_ms` later. A report
  sent longer than `window_ms` ago is stale and dropped (`peer_evidence`), which is also how a
  member that died stops counting: it reports no more.

So when the endpoint fails, the failures of every member count towards each one's window, and
they all open (each within about `REPORT_S` plus a poll of the first). Open, a member hands out
nothing (`admit`); what it holds waits in its scheduler in key order, and nothing is dropped or
re-read. After `open_for`, half-open: it hands out at most `probes` messages, and once all of
them ended, their attempts are its verdict, as a shard's probe batch is (a probe batch without
an attempt, every message dead-lettered unsent, decides nothing and the next is handed out). A
verdict that closes it is a *heal*: the others read it in its report and close too
(`CircuitBreaker.heal`: each one that last opened before the heal), so one member's successful
probe closes them all. Counts that arrive while a circuit is open or half-open are not its
verdict and are dropped (the shards' open circuit ignores straggling batches too).

Hazards: a member sees the others' failures about `REPORT_S` (plus a poll) after they ended, so
members open up to a couple of seconds apart, and an opening member's last requests in flight
still end; report times and heals are compared across hosts' clocks (`sent_ms`, `healed_ms`),
so a clock more than `window_ms` behind drops a member's reports as stale, and one ahead can
make an old heal close a circuit (which then opens again on the next window of failures);
every member reads the whole progress topic (every shard's and member's documents), a cost
that grows with the cluster's other subscriptions.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kafka import KafkaProducer, TopicPartition

from varadhi.core.circuit import CircuitBreaker, State, now_ms
from varadhi.core.policies import CircuitPolicy
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.progress import progress_topic
from varadhi.kafka.settings import Settings

log = logging.getLogger(__name__)

#: How often a member feeds its breaker what ended (its "batch"), and reads the others' reports.
TICK_S = 0.2
#: How often a member that made attempts reports them (a heal goes out at the next tick).
REPORT_S = 1.0
#: The key suffix of a member's reports on the progress topic: `<subscription>/circuit/<member>`.
CIRCUIT = "circuit/"

T = TypeVar("T")


@dataclass(frozen=True)
class Report:
    """What a member tells the others: the attempts and failures that ended between its
    previous report and `sent_ms`, and when a half-open verdict last closed its circuit."""

    member: str
    sent_ms: int
    attempts: int
    failures: int
    healed_ms: int | None


@dataclass(frozen=True)
class PeerEvidence:
    """The other members' live reports of one tick, summed: counts, and the newest heal."""

    attempts: int = 0
    failures: int = 0
    healed_ms: int | None = None


def report_key(subscription: str, member: str) -> bytes:
    return f"{subscription}/{CIRCUIT}{member}".encode()


def encode(report: Report) -> bytes:
    return json.dumps(
        {
            "sent_ms": report.sent_ms,
            "attempts": report.attempts,
            "failures": report.failures,
            "healed_ms": report.healed_ms,
        }
    ).encode()


def parse(key: bytes | None, value: bytes | None, subscription: str) -> Report | None:
    """A progress-topic record as a member's report of `subscription` (pure); None for any other
    record (another key, a tombstone, a value that is not a report)."""
    prefix = f"{subscription}/{CIRCUIT}".encode()
    if key is None or value is None or not key.startswith(prefix):
        return None
    try:
        doc = json.loads(value)
        healed = doc.get("healed_ms")
        return Report(
            key[len(prefix) :].decode(),
            int(doc["sent_ms"]),
            max(0, int(doc["attempts"])),
            max(0, int(doc["failures"])),
            None if healed is None else int(healed),
        )
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
        log.warning("progress topic: skipped a circuit report that does not parse: %r", key)
        return None


def peer_evidence(reports: Iterable[Report], me: str, now: int, window_ms: int) -> PeerEvidence:
    """What the other members reported, summed (pure): reports of `me` are left out (its own
    counts are fed directly), and so are stale ones, sent more than `window_ms` before `now`."""
    attempts = failures = 0
    healed: int | None = None
    for r in reports:
        if r.member == me or r.sent_ms < now - window_ms:
            continue
        attempts += r.attempts
        failures += min(r.failures, r.attempts)
        if r.healed_ms is not None and (healed is None or r.healed_ms > healed):
            healed = r.healed_ms
    return PeerEvidence(attempts, failures, healed)


class SharedCircuit:
    """One member's circuit (module docstring): pure, its clock injected (`clock`, ms), and
    thread-safe: delivery threads `admit` and end messages, the circuit's thread `tick`s and
    `report`s. Lock order: the runtime's lock, then this one, then the breaker's."""

    def __init__(self, policy: CircuitPolicy, clock: Callable[[], int] = now_ms):
        self.breaker = CircuitBreaker(policy, clock)
        self._lock = threading.Lock()
        self._tick = (0, 0)  # own (attempts, failures) since the last tick
        self._unreported = (0, 0)  # own (attempts, failures) since the last report
        self._reported_heal: int | None = None
        self._epoch: tuple[State, int] = (self.breaker.state, self.breaker.since_ms)
        self._ticked = self._epoch  # the breaker's state and since when, at the last tick
        self._probes: set[object] = set()  # handed out while half-open, not ended yet
        self._probes_taken = 0
        self._verdict = (0, 0)  # the probes' (attempts, failures)

    def admit(self, take: Callable[[], T | None]) -> T | None:
        """The next message to hand out (`take`, called under this lock), if the circuit lets
        one go: closed, any; open, none; half-open, `probes` in all until their verdict."""
        with self._lock:
            state = self.breaker.poll()
            self._sync()
            if state == "open":
                return None
            if state == "half_open" and self._probes_taken >= self.breaker.policy.probes:
                return None
            item = take()
            if item is not None and state == "half_open":
                self._probes_taken += 1
                self._probes.add(item)
            return item

    def ended(self, item: object, failed: bool | None) -> None:
        """A message handed out ended: an attempt that succeeded (`failed` False) or did not
        (True: a retry or a dead letter), or None: no attempt (dead-lettered unsent)."""
        with self._lock:
            if failed is not None:
                self._tick = _plus(self._tick, failed)
                self._unreported = _plus(self._unreported, failed)
            if item in self._probes:
                self._probes.discard(item)
                if failed is not None:
                    self._verdict = _plus(self._verdict, failed)

    def tick(self, peers: PeerEvidence) -> tuple[State, bool]:
        """Feed the breaker what ended since the last tick, with the other members' evidence;
        returns its state and whether it moved since the last tick (here, or in an `admit`
        that found an open circuit's time up; open again after a failed probe is a move too).
        Closed: own and peers' counts are one batch. Open or half-open: a peer's heal after
        this circuit's last open closes it; else half-open decides once every probe handed out
        ended (its own probes' attempts only). The tick that closed it counts nothing."""
        with self._lock:
            breaker = self.breaker
            state = breaker.poll()
            self._sync()
            (own_attempts, own_failures), self._tick = self._tick, (0, 0)
            if state != "closed" and peers.healed_ms is not None:
                breaker.heal(peers.healed_ms)  # closed now, or it goes on as below
                state = breaker.state
            if state == "closed" and self._ticked[0] == "closed":
                attempts = own_attempts + peers.attempts
                if attempts:
                    breaker.record(attempts, own_failures + peers.failures)
            elif state == "half_open" and self._probes_taken and not self._probes:
                attempts, failures = self._verdict
                if attempts:
                    breaker.record(attempts, failures)
                else:  # nothing was attempted: no verdict, the next probes go
                    self._probes_taken = 0
            self._sync()
            moved, self._ticked = self._epoch != self._ticked, self._epoch
            return breaker.state, moved

    def report(self, member: str, now: int, due: bool) -> Report | None:
        """This member's report now, or None: one goes out when a heal is new, or when `due`
        (every `REPORT_S`) and attempts ended since the last report."""
        with self._lock:
            healed = self.breaker.healed_ms
            attempts, failures = self._unreported
            if healed == self._reported_heal and not (due and attempts):
                return None
            self._unreported, self._reported_heal = (0, 0), healed
            return Report(member, now, attempts, failures, healed)

    def status(self) -> dict[str, Any]:
        """The breaker's status (`CircuitBreaker.status`), for `health()` and progress."""
        return self.breaker.status()

    def _sync(self) -> None:
        """Forget the probes' bookkeeping when the breaker moved since it began (under the
        lock): each half-open spell hands out its own `probes`."""
        epoch = (self.breaker.state, self.breaker.since_ms)
        if epoch != self._epoch:
            self._epoch = epoch
            self._probes, self._probes_taken, self._verdict = set(), 0, (0, 0)


def _plus(counts: tuple[int, int], failed: bool) -> tuple[int, int]:
    return counts[0] + 1, counts[1] + int(failed)


class CircuitLink:
    """The circuit's I/O (thin): reads the progress topic's tail for the other members'
    reports, ticks the circuit, publishes this member's reports. `run` is its own thread."""

    def __init__(self, settings: Settings, subscription: str, member: str, circuit: SharedCircuit):
        """Reading starts `window_ms` back, so a member that starts during an outage counts the
        others' recent failures. Raises Kafka's errors (the member does not start). A report
        is sent without waiting or checking: one lost is evidence missed, never a failure."""
        self.subscription, self.member, self.circuit = subscription, member, circuit
        self.topic = progress_topic(settings)  # made by the member's `ProgressPublisher`
        self._reader = kafka_clients.consumer(settings, enable_auto_commit=False)
        self._producer: KafkaProducer | None = None
        try:
            # a send waits at most a tick for metadata (a broker away): the ticks go on
            self._producer = kafka_clients.producer(
                settings, linger_ms=0, max_block_ms=int(TICK_S * 1000)
            )
            tp = TopicPartition(self.topic, 0)
            self._reader.assign([tp])
            since = now_ms() - circuit.breaker.policy.window_ms
            at = self._reader.offsets_for_times({tp: since}).get(tp)
            if at is None:
                self._reader.seek_to_end(tp)
            else:
                self._reader.seek(tp, at.offset)
        except BaseException:
            self._close()
            raise

    def run(self, stopping: threading.Event, moved: Callable[[State], None]) -> None:
        """Until `stopping`: every `TICK_S`, read the reports that arrived, tick the circuit
        (`moved(state)` when it moved since the last tick), publish this member's report when one is due. A
        Kafka error that may pass by itself (`kafka_clients.transient`) is logged and the next
        tick tries again; any other error ends the thread (raised)."""
        policy = self.circuit.breaker.policy
        next_report = time.monotonic() + REPORT_S
        try:
            while not stopping.is_set():
                try:
                    batches = self._reader.poll(timeout_ms=int(TICK_S * 1000))
                except Exception as e:
                    if not kafka_clients.transient(e):
                        raise
                    log.warning("%s: circuit reports not read now (%s)", self.subscription, e)
                    batches = {}
                reports = [
                    report
                    for records in batches.values()
                    for r in records
                    if (report := parse(r.key, r.value, self.subscription)) is not None
                ]
                now = now_ms()
                state, changed = self.circuit.tick(
                    peer_evidence(reports, self.member, now, policy.window_ms)
                )
                if changed:
                    moved(state)
                due = time.monotonic() >= next_report
                report = self.circuit.report(self.member, now, due)
                if due:
                    next_report = time.monotonic() + REPORT_S
                if report is not None:
                    self._send(report)
        finally:
            self._close()

    def _send(self, report: Report) -> None:
        """Hand `report` to the producer; a Kafka error that may pass by itself (the broker
        away: metadata not there in time) loses it, logged: evidence missed, not a failure."""
        assert self._producer is not None
        key = report_key(self.subscription, self.member)
        try:
            self._producer.send(self.topic, key=key, value=encode(report), partition=0)
        except Exception as e:
            if not kafka_clients.transient(e):
                raise
            log.warning("%s: circuit report not sent (%s)", self.subscription, e)

    def _close(self) -> None:
        self._reader.close(autocommit=False)
        if self._producer is not None:
            self._producer.close(timeout=5)
