"""What the delivery journal costs a delivery task, and how much a crash re-delivers with it.

Runs the body of a shard's phase-1 task (`varadhi.spark.batch.deliver_records`, what a Spark task runs
on its Kafka records; no Spark) over `--messages` 1 KiB messages of `--groups` groups against
nginx answering 204 on loopback (the endpoint of bench/delivery.py), alternately with the
journal off and at each `--intervals` value, `--repeat` times. The journal writes to the local
broker, as in a shard (a topic of its own, deleted at the end). Per run: CPU time of this
process per message (the task's thread, the journal's thread and its Kafka producer's; the
endpoint is another process), wall time, journal records written, and the largest number of
accepted messages whose journal record the broker had not acknowledged at any moment
(`unjournaled_max`): what a crash
at the worst moment would have re-delivered of this task's work (plus its requests in flight).

The hold-back (`consumption.journal_max_lag`): `--max-lags 1000 5000` runs the journaled task
once per value; `--broker-pause 8` freezes the broker (SIGSTOP, then SIGCONT: Kafka away, no
data lost) for that many seconds, starting `--pause-after` seconds into every run (the run
without a journal too: the task's own time with the broker away). It freezes the broker that
`scripts/kafka` runs (`VARADHI_KAFKA_PORT` picks which), which must be the one
`VARADHI_BOOTSTRAP` names.
A shorter hold-back then shows as fewer accepted messages waiting unjournaled (what a crash
during the outage re-delivers) and a longer wall time (the task stalls sooner).

    scripts/kafka start
    .venv/bin/python bench/journal.py [--messages 50000] [--intervals 250 100] [--repeat 5]
    .venv/bin/python bench/journal.py --max-lags 1000 5000 --broker-pause 8 --repeat 2

Needs Debian's nginx (`apt-get install nginx-light`). Writes bench/results/journal.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa

from common import machine, nginx_binary, write_results
from delivery import nginx
from varadhi.core import messages as m
from varadhi.core.policies import ConsumptionPolicy, Endpoint, RetryPolicy, SubscriptionSpec
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.settings import Settings
from varadhi.spark import batch as batch_module
from varadhi.spark import journal
from varadhi.spark.batch import BatchContext, ForwardRule, deliver_records
from varadhi.spark.shard.commit import stat_rows

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "journal.json"
TOPIC = "bench.0"


def broker_pid() -> int:
    """The pid of the broker `scripts/kafka` runs (VARADHI_KAFKA_PORT picks which)."""
    folder = subprocess.run(
        [str(ROOT / "scripts" / "kafka"), "dir"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return int((Path(folder) / "broker.pid").read_text())


class BrokerPause:
    """Freezes the broker process for `seconds`, `after` seconds from entering; always thaws
    it on the way out."""

    def __init__(self, pid: int, after: float, seconds: float):
        self.pid, self.after, self.seconds = pid, after, seconds
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._pause, daemon=True)

    def _pause(self) -> None:
        if self._done.wait(self.after):
            return
        os.kill(self.pid, signal.SIGSTOP)
        try:
            self._done.wait(self.seconds)
        finally:
            os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> BrokerPause:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(self.after + self.seconds + 5)
        self._done.set()
        os.kill(self.pid, signal.SIGCONT)


def records(messages: int, groups: int) -> pd.DataFrame:
    """Kafka source rows of one partition, groups interleaved in produce order."""
    body = os.urandom(512).hex().encode()
    rows = []
    for offset in range(messages):
        g = f"g{offset % groups}"
        headers = [
            {"key": m.H_MSG_ID, "value": f"{g}.{offset}".encode()},
            {"key": m.H_GROUP_ID, "value": g.encode()},
        ]
        rows.append(
            {
                "kind": "mq",
                "group_key": g,
                "group_id": g,
                "msg_id": f"{g}.{offset}",
                "topic": TOPIC,
                "partition": 0,
                "offset": offset,
                "key": g.encode(),
                "value": body,
                "kheaders": headers,
            }
        )
    return pd.DataFrame(rows)


class Watch:
    """Samples every writer the task made, every 5 ms: how many accepted messages wait for the
    broker's acknowledgement of their journal record (`JournalWriter.unacknowledged`)."""

    def __init__(self):
        self.max_waiting = 0
        self.writers: list[journal.JournalWriter] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.005):
            for w in self.writers:
                self.max_waiting = max(self.max_waiting, w.unacknowledged())

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(
    frame: pd.DataFrame,
    url: str,
    interval_ms: int,
    args,
    topic: str,
    settings,
    max_lag_ms: int = ConsumptionPolicy().journal_max_lag_ms,
    pause: BrokerPause | None = None,
) -> dict:
    spec = SubscriptionSpec(
        name="bench",
        topic="bench",
        endpoint=Endpoint(url=url),
        retry=RetryPolicy(),
        consumption=ConsumptionPolicy(max_in_flight=args.max_in_flight),
    )
    target = (
        journal.JournalTarget(
            settings.bootstrap,
            topic,
            0,
            f"bench/{uuid.uuid4().hex[:6]}",
            interval_ms,
            max_lag_ms=max_lag_ms,
            kafka=kafka_clients.config_of(settings),
        )
        if interval_ms
        else None
    )
    ctx = BatchContext(spec, {TOPIC: 0}, int(time.time() * 1000), seed=1, journal=target)
    original = journal.JournalWriter
    watch = Watch()

    class Counted(original):  # type: ignore[misc, valid-type]
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            watch.writers.append(self)

    batch_module.JournalWriter = Counted  # the writer the task creates, to count and watch it
    try:
        with watch, pause or contextlib.nullcontext():
            cpu0, wall0 = time.process_time(), time.perf_counter()
            [batch] = deliver_records(iter([pa.RecordBatch.from_pandas(frame)]), ctx, ForwardRule())
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        batch_module.JournalWriter = original
    [stat] = stat_rows(batch.to_pandas())
    return {
        "interval_ms": interval_ms,
        "max_lag_ms": max_lag_ms if interval_ms else None,
        "broker_pause_s": pause.seconds if pause else 0,
        "messages": len(frame),
        "cpu_us_per_msg": round(cpu / len(frame) * 1e6, 2),
        "wall_s": round(wall, 3),
        "msg_s": round(len(frame) / wall),
        "journal_records": sum(w.sent_records for w in watch.writers),
        "journaled": sum(w.sent_origins for w in watch.writers),
        "unjournaled_max": watch.max_waiting if interval_ms else None,
        "task": stat,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--intervals", nargs="+", type=int, default=[250])
    parser.add_argument(
        "--max-lags",
        nargs="+",
        type=int,
        default=[ConsumptionPolicy().journal_max_lag_ms],
        help="consumption.journal_max_lag values in ms, one journaled run each (default: the "
        "default)",
    )
    parser.add_argument(
        "--broker-pause",
        type=float,
        default=0,
        help="seconds to freeze the broker (SIGSTOP) in every run (default 0: none)",
    )
    parser.add_argument("--pause-after", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    binary = nginx_binary()
    if not binary:
        print("no nginx (apt-get install nginx-light)", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    topic = f"bench-journal-{uuid.uuid4().hex[:8]}.journal"
    journal.ensure_topic(settings, topic, 1)
    load = os.getloadavg()
    frame = records(args.messages, args.groups)
    pid = broker_pid() if args.broker_pause else None
    variants = [(0, None)] + [(i, lag) for i in args.intervals for lag in args.max_lags]
    rows = []
    try:
        with nginx(binary) as endpoint:
            run(frame.head(2_000), endpoint.url, args.intervals[0], args, topic, settings)
            for i in range(args.repeat):
                for interval, lag in variants:
                    pause = BrokerPause(pid, args.pause_after, args.broker_pause) if pid else None
                    row = run(frame, endpoint.url, interval, args, topic, settings, lag or 0, pause)
                    row["repeat"] = i
                    rows.append(row)
                    print(
                        f"journal {interval or 'off':>4} ms, max lag {lag or '-':>5} ms: "
                        f"{row['cpu_us_per_msg']:6.2f} CPU us/msg, {row['wall_s']:6.2f} s, "
                        f"{row['msg_s']:6,} msg/s, {row['journal_records']} records, "
                        f"at most {row['unjournaled_max']} waiting",
                        flush=True,
                    )
    finally:
        admin = kafka_clients.admin(settings)
        admin.delete_topics([topic])
        admin.close()
    summary = {}
    for interval, lag in variants:
        mine = [r for r in rows if r["interval_ms"] == interval and r["max_lag_ms"] == lag]
        summary[f"{interval}/{lag}" if lag else str(interval)] = {
            "cpu_us_per_msg_median": statistics.median(r["cpu_us_per_msg"] for r in mine),
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
            "msg_s_median": statistics.median(r["msg_s"] for r in mine),
            "unjournaled_max": max((r["unjournaled_max"] or 0) for r in mine),
        }
    print(summary)
    write_results(
        args.out,
        {
            "benchmark": "journal",
            "command": "python bench/journal.py " + " ".join(argv or sys.argv[1:]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": machine(load),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "summary": summary,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
