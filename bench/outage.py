"""An endpoint outage: the backlog built up while the endpoint answered 503 to everything, and how
fast it drains once the endpoint recovers.

    scripts/setup && scripts/kafka start
    .venv/bin/python bench/outage.py [--modes grouped ungrouped] [--rate 2000] [--groups 1000]
                                     [--outage-s 30] [--retry-after 1] [--no-circuit-breaker]

Per mode (`--modes`: a grouped and an ungrouped subscription, one run each, on a topic of its
own), one shard (`ShardJob` in this process, local Spark, trigger 500 ms) delivers to the
project's test endpoint (`python -m varadhi.testing.endpoint`, a process of its own on
127.0.0.1, recording every request with its arrival time, message id, attempt and answer). A
producer process paces `--rate` messages a second (1 KiB, message ids `m<i>`, group
`group-<i % groups>`) for the whole run. The run, one step after the other:

1. start-up: the shard starts and catches up with what was produced meanwhile;
2. healthy: `--healthy-s` seconds of steady delivery (the healthy rate, and the lag that is
   "steady": the most the lag reached in this window);
3. control: the subscription is paused for `--outage-s` seconds (`varadhi subscription pause`),
   then resumed: the same backlog as the outage's, drained against a healthy endpoint. Its drain
   rate is the shard's max rate, which the outage's is judged against;
4. `--settle-s` seconds of steady delivery;
5. outage: the endpoint answers 503 (with `Retry-After: --retry-after` s) to every request for
   `--outage-s` seconds (`GET /outage`), then recovers;
6. once caught up again, `--tail-s` more seconds; then the producer stops and the shard stops
   when it has delivered everything (at most `--drain-timeout-s`).

Judged from the endpoint's record and the producer's log (message counts over time), after the
run: the healthy rate; the lag at the end of the control pause and at recovery (the backlog);
time from then to caught up (the lag back at the steady lag) and the delivery rate over that
window (control: the max rate; outage: the drain rate and its ratio to the max rate, target
>= 0.8); the wait for the first delivery after recovery; the most delivered in 10 s while
draining; messages sent before their due time (must be 0: a retry's attempt n+1 arriving earlier
than attempt n's arrival plus the policy's least backoff after n failures, jitter taken at its
low end, or the endpoint's Retry-After when the policy honours it for 503); requests that arrived
while the circuit breaker was open (must be 0: nothing is read or sent while open,
docs/architecture.md "Circuit breaker"), and the requests of each half-open probe (documented:
about twice `probes` against a dead endpoint); lost messages (0) and, grouped, order
violations (0: a request for a group's message while an earlier message of the group had not
been delivered). The shard's status (`varadhi status`: circuit state, main-topic lag, RQ
pending, held) is sampled every second, and every micro-batch's figures (records, seconds,
phases, attempts, failures) kept, to say where a slow drain's time goes.

The subscription: default retry backoff (1 s, exponential, 20% jitter, at most 60 s:
`--max-backoff-ms`) with `retry.max_attempts` `--max-attempts` (20: an outage must not
dead-letter), the default circuit breaker unless `--no-circuit-breaker`. The test endpoint is
Python and writes a record per request: it caps the drain rate (docs/benchmarks.md, "HTTP
delivery engine": ~10k req/s without recording), for the control and the outage alike.

Uses its own catalog topic and warehouse (bench/delivery.py's `Env`), deleted at the end.
Results: a table on stdout, JSON in bench/results/outage.json.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import math
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import endpoint_process, machine, print_table, results_head, write_results
from harness import bench_topic, parser, run_shard
from varadhi.core.policies import RetryPolicy
from varadhi.core.retry import backoff_ms, classify
from varadhi.testing.endpoint import Record

if TYPE_CHECKING:  # the run's types; the judge imports no Spark
    from varadhi.kafka.subscriptions import SubscriptionService
    from varadhi.spark.shard.job import ShardJob

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "outage.json"
TARGET = 0.8  # issue 13: the outage's backlog drains at >= 0.8x the healthy (max) rate
STEP_MS = 250  # the lag's time grid
# The run's steps (epoch ms), in order; the judge needs them all.
EVENTS = ("healthy_from", "healthy_to", "pause_from", "pause_to", "outage_from", "outage_to", "end")
PEAK_WINDOW_MS = 10_000
# The product takes `now` as whole milliseconds; the endpoint stamps fractional ones.
CLOCK_SLACK_MS = 1
COLUMNS = [
    ("mode", "mode", 9, ""),
    ("healthy/s", "healthy_msg_s", 9, ""),
    ("max/s", "max_msg_s", 7, ""),
    ("backlog", "backlog", 8, ""),
    ("1st ok s", "first_ok_s", 8, ""),
    ("drain s", "drain_s", 7, ""),
    ("drain/s", "drain_msg_s", 7, ""),
    ("ratio", "ratio", 5, ""),
    ("early", "early_sends", 5, ""),
    ("open", "sent_while_open", 4, ""),
    ("lost", "lost", 4, ""),
    ("order", "order_violations", 5, ""),
]


# -- judging (pure) ----------------------------------------------------------------------------


def message_index(message_id: str | None) -> int | None:
    """The producer's sequence number of message id `m<i>`, else None."""
    if message_id and message_id[0] == "m" and message_id[1:].isdigit():
        return int(message_id[1:])
    return None


