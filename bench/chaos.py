"""A chaos run anyone can repeat: a grouped subscription delivering under failures, kills, a broker
restart and shard-count changes while producing goes on, judged from what the endpoint saw.

    .venv/bin/python bench/chaos.py                       # 100,000 messages, about 15-25 min
    .venv/bin/python bench/chaos.py --messages 20000 --produce-seconds 60 --kills 3   # shorter

What it does, on its own broker (scripts/kafka on --kafka-port, a throw-away data folder, so the
broker can be killed without touching anyone else's):

1. A local endpoint (varadhi.testing.endpoint) that fails `--fail-rate` of attempts: 500s, 503s
   with Retry-After, and answers slower than the request timeout; plus *poison*: `--poison`
   messages it always refuses with 422 and as many records with no value (both dead-lettered).
   It runs in a process of its own (`python -m varadhi.testing.endpoint`), so the load of this
   one (producer, supervisor, kills) cannot stall its reading of requests, and writes a record
   of every request to a file in the work folder, which the judge reads at the end.
2. A 12-partition topic and a grouped subscription (2 shards, `on_dead_letter: skip`, enough
   attempts that random failures never exhaust a message), shards run with ./spark-submit.sh
   under a supervisor that restarts a shard whose process ended.
3. A producer sending `--messages` over `--groups` groups at a steady rate for
   `--produce-seconds`, retrying a send until the broker acknowledges it.
4. Meanwhile, at seeded random moments: `--kills` SIGKILLs of a random shard's process group,
   a SIGKILL of the broker and its restart, and shard-count changes 2 -> 4 -> 3 by the documented
   path (pause, stop, change-shards with external feeders, feeders, start, resume). Before each
   change (unless `--no-kill-before-change`), one shard is SIGKILLed inside a batch that has
   delivered something: its checkpoint has the batch planned and not committed, and the
   delivery journal already names messages the endpoint accepted in it (read as change-shards
   reads it); it is kept down until the change, so the change has that batch to hand over to
   the new shards (`--kill-wait` seconds at most to find one; the event's `killed_in_batch`).
   A batch whose journal grew since the previous poll is preferred (it is delivering now);
   after half the wait, one that did not (an earlier run's, not re-run yet) is taken.
5. At the end the shards run until idle, and the run is judged:
   - lost: acknowledged messages neither delivered (2xx) nor in the DLQ (must be 0);
   - order violations: groups whose first successful deliveries are not in produce order (0);
   - early retries: attempt n+1 of a message sent before attempt n's backoff could have passed
     (0; the policy has no jitter so the bound is exact), from the endpoint's clock: a request
     it read after the client had left (`read_after_client_left`: a timeout on a starved
     machine) bounds nothing, and whether the client saw a Retry-After it cannot tell (see
     `early_retries`);
   - dead letters: must be exactly the poison messages (an unexpected one whose every attempt
     reached the endpoint and failed, as a starved endpoint's timeouts can make them, is listed
     in `unexpected_dead_letters_every_attempt_failed`);
   - duplicates: successful deliveries beyond the first of each message, as a share, split by
     cause: `after_timeout` (the endpoint's 2xx reached the client after its request timeout,
     so the client saw a failure and rightly sent the next attempt: any at-least-once client
     does the same) and `redelivered` (the same attempt sent again: a crash, a kill or a fence
     re-running a batch; the figure the delivery journal exists to keep small), with when the
     re-deliveries happened and when the successes they repeat did (10 s buckets), and how
     long after the success they repeat.

Prints the verdict and writes --out (default bench/results/chaos.json). Exit 1 if a must-be-zero
figure is not; the run's work folder is deleted, so --out then also holds the evidence: under
`evidence`, every request the endpoint saw of each early-retry message and each unexpected dead
letter (arrival order, attempt, status, the headers the shard sent, among them the record it was
read from), those dead letters' DLQ records (reason, attempts, headers), and the shards' logs are
copied to `<out stem>-logs/` (with each change-shards command's output). The same is kept, for up
to 20 re-delivered messages (`redelivered_examples`), when re-deliveries exceed the 2% target.
Each change-shards event carries the shard killed for it (`killed_in_batch`: shard, batch,
journaled count; shard None if none was found in time), what the hand-over of the old shards'
uncommitted batches did (`handover`), and the command's refusals before it ran (`refusals`: an old
shard's journal it could not read yet, e.g. right after the broker's restart, or a shard killed
before the change whose lease has not expired yet; it is run again 10 s later, up to `CHANGE_TRIES`
times, as docs/operations.md tells an operator to). The verdict's `handovers` counts the changes
that handed something over (`changes_that_handed_over` of `changes`, and per change the messages
journaled, dropped from GroupState and handed over); the printout says plainly when none did (the
hand-over was not exercised). Needs scripts/setup; sends nothing anywhere but 127.0.0.1.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

from kafka import KafkaProducer

from common import endpoint_process, machine, write_results
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq, subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import change_shards as resharding
from varadhi.ops import change_shards_plan, status
from varadhi.spark import checkpoints, layouts
from varadhi.spark.warehouse_fs import for_path
from varadhi.testing.endpoint import read_records

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 12
RETRY = {"max_attempts": 12, "min_backoff_ms": 200, "max_backoff_ms": 2_000, "retry_after_s": 1}
REQUEST_TIMEOUT_MS = 1_000
CLOCK_SLACK_MS = 5  # the endpoint stamps arrival after reading the request
REDELIVERY_TARGET = 0.02  # issue 12's target for re-delivered duplicates (not a must-be-zero)
# change-shards runs, 10 s apart, while it cannot read an old shard's journal or a killed shard's
# lease has not expired
CHANGE_TRIES = 6
MIX = {"500": 0.4, "503": 0.4, "slow": 0.2}  # the endpoint's failures, by weight
POISON_ANSWERS = [422] * 20  # more than `max_attempts`: a poison message never succeeds


def log(t0: float, text: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f} s] {text}", flush=True)


class Broker:
    """The run's own broker: scripts/kafka on its port and data folder."""

    def __init__(self, port: int, folder: str):
        self.env = dict(os.environ, VARADHI_KAFKA_PORT=str(port), VARADHI_KAFKA_DIR=folder)
        self.folder = folder
        self.bootstrap = f"127.0.0.1:{port}"

    def _script(self, command: str) -> None:
        subprocess.run(
            [str(ROOT / "scripts" / "kafka"), command],
            env=self.env,
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self._script("start")

    def kill_and_restart(self, down_s: float) -> None:
        pid = int(Path(self.folder, "broker.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
        time.sleep(down_s)
        self.start()

    def wipe(self) -> None:
        self._script("wipe")


class Shards:
    """The subscription's shard processes (./spark-submit.sh), restarted when they end unless
    stopped on purpose or `held` (killed in a batch for the next shard-count change to hand
    over: a restart would re-run that batch and commit it first)."""

    def __init__(self, name: str, env: dict[str, str], logs: Path, t0: float):
        self.name, self.env, self.logs, self.t0 = name, env, logs, t0
        self.procs: dict[int, subprocess.Popen] = {}
        self.supervise = False
        self.restarts = 0
        self.exits: list[tuple[int, int]] = []
        self.held: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._supervisor, daemon=True).start()

    def start(self, count: int, extra: tuple[str, ...] = ()) -> None:
        with self._lock:
            for shard in range(count):
                self._start(shard, extra)
            self.held.clear()
            self.supervise = not extra

    def _start(self, shard: int, extra: tuple[str, ...] = ()) -> None:
        out = open(self.logs / f"shard-{shard}.log", "a")  # noqa: SIM115
        self.procs[shard] = subprocess.Popen(
            [str(ROOT / "spark-submit.sh"), self.name, str(shard), *extra],
            env=self.env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _supervisor(self) -> None:
        while True:
            time.sleep(1)
            with self._lock:
                if not self.supervise:
                    continue
                for shard, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is not None and shard not in self.held:
                        self.exits.append((shard, code))
                        self.restarts += 1
                        log(self.t0, f"shard {shard} ended with {code}; restarting it")
                        self._start(shard)

    def kill(self, rng: random.Random) -> int:
        with self._lock:
            shard = rng.choice(sorted(self.procs))
            os.killpg(self.procs[shard].pid, signal.SIGKILL)
            return shard

    def kill_and_hold(self, shard: int) -> None:
        """SIGKILL `shard`'s process group and keep it down (no restart) until `release` or
        the next `start`; returns once the process has ended (its checkpoint no longer moves)."""
        with self._lock:
            self.held.add(shard)
            proc = self.procs[shard]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)

    def release(self, shard: int) -> None:
        """Let the supervisor restart a `kill_and_hold` shard again."""
        with self._lock:
            self.held.discard(shard)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 180) -> list[int]:
        with self._lock:
            self.supervise = False
            for proc in self.procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
            codes = []
            for proc in self.procs.values():
                try:
                    codes.append(proc.wait(timeout))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    codes.append(proc.wait())
            self.procs.clear()
            return codes

    def wait(self) -> list[int]:
        return [p.wait() for p in self.procs.values()]


class Producing(threading.Thread):
    """Sends messages `<run>-<group>-<seq>` at a steady rate; each is re-sent until acked."""

    def __init__(self, settings, topic, run, messages, groups, seconds, poison):
        super().__init__(daemon=True)
        self.settings, self.topic, self.run_id = settings, topic, run
        self.messages, self.groups, self.seconds, self.poison = messages, groups, seconds, poison
        self.acked: dict[str, tuple[str, int]] = {}  # msg id -> (group, seq in group)
        self.resent = 0
        self.error: BaseException | None = None

    def ids(self):
        per_group: dict[str, int] = defaultdict(int)
        for i in range(self.messages):
            group = f"g{i % self.groups}"
            seq = per_group[group]
            per_group[group] += 1
            yield f"{self.run_id}-{group}-{seq}", group, seq

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def _produce(self) -> None:
        started = time.monotonic()
        chunk: list[tuple[str, str, int]] = []
        with Producer(self.topic, self.settings) as producer:
            for n, item in enumerate(self.ids()):
                chunk.append(item)
                if len(chunk) == 500 or n == self.messages - 1:
                    self._send(producer, chunk)
                    chunk = []
                    ahead = started + self.seconds * (n + 1) / self.messages - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)

    def _send(self, producer: Producer, chunk) -> None:
        todo = list(chunk)
        while todo:
            results = []
            for msg_id, group, seq in todo:
                try:
                    results.append(
                        (
                            producer.send(f"body {msg_id}", group, message_id=msg_id),
                            msg_id,
                            group,
                            seq,
                        )
                    )
                except Exception:  # noqa: BLE001 - the broker is down: send again later
                    results.append((None, msg_id, group, seq))
            failed = []
            for result, msg_id, group, seq in results:
                try:
                    if result is None:
                        raise RuntimeError("not sent")
                    result.get(timeout=60)
                    self.acked[msg_id] = (group, seq)
                except Exception:  # noqa: BLE001
                    failed.append((msg_id, group, seq))
            if failed:
                self.resent += len(failed)
                time.sleep(1)
            todo = failed


