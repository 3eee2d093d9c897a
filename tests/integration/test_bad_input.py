"""Input that no producer of ours wrote, against the real broker, Spark, Delta and HTTP.

Every kind of record in docs/bad-input.md is written straight onto a subscription's main topic
(or its RQ) with a plain Kafka producer, one shard runs until it is idle, and then each record's
fate is judged from outside: delivered (with the group and message id its text forms give) or
dead-lettered with its reason. The shard must never die of any of them; a replay of the same
range must not either. Case numbers are the rows of docs/bad-input.md.
"""

from __future__ import annotations

import time
import uuid

import pytest

from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.ops import feeders, replay
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.bad_input import (
    QUEUE_LIMIT,
    cases,
    misjudged,
    set_max_message_bytes,
    write_cases,
)
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import END_IDLE_S, read_queue

pytestmark = [pytest.mark.spark, pytest.mark.kafka]


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
        where = write_cases(settings.bootstrap, f"{topic}.0", f"{name}.rq.0", all_cases)

        job = ShardJob(name, 0, settings, spark=spark, stop_when_idle_s=END_IDLE_S)
        assert job.run() == 0, job.stats

        # Delivered: by source position, with the ids' text forms in the HTTP headers.
        ok = {}
        for r in ep.records():
            if r.status < 300:
                ok[r.headers["X-Varadhi-Source"]] = r
        dlq = {d["headers"][m.H_ORIGIN]: d for d in read_queue(settings.bootstrap, f"{name}.dlq.0")}
        assert misjudged(all_cases, where, topic, ok, dlq) == []

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
