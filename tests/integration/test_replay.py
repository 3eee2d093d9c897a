"""`varadhi replay` against the real broker, the session's SparkSession and a real HTTP endpoint.

One composite topic with two storage topics holds three time windows of messages, produced with
explicit Kafka timestamps (kafka-python's `timestamp_ms`) to the partitions the router chooses
(`varadhi.kafka.producer.plan`): "before" (one ms before the range), "window 1" (the range; partly on
storage topic 0, partly on storage topic 1 after a produce switch) and "window 2" (from exactly
the range's exclusive end on). Replaying window 1 must re-deliver exactly its messages, per group
in produce order, with the replay header, and leave the subscription's offsets, state and queues
as they were. No shard runs: replays need none.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from kafka import KafkaProducer

from varadhi.cli import main as cli
from varadhi.core.errors import InvalidArgument
from varadhi.core.subscription_spec import parse_spec
from varadhi.core.version import __version__
from varadhi.kafka import topics
from varadhi.kafka.producer import encode, kafka_headers, plan
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import replay
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import wait_for
from varadhi.testing.prometheus import scrape

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

BASE = (int(time.time() * 1000) - 600_000) // 1000 * 1000  # the range's start, 10 minutes ago
TO = BASE + 60_000  # the range's (exclusive) end
GROUPS = ("a", "b", "c")


class History:
    """The topic, the subscription and what was produced: window -> [(group, message id)]."""

    def __init__(self, topic: str, sub: str, endpoint: TestEndpoint, produced: dict):
        self.topic, self.sub, self.endpoint, self.produced = topic, sub, endpoint, produced

    def ids(self, window: str, group: str | None = "*") -> list[str]:
        """Message ids of `window` in produce order: all, or of one group (None: ungrouped)."""
        return [i for g, i in self.produced[window] if group == "*" or g == group]


def _send(producer: KafkaProducer, topic, group: str | None, msg_id: str, ts: int) -> None:
    record = encode(f"body-{msg_id}", group, None, msg_id, 1 << 20)
    storage, partition = plan(topic, group, spread=int(msg_id.rsplit("-", 1)[1]))
    producer.send(
        storage,
        key=record.key,
        value=record.value,
        partition=partition,
        headers=kafka_headers(record, ts),
        timestamp_ms=ts,
    ).get(timeout=60)


@pytest.fixture(scope="module")
def history(catalog, settings):
    """Three windows of messages for groups a, b, c (and ungrouped ones), and a subscription
    (retry: 3 attempts, 100 ms fixed backoff) delivering to a recording endpoint; in window 1,
    b's second message answers 503 once (retried in place) and c's third 404 (stops c)."""
    suffix = uuid.uuid4().hex[:8]
    name, sub = f"replay-{suffix}", f"replay-sub-{suffix}"
    service = TopicService(catalog)
    service.create(name, 2)
    service.add_storage(name, 4)  # K=2: compatible, groups keep their shard
    produced: dict[str, list[tuple[str | None, str]]] = {"before": [], "w1": [], "w2": []}
    n = 0

    def send(window: str, group: str | None, ts: int) -> None:
        nonlocal n
        msg_id = f"{window}-{group or 'u'}-{n}"
        n += 1
        _send(producer, service.get(name), group, msg_id, ts)
        produced[window].append((group, msg_id))

    producer = KafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    try:
        for group in GROUPS:
            send("before", group, BASE - 1)  # one ms before --from
        for i in range(4):  # window 1 on storage topic 0; the first ones exactly at --from
            for group in GROUPS:
                send("w1", group, BASE + 100 * i)
        send("w1", None, BASE + 500)
        service.switch_produce(name)
        for i in range(3):  # window 1 on storage topic 1
            for group in GROUPS:
                send("w1", group, BASE + 1_000 + 100 * i)
        for i in range(2):  # window 2: exactly at --to (exclusive) and later
            for group in GROUPS:
                send("w2", group, TO + 1_000 * i)
    finally:
        producer.close()

    script = {produced["w1"][4][1]: [503, 200], produced["w1"][8][1]: [404]}
    assert produced["w1"][4][0] == "b" and produced["w1"][8][0] == "c"
    with TestEndpoint(script=script, record_headers=True) as endpoint:
        spec = parse_spec(
            {
                "name": sub,
                "topic": name,
                "endpoint": {"url": endpoint.url},
                "shards": 2,
                "retry": {"max_attempts": 3, "backoff": "fixed", "min_backoff": "100ms"},
            }
        )
        SubscriptionService(catalog).create(spec)
        yield History(name, sub, endpoint, produced)


def successes(endpoint: TestEndpoint, since: int = 0) -> dict[str | None, list[str]]:
    out: dict[str | None, list[str]] = {}
    for r in endpoint.records(since):
        if r.status < 300:
            out.setdefault(r.group_id, []).append(r.message_id)
    return out


def untouched_state(catalog, settings, history: History) -> dict:
    """What a replay must not change: the subscription's record, its readers, leases and
    progress, RQ/DLQ end offsets, and the (absent) state and checkpoints in the warehouse."""
    snap = catalog.snapshot()
    sub = snap.get("subscription", history.sub)
    mine = {
        kind: {k: v for k, v in snap.items(kind).items() if k.startswith(f"{history.sub}/")}
        for kind in ("reader", "lease", "progress")
    }
    queues = [topics.from_snapshot(snap, f"{history.sub}.{q}") for q in ("rq", "dlq")]
    ends = topics.end_offsets(catalog, [st for q in queues for st in q.storage_topics])
    return {
        "subscription": sub,
        "others": mine,
        "queue_ends": ends,
        "warehouse": os.path.exists(Path(settings.warehouse) / history.sub),
    }


@pytest.mark.compat  # also run on the older Spark lines (scripts/test --spark-line)
def test_replay_redelivers_exactly_the_range_in_group_order(
    history, catalog, settings, spark, monkeypatch, capsys
):
    monkeypatch.setenv("VARADHI_WAREHOUSE", settings.warehouse)
    before = untouched_state(catalog, settings, history)
    assert before["warehouse"] is False and sum(map(sum, before["queue_ends"].values())) == 0
    since = len(history.endpoint.records())
    capsys.readouterr()

    code = cli(["replay", history.sub, "--from", str(BASE), "--to", str(TO), "--output", "json"])
    out, err = capsys.readouterr()
    assert code == 1, err  # c's message failed
    doc = json.loads(out)

    got = successes(history.endpoint, since)
    w1 = history.ids("w1")
    assert got["a"] == history.ids("w1", "a")  # storage topic 0 first, then 1, produce order
    assert got["b"] == history.ids("w1", "b")  # b's 503 was retried in place, order kept
    assert got["c"] == history.ids("w1", "c")[:2]  # c stopped at its 404
    assert got[None] == history.ids("w1", None)
    records = history.endpoint.records(since)
    assert {r.message_id for r in records} <= set(w1)  # nothing of "before" or window 2
    b1 = history.ids("w1", "b")[1]
    assert [(r.attempt, r.status) for r in records if r.message_id == b1] == [(1, 503), (2, 200)]
    for r in records:
        assert r.headers["X-Varadhi-Replay"] == doc["replay_id"]
        assert r.headers["Idempotency-Key"] == r.message_id
        storage, partition, offset = r.headers["X-Varadhi-Source"].split("/")
        assert storage in (f"{history.topic}.0", f"{history.topic}.1")

    c = history.ids("w1", "c")
    assert doc["counts"] == {
        "records": len(w1),
        "groups": 4,  # a, b, c and the ungrouped message
        "delivered": len(w1) - len(c) + 2,
        "failed": 1,
        "not_delivered": len(c) - 3,
        "attempts": len(w1) - len(c) + 3 + 1,  # c0, c1, c2 (404); b1 twice
        "filtered": 0,  # the subscription has no filter
    }
    (failure,) = doc["failures"]
    assert (failure["msg_id"], failure["group_id"], failure["status"]) == (c[2], "c", 404)
    assert failure["reason"] == "fatal response 404" and failure["not_delivered"] == len(c) - 3
    offsets = doc["offsets"]
    assert set(offsets) == {f"{history.topic}.0", f"{history.topic}.1"}
    assert sum(b - a for parts in offsets.values() for a, b in parts.values()) == len(w1)
    assert (doc["from_ms"], doc["to_ms"], doc["step"]) == (BASE, TO, "done")

    recorded = replay.replays(catalog.snapshot(), history.sub)
    assert recorded[f"replay-{doc['replay_id']}"] == json.loads(json.dumps(doc))
    assert untouched_state(catalog, settings, history) == before


def test_the_job_entry_point_replays_up_to_now(history, catalog, settings, spark, capsys):
    path = Path(__file__).resolve().parents[2] / "jobs" / "replay.py"
    module_spec = importlib.util.spec_from_file_location("replay_job", path)
    job = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(job)
    since = len(history.endpoint.records())
    capsys.readouterr()

    code = job.main(
        ["--subscription", history.sub, "--from", str(TO), "--bootstrap", settings.bootstrap]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "delivered 6 of 6 messages in 3 groups" in out
    got = successes(history.endpoint, since)
    assert got == {g: history.ids("w2", g) for g in GROUPS}  # from --from inclusive, to now


# What a driver run with --log-format json writes that is not a JSON line: the JVM's own notice
# for the vector module Spark 4 adds (printed by the JVM before any Java code runs, so before
# log4j2 exists), and the job's exit line (`varadhi: ...`, printed, not logged: the one-line error
# every job ends with, its contract with scripts).
NOT_LOGGED = re.compile(r"WARNING: Using incubator modules: .*|varadhi: .*")
# PySpark's worker daemon (an executor's process, not the driver's: in local mode its stderr is
# the driver's too) prints a plain traceback when a cancel closes a worker's socket before the
# worker's last flush (seen under load in a CI run); only that exact block is not JSON.
DAEMON_BROKEN_PIPE = re.compile(
    r"Traceback \(most recent call last\):\n"
    r"(?:  File \"[^\"]*/pyspark/daemon\.py\", line \d+, in \w+\n)+"
    r"BrokenPipeError: \[Errno 32\] Broken pipe\n"
)


def test_ctrl_c_cancels_the_replay_job_and_records_it(history, catalog, tmp_path):
    """Ctrl-C (SIGINT to the process group: the JVM and the Python driver) while
    `spark-submit.sh --job replay` delivers: the JVM does not go down under the job; the Spark
    job is cancelled, the replay recorded as failed, and the job exits 1 saying why. Run with
    --metrics-port and --log-format json: a scrape during the delivery shows the replay's range
    and its Spark tasks, and every line the driver writes is JSON (but `NOT_LOGGED`): the JVM's
    stderr, Spark's log4j2 lines from the JVM's start on, and the Python driver's output, which
    spark-submit's PythonRunner passes on to its stdout."""
    since = len(history.endpoint.records())
    history.endpoint.latency_ms = 500  # a's 7 messages, one at a time: >= 3.5 s of deliveries
    jvm_log, python_log = tmp_path / "replay.err", tmp_path / "replay.out"
    root = Path(__file__).resolve().parents[2]
    cmd = [str(root / "spark-submit.sh"), "--job", "replay", "--subscription", history.sub]
    telemetry = ["--metrics-port", "0", "--log-format", "json"]
    seen: dict = {}

    def scraped_while_delivering() -> bool:
        port = seen.get("port") or logged_port(python_log)
        seen["port"] = port
        seen["metrics"] = scrape(port, ()) if port else {}
        return active_tasks(seen["metrics"]) > 0

    try:
        with open(jvm_log, "wb") as err, open(python_log, "wb") as out:
            proc = subprocess.Popen(
                [*cmd, "--from", str(BASE), "--to", str(TO), *telemetry],
                cwd=tmp_path,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, as a terminal's foreground job
            )
        try:
            wait_for(
                lambda: len(history.endpoint.records()) > since or proc.poll() is not None,
                240,
                "the replay's first delivery",
            )
            assert proc.poll() is None, python_log.read_text(errors="replace")[-3000:]
            wait_for(scraped_while_delivering, 120, "a scrape while the replay's tasks deliver")
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        history.endpoint.latency_ms = 0
    text = jvm_log.read_text(errors="replace") + python_log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    assert "Fatal Python error" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    [replay_id] = re.findall(r"varadhi: interrupted by SIGINT: replay (\S+) failed", text)
    recorded = replay.replays(catalog.snapshot(), history.sub)[f"replay-{replay_id}"]
    assert recorded["step"] == "failed" and recorded["error"], recorded  # a whole one: "done"

    scraped, ids = seen["metrics"], (("replay", replay_id), ("subscription", history.sub))
    assert scraped[("varadhi_job_info", (("job", "replay"), *ids, ("version", __version__)))] == 1
    ranges = [
        end - start for parts in recorded["offsets"].values() for start, end in parts.values()
    ]
    assert scraped[("varadhi_replay_range_records", ids)] == sum(ranges) > 0
    assert scraped[("varadhi_replay_done", ids)] == 0
    loggers = set()
    for line in DAEMON_BROKEN_PIPE.sub("", text).splitlines():
        if not NOT_LOGGED.fullmatch(line):
            doc = json.loads(line)  # raises for a line that is not JSON
            assert {"ts", "level", "logger", "message"} <= set(doc), line
            loggers.add(doc["logger"])
    assert any(x.startswith("org.apache.spark") for x in loggers), loggers  # the JVM's lines
    assert "varadhi.spark.telemetry" in loggers  # Python's