def first_successes(records: Iterable[Record]) -> dict[int, float]:
    """Message index -> arrival (epoch ms) of its first request answered 2xx."""
    out: dict[int, float] = {}
    for r in records:
        i = message_index(r.message_id)
        if i is not None and 200 <= r.status < 300 and r.received_ms < out.get(i, math.inf):
            out[i] = r.received_ms
    return out


class Counts:
    """A count over time from sorted event times, or from (time, count) samples of a count
    that only grows (the producer's log): `at(t)` is the count at time `t` (epoch ms)."""

    def __init__(self, times: Sequence[float], counts: Sequence[int] | None = None):
        self.times = list(times)
        self.counts = list(counts) if counts is not None else list(range(1, len(times) + 1))

    def at(self, t: float) -> int:
        k = bisect.bisect_right(self.times, t)
        return self.counts[k - 1] if k else 0

    def first_after(self, t: float) -> float | None:
        """The first event time at or after `t` (None: none)."""
        k = bisect.bisect_left(self.times, t)
        return self.times[k] if k < len(self.times) else None


def lag_at(produced: Counts, delivered: Counts, t: float) -> int:
    """Messages produced by `t` and not delivered by then."""
    return max(0, produced.at(t) - delivered.at(t))


def steady_lag(produced: Counts, delivered: Counts, start: float, end: float) -> int:
    """The most the lag reached over [start, end] (a grid of `STEP_MS`): what steady looks
    like; caught up means back at or under it."""
    t, most = start, 0
    while t <= end:
        most = max(most, lag_at(produced, delivered, t))
        t += STEP_MS
    return most


def drain(produced: Counts, delivered: Counts, start: float, threshold: int, until: float) -> dict:
    """A backlog's drain from `start` (the end of a pause or an outage, epoch ms): the lag
    then (`backlog`), the first delivery after it, when the lag came back to `threshold`
    (None: not by `until`), the seconds that took, the delivery rate over that window and the
    most delivered in `PEAK_WINDOW_MS`."""
    backlog = lag_at(produced, delivered, start)
    first = delivered.first_after(start)
    t, caught = start, None
    while t <= until:
        if lag_at(produced, delivered, t) <= threshold:
            caught = t
            break
        t += STEP_MS
    out: dict = {
        "backlog": backlog,
        "first_ok_s": None if first is None else round((first - start) / 1000, 2),
        "caught_up_s": None,
        "msg_s": None,
        "peak_10s_msg_s": None,
    }
    if caught is None or caught <= start:
        return out
    seconds = (caught - start) / 1000
    peak, w = 0, start
    while w + PEAK_WINDOW_MS <= caught or w == start:
        peak = max(peak, delivered.at(w + PEAK_WINDOW_MS) - delivered.at(w))
        w += STEP_MS
    out.update(
        caught_up_s=round(seconds, 2),
        msg_s=round((delivered.at(caught) - delivered.at(start)) / seconds),
        peak_10s_msg_s=round(peak * 1000 / PEAK_WINDOW_MS),
    )
    return out


class _LowestDraw:
    """An rng whose every draw is the low end: `backoff_ms` then gives the least delay its
    jitter allows."""

    def uniform(self, a: float, b: float) -> float:
        return a


