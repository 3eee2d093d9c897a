"""Helpers for tests of the library runtime (`varadhi.library`): a `varadhi-consumer` run as a
real process, and the checks of what an endpoint received from members that were killed, hung,
restarted or rebalanced (pure functions of the endpoint's records and the queues' records).

The checks, and why each holds (docs/library.md, "How members share the work"):

- `lost`: every message is delivered (a 2xx) or dead-lettered: at least once.
- `order_violations`: per key, the *first* 2xx of each message arrives in produce order. A
  member hands out one message of a key at a time, in origin order, a retried one holding its
  key until its copy is delivered; a new owner starts at the last commit (at or below the
  first unfinished message), so what it sends again was first delivered before, in order.
  Messages that can be dead-lettered are left out: a dead letter that a new owner reads again
  is a fresh first attempt, and may then succeed after the key's later messages.
- `early_retries`: an attempt n > 1 never arrives before the due time (`varadhi-due-ms`) of an
  RQ copy of its message that carries n - 1 attempts.
- `unexplained_duplicates`: a second 2xx of a message comes only after a member lost the
  message's slot after its first 2xx (the new owner delivers again what finished since the
  last commit and what was in flight), in a rebalance (a member joined, left, or missed its
  session: killed or hung; every member gives up its slots in the eager rebalance), or a
  hung member went on after its slots had moved. So each duplicate needs such a disruption
  between its first 2xx and itself (`GroupWatch` sees the rebalances); one without is a bug.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from varadhi.core import messages as m
from varadhi.core.policies import CircuitPolicy, Endpoint, RetryPolicy, SubscriptionSpec
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.testing.endpoint import Record

#: This package's source folder: the process runs this checkout's code, whatever is installed.
LIB = str(Path(__file__).resolve().parents[2])
#: Retries due within a second: the tests and benches wait for them.
#: The one generous deadline of a wait on consumers (`wait_for`), for a loaded machine.
DEADLINE_S = 60


def wait_for(condition, what: str, *consumers: Any, deadline_s: float = DEADLINE_S) -> None:
    """Wait for `condition()` with one deadline; a timeout shows the consumers' (library
    `Consumer`s) health and counters."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            states = [(c.health(), c.counters()) for c in consumers]
            raise AssertionError(f"timed out waiting for {what}: {states}")
        time.sleep(0.05)


def produce_ids(settings: Settings, topic: str, ids: Iterable[str]) -> None:
    """One message per id (the id as the body), of the group named by the id's part before its
    first `-` (`k-0` is group `k`'s), in this order."""
    with Producer(topic, settings) as producer:
        for msg_id in ids:
            producer.send(msg_id.encode(), group_id=msg_id.split("-")[0], message_id=msg_id)
        producer.flush()


def produce_rounds(settings: Settings, topic: str, groups: int, start: int, stop: int) -> list[str]:
    """Messages `g<i>-<n>` of groups `g<i>` (the id as the body), n from `start` to `stop`,
    round by round; their ids in produce order."""
    ids = []
    with Producer(topic, settings) as producer:
        for n in range(start, stop):
            for g in range(groups):
                msg_id = f"g{g}-{n}"
                producer.send(msg_id.encode(), group_id=f"g{g}", message_id=msg_id)
                ids.append(msg_id)
        producer.flush()
    return ids


FAST_RETRY = RetryPolicy(min_backoff_ms=200, max_backoff_ms=1_000, jitter=0.0, in_place_window_ms=0)


def subscription_spec(
    name: str, topic: str, endpoint: Endpoint, shards: int = 2, **fields
) -> SubscriptionSpec:
    """A `runtime: library` subscription as the tests and benches run one: dead letters skipped
    (a key goes on), the circuit off (a test of failures then sees every attempt), retries due
    within a second, every one through the RQ (`FAST_RETRY`: the path most tests check; the
    retries in place: tests/integration/test_library_in_place.py); `fields` sets any other field of the spec, or one of those
    (the circuit's tests turn it on, block mode's tests set `on_dead_letter: block`)."""
    defaults: dict[str, Any] = {
        "on_dead_letter": "skip",
        "circuit_breaker": CircuitPolicy(enabled=False),
        "retry": FAST_RETRY,
    }
    return SubscriptionSpec(
        name, topic, endpoint, shards=shards, runtime="library", **{**defaults, **fields}
    )