def logged_port(log: Path) -> int | None:
    """The metrics port the job logged (a JSON line), None before it did."""
    m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace"))
    return int(m[1]) if m else None


def active_tasks(samples: dict) -> float:
    return sum(
        v
        for (name, labels), v in samples.items()
        if name == "varadhi_spark_tasks" and ("state", "active") in labels
    )


def test_bad_requests_are_refused_before_anything_happens(history, catalog, capsys):
    since = len(history.endpoint.records())
    ops_before = replay.replays(catalog.snapshot(), history.sub)
    future = str(int(time.time() * 1000) + 3_600_000)
    cases = [
        (["no-such-sub", "--from", str(BASE)], "does not exist"),
        ([history.sub, "--from", "yesterday"], "from: 'yesterday' is not a time"),
        ([history.sub, "--from", str(TO), "--to", str(BASE)], "is not after --from"),
        ([history.sub, "--from", future], "is in the future"),
        (
            [history.sub, "--from", str(BASE - 120_000), "--to", str(BASE - 60_000)],
            "no messages between",
        ),
        ([history.sub, "--from", str(BASE), "--parallelism", "0"], "parallelism: must be"),
    ]
    for args, words in cases:
        capsys.readouterr()
        assert cli(["replay", *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err, (args, err)
    assert replay.replays(catalog.snapshot(), history.sub) == ops_before
    assert history.endpoint.records(since) == []


def test_an_endpoint_header_that_would_mask_replays_is_refused(history, catalog):
    """A static X-Varadhi-Replay header would make live traffic look like a replay; it is refused
    when the subscription is declared, so no such subscription can be replayed."""
    name = f"replay-hdr-{uuid.uuid4().hex[:8]}"
    doc = {
        "name": name,
        "topic": history.topic,
        "endpoint": {"url": history.endpoint.url, "headers": {"X-Varadhi-Replay": "no"}},
        "shards": 1,
    }
    with pytest.raises(InvalidArgument, match="X-Varadhi-Replay") as refused:
        parse_spec(doc)
    assert refused.value.field.startswith("endpoint.headers")
    assert catalog.snapshot().get("subscription", name) is None