def least_wait_ms(policy: RetryPolicy, failures: int, status: int, retry_after_ms: int) -> int:
    """The least a retry may wait after its `failures`-th failed attempt, answered `status`:
    the policy's backoff with its jitter at the low end, or the endpoint's Retry-After when the
    matching rule honours it and it asks for longer (`varadhi.core.retry.decide`)."""
    wait = backoff_ms(policy, failures, _LowestDraw())  # type: ignore[arg-type]
    if classify(status, None, policy.responses).honour_retry_after:
        wait = max(wait, retry_after_ms)
    return wait


def early_sends(records: Iterable[Record], policy: RetryPolicy, retry_after_ms: int) -> list[dict]:
    """Every request for attempt n+1 of a message that arrived before attempt n's arrival plus
    `least_wait_ms` (the client decides once it has attempt n's answer, so never before the
    endpoint stamped it; it then waits at least that): the message, both `seq`s, the gap and
    the wait owed, in ms. Attempt n answered 2xx is not retried: a later request is a duplicate,
    not a retry."""
    by_msg: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r.message_id is not None and r.attempt is not None:
            by_msg[r.message_id].append(r)
    early = []
    for msg, rs in by_msg.items():
        rs.sort(key=lambda r: r.received_ms)
        last_of: dict[int, Record] = {}
        for r in rs:
            prev = last_of.get(r.attempt - 1)
            if prev is not None and prev.status >= 300:
                need = least_wait_ms(policy, prev.attempt, prev.status, retry_after_ms)
                if r.received_ms + CLOCK_SLACK_MS < prev.received_ms + need:
                    early.append(
                        {
                            "message": msg,
                            "seq": [prev.seq, r.seq],
                            "attempt": r.attempt,
                            "gap_ms": round(r.received_ms - prev.received_ms, 1),
                            "need_ms": need,
                        }
                    )
            last_of[r.attempt] = r
    return early


def open_intervals(samples: Iterable[dict]) -> list[tuple[int, int]]:
    """The circuit's open periods (since, until; epoch ms) that the status samples saw, in
    order, each once."""
    seen = {
        (int(c["since_ms"]), int(c["open_until_ms"]))
        for s in samples
        if (c := s.get("circuit")) and c.get("state") == "open" and c.get("open_until_ms")
    }
    return sorted(seen)


def sent_while_open(records: Iterable[Record], intervals: Sequence[tuple[int, int]]) -> list[int]:
    """`seq` of every request that arrived inside an open period (strictly: the batch that
    opened the circuit ended, and was recorded, after its last request arrived)."""
    starts = [a for a, _ in intervals]
    out = []
    for r in records:
        k = bisect.bisect_right(starts, r.received_ms) - 1
        if k >= 0 and intervals[k][0] < r.received_ms < intervals[k][1]:
            out.append(r.seq)
    return out


def half_open_periods(samples: Iterable[dict], end_ms: float) -> list[tuple[float, float]]:
    """The circuit's half-open periods the status samples let one tell (epoch ms): from each
    open period's end to the next change the samples saw after it (opened again, or closed),
    else to `end_ms`."""
    changes = sorted(
        {
            (int(c["since_ms"]), c["state"])
            for s in samples
            if (c := s.get("circuit")) and c.get("state") in ("open", "closed")
        }
    )
    out = []
    for _, until in open_intervals(samples):
        after = [t for t, _ in changes if t > until]
        out.append((float(until), float(after[0]) if after else end_ms))
    return out


def probe_requests(records: Iterable[Record], periods: Sequence[tuple[float, float]]) -> list[int]:
    """Requests that arrived in each half-open period (`half_open_periods`)."""
    times = sorted(r.received_ms for r in records)
    return [bisect.bisect_left(times, b) - bisect.bisect_left(times, a) for a, b in periods]


def order_violations(records: Iterable[Record], produced: int, groups: int) -> dict:
    """Requests (arrival order) for a message of a group while an earlier message of that group
    (`m<i>`, group `i % groups`, i < `produced`) had not been answered 2xx yet: their count and
    the groups they were in."""
    delivered: set[int] = set()
    frontier: dict[int, int] = defaultdict(int)  # group -> k of its first undelivered message
    bad = 0
    bad_groups: set[int] = set()
    for r in sorted(records, key=lambda r: r.received_ms):
        i = message_index(r.message_id)
        if i is None or i >= produced:
            continue
        g, k = i % groups, i // groups
        if k > frontier[g]:
            bad += 1
            bad_groups.add(g)
        if 200 <= r.status < 300:
            delivered.add(i)
            while frontier[g] * groups + g in delivered:
                frontier[g] += 1
    return {"requests": bad, "groups": len(bad_groups), "examples": sorted(bad_groups)[:10]}


