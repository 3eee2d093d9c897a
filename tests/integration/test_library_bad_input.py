"""docs/bad-input.md's list through a library member (`varadhi-consumer` as a process), against
the real broker and a real endpoint: every record written by a plain producer is delivered with
its ids' text forms or dead-lettered with its reason, the RQ records no member wrote are dropped,
and the process never dies of any of them: it runs until SIGTERM and exits 0. The cases and
their judge are the shard's (`varadhi.testing.bad_input`, tests/integration/test_bad_input.py)."""

from __future__ import annotations

import time

import pytest

from varadhi.core import messages as m
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.testing.bad_input import (
    QUEUE_LIMIT,
    cases,
    misjudged,
    set_max_message_bytes,
    write_cases,
)
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import ConsumerProcess

pytestmark = pytest.mark.kafka

DEADLINE_S = 120


def test_every_kind_of_bad_input_is_delivered_or_dead_lettered_and_the_member_lives(
    settings, catalog, make_topic, unique_name, tmp_path
):
    topic, name = make_topic(4), unique_name("libbad")
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": "http://127.0.0.1:1/unused"},
        "shards": 1,
        "runtime": "library",
        "on_dead_letter": "skip",
        "max_message_bytes": 200_000,
        "retry": {
            "max_attempts": 3,
            "min_backoff": "100ms",
            "max_backoff": "200ms",
            "jitter": 0,
            "in_place_window": 0,
        },  # fmt: skip
        "circuit_breaker": {"enabled": False},
    }
    all_cases = cases()
    with TestEndpoint(record_headers=True) as ep:
        doc["endpoint"]["url"] = ep.url
        SubscriptionService(catalog).create(parse_spec(doc))
        # before the member starts: it reads the queues' limits then
        set_max_message_bytes(settings.bootstrap, [f"{name}.rq.0", f"{name}.dlq.0"], QUEUE_LIMIT)
        for case in all_cases:
            if case.script:
                ep.set_script(f"case-{case.n}", list(case.script))
        where = write_cases(settings.bootstrap, f"{topic}.0", f"{name}.rq.0", all_cases)
        member = ConsumerProcess(settings, name, tmp_path / "member.log")
        try:

            def judged() -> list[str]:
                ok = {r.headers["X-Varadhi-Source"]: r for r in ep.records() if r.status < 300}
                dlq = {
                    d["headers"][m.H_ORIGIN]: d
                    for d in read_queue(settings, f"{name}.dlq.0", timeout_s=DEADLINE_S)
                }
                return misjudged(all_cases, where, topic, ok, dlq)

            deadline = time.monotonic() + DEADLINE_S
            while (wrong := judged()) and member.alive():
                assert time.monotonic() < deadline, f"{wrong}\n{member.log()}"
                time.sleep(0.5)
            assert member.alive(), member.log()
            assert wrong == []
            assert member.stop() == 0, member.log()
        finally:
            member.kill()

    dlq = {d["headers"][m.H_ORIGIN]: d for d in read_queue(settings, f"{name}.dlq.0")}
    # 33: too large for the RQ, dead-lettered; the DLQ copy is cut to the DLQ's limit.
    d33 = dlq[f"0:{where[33][0]}:{where[33][1]}"]
    assert "exceeds the retry queue" in d33["headers"][m.H_REASON]
    assert d33["headers"][m.H_TRUNCATED] == "100000"
    assert 0 < len(d33["value"]) < QUEUE_LIMIT
    # 34: the dead letter carries the start of the endpoint's answer.
    d34 = dlq[f"0:{where[34][0]}:{where[34][1]}"]
    assert "test endpoint answered 404" in d34["headers"][m.H_RESPONSE]
    # 28: junk in varadhi-produced-ms is not sent on.
    ok = {r.headers["X-Varadhi-Source"]: r for r in ep.records() if r.status < 300}
    assert "X-Varadhi-Produced-At" not in ok[f"{topic}.0/{where[28][0]}/{where[28][1]}"].headers
    # 35, 36: the RQ records no member wrote were dropped, never delivered.
    assert not [r for r in ep.records() if r.body_bytes == 4 and r.message_id is None]
    assert member.log().count("has no retry state: dropped") == 2, member.log()
