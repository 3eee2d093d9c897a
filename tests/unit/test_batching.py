"""Batch mode's pure parts (`varadhi.core.batching`): the request body, what each message of a batch
gets from the endpoint's answer (a malformed 207 is never a success), the retry decision of an
invalid answer, and the `delivery` section of a subscription document."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import replace

import pytest

from varadhi.core import messages as m
from varadhi.core.batching import (
    INVALID,
    MAX_ANSWER_BYTES,
    Result,
    body_size,
    encode_body,
    encode_entry,
    split_answer,
)
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import Entry as StateEntry
from varadhi.core.group_state import http_headers
from varadhi.core.policies import DeliveryPolicy, ResponseRule, RetryPolicy
from varadhi.core.retry import decide
from varadhi.core.subscription_spec import parse_spec, spec_to_dict
from varadhi.kafka.subscriptions import changed_fields

SNIPPET = 1024
IDS = ["a", "b", "c"]


def headers(msg_id: str, group: str | None = "g1", attempt: int = 1) -> dict[str, str]:
    h = {m.HTTP_MESSAGE_ID: msg_id, m.HTTP_ATTEMPT: str(attempt), m.HTTP_SOURCE: "orders.1/3/17"}
    if group is not None:
        h[m.HTTP_GROUP_ID] = group
    return h


def split(status=207, body=b"", error=None, retry_after=None, truncated=False, ids=IDS):
    detail = error or f"HTTP {status}"
    return split_answer(status, error, detail, retry_after, body, truncated, ids, SNIPPET)


def answer(*items) -> bytes:
    return json.dumps(list(items)).encode()


# -- the request --------------------------------------------------------------------------------


def test_an_entry_carries_id_group_attempt_source_and_the_value_as_text():
    entry_state = StateEntry(
        origin=m.Origin(1, 3, 17),
        msg_id="m-1",
        group_id="customer-42",
        location="new",
        value=b'{"order": 1}',
        headers={m.H_PRODUCED_MS: "1700000000000"},
        attempts=2,
        source="orders.1/3/17",
    )
    entry = encode_entry(entry_state.value, http_headers(entry_state))  # what a shard sends
    assert entry.id == "m-1"
    assert json.loads(entry.data) == {
        "id": "m-1",
        "group": "customer-42",
        "attempt": 3,
        "source": {"topic": "orders.1", "partition": 3, "offset": 17},
        "produced_at": 1700000000000,
        "value": '{"order": 1}',
    }
    assert b"\n" not in entry.data
    redriven = replace(entry_state, headers={m.H_REDRIVEN: "redrive-1-a"})
    doc = json.loads(encode_entry(redriven.value, http_headers(redriven)).data)
    assert doc["redriven"] == "redrive-1-a"


def test_a_value_that_is_not_utf8_goes_as_base64_and_ungrouped_has_a_null_group():
    raw = b"\xff\xfe\x00binary"
    doc = json.loads(encode_entry(raw, headers("x", group=None)).data)
    assert doc["group"] is None and "value" not in doc
    assert base64.b64decode(doc["value_base64"]) == raw
    assert "produced_at" not in doc


def test_ids_that_are_not_ascii_are_encoded_safely():
    entry = encode_entry(b"v", headers("caf\u00e9-\ud800"))  # a lone surrogate too
    assert json.loads(entry.data)["id"] == "caf\u00e9-\ud800"


@pytest.mark.parametrize("fmt", ["ndjson", "json_array"])
def test_both_body_formats_read_back_in_order_and_fit_body_size(fmt):
    entries = [encode_entry(f"v{i}".encode(), headers(f"id-{i}", f"g{i}")) for i in range(5)]
    body = encode_body([e.data for e in entries], fmt)
    if fmt == "ndjson":
        docs = [json.loads(line) for line in body.decode().splitlines()]
    else:
        docs = json.loads(body)
    assert [d["id"] for d in docs] == [f"id-{i}" for i in range(5)]
    assert len(body) <= body_size(5, sum(len(e.data) for e in entries))


# -- the answer: all at once --------------------------------------------------------------------


def test_a_2xx_other_than_207_accepts_every_message_whatever_its_body():
    results = split(status=200, body=b"not json at all")
    assert [(r.status, r.error) for r in results] == [(200, None)] * 3


def test_a_non_2xx_or_an_error_applies_to_every_message_with_retry_after_and_snippet():
    results = split(status=503, body=b"x" * 5000, retry_after="7")
    assert all(r.status == 503 and r.retry_after == "7" for r in results)
    assert all(len(r.body) == SNIPPET for r in results)
    assert (
        split(status=None, error="timeout") == [Result(None, "timeout", "timeout", None, b"")] * 3
    )


# -- the answer: 207 multi-status ---------------------------------------------------------------


def test_a_207_gives_each_message_its_own_status_in_request_order():
    body = answer(
        {"id": "c", "status": 200},
        {"id": "a", "status": 503, "retry_after": 5, "detail": "busy", "extra": 1},
        {"id": "b", "status": 404, "retry_after": "Wed, 21 Oct 2015 07:28:00 GMT"},
    )
    a, b, c = split(body=body)
    assert (a.status, a.error, a.retry_after, a.body) == (503, None, "5", b"busy")
    assert (b.status, b.retry_after, b.body) == (404, "Wed, 21 Oct 2015 07:28:00 GMT", b"")
    assert (c.status, c.error) == (200, None)


@pytest.mark.parametrize(
    "body,truncated,why",
    [
        (b"<html>oops</html>", False, "is not JSON"),
        (b"", False, "is not JSON"),
        (b"\xff\xfe", False, "is not JSON"),
        (b'{"a": 200}', False, "is not a JSON array"),
        (answer({"id": "a", "status": 200}), True, f"larger than {MAX_ANSWER_BYTES}"),
        (answer({"id": "a", "status": 200}, "b", {"id": "c", "status": 200}), False, "entry 1"),
        (answer({"status": 200}), False, "entry 0 has no string id"),
        (answer({"id": 1, "status": 200}), False, "entry 0 has no string id"),
        (
            answer(*({"id": i, "status": 200} for i in IDS), {"id": "zz", "status": 200}),
            False,
            "lists id 'zz', which the request did not carry",
        ),
        (
            answer(*({"id": i, "status": 200} for i in IDS), {"id": "b", "status": 500}),
            False,
            "lists id 'b' twice",
        ),
        (answer({"id": "a", "status": 200}), False, "leaves out 2 of 3 ids (first: 'b')"),
        (answer(), False, "leaves out 3 of 3 ids"),
        (answer({"id": "a", "status": "200"}), False, "status must be 200-599"),
        (answer({"id": "a", "status": True}), False, "status must be 200-599"),
        (answer({"id": "a", "status": 102}), False, "status must be 200-599"),
        (answer({"id": "a", "status": 600}), False, "status must be 200-599"),
        (answer({"id": "a", "status": 503, "retry_after": -1}), False, "retry_after"),
        (answer({"id": "a", "status": 503, "retry_after": [1]}), False, "retry_after"),
        (answer({"id": "a", "status": 500, "detail": {"x": 1}}), False, "detail must be text"),
    ],
)
def test_a_malformed_or_inconsistent_207_fails_the_whole_request_with_its_reason(
    body, truncated, why
):
    results = split(body=body, truncated=truncated)
    assert len(results) == 3
    for r in results:
        assert (r.status, r.error) == (None, INVALID), "never a success"
        assert why in r.detail and r.detail.startswith("HTTP 207 multi-status answer ")
        assert r.body == body[:SNIPPET]


def test_a_207_nested_too_deeply_to_parse_is_an_invalid_answer_not_a_crash():
    """json's parser recurses once per level: `[[[[...` a few thousand deep raised
    RecursionError out of the delivery task (issue 29, part 7)."""
    results = split_answer(207, None, "HTTP 207", None, b"[" * 100_000, False, ["a"], 64)
    assert results[0].error == INVALID
    assert "nested too deeply" in results[0].detail


def test_a_207_where_every_entry_is_fine_but_one_id_is_unknown_accepts_none():
    """The case a naive client gets wrong: two of three listed as 200, the third under an id the
    request did not carry. None of the three may count as delivered."""
    body = answer(
        {"id": "a", "status": 200}, {"id": "b", "status": 200}, {"id": "x", "status": 200}
    )
    assert {r.error for r in split(body=body)} == {INVALID}


def test_a_long_unknown_id_is_shortened_in_the_reason():
    body = answer({"id": "q" * 500, "status": 200})
    (r, *_) = split(body=body)
    assert "q" * 61 + "..." in r.detail and "q" * 70 not in r.detail


# -- what an invalid answer means for a message (varadhi.core.retry) -----------------------------------


def test_an_invalid_answer_is_retried_by_default_and_the_reason_says_why():
    policy = RetryPolicy(jitter=0.0)
    d = decide(policy, 1, None, INVALID, None, 0, random.Random(1), detail="leaves out 1 of 2 ids")
    assert d.action == "retry"
    assert d.reason.startswith("invalid_response (leaves out 1 of 2 ids); retry in")
    last = decide(policy, 5, None, INVALID, None, 0, random.Random(1), detail="is not JSON")
    assert last.action == "dead_letter"
    assert last.reason == "retries exhausted after 5 attempts: invalid_response (is not JSON)"


def test_a_table_without_a_rule_for_invalid_answers_dead_letters_them_with_the_reason():
    policy = RetryPolicy(responses=(ResponseRule("2xx", "success"),))
    d = decide(policy, 1, None, INVALID, None, 0, random.Random(1), detail="is not JSON")
    assert (d.action, d.reason) == (
        "dead_letter",
        "no response rule matches invalid_response (is not JSON)",
    )
    fatal = RetryPolicy(
        responses=(ResponseRule("2xx", "success"), ResponseRule(INVALID, "dead_letter"))
    )
    d = decide(fatal, 1, None, INVALID, None, 0, random.Random(1), detail="is not JSON")
    assert d.reason == "fatal response invalid_response (is not JSON)"
    # The detail is for invalid answers only: other reasons are as before.
    d = decide(fatal, 1, None, "timeout", None, 0, random.Random(1), detail="curl error 28")
    assert d.reason == "no response rule matches timeout"


# -- the `delivery` section of a subscription ------------------------------------------------------

DOC = {"name": "s", "topic": "t", "endpoint": {"url": "http://127.0.0.1:1/"}}


def test_delivery_defaults_to_one_message_per_request_and_round_trips():
    assert parse_spec(DOC).delivery == DeliveryPolicy(mode="single")
    spec = parse_spec(
        {**DOC, "delivery": {"mode": "batch", "max_messages": 10, "format": "json_array"}}
    )
    assert spec.delivery == DeliveryPolicy("batch", 10, 1_048_576, "json_array")
    assert parse_spec(spec_to_dict(spec)) == spec


@pytest.mark.parametrize(
    "delivery,field",
    [
        ({"mode": "bulk"}, "delivery.mode"),
        ({"mode": "batch", "max_messages": 0}, "delivery.max_messages"),
        ({"mode": "batch", "max_messages": 1001}, "delivery.max_messages"),
        ({"mode": "batch", "max_messages": "10"}, "delivery.max_messages"),
        ({"mode": "batch", "max_bytes": 100}, "delivery.max_bytes"),
        ({"mode": "batch", "max_bytes": 1 << 30}, "delivery.max_bytes"),
        ({"mode": "batch", "format": "xml"}, "delivery.format"),
        ({"mode": "batch", "size": 10}, "delivery.size"),
        ("batch", "delivery"),
    ],
)
def test_an_invalid_delivery_section_is_refused_naming_the_field(delivery, field):
    with pytest.raises(InvalidArgument) as e:
        parse_spec({**DOC, "delivery": delivery})
    assert e.value.field == field


def test_apply_may_switch_the_delivery_mode():
    from varadhi.kafka.subscriptions import Subscription

    current = Subscription(parse_spec(DOC), shard_count=1, created_ms=0)
    new = parse_spec({**DOC, "delivery": {"mode": "batch"}})
    assert changed_fields(current, new) == ["delivery"]