def circuit_timeline(samples: Iterable[dict], t0_ms: float) -> list[dict]:
    """The circuit's states the status samples saw, each change once: seconds since `t0_ms`
    (the state's own `since_ms`), state, open-for seconds and consecutive opens."""
    out: list[dict] = []
    last = None
    for s in samples:
        c = s.get("circuit")
        if not c:
            continue
        key = (c.get("state"), c.get("since_ms"))
        if key == last:
            continue
        last = key
        row = {"t_s": round((int(c["since_ms"]) - t0_ms) / 1000, 1), "state": c["state"]}
        if c["state"] == "open" and c.get("open_until_ms"):
            row["open_s"] = round((int(c["open_until_ms"]) - int(c["since_ms"])) / 1000, 1)
            row["consecutive_opens"] = c.get("consecutive_opens")
        out.append(row)
    return out


def judge(
    records: list[Record],
    produced_log: Sequence[tuple[float, int]],
    events: dict[str, float],
    samples: list[dict],
    policy: RetryPolicy,
    retry_after_ms: int,
    groups: int,
    grouped: bool,
) -> dict:
    """One mode's figures (see the module docstring) from the endpoint's `records`, the
    producer's (epoch ms, messages produced) log, the run's `events` (epoch ms: healthy_from,
    healthy_to, pause_from, pause_to, outage_from, outage_to, end) and the status samples."""
    produced = Counts([t for t, _ in produced_log], [n for _, n in produced_log])
    total = produced_log[-1][1] if produced_log else 0
    ok = first_successes(records)
    delivered = Counts(sorted(ok.values()))
    hf, ht = events["healthy_from"], events["healthy_to"]
    threshold = steady_lag(produced, delivered, hf, ht)
    healthy_s = (ht - hf) / 1000
    control = drain(produced, delivered, events["pause_to"], threshold, events["outage_from"])
    outage = drain(produced, delivered, events["outage_to"], threshold, events["end"])
    ratio = (
        round(outage["msg_s"] / control["msg_s"], 2)
        if outage["msg_s"] and control["msg_s"]
        else None
    )
    intervals = open_intervals(samples)
    early = early_sends(records, policy, retry_after_ms)
    while_open = sent_while_open(records, intervals)
    order = order_violations(records, total, groups) if grouped else None
    in_outage = [r for r in records if events["outage_from"] <= r.received_ms < events["outage_to"]]
    return {
        "produced": total,
        "requests": len(records),
        "delivered": len(ok),
        "lost": sum(1 for i in range(total) if i not in ok),
        "duplicates": sum(1 for r in records if 200 <= r.status < 300) - len(ok),
        "healthy_msg_s": round((delivered.at(ht) - delivered.at(hf)) / healthy_s),
        "offered_msg_s": round((produced.at(ht) - produced.at(hf)) / healthy_s),
        "steady_lag": threshold,
        "control": control,
        "outage": outage,
        "ratio": ratio,
        "meets_target": None if ratio is None else ratio >= TARGET,
        "requests_during_outage": len(in_outage),
        "retries": sum(1 for r in records if r.attempt is not None and r.attempt > 1),
        "early_sends": len(early),
        "early_send_examples": early[:20],
        "open_periods": len(intervals),
        "sent_while_open": len(while_open),
        "sent_while_open_seq": while_open[:20],
        "probe_requests": probe_requests(records, half_open_periods(samples, events["end"])),
        "order_violations": None if order is None else order["groups"],
        "order": order,
        "circuit": circuit_timeline(samples, events["healthy_from"]),
    }


def circuit_line(run: dict) -> str:
    """One mode's outage and circuit states over time, in seconds since its healthy window
    began: `grouped: outage 105.5-135.5 s; circuit closed at -164.8, open 5 s at 145, ...`."""
    states = []
    for c in run["circuit"]:
        held = f" {c['open_s']:g} s" if "open_s" in c else ""
        states.append(f"{c['state']}{held} at {c['t_s']:g}")
    ev = run["events_s"]
    return (
        f"{run['mode']}: outage {ev['outage_from']:g}-{ev['outage_to']:g} s; "
        f"circuit {', '.join(states) or 'not sampled'}"
    )