class ConsumerProcess:
    """`varadhi-consumer SUBSCRIPTION [args]` as a process of its own (`python -m
    varadhi.library.console` with this checkout's `lib` first on `PYTHONPATH`), its stderr in
    `log_path`. `signal` sends one (SIGKILL, SIGSTOP, SIGCONT, SIGTERM); `stop` sends SIGTERM
    and returns the exit code (SIGCONT first: a stopped process cannot act on SIGTERM)."""

    def __init__(self, settings: Settings, subscription: str, log_path: Path, *args: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (LIB, env.get("PYTHONPATH")) if p)
        env["VARADHI_CATALOG_TOPIC"] = settings.catalog_topic
        self.log_path = log_path
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed by stop/kill
        command = [sys.executable, "-m", "varadhi.library.console", subscription]
        command += ["--bootstrap", settings.bootstrap, *args]
        self.proc = subprocess.Popen(command, env=env, stderr=self._log, stdout=self._log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (after SIGCONT), then wait for the exit; returns the exit code (SIGKILL and
        AssertionError with the log when it does not end within `timeout_s`)."""
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"varadhi-consumer {self.pid} did not stop within {timeout_s:g} s:\n{self.log()}"
            ) from None
        finally:
            self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL and reap (also the clean-up of a test that failed midway)."""
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def first_successes(records: Iterable[Record]) -> dict[str, Record]:
    """Each message id's first 2xx record (records in arrival order)."""
    out: dict[str, Record] = {}
    for r in records:
        if r.status < 300 and r.message_id is not None and r.message_id not in out:
            out[r.message_id] = r
    return out


def lost(produced: Iterable[str], records: Iterable[Record], dead: Iterable[str]) -> set[str]:
    """Message ids neither delivered (a 2xx) nor dead-lettered (`dead`: the DLQ's ids)."""
    return set(produced) - set(first_successes(records)) - set(dead)


def order_violations(
    records: Iterable[Record], keys: Mapping[str, list[str]], unordered: Iterable[str] = ()
) -> list[str]:
    """Per key (`keys`: key -> its message ids in produce order), messages whose first 2xx
    arrived after the first 2xx of a later message of the key; messages in `unordered` (those
    that may be dead-lettered) are not judged. One line per violation."""
    firsts = first_successes(records)
    skip = set(unordered)
    out = []
    for key, ids in keys.items():
        last_seq, last_id = -1, None
        for msg_id in ids:
            r = firsts.get(msg_id)
            if msg_id in skip or r is None:
                continue
            if r.seq < last_seq:
                out.append(f"{key}: {msg_id} first delivered (#{r.seq}) after {last_id}")
            else:
                last_seq, last_id = r.seq, msg_id
    return out


def early_retries(records: Iterable[Record], rq: Iterable[dict]) -> list[str]:
    """Attempts n > 1 that arrived before the due time of every RQ copy of their message with
    n - 1 attempts (`rq`: `harness.read_queue` records), or with no such copy at all."""
    due: dict[tuple[str, int], int] = {}
    for copy in rq:
        h = copy["headers"]
        try:
            where = (h[m.H_MSG_ID], int(h[m.H_ATTEMPTS]))
            at = int(h[m.H_DUE_MS])
        except (KeyError, ValueError):
            continue
        due[where] = min(at, due.get(where, at))
    out = []
    for r in records:
        if r.attempt is None or r.attempt < 2 or r.message_id is None:
            continue
        at = due.get((r.message_id, r.attempt - 1))
        if at is None:
            out.append(f"{r.message_id} attempt {r.attempt}: no RQ copy of attempt {r.attempt - 1}")
        elif r.received_ms < at:
            out.append(f"{r.message_id} attempt {r.attempt}: {at - r.received_ms:.0f} ms early")
    return out


def duplicates(records: Iterable[Record]) -> list[tuple[Record, Record]]:
    """(first 2xx, a later 2xx) of every message delivered successfully more than once."""
    firsts: dict[str, Record] = {}
    out = []
    for r in records:
        if r.status >= 300 or r.message_id is None:
            continue
        first = firsts.setdefault(r.message_id, r)
        if first is not r:
            out.append((first, r))
    return out


def unexplained_duplicates(
    records: Iterable[Record], disruptions_ms: Iterable[tuple[float, float]], in_flight_ms: float
) -> list[str]:
    """Duplicates (`duplicates`) that no disruption explains. A disruption is an interval
    (epoch ms) in which members may lose slots: a rebalance (`GroupWatch.changes`), a signal to
    a member (SIGKILL, SIGSTOP: `(t, t)`), a hung member's time from SIGCONT to its rejoin. It
    explains a duplicate whose first 2xx came before its end, or up to `in_flight_ms` after
    (a request handed out before the member gave the slot up reaches the endpoint within the
    endpoint's request timeout: it was in flight), and which itself came after its start."""
    spans = list(disruptions_ms)
    out = []
    for first, again in duplicates(records):
        if not any(
            start <= again.received_ms and first.received_ms <= end + in_flight_ms
            for start, end in spans
        ):
            out.append(
                f"{again.message_id}: delivered again at {again.received_ms:.0f} after"
                f" {first.received_ms:.0f} with no member lost in between"
            )
    return out


def duplicate_causes(
    records: Iterable[Record],
    disruptions_ms: Iterable[tuple[str, float, float]],
    in_flight_ms: float,
) -> dict[str, int]:
    """How many duplicates each labelled disruption `(label, start, end)` explains (as in
    `unexplained_duplicates`; when several do, the last to start before the duplicate: the one
    in which the slot moved to whoever delivered it again), split by when the first 2xx came:
    `"<label>: finished before"` (before the disruption started: finished and not committed,
    or held by a member that was hung meanwhile) or `"<label>: during"` (in flight at it, or
    delivered while it lasted). Unexplained ones count under `"unexplained"`. For the report
    of a chaos run, not a check."""
    spans = sorted(disruptions_ms, key=lambda s: s[1])
    out: dict[str, int] = {}
    for first, again in duplicates(records):
        cause = "unexplained"
        for label, start, end in reversed(spans):
            if start <= again.received_ms and first.received_ms <= end + in_flight_ms:
                when = "finished before" if first.received_ms < start else "during"
                cause = f"{label}: {when}"
                break
        out[cause] = out.get(cause, 0) + 1
    return dict(sorted(out.items()))


class GroupWatch:
    """Samples a consumer group (its state and members' ids, from the group's coordinator)
    every `every_s` on a thread of its own, from `start()` to `stop()`; also a context manager.

    `changes()`: the (from, to) epoch-ms intervals from the last sample before the group
    changed (another member set) or was seen rebalancing (not `Stable`) to the first sample
    that saw it settled (`Stable`, the same members): every rebalance, in which members give
    up slots, falls inside one (a rebalance quicker than a sample and
    leaving the same members is missed; none is made without a member joining, leaving or
    missing its session). `latest()`: the last sample's (state, member ids)."""

    def __init__(self, settings: Settings, group: str, every_s: float = 0.1):
        self.settings, self.group, self.every_s = settings, group, every_s
        self._changes: list[tuple[float, float]] = []
        self._from_ms: float | None = None  # a change seen and not settled yet: since when
        self._latest: tuple[str, frozenset[str]] = ("Unknown", frozenset())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{group}", daemon=True)

    def start(self) -> GroupWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> GroupWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def latest(self) -> tuple[str, frozenset[str]]:
        with self._lock:
            return self._latest

    def changes(self) -> list[tuple[float, float]]:
        with self._lock:
            ongoing = [] if self._from_ms is None else [(self._from_ms, time.time() * 1000)]
            return self._changes + ongoing

    def _run(self) -> None:
        from kafka.errors import KafkaError

        from varadhi.kafka import clients as kafka_clients

        admin = kafka_clients.admin(self.settings)
        try:
            last_ms, last = time.time() * 1000, None
            while not self._stop.wait(self.every_s):
                try:
                    info = admin.describe_groups([self.group])[self.group]
                except KafkaError as e:  # a coordinator not found yet, say: sample again
                    if not e.retriable:
                        raise
                    continue
                now_ms = time.time() * 1000
                seen = (info["group_state"], frozenset(x["member_id"] for x in info["members"]))
                with self._lock:
                    changed = seen[0] != "Stable" or (last is not None and seen[1] != last[1])
                    if changed and self._from_ms is None:
                        self._from_ms = last_ms  # the last sample before it
                    elif not changed and self._from_ms is not None:
                        self._changes.append((self._from_ms, now_ms))  # seen settled
                        self._from_ms = None
                    self._latest = seen
                last_ms, last = now_ms, seen
        finally:
            admin.close()