def endpoint_options(fail_rate: float, seed: int, script: Path, record: Path) -> list[str]:
    """The test endpoint's command line for the run (pure): it fails `fail_rate` of attempts
    (`MIX`, drawn from `seed`), answers "slow" past the request timeout, sends the policy's
    Retry-After on 503, answers `script` (a JSON file of answers by message id: the poison), and
    records every request with its headers (the evidence of a failed figure) to `record`."""
    return [
        *("--fail-rate", str(fail_rate), "--seed", str(seed)),
        *("--mix", ",".join(f"{answer}={weight}" for answer, weight in MIX.items())),
        *("--slow-ms", str(REQUEST_TIMEOUT_MS + 500)),
        *("--retry-after", str(RETRY["retry_after_s"])),
        *("--script", str(script)),
        *("--record", str(record), "--record-headers"),
    ]


def journaled_batch(catalog: Catalog, name: str, shard: int) -> tuple[int, int] | None:
    """(batch id, messages its journal names as accepted) of shard `shard`'s newest batch if it
    is planned, not committed, and has journaled at least one message the endpoint accepted;
    else None. What change-shards would hand over for that shard if it ran now
    (`varadhi.ops.change_shards.journaled_plan`, as `varadhi.ops.change_shards.ChangeShards._uncommitted_of` reads it). Raises
    what reading Kafka raises (the broker restarting)."""
    sub, layout = _current(catalog, name, shard)
    warehouse = catalog.settings.warehouse
    found = resharding.journaled_plan(
        catalog.settings,
        name,
        sub.shard_count,
        shard,
        layout,
        sub.created_ms,
        for_path(warehouse),
    )
    if found is None:
        return None
    batch_id, _, accepted = found
    # the batch may have committed while the journal was read
    return (
        (batch_id, len(accepted))
        if accepted and _still_planned(catalog, name, shard, batch_id)
        else None
    )