def table_row(mode: str, v: dict) -> dict:
    """The table's strings for one mode's verdict ("-": not measured, e.g. never caught up)."""

    def num(x, fmt=","):
        return "-" if x is None else format(x, fmt)

    return {
        "mode": mode,
        "healthy_msg_s": num(v["healthy_msg_s"]),
        "max_msg_s": num(v["control"]["msg_s"]),
        "backlog": num(v["outage"]["backlog"]),
        "first_ok_s": num(v["outage"]["first_ok_s"], ".1f"),
        "drain_s": num(v["outage"]["caught_up_s"], ".1f"),
        "drain_msg_s": num(v["outage"]["msg_s"]),
        "ratio": num(v["ratio"], ".2f"),
        "early_sends": num(v["early_sends"]),
        "sent_while_open": num(v["sent_while_open"]),
        "lost": num(v["lost"]),
        "order_violations": num(v["order_violations"]),
    }


# -- the run -------------------------------------------------------------------------------------


def pace(settings_env: dict, topic: str, rate: int, groups: int, stop, produced, log_path: str):
    """The producer process: `rate` msg/s (ids `m<i>`, group `group-<i % groups>`) until `stop`
    is set; `produced` (a shared int) and the log file (`<epoch ms> <count>` lines, every 10 ms
    or so) say how many so far."""
    os.environ.update(settings_env)
    from varadhi.kafka.producer import Producer
    from varadhi.kafka.settings import Settings

    value = os.urandom(512).hex().encode()  # 1 KiB
    sent = 0
    with Producer(topic, Settings.from_env(), linger_ms=5) as p, open(log_path, "w") as out:
        t0 = time.monotonic()
        while not stop.is_set():
            due = int((time.monotonic() - t0) * rate) + 1
            while sent < due:
                p.send(value, group_id=f"group-{sent % groups}", message_id=f"m{sent}")
                sent += 1
            produced.value = sent
            out.write(f"{time.time() * 1000:.1f} {sent}\n")
            time.sleep(0.01)
        p.flush()
        out.write(f"{time.time() * 1000:.1f} {sent}\n")
    produced.value = sent


def read_produced(path: Path) -> list[tuple[float, int]]:
    """The producer's log: (epoch ms, messages sent by then)."""
    out = []
    for line in path.read_text().splitlines():
        t, n = line.split()
        out.append((float(t), int(n)))
    return out


@dataclass
class Run:
    """What the controller needs of one mode's run."""

    job: ShardJob
    url: str
    produced: Any  # multiprocessing.Value("q"): the producer's count so far
    stop_producing: Any  # multiprocessing.Event
    subscriptions: SubscriptionService  # on the controller's own catalog client
    name: str
    args: argparse.Namespace
    events: dict[str, float]
    note: Callable[[str], None]


def lag_now(run: Run) -> int:
    return run.produced.value - run.job.stats.delivered


def wait_caught_up(run: Run, what: str, timeout_s: float) -> bool:
    """Until the live lag (produced - delivered so far) is under `--steady-lag-s` of the
    offered rate for 3 s in a row (the controller's cue only: the judge decides from the
    records), or `timeout_s`."""
    limit = run.args.rate * run.args.steady_lag_s
    deadline = time.monotonic() + timeout_s
    below_since = None
    while time.monotonic() < deadline:
        if lag_now(run) <= limit:
            below_since = below_since or time.monotonic()
            if time.monotonic() - below_since >= 3:
                return True
        else:
            below_since = None
        time.sleep(0.5)
    run.note(f"{what}: not caught up after {timeout_s:.0f} s (lag {lag_now(run):,})")
    return False


