"""Input that no producer of ours wrote, against the real broker, Spark, Delta and HTTP.

Every kind of record in docs/bad-input.md is written straight onto a subscription's main topic
(or its RQ) with a plain Kafka producer, one shard runs until it is idle, and then each record's
fate is judged from outside: delivered (with the group and message id its text forms give) or
dead-lettered with its reason. The shard must never die of any of them; a replay of the same
range must not either. Case numbers are the rows of docs/bad-input.md.
"""

from __future__ import annotations

import base64
import hashlib
import time
import uuid
from dataclasses import dataclass

import pytest
from kafka import KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import feeders, replay
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

QUEUE_LIMIT = 64 * 1024  # max.message.bytes of the RQ and DLQ here; the main topic takes 10 MiB
AVRO_KEY = b"\x00\x00\x00\x00\x07" + b"\x0ccust-7"  # Schema Registry frame, schema id 7
PROTO_KEY = b"\x00\x00\x00\x00\x09\x00" + b"\x0a\x03abc"  # frame, message index 0, field 1


def b64(data: bytes) -> str:
    return "b64:" + base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Case:
    """One record: what is written, and either the group/message id it is delivered with or
    the start of the reason it is dead-lettered with. `msg_id=None`: the id falls back to the
    record's position (`<topic>-<partition>-<offset>`)."""

    n: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    group: str | None = None
    msg_id: str | None = "same"  # "same": the case's own id header
    reason: str | None = None  # dead-lettered with this reason (prefix)
    script: tuple = ()  # the endpoint's answers to this message


def cases() -> list[Case]:
    def c(n, key=None, value=b"v", headers=None, **kw) -> Case:
        if headers is None:
            headers = [(m.H_MSG_ID, f"case-{n}".encode())]
        return Case(n, key, value, headers, **kw)

    big_text = b"k" * 2000
    return [
        # keys
        c(1, key=None, headers=[], msg_id=None),
        c(2, key=b"", headers=[], msg_id=None),
        c(3, key=b"plain-key", headers=[], msg_id=None, group="plain-key"),
        c(4, key=b"\xff\xfe\xfd", group=b64(b"\xff\xfe\xfd")),
        c(5, key=AVRO_KEY, group=b64(AVRO_KEY)),
        c(6, key=PROTO_KEY, group=b64(PROTO_KEY)),
        c(7, key=b"a\r\nX-Evil: 1", group=b64(b"a\r\nX-Evil: 1")),
        c(8, key=big_text, group=sha(big_text)),
        c(9, key=b"\x01" * 300, group=sha(b"\x01" * 300)),
        c(10, key=b"j" * 1024, group="j" * 1024),
        c(11, key="größe-日本-😀".encode(), group="größe-日本-😀"),
        c(12, key=b"\xff\x00", headers=[], msg_id=None, group=b64(b"\xff\x00")),
        # group id header
        c(
            13,
            headers=[(m.H_MSG_ID, b"case-13"), (m.H_GROUP_ID, b"\x80\x81")],
            group=b64(b"\x80\x81"),
        ),
        c(14, key=b"k14", headers=[(m.H_MSG_ID, b"case-14"), (m.H_GROUP_ID, b"")], group="k14"),
        c(
            15,
            key=b"k15",
            headers=[(m.H_MSG_ID, b"case-15"), (m.H_GROUP_ID, b"\x00")],
            group=b64(b"\x00"),
        ),
        c(16, headers=[(m.H_MSG_ID, b"case-16"), (m.H_GROUP_ID, b"g\r\n")], group=b64(b"g\r\n")),
        c(
            17,
            headers=[(m.H_MSG_ID, b"case-17"), (m.H_GROUP_ID, b"first"), (m.H_GROUP_ID, b"2nd")],
            group="first",
        ),
        c(18, key=b"\xff", headers=[(m.H_MSG_ID, b"case-18"), (m.H_GROUP_ID, b"g18")], group="g18"),
        # message id header
        c(
            19,
            key=b"g19",
            headers=[(m.H_MSG_ID, b"\xfa\xfb")],
            group="g19",
            msg_id=b64(b"\xfa\xfb"),
        ),
        c(20, key=b"g20", headers=[(m.H_MSG_ID, b"")], group="g20", msg_id=None),
        c(
            21,
            key=b"g21",
            headers=[(m.H_MSG_ID, b"id\r\nX: 1")],
            group="g21",
            msg_id=b64(b"id\r\nX: 1"),
        ),
        c(
            22,
            key=b"g22",
            headers=[(m.H_MSG_ID, b"i" * 5000)],
            group="g22",
            msg_id=sha(b"i" * 5000),
        ),
        c(
            23,
            key=b"g23",
            headers=[(m.H_MSG_ID, b"case-23"), (m.H_MSG_ID, b"other")],
            group="g23",
        ),
        # other headers
        c(
            24,
            key=b"g24",
            headers=[(m.H_MSG_ID, b"case-24"), ("x-trace", b"\xff\xfe\x00")],
            group="g24",
        ),
        c(25, key=b"g25", headers=[(m.H_MSG_ID, b"case-25"), ("x-empty", b"")], group="g25"),
        c(
            26,
            key=b"g26",
            headers=[(m.H_MSG_ID, b"case-26"), ("x-big", b"h" * 100_000)],
            group="g26",
        ),
        c(
            27,
            key=b"g27",
            headers=[(m.H_MSG_ID, b"case-27")] + [(f"x-{i}", b"v") for i in range(500)],
            group="g27",
        ),
        c(
            28,
            key=b"g28",
            headers=[(m.H_MSG_ID, b"case-28"), (m.H_PRODUCED_MS, b"12\r\n")],
            group="g28",
        ),
        # values
        c(29, key=b"g29", value=None, group="g29", reason="malformed: no value"),
        c(30, key=b"g30", value=b"", group="g30"),
        c(31, key=b"g31", value=b"\x00\x00\x00\x00\x07\xff\xfe binary avro", group="g31"),
        c(32, key=b"g32", value=b"x" * 300_000, group="g32", reason="malformed: value of 300000"),
        # a retry too large for the RQ: dead-lettered, as a truncated copy
        c(33, key=b"g33", value=b"y" * 100_000, group="g33", reason="HTTP 500", script=(500,)),
        # a fatal answer with a body: the dead letter carries its start
        c(34, key=b"g34", group="g34", reason="fatal response 404", script=(404,)),
    ]