def kill_in_batch(catalog: Catalog, shards: Shards, name: str, wait_s: float, t0) -> dict:
    """Before a shard-count change: SIGKILL a shard while it is inside a batch whose journal
    already names accepted messages (`journaled_batch`, polled over the running shards) and keep
    it down, so that the change has that batch to hand over. A batch whose journaled count grew
    since the previous poll is delivering now (`delivering`); one that did not may be an
    earlier run's batch that a restarted shard has not re-run yet, and is taken only after half
    of `wait_s`. Gives up after `wait_s`. The checkpoint is read again once the process has
    ended: a commit that landed between the read and the kill hands nothing over, so the shard
    is let restart and another batch is sought (`missed`). Returns the shard (None: none found),
    batch, journaled count, `delivering`, the seconds waited and `missed`."""
    started = time.monotonic()
    missed = 0
    seen: dict[int, tuple[int, int]] = {}  # shard -> (batch, journaled) at the previous poll
    while time.monotonic() - started < wait_s:
        for shard in sorted(shards.procs):
            try:
                found = journaled_batch(catalog, name, shard)
            except Exception as e:  # noqa: BLE001 - Kafka away (the broker's restart): poll on
                log(t0, f"cannot read shard {shard}'s journal yet ({type(e).__name__})")
                found = None
            before, seen[shard] = seen.get(shard), found or (-1, 0)
            if found is None:
                continue
            delivering = before is not None and before[0] == found[0] and found[1] > before[1]
            if not delivering and time.monotonic() - started < wait_s / 2:
                continue
            shards.kill_and_hold(shard)
            if _still_planned(catalog, name, shard, found[0]):
                log(t0, f"SIGKILL shard {shard} in batch {found[0]} ({found[1]} journaled)")
                return {
                    "shard": shard,
                    "batch": found[0],
                    "journaled": found[1],
                    "delivering": delivering,
                    "waited_s": round(time.monotonic() - started, 1),
                    "missed": missed,
                }
            missed += 1
            seen.pop(shard)
            shards.release(shard)
        time.sleep(0.5)
    log(t0, f"no shard was in a batch with journaled deliveries within {wait_s:.0f} s")
    return {"shard": None, "waited_s": round(time.monotonic() - started, 1), "missed": missed}