def control(run: Run) -> None:
    """The schedule of one mode's run (module docstring, steps 1-6), in a thread; stops the
    shard at the end, whatever happened."""
    a, ev = run.args, run.events
    try:
        while run.job.stats.delivered == 0:
            time.sleep(0.5)
        run.note("first deliveries")
        wait_caught_up(run, "start-up", a.drain_timeout_s)
        ev["healthy_from"] = time.time() * 1000
        run.note(f"healthy for {a.healthy_s:.0f} s")
        time.sleep(a.healthy_s)
        ev["healthy_to"] = ev["pause_from"] = time.time() * 1000
        run.subscriptions.set_paused(run.name, True)
        run.note(f"paused for {a.outage_s:.0f} s (control)")
        time.sleep(a.outage_s)
        run.subscriptions.set_paused(run.name, False)
        ev["pause_to"] = time.time() * 1000
        run.note("resumed")
        wait_caught_up(run, "control", a.drain_timeout_s)
        time.sleep(a.settle_s)
        with urllib.request.urlopen(f"{run.url}outage?seconds={a.outage_s}", timeout=30) as r:
            window = json.loads(r.read())
        ev["outage_from"], ev["outage_to"] = window["from_ms"], window["until_ms"]
        run.note(f"endpoint down for {a.outage_s:.0f} s")
        time.sleep(max(0.0, ev["outage_to"] / 1000 - time.time()))
        run.note("endpoint recovered")
        wait_caught_up(run, "outage", a.drain_timeout_s)
        time.sleep(a.tail_s)
    except Exception as e:  # the run ends either way; the judge says what is missing
        run.note(f"controller failed: {e!r}")
    finally:
        run.stop_producing.set()
        deadline = time.monotonic() + a.drain_timeout_s
        time.sleep(2)
        while lag_now(run) > 0 and time.monotonic() < deadline:
            time.sleep(1)
        ev["end"] = time.time() * 1000
        run.note(f"stopping (lag {lag_now(run):,})")
        run.job.request_stop()


def sample_status(catalog, name: str, out: list[dict], stop: threading.Event) -> None:
    """`varadhi status` of shard 0 every second into `out` (time, state, circuit, lags)."""
    from varadhi.ops import status

    while not stop.wait(1.0):
        try:
            s = status.collect(catalog, name)["shards"][0]
        except Exception as e:  # a slow broker: skip the sample, say so in the results
            out.append({"t_ms": time.time() * 1000, "error": repr(e)})
            continue
        out.append(
            {
                "t_ms": round(time.time() * 1000),
                "state": s["state"],
                "circuit": s["circuit"],
                "main_lag": s["queues"]["main"]["lag"],
                "rq_lag": s["queues"]["rq"]["lag"],
                "rq_pending": s["queues"]["rq"]["pending"],
                "held": s["held"],
            }
        )


