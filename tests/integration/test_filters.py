"""A grouped subscription with a header filter, end to end in this process: real Kafka, real
Delta, `TestEndpoint` (tests/integration/test_shard_delivery.py runs shards the same way).

One shard run covers the contract of `varadhi.core.filters` in the delivery path: only matching
messages reach the endpoint, per group in produce order, also behind a retry; a group whose
messages are all filtered blocks nothing; malformed headers are no error; the `filtered` count
(shard stats and `varadhi status`) is exactly the number dropped; a filter changed with `apply`
while the shard runs applies to the batches after it, without a restart. A replay afterwards
applies the current filter. The subscription is traced (`varadhi trace`): a retried message's
attempts, a delivered one and a filtered one read back from the trace topic.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable

import pytest
from kafka import KafkaProducer

from varadhi import cli
from varadhi.client import Client
from varadhi.core import filters, routing
from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import status
from varadhi.ops.replay import run_replay
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

FILTER_1 = {
    "all": [
        {"header": "type", "in": ["order.created", "order.paid"]},
        {"not": {"header": "region", "prefix": "test-"}},
    ]
}
FILTER_2 = {"header": "type", "in": ["order.viewed"]}
WAIT_S = 600  # generous: the machine may be shared; a test that waits this long has failed


def first_text(headers: list[tuple[str, bytes]], name: str) -> str | None:
    """The test's own reading of the documented rule: first value, UTF-8 or nothing."""
    for k, v in headers:
        if k == name:
            try:
                return v.decode() if v else None
            except UnicodeDecodeError:
                return None
    return None


def matches_1(h) -> bool:
    region = first_text(h, "region")
    return first_text(h, "type") in ("order.created", "order.paid") and not (
        region is not None and region.startswith("test-")
    )


def matches_2(h) -> bool:
    return first_text(h, "type") == "order.viewed"


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.2)