def _current(catalog: Catalog, name: str, shard: int):
    """The subscription and shard `shard`'s current reader layout."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    return sub, layouts.current(snap, name, sub.shard_count, shard, sub.generation)


def _still_planned(catalog: Catalog, name: str, shard: int, batch_id: int) -> bool:
    """Whether shard `shard`'s checkpoint still has batch `batch_id` planned without a commit
    (the local warehouse of the run)."""
    sub, layout = _current(catalog, name, shard)
    warehouse = catalog.settings.warehouse
    path = layouts.checkpoint_path(warehouse, name, sub.shard_count, shard, layout)
    planned = checkpoints.uncommitted_plan(path, for_path(warehouse))
    return planned is not None and planned[0] == batch_id


def change_shards(catalog: Catalog, shards: Shards, name: str, to: int, env, t0) -> dict:
    """The documented path: pause, stop, change-shards with external feeders, run the feeders,
    start the new shards, resume."""
    varadhi = [str(ROOT / ".venv" / "bin" / "varadhi")]
    started = time.monotonic()
    subprocess.run([*varadhi, "subscription", "pause", name], env=env, check=True)
    stopped = shards.stop()
    command = [*varadhi, "subscription", "change-shards", name, "--to", str(to)]
    refusals = []
    for _ in range(CHANGE_TRIES):
        output = subprocess.run(
            [*command, "--feeders", "external"], env=env, capture_output=True, text=True
        )
        with open(shards.logs / f"change-shards-to-{to}.log", "a") as f:
            f.write(output.stdout + output.stderr)
        # An old shard's uncommitted batch that cannot be read yet (the broker just restarted):
        # the command refuses rather than hand over nothing; a shard SIGKILLed before the
        # change counts as running until its lease expires (15 s). Run it again, as an
        # operator would.
        if output.returncode == 0 or not any(
            why in output.stderr for why in ("cannot be read", "are still running")
        ):
            break
        refusals.append(output.stderr.strip())
        log(t0, f"change-shards refused ({output.returncode}); again in 10 s")
        time.sleep(10)
    output.check_returncode()
    op = catalog.snapshot().get("operation", change_shards_plan.operation_name(name)) or {}
    sources = [f["source"] for f in op.get("feeders", []) if not f.get("done")]
    feeders = [
        subprocess.Popen(
            [
                str(ROOT / "spark-submit.sh"),
                "--job",
                "feeder",
                "--subscription",
                name,
                "--source",
                s,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for s in sources
    ]
    shards.start(to)
    subprocess.run([*varadhi, "subscription", "resume", name], env=env, check=True)
    codes = [f.wait() for f in feeders]
    log(t0, f"shard count now {to}; feeders {sources} exited {codes}")
    return {
        "to": to,
        "feeders": len(sources),
        "feeder_exits": codes,
        # the old shards' exit codes (-9: killed before the change, or not stopped in 180 s)
        "old_shard_exits": stopped,
        "seconds": round(time.monotonic() - started, 1),
        # what the old shards' uncommitted batches handed over (`varadhi.spark.journal`)
        "handover": (op.get("state") or {}).get("handover"),
        # the command's refusals before that (a journal it could not read yet)
        "refusals": refusals,
    }


def _client_saw_a_failure(success, again) -> bool:
    """Whether `again` (a later request of the message `success` was a 2xx answer to) is a retry
    of a failure the client saw: the endpoint answered after the client's timeout (a "slow"
    answer, or a normal one delayed past it on a starved machine), so the client sent the next
    attempt. A re-delivery (a crash or fence re-running a batch) sends the same attempt again."""
    if success.delay_ms >= REQUEST_TIMEOUT_MS:
        return True
    return None not in (success.attempt, again.attempt) and again.attempt > success.attempt


def early_retries(by_msg: dict[str, list]) -> list[dict]:
    """Each pair of consecutive records of one message (in arrival order) where attempt n failed
    and attempt n+1 arrived before n's backoff could have passed (pure): the message, both
    records' `seq`, the gap and the wait owed, in ms.

    The bound is what the endpoint's clock can prove. The client decides when it has the answer
    or its timeout passed, so never before the endpoint read the request, and waits the backoff
    from then; whether it saw the answer (and its Retry-After) or timed out first, the endpoint
    cannot tell on a starved machine, so the wait owed is the policy's backoff, not Retry-After
    (honoured in tests/unit/test_retry.py and the engine's tests). Attempt n read after the client
    had given up on it (`Record.client_gone`) bounds nothing: the client timed out before the
    endpoint's clock started, and its next attempt may arrive right after."""
    early = []
    for msg_id, rs in by_msg.items():
        for prev, nxt in zip(rs, rs[1:], strict=False):
            if prev.attempt is None or nxt.attempt != prev.attempt + 1 or prev.status < 300:
                continue
            if prev.client_gone:
                continue
            need = min(RETRY["min_backoff_ms"] * 2 ** (prev.attempt - 1), RETRY["max_backoff_ms"])
            if nxt.received_ms + CLOCK_SLACK_MS < prev.received_ms + need:
                early.append(
                    {
                        "message": msg_id,
                        "seq": [prev.seq, nxt.seq],
                        "gap_ms": round(nxt.received_ms - prev.received_ms, 1),
                        "need_ms": need,
                    }
                )
    return early


def every_attempt_failed(rs: list) -> bool:
    """Whether a dead letter's records (arrival order) show each of its `max_attempts` attempts
    reaching the endpoint and failing as the client saw it (pure): a failure status, a slow
    answer, a request read after the client had left, or one the client sent the next attempt
    after. True means its attempts ran out on the endpoint's answers (a starved endpoint times
    out many in a row), none was used up without a request; False leaves that open."""
    failed: set[int] = set()
    for i, r in enumerate(rs):
        if r.attempt is None:
            continue
        retried = any(later.attempt == r.attempt + 1 for later in rs[i + 1 :])
        if r.status >= 300 or r.delay_ms >= REQUEST_TIMEOUT_MS or r.client_gone or retried:
            failed.add(r.attempt)
    return failed >= set(range(1, RETRY["max_attempts"] + 1))


def evidence(records, verdict: dict) -> dict[str, list[dict]]:
    """What the endpoint saw of each message a must-be-zero figure names (pure): every record
    (arrival order) of each early-retry message and of each unexpected dead letter, with the
    request headers the product sent. Empty when those figures are zero."""
    wanted = {e["message"] for e in verdict["early_retry_pairs"]}
    wanted |= set(verdict["unexpected_dead_letters"])
    if verdict["redelivered_share"] > REDELIVERY_TARGET:
        wanted |= set(verdict["redelivered_examples"])
    out: dict[str, list[dict]] = {m: [] for m in sorted(wanted)}
    for r in sorted(records, key=lambda r: r.seq):
        if r.message_id in wanted:
            out[r.message_id].append(
                {
                    k: getattr(r, k)
                    for k in (
                        "seq",
                        "received_ms",
                        "attempt",
                        "status",
                        "delay_ms",
                        "connection",
                        "client_gone",
                    )
                }
                | {"headers": r.headers}
            )
    return out


def judge(records, acked, parked_ids, poison, start_ms: float) -> dict:
    """The verdict from what the endpoint saw (`records`), the producer's acks and the DLQ
    (pure). `start_ms`: the run's start (epoch ms), for when re-deliveries happened."""
    records = sorted(records, key=lambda r: r.seq)
    ok_count: dict[str, int] = defaultdict(int)
    last_ok: dict[str, object] = {}
    after_timeout = 0
    redelivered_at: dict[int, int] = defaultdict(int)  # 10 s bucket since start -> count
    first_at: dict[int, int] = defaultdict(int)  # the same, of the success each one repeats
    gaps_s: list[float] = []  # re-delivery minus the success before it
    redelivered: list[str] = []  # message ids, in the order of their re-deliveries
    order: dict[str, list[int]] = defaultdict(list)
    by_msg: dict[str, list] = defaultdict(list)
    for r in records:
        if r.message_id is None:
            continue
        by_msg[r.message_id].append(r)
        if r.status < 300:
            ok_count[r.message_id] += 1
            before = last_ok.get(r.message_id)
            if before is not None and _client_saw_a_failure(before, r):
                after_timeout += 1
            elif before is not None:
                redelivered_at[int((r.received_ms - start_ms) // 10_000) * 10] += 1
                first_at[int((before.received_ms - start_ms) // 10_000) * 10] += 1
                gaps_s.append((r.received_ms - before.received_ms) / 1000)
                redelivered.append(r.message_id)
            last_ok[r.message_id] = r
            if ok_count[r.message_id] == 1 and r.message_id in acked:
                order[acked[r.message_id][0]].append(acked[r.message_id][1])
    broken = sorted(g for g, seqs in order.items() if seqs != sorted(seqs))
    early = early_retries(by_msg)
    delivered = {m for m, n in ok_count.items() if n}
    lost = sorted(m for m in acked if m not in delivered and m not in parked_ids)
    duplicates = sum(n - 1 for n in ok_count.values())
    share = max(len(delivered), 1)
    gaps_s.sort()
    return {
        "acknowledged_by_kafka": len(acked),
        "delivered": len(delivered & set(acked)),
        "requests": len(records),
        "lost": len(lost),
        "lost_examples": lost[:10],
        "order_violations": len(broken),
        "order_violation_groups": broken[:10],
        "early_retries": len(early),
        "early_retry_pairs": early,
        "read_after_client_left": sum(r.client_gone for r in records),
        "dead_letters": len(parked_ids),
        "dead_letters_are_the_poison": set(parked_ids) == set(poison),
        "unexpected_dead_letters": sorted(set(parked_ids) - set(poison)),
        "unexpected_dead_letters_every_attempt_failed": sorted(
            m for m in set(parked_ids) - set(poison) if every_attempt_failed(by_msg.get(m, []))
        ),
        "poison_not_dead_lettered": sorted(set(poison) - set(parked_ids))[:10],
        "duplicates": duplicates,
        "duplicate_share": round(duplicates / share, 4),
        "duplicates_after_timeout": after_timeout,
        "duplicates_redelivered": duplicates - after_timeout,
        "redelivered_share": round((duplicates - after_timeout) / share, 4),
        "redelivered_by_10s_since_start": dict(sorted(redelivered_at.items())),
        # when the successes they repeat happened: the moments whose deliveries were not
        # journaled (or not handed over) before a crash
        "redelivered_success_by_10s_since_start": dict(sorted(first_at.items())),
        # up to 20, spread over the run: the evidence when the share is over the target
        "redelivered_examples": redelivered[:: max(len(redelivered) // 20, 1)][:20],
        "redelivery_gap_s": {
            q: round(gaps_s[int(q * (len(gaps_s) - 1))], 1) for q in (0.1, 0.5, 0.9, 1.0)
        }
        if gaps_s
        else {},
    }


def dead_letter_records(catalog: Catalog, name: str, msg_ids: set[str]) -> list[dict]:
    """The DLQ records of `msg_ids`: where they are, the reason, attempts, status and failure
    times, and every header."""
    if not msg_ids:
        return []
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    queue = topics.from_snapshot(snap, sub.spec.dlq_topic)
    found = []
    for chunk in dlq.iter_parked(
        catalog.settings, dlq.dlq_partitions(sub, queue), dlq.dlq_start(snap, name)
    ):
        found += [p.summary() | {"headers": p.headers} for p in chunk if p.msg_id in msg_ids]
    return found


def keep_logs(logs: Path, out: Path) -> str:
    """Copy the shards' logs next to `out` (`<out stem>-logs/`); returns where."""
    target = out.with_name(f"{out.stem}-logs")
    shutil.copytree(logs, target, dirs_exist_ok=True)
    return str(target)


def create_subscription(
    catalog: Catalog, topic: str, name: str, url: str, journal_max_lag: str | None = None
) -> None:
    """The run's topic and its grouped subscription to `url` (2 shards, dead letters skipped,
    `RETRY` without jitter, no circuit breaker; `consumption.journal_max_lag` when given, else
    its default)."""
    TopicService(catalog).create(topic, PARTITIONS)
    SubscriptionService(catalog).create(
        parse_spec(
            {
                "name": name,
                "topic": topic,
                "endpoint": {"url": url, "request_timeout": f"{REQUEST_TIMEOUT_MS}ms"},
                "shards": 2,
                "on_dead_letter": "skip",
                "retry": {
                    "max_attempts": RETRY["max_attempts"],
                    "min_backoff": f"{RETRY['min_backoff_ms']}ms",
                    "max_backoff": f"{RETRY['max_backoff_ms']}ms",
                    "jitter": 0,
                },
                "consumption": {
                    "trigger_interval": "500ms",
                    "max_messages_per_batch": 20_000,
                    **({"journal_max_lag": journal_max_lag} if journal_max_lag else {}),
                },
                # Failures are the subject: the breaker would only slow the run down.
                "circuit_breaker": {"enabled": False},
            }
        )
    )


def send_malformed(settings: Settings, topic: str, run: str) -> list[str]:
    """Records no producer library would write: no value (dead-lettered as malformed); returns
    their message ids."""
    raw = KafkaProducer(bootstrap_servers=settings.bootstrap)
    malformed = []
    for i in range(3):
        msg_id = f"{run}-malformed-{i}"
        raw.send(
            f"{topic}.0",
            key=f"m{i}".encode(),
            value=None,
            headers=[("varadhi-msg-id", msg_id.encode())],
        ).get(30)
        malformed.append(msg_id)
    raw.close()
    return malformed


def disrupt(args, rng, broker: Broker, catalog: Catalog, shards: Shards, name, env, t0) -> list:
    """While producing goes on, at seeded random moments of `--produce-seconds`: `--kills` shard
    SIGKILLs, the broker's SIGKILL and restart (at half time), and the shard-count changes
    2 -> 4 -> 3 (at 30% and 70%); returns the events as they happened."""
    span = args.produce_seconds
    timeline = sorted(
        [(rng.uniform(0.1, 0.9) * span, "kill") for _ in range(args.kills)]
        + [(0.3 * span, "change:4"), (0.5 * span, "broker"), (0.7 * span, "change:3")]
    )
    events = []
    produce_started = time.monotonic()
    for at, what in timeline:
        delay = produce_started + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now = round(time.monotonic() - t0, 1)
        if what == "kill":
            shard = shards.kill(rng)
            log(t0, f"SIGKILL shard {shard}")
            events.append({"t": now, "event": "kill", "shard": shard})
        elif what == "broker":
            log(t0, "SIGKILL the broker; restart in 5 s")
            broker.kill_and_restart(5)
            events.append({"t": now, "event": "broker restart"})
        else:
            to = int(what.split(":")[1])
            held = None
            if args.kill_before_change:
                held = kill_in_batch(catalog, shards, name, args.kill_wait, t0)
            log(t0, f"changing the shard count to {to}")
            events.append(
                {
                    "t": now,
                    "event": "change-shards",
                    "killed_in_batch": held,
                    **change_shards(catalog, shards, name, to, env, t0),
                }
            )
    return events


def handovers(events: list[dict]) -> dict:
    """What the run's shard-count changes handed over (pure), from their events' `handover`
    (change-shards' `state` step): per change, the old shards' uncommitted batches (`batch` -1:
    carried from an earlier change), the messages their journals named as accepted, the pending
    entries dropped from GroupState and the messages handed to new shards; and how many changes
    handed anything over (a journal naming at least one accepted message). A run whose
    `changes_that_handed_over` is 0 did not exercise the hand-over, whatever its figures."""
    per = []
    for e in events:
        if e["event"] != "change-shards":
            continue
        h = e.get("handover") or {}
        batches = h.get("batches") or []
        held = e.get("killed_in_batch") or {}
        per.append(
            {
                "to": e["to"],
                "killed_in_batch": held.get("shard"),
                "batches": [(b["shard"], b["batch"]) for b in batches],
                "accepted": sum(b["accepted"] for b in batches),
                "pending_dropped": h.get("pending_dropped", 0),
                "handed_over": sum((h.get("handed_over") or {}).values()),
                "left_out": h.get("left_out", 0),
            }
        )
    return {
        "changes": len(per),
        "changes_that_handed_over": sum(c["accepted"] > 0 for c in per),
        "per_change": per,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--groups", type=int, default=1_000)
    p.add_argument("--produce-seconds", type=float, default=300)
    p.add_argument("--fail-rate", type=float, default=0.2)
    p.add_argument("--poison", type=int, default=10, help="messages the endpoint always refuses")
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs of a random shard")
    p.add_argument(
        "--kill-before-change",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before each shard-count change, SIGKILL a shard inside a batch whose journal "
        "names accepted messages and keep it down, so the change hands that batch over "
        "(default: on)",
    )
    p.add_argument(
        "--kill-wait",
        type=float,
        default=60,
        help="seconds to wait for such a batch before changing without it (default 60)",
    )
    p.add_argument(
        "--journal-max-lag",
        help="the subscription's consumption.journal_max_lag, e.g. 5s (default: its default)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kafka-port", type=int, default=29592)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "chaos.json"))
    args = p.parse_args()

    rng = random.Random(args.seed)
    load = os.getloadavg()
    t0 = time.monotonic()
    start_ms = time.time() * 1000
    work = Path(tempfile.mkdtemp(prefix="varadhi-chaos-"))
    broker = Broker(args.kafka_port, str(work / "kafka"))
    broker.start()
    running: list[Shards] = []  # for `leftovers`

    def leftovers() -> None:
        # A run that ends on an error (a change-shards refusal it does not retry, a producer
        # error) leaves no broker, shard or work folder behind; its output says why.
        if work.exists():
            for shards in running:
                shards.stop(signal.SIGKILL, timeout=30)
            broker.wipe()
            shutil.rmtree(work, ignore_errors=True)

    atexit.register(leftovers)
    run = uuid.uuid4().hex[:6]
    settings = Settings(
        bootstrap=broker.bootstrap,
        catalog_topic=f"__varadhi_catalog_chaos_{run}",
        warehouse=str(work / "warehouse"),
    )
    env = dict(
        os.environ,
        VARADHI_BOOTSTRAP=settings.bootstrap,
        VARADHI_CATALOG_TOPIC=settings.catalog_topic,
        VARADHI_WAREHOUSE=settings.warehouse,
    )
    os.environ.update(
        {k: env[k] for k in ("VARADHI_BOOTSTRAP", "VARADHI_CATALOG_TOPIC", "VARADHI_WAREHOUSE")}
    )
    catalog = Catalog(settings)
    logs = work / "logs"
    logs.mkdir()
    log(t0, f"broker {broker.bootstrap}, work folder {work}")

    producing = Producing(
        settings, f"chaos-{run}", run, args.messages, args.groups, args.produce_seconds, ()
    )
    all_ids = list(producing.ids())
    poison = sorted(m for m, _, _ in rng.sample(all_ids, args.poison))
    script, received = work / "poison.json", work / "received.jsonl"
    script.write_text(json.dumps({m: POISON_ANSWERS for m in poison}))
    topic, name = f"chaos-{run}", f"chaos-http-{run}"
    with endpoint_process(*endpoint_options(args.fail_rate, args.seed, script, received)) as url:
        create_subscription(catalog, topic, name, url, args.journal_max_lag)
        malformed = send_malformed(settings, topic, run)
        shards = Shards(name, env, logs, t0)
        running.append(shards)
        shards.start(2)
        producing.start()
        log(
            t0,
            f"{args.messages} messages over {args.groups} groups in {args.produce_seconds:.0f} s; endpoint fails {args.fail_rate:.0%}; poison {len(poison)} + {len(malformed)} malformed",
        )
        events = disrupt(args, rng, broker, catalog, shards, name, env, t0)
        producing.join()
        if producing.error is not None:
            raise producing.error
        log(
            t0,
            f"producing done: {len(producing.acked)} acknowledged, {producing.resent} sends repeated",
        )

        shards.stop()
        count = status.collect(catalog, name)["shard_count"]
        shards.start(count, ("--stop-when-idle", "20"))
        drain_codes = shards.wait()
        log(t0, f"drained; shards exited {drain_codes}")
    # The endpoint process has ended: its file holds every request it read.
    records = read_records(str(received))

    parked = {p["msg_id"] for p in dlq.list_parked(catalog, name, limit=0)}
    verdict = judge(records, producing.acked, parked, poison + malformed, start_ms)
    verdict.update(
        seconds=round(time.monotonic() - t0, 1),
        shard_restarts=shards.restarts,
        shard_exits=shards.exits,
        events=events,
        handovers=handovers(events),
    )
    bad = (
        verdict["lost"]
        or verdict["order_violations"]
        or verdict["early_retries"]
        or not verdict["dead_letters_are_the_poison"]
    )
    kept: dict = {}
    if bad or verdict["redelivered_share"] > REDELIVERY_TARGET:
        # the work folder goes: keep what explains the failed figure or the re-deliveries
        kept = {
            "endpoint_records": evidence(records, verdict),
            "dead_letter_records": dead_letter_records(
                catalog, name, set(verdict["unexpected_dead_letters"])
            ),
            "shard_logs": keep_logs(logs, Path(args.out)),
        }
    catalog.close()
    broker.wipe()
    shutil.rmtree(work, ignore_errors=True)

    for k in (
        "acknowledged_by_kafka",
        "delivered",
        "lost",
        "order_violations",
        "early_retries",
        "read_after_client_left",
        "dead_letters",
        "dead_letters_are_the_poison",
        "duplicates",
        "duplicate_share",
        "duplicates_after_timeout",
        "duplicates_redelivered",
        "redelivered_share",
        "shard_restarts",
        "seconds",
    ):
        print(f"{k:>28}: {verdict[k]}")
    over = verdict["handovers"]
    print(
        f"{'hand-overs':>28}: {over['changes_that_handed_over']} of {over['changes']} changes "
        "handed something over"
        + ("" if over["changes_that_handed_over"] else " (the hand-over was NOT exercised)")
    )
    for c in over["per_change"]:
        print(
            f"{'to ' + str(c['to']):>28}: killed in batch: shard {c['killed_in_batch']}; "
            f"{c['accepted']} journaled as accepted in {len(c['batches'])} batches, "
            f"{c['pending_dropped']} pending dropped, {c['handed_over']} handed over, "
            f"{c['left_out']} left out"
        )
    config = {k: v for k, v in vars(args).items() if k != "out"}
    doc = {"machine": machine(load), "config": config, "verdict": verdict}
    write_results(Path(args.out), doc | ({"evidence": kept} if kept else {}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