def run_mode(env, spark, topic: str, mode: str, args, work: Path) -> dict:
    """One mode's run (module docstring) and its verdict."""
    from varadhi.core.subscription_spec import parse_spec
    from varadhi.kafka.catalog import Catalog
    from varadhi.kafka.subscriptions import SubscriptionService
    from varadhi.spark.shard.job import ShardJob
    from varadhi.testing.endpoint import read_records

    name = f"bench-{env.tag}-{mode}"
    record = work / f"{mode}-requests.jsonl"
    produced_log = work / f"{mode}-produced.txt"
    t0 = time.monotonic()

    def note(text: str) -> None:
        print(f"[{mode} {time.monotonic() - t0:6.1f}s] {text}", flush=True)

    endpoint = ["--record", str(record), "--retry-after", str(args.retry_after)]
    with endpoint_process(*endpoint) as url:
        doc = {
            "name": name,
            "topic": topic,
            "endpoint": {"url": url},
            "grouped": mode == "grouped",
            "retry": {
                "max_attempts": args.max_attempts,
                "max_backoff": f"{args.max_backoff_ms}ms",
            },
            "consumption": {"trigger_interval": "500ms"},
        }
        if args.no_circuit_breaker:
            doc["circuit_breaker"] = {"enabled": False}
        spec = parse_spec(doc, "bench")
        SubscriptionService(env.catalog).create(spec)
        job = ShardJob(name, 0, env.settings, spark=spark)
        batches: list[dict] = []
        job.batch_hooks.append(
            lambda last, _summary: batches.append({"t_ms": round(time.time() * 1000), **last})
        )
        ctx = multiprocessing.get_context("spawn")
        stop_producing, produced = ctx.Event(), ctx.Value("q", 0)
        producer = ctx.Process(
            target=pace,
            args=(
                env.spark_env(),
                topic,
                args.rate,
                args.groups,
                stop_producing,
                produced,
                str(produced_log),
            ),
        )
        events: dict[str, float] = {}
        samples: list[dict] = []
        stop_sampling = threading.Event()
        # The sampler and the controller each have a catalog client of their own (threads).
        sampler_catalog, control_catalog = Catalog(env.settings), Catalog(env.settings)
        sampler = threading.Thread(
            target=sample_status, args=(sampler_catalog, name, samples, stop_sampling), daemon=True
        )
        service = SubscriptionService(control_catalog)
        run = Run(job, url, produced, stop_producing, service, name, args, events, note)
        producer.start()
        sampler.start()
        controller = threading.Thread(target=control, args=(run,), daemon=True)
        controller.start()
        try:
            note("shard starting")
            run_shard(job, f"the {mode} shard")
        finally:
            stop_producing.set()
            stop_sampling.set()
            producer.join(60)
            if producer.is_alive():
                producer.terminate()
            controller.join(5)
            sampler.join(10)
            sampler_catalog.close()
            control_catalog.close()
    start = events.get("healthy_from", 0)
    missing = [k for k in EVENTS if k not in events]
    if missing:  # stopped early (a signal, a failed step): no figures, say where it stopped
        note(f"stopped before {missing[0]}: not judged")
        return {"mode": mode, "incomplete": f"stopped before {missing[0]}", "events": events}
    note("judging")
    records = read_records(str(record))
    verdict = judge(
        records,
        read_produced(produced_log),
        events,
        samples,
        spec.retry,
        args.retry_after * 1000,
        args.groups,
        mode == "grouped",
    )
    return {
        "mode": mode,
        **verdict,
        "events_s": {k: round((v - start) / 1000, 1) for k, v in events.items()},
        "status": [s | {"t_s": round((s["t_ms"] - start) / 1000, 1)} for s in samples],
        "batches": [b | {"t_s": round((b["t_ms"] - start) / 1000, 1)} for b in batches],
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, RESULTS)
    p.add_argument(
        "--modes", nargs="+", choices=["grouped", "ungrouped"], default=["grouped", "ungrouped"]
    )
    p.add_argument("--rate", type=int, default=2_000, help="offered load, msg/s (default 2,000)")
    p.add_argument("--outage-s", type=float, default=30, help="the outage's (and the pause's) s")
    p.add_argument("--retry-after", type=int, default=1, help="the endpoint's Retry-After, s")
    p.add_argument("--healthy-s", type=float, default=30, help="steady delivery measured, s")
    p.add_argument("--settle-s", type=float, default=15, help="steady between control and outage")
    p.add_argument("--tail-s", type=float, default=15, help="steady after the outage's drain")
    p.add_argument("--max-attempts", type=int, default=20, help="the subscription's retry")
    p.add_argument(
        "--max-backoff-ms", type=int, default=RetryPolicy().max_backoff_ms, help="retry.max_backoff"
    )
    p.add_argument("--no-circuit-breaker", action="store_true", help="circuit_breaker disabled")
    p.add_argument(
        "--steady-lag-s",
        type=float,
        default=5,
        help="the run moves on once the live lag is under this many seconds of --rate",
    )
    p.add_argument("--drain-timeout-s", type=float, default=300, help="most any drain may take")
    p.epilog = __doc__.split("\n\n", 1)[1]  # the whole story under the options
    args = p.parse_args(argv)

    from varadhi.spark.session import get_spark

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)  # a loaded machine's slow-poll noise
    load_at_start = os.getloadavg()
    rows = []
    with bench_topic(args) as (env, first_topic), tempfile.TemporaryDirectory() as tmp:
        logging.getLogger("varadhi.spark.shard.job").setLevel(logging.INFO)
        spark = get_spark("varadhi-bench-outage")
        for n, mode in enumerate(args.modes):
            topic = first_topic
            if n:
                from varadhi.kafka.topics import TopicService

                topic = f"{first_topic}-{mode}"
                TopicService(env.catalog).create(topic, args.partitions)
            rows.append(run_mode(env, spark, topic, mode, args, Path(tmp)))
    print_table([table_row(r["mode"], r) for r in rows if "incomplete" not in r], COLUMNS)
    for r in rows:
        if "incomplete" in r:
            print(f"{r['mode']}: {r['incomplete']}")
        else:
            print(circuit_line(r))
    load_at_end = [round(x, 2) for x in os.getloadavg()]
    result = {
        **results_head("outage", argv, machine(load_at_start, load_at_end=load_at_end)),
        "settings": {
            k: getattr(args, k)
            for k in (
                "modes",
                "rate",
                "groups",
                "partitions",
                "outage_s",
                "retry_after",
                "healthy_s",
                "settle_s",
                "tail_s",
                "max_attempts",
                "max_backoff_ms",
                "no_circuit_breaker",
            )
        },
        "target": TARGET,
        "runs": rows,
    }
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