def test_a_filter_delivers_only_matching_messages_in_order_and_counts_the_rest(
    settings, catalog, spark, capsys
):
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"flt-{suffix}", f"flts-{suffix}"
    TopicService(catalog).create(topic, 4)
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": "http://127.0.0.1:1/"},
        "retry": {"max_attempts": 3, "min_backoff": "100ms", "jitter": 0, "in_place_window": 0},
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {"enabled": False},
        "filter": FILTER_1,
        "trace": {"retention": "1d"},
    }
    ep = TestEndpoint(record_headers=True)
    ep.start()
    doc["endpoint"]["url"] = ep.url
    service = SubscriptionService(catalog)
    service.create(parse_spec(doc))

    produced: dict[str, list[str]] = defaultdict(list)  # group -> ids in produce order
    headers_of: dict[str, list[tuple[str, bytes]]] = {}  # id -> the user's headers
    phase: dict[str, int] = {}

    def send(producer: Producer, group: str, n: int, kind: str, region: str, p: int) -> None:
        msg_id = f"{group}.{n:03d}"
        producer.send(f"body {msg_id}", group, {"type": kind, "region": region}, msg_id)
        produced[group].append(msg_id)
        headers_of[msg_id] = [("type", kind.encode()), ("region", region.encode())]
        phase[msg_id] = p

    cycle = ["order.created", "order.viewed", "order.paid", "order.refunded"]
    started_ms = int(time.time() * 1000) - 1000
    with Producer(topic, settings) as producer:
        for n in range(12):
            send(producer, "mixed", n, cycle[n % 4], "eu-1", 1)
            send(producer, "retry", n, cycle[n % 2], "eu-2", 1)
            if n < 5:
                send(producer, "alltest", n, "order.created", "test-x", 1)  # all filtered
                send(producer, "viewonly", n, "order.viewed", "eu-3", 1)  # all filtered
        producer.flush(30)
    ep.set_script("retry.000", [500])  # goes through the RQ; its group's later ones wait

    # Records no Producer would write, in group "raw"'s partition: headers that are not UTF-8,
    # repeated, missing. None of them may fail the batch.
    raw = [
        [("type", b"\xff\xfeorder.created"), ("region", b"eu-1")],  # type not UTF-8: dropped
        [("type", b"order.paid"), ("region", b"\xfftest-")],  # region not UTF-8: kept
        [("type", b"order.viewed"), ("type", b"order.paid")],  # the first counts: dropped
        [],  # no header of its own: dropped
        [("type", b"order.paid"), ("region", b"")],  # an empty value is missing: kept
    ]
    kafka = KafkaProducer(bootstrap_servers=settings.bootstrap)
    try:
        for n, extra in enumerate(raw):
            msg_id = f"raw.{n:03d}"
            ids = [(m.H_MSG_ID, msg_id.encode()), (m.H_GROUP_ID, b"raw")]
            kafka.send(
                f"{topic}.0",
                key=b"raw",
                value=msg_id.encode(),
                headers=ids + extra,
                partition=routing.route_group("raw", 4, 1),
            ).get(30)
            produced["raw"].append(msg_id)
            headers_of[msg_id] = extra
            phase[msg_id] = 1
    finally:
        kafka.close()

    expected_1 = {i for i, h in headers_of.items() if matches_1(h)}
    assert {i.split(".")[0] for i in expected_1} == {"mixed", "retry", "raw"}

    def delivered() -> set[str]:
        return {r.message_id for r in ep.records() if 200 <= r.status < 300}

    job = ShardJob(name, 0, settings, spark=spark)
    outcome: dict[str, object] = {}

    def read_all(expected: set[str], dropped: int) -> Callable[[], bool]:
        """Delivered `expected`, and counted `dropped` filtered so far: every batch holding one
        of the phase's messages is done (before that, a filter change would reach them)."""
        return lambda: expected <= delivered() and job.stats.filtered >= dropped

    def operator() -> None:
        """While the shard runs: wait for phase 1, change the filter, produce phase 2."""
        try:
            dropped_1 = len(phase) - len(expected_1)
            wait_for("phase 1", read_all(expected_1, dropped_1))
            new = parse_spec({**doc, "filter": FILTER_2})
            assert service.apply(new)[0] == "updated"
            wait_for("the new filter", lambda: service.get(name).spec.filter == new.filter)
            with Producer(topic, settings) as producer:
                for n in range(12, 18):
                    send(producer, "mixed", n, cycle[n % 4], "eu-1", 2)
                    send(producer, "viewonly", n - 7, "order.viewed", "eu-3", 2)  # now kept
                producer.flush(30)
            phase_2 = [i for i, p in phase.items() if p == 2]
            expected_2 = {i for i in phase_2 if matches_2(headers_of[i])}
            outcome["expected_2"] = expected_2
            wait_for("phase 2", read_all(expected_2, dropped_1 + len(phase_2) - len(expected_2)))
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            outcome["error"] = e
        finally:
            job.request_stop()

    helper = threading.Thread(target=operator, daemon=True)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    helper.start()
    try:
        code = job.run()
    finally:
        for s, handler in saved.items():  # ShardJob installs its own handlers
            signal.signal(s, handler)
        helper.join(WAIT_S)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    assert code == 0, f"shard run ended with {code}: {job.stats}"

    expected = expected_1 | outcome["expected_2"]  # type: ignore[operator]
    records = [r for r in ep.records() if r.headers and "X-Varadhi-Replay" not in r.headers]
    ok = [r for r in sorted(records, key=lambda r: r.seq) if 200 <= r.status < 300]
    # Only matching messages arrived (each once), and nothing of the filtered groups in phase 1.
    assert sorted(r.message_id for r in ok) == sorted(expected)
    assert {r.message_id for r in records} == expected
    assert [r.attempt for r in records if r.message_id == "retry.000"] == [1, 2]
    # Per group, in produce order, also behind retry.000's retry.
    position = {i: n for ids in produced.values() for n, i in enumerate(ids)}
    per_group: dict[str, list[str]] = defaultdict(list)
    for r in ok:
        per_group[r.message_id.split(".")[0]].append(r.message_id)
    for group, ids in per_group.items():
        assert ids == sorted(ids, key=position.__getitem__), group
    assert per_group["viewonly"] == [f"viewonly.{n:03d}" for n in range(5, 11)]

    dropped = len(headers_of) - len(expected)
    assert job.stats.filtered == dropped
    assert job.stats.delivered == len(expected)
    assert job.stats.dead_lettered == 0
    doc_status = status.collect(catalog, name)
    assert doc_status["filtered"] == doc_status["shards"][0]["filtered"] == dropped
    assert doc_status["shards"][0]["blocked_groups"] == 0

    check_trace(settings, name, capsys)

    # A replay of everything applies the filter in force now (FILTER_2), old messages included.
    result = run_replay(catalog, name, str(started_ms), spark=spark)
    replayed = {
        r.message_id
        for r in ep.records()
        if r.headers and "X-Varadhi-Replay" in r.headers and 200 <= r.status < 300
    }
    assert replayed == {i for i, h in headers_of.items() if matches_2(h)}
    assert result.counts["filtered"] == len(headers_of) - len(replayed)
    assert result.counts["records"] == len(replayed)
    assert filters.to_dict(service.get(name).spec.filter) == filters.to_dict(
        filters.parse(FILTER_2)
    )
    ep.stop()


def check_trace(settings, name: str, capsys) -> None:
    """The shard's delivery trace, read back as a user would (`Client.trace`, `varadhi trace`):
    retry.000 failed once (500, to the RQ) and was delivered on its second attempt; a filtered
    message has one routed step; an unknown id has none."""
    client = Client(settings)
    retried = client.trace(name, "retry.000")
    assert [(e["kind"], e.get("attempt"), e.get("status"), e["next"]) for e in retried] == [
        ("attempt", 1, 500, "rq"),
        ("attempt", 2, 200, "delivered"),
    ]
    assert all(e["shard"] == 0 and e["group_id"] == "retry" for e in retried)
    assert all(e["latency_ms"] >= 0 for e in retried)
    assert retried[0]["at_ms"] <= retried[1]["at_ms"]
    assert [e["next"] for e in client.trace(name, "mixed.000")] == ["delivered"]
    filtered = client.trace(name, "alltest.000")
    assert [(e["kind"], e["next"]) for e in filtered] == [("routed", "filtered")]
    assert "filter" in filtered[0]["reason"]
    assert client.trace(name, "no-such-message") == []

    capsys.readouterr()
    assert cli.main(["--bootstrap", settings.bootstrap, "subscription", "describe", name]) == 0
    assert f"trace         kept 1d in {name}.trace (varadhi trace)" in capsys.readouterr().out
    args = ["--bootstrap", settings.bootstrap, "trace", name, "--message-id", "retry.000"]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["time", "(UTC)", "shard"]
    # date, time, shard, attempt, status, latency, "ms", next, the answer's start
    assert [line.split()[2:5] + line.split()[7:8] for line in lines[1:]] == [
        ["0", "1", "500", "rq"],
        ["0", "2", "200", "delivered"],
    ]