def set_max_message_bytes(bootstrap: str, topics: list[str], limit: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.alter_configs(
            [
                ConfigResource(
                    ConfigResourceType.TOPIC, t, configs={"max.message.bytes": str(limit)}
                )
                for t in topics
            ]
        )
    finally:
        admin.close()


def test_every_kind_of_bad_input_is_delivered_or_dead_lettered_and_nothing_dies(
    settings, catalog, spark, varadhi_cli
):
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"bad-{suffix}", f"bads-{suffix}"
    TopicService(catalog).create(topic, 4)
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": "http://127.0.0.1:1/unused"},
        "shards": 1,
        "on_dead_letter": "skip",
        "max_message_bytes": 200_000,
        "retry": {
            "max_attempts": 3,
            "min_backoff": "100ms",
            "max_backoff": "200ms",
            "jitter": 0,
            "in_place_window": 0,
        },
        "consumption": {"trigger_interval": "100ms"},
        "circuit_breaker": {"enabled": False},
    }
    all_cases = cases()
    with TestEndpoint(record_headers=True) as ep:
        doc["endpoint"]["url"] = ep.url
        SubscriptionService(catalog).create(parse_spec(doc))
        set_max_message_bytes(settings.bootstrap, [f"{name}.rq.0", f"{name}.dlq.0"], QUEUE_LIMIT)
        for case in all_cases:
            if case.script:
                ep.set_script(f"case-{case.n}", list(case.script))

        started_ms = int(time.time() * 1000) - 1000
        kafka = KafkaProducer(
            bootstrap_servers=settings.bootstrap,
            max_request_size=8 * 1024 * 1024,
            max_in_flight_requests_per_connection=1,
        )
        where: dict[int, tuple[int, int]] = {}
        try:
            for case in all_cases:
                meta = kafka.send(
                    f"{topic}.0",
                    key=case.key,
                    value=case.value,
                    headers=case.headers,
                    partition=case.n % 4,
                ).get(30)
                where[case.n] = (meta.partition, meta.offset)
            # Records on the RQ that no shard wrote: binary junk, and a damaged origin.
            for key, headers in [
                (b"\xff\xfe", [("x", b"\xff")]),
                (b"g-rq", [(m.H_ORIGIN, b"not:an:origin:at:all"), (m.H_ATTEMPTS, b"\xff")]),
            ]:
                kafka.send(f"{name}.rq.0", key=key, value=b"junk", headers=headers).get(30)
        finally:
            kafka.close()

        job = ShardJob(name, 0, settings, spark=spark, stop_when_idle_s=3.0)
        assert job.run() == 0, job.stats

        # Delivered: by source position, with the ids' text forms in the HTTP headers.
        ok = {}
        for r in ep.records():
            if r.status < 300:
                ok[r.headers["X-Varadhi-Source"]] = r
        dlq = {d["headers"][m.H_ORIGIN]: d for d in read_queue(settings.bootstrap, f"{name}.dlq.0")}
        for case in all_cases:
            partition, offset = where[case.n]
            source = f"{topic}.0/{partition}/{offset}"
            expected_id = (
                f"case-{case.n}"
                if case.msg_id == "same"
                else case.msg_id or f"{topic}.0-{partition}-{offset}"
            )
            if case.reason is None:
                assert source in ok, f"case {case.n} was not delivered"
                r = ok[source]
                assert r.message_id == expected_id, f"case {case.n}"
                assert r.headers.get("Idempotency-Key") == expected_id, f"case {case.n}"
                assert r.group_id == case.group, f"case {case.n}"
                assert "X-Evil" not in r.headers and "X" not in r.headers, f"case {case.n}"
                assert r.body_bytes == len(case.value or b""), f"case {case.n}"
            else:
                assert source not in ok, f"case {case.n} was delivered"
                d = dlq.get(f"0:{partition}:{offset}")
                assert d is not None, f"case {case.n} is not in the DLQ"
                assert d["headers"][m.H_REASON].startswith(case.reason), (case.n, d["headers"])

        # 28: junk in varadhi-produced-ms is not sent on.
        p28 = where[28]
        assert "X-Varadhi-Produced-At" not in ok[f"{topic}.0/{p28[0]}/{p28[1]}"].headers

        # 33: too large for the RQ, dead-lettered; the DLQ copy is cut to the DLQ's limit.
        d33 = dlq[f"0:{where[33][0]}:{where[33][1]}"]
        assert "exceeds the retry queue" in d33["headers"][m.H_REASON]
        assert d33["headers"][m.H_TRUNCATED] == "100000"
        assert 0 < len(d33["value"]) < QUEUE_LIMIT
        # 34: the dead letter carries the start of the endpoint's answer.
        d34 = dlq[f"0:{where[34][0]}:{where[34][1]}"]
        assert "test endpoint answered 404" in d34["headers"][m.H_RESPONSE]
        assert d34["headers"][m.H_STATUS] == "404"

        # The RQ junk was dropped, not delivered and not fatal.
        assert job.stats.duplicates >= 2
        assert not [r for r in ep.records() if r.body_bytes == 4 and r.message_id is None]

        # Replay of the same range reads the same records and does not die either.
        before = len(ep.records())
        plan = replay.prepare(catalog, name, str(started_ms), None)
        result = replay.execute(spark, catalog, plan)
        assert result.counts["records"] == len(all_cases)
        assert len(ep.records()) > before

        # Feeders of a shard-count change copy the same RQ and DLQ records (the junk included)
        # to the new shards' storage topics without dying.
        code, out, err = varadhi_cli(
            "subscription", "change-shards", name, "--to", "2", "--feeders", "external"
        )
        assert code == 0, out + err
        for queue in ("rq", "dlq"):
            source = f"{name}.{queue}.0"
            copied = feeders.feed(spark, catalog, name, source)
            expected = [
                r
                for r in read_queue(settings.bootstrap, source)
                if "varadhi-tick" not in r["headers"]
            ]
            assert copied == len(expected) > 0, queue
