"""The subscription's runtime (`runtime: spark | library`), pure parts: parsing and the stored
form, when `apply` may change it, each runtime's refusal of the other's subscriptions, and how
`varadhi status` reads and shows library members (docs/library.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kafka import TopicPartition

from varadhi.cli.status import library_lines
from varadhi.core.errors import InvalidArgument, WrongRuntime
from varadhi.core.policies import Endpoint, SubscriptionSpec
from varadhi.core.subscription_spec import parse_spec, spec_from_dict, spec_to_dict
from varadhi.kafka import subscriptions as subs
from varadhi.ops import status

DOC = {"name": "orders-http", "topic": "orders", "endpoint": {"url": "http://127.0.0.1:1/"}}


def test_the_runtime_defaults_to_spark_and_round_trips():
    assert parse_spec(DOC).runtime == "spark"
    spec = parse_spec({**DOC, "runtime": "library"})
    assert spec.runtime == "library"
    assert spec_to_dict(spec)["runtime"] == "library"
    assert spec_from_dict(spec_to_dict(spec)) == spec
    stored_before = {k: v for k, v in spec_to_dict(parse_spec(DOC)).items() if k != "runtime"}
    assert spec_from_dict(stored_before).runtime == "spark"  # records written before the field


@pytest.mark.parametrize("value", ["flink", "", 1, "Library"])
def test_an_unknown_runtime_is_refused_by_field(value):
    with pytest.raises(InvalidArgument) as e:
        parse_spec({**DOC, "runtime": value})
    assert e.value.field == "runtime"


def _sub(runtime="spark", paused=False) -> subs.Subscription:
    spec = SubscriptionSpec("orders-http", "orders", Endpoint("http://127.0.0.1:1/"), shards=2)
    return subs.Subscription(replace(spec, runtime=runtime), 2, 0, paused=paused)


def test_each_runtime_refuses_the_others_subscription():
    subs.check_runtime(_sub("spark"), "spark", "a Spark shard")
    subs.check_runtime(_sub("library"), "library", "a library member")
    with pytest.raises(WrongRuntime) as e:
        subs.check_runtime(_sub("library"), "spark", "a Spark shard")
    assert e.value.exit_code == 2
    assert str(e.value).startswith("subscription orders-http has runtime: library; a Spark shard")
    assert "varadhi-consumer" in str(e.value)
    with pytest.raises(WrongRuntime, match="runtime: spark; a library member"):
        subs.check_runtime(_sub("spark"), "library", "a library member")


def test_apply_changes_the_runtime_only_while_paused():
    library = replace(_sub().spec, runtime="library")
    with pytest.raises(InvalidArgument) as e:
        subs.changed_fields(_sub("spark"), library)
    assert e.value.field == "runtime"
    assert "varadhi subscription pause orders-http" in str(e.value)
    assert subs.changed_fields(_sub("spark", paused=True), library) == ["runtime"]


def test_a_runtime_switch_waits_for_every_process_that_may_deliver():
    sub = _sub("spark", paused=True)
    status.check_runtime_switch(sub, {}, {})
    with pytest.raises(InvalidArgument) as e:
        status.check_runtime_switch(sub, {1: "running"}, {"h-1-a": "pausing"})
    assert e.value.field == "runtime"
    assert "shard 1 (running), member h-1-a (pausing)" in str(e.value)


def member_doc(state: str, updated_ms: int, **extra) -> dict:
    return {"state": state, "updated_ms": updated_ms, "slots": [0], "counters": {}, **extra}


def test_members_are_read_from_their_progress_documents():
    now = 10_000_000
    found = {
        "0": {"state": "running", "updated_ms": now},  # a shard's: not a member
        "0/standby/x": {"state": "standby", "updated_ms": now},
        "circuit/a": {"sent_ms": now, "attempts": 3, "failures": 3},  # a circuit report
        "member/a": member_doc("running", now - 1_000, counters={"delivered": 5}),
        "member/b": member_doc("paused", now - 2_000),
        "member/c": member_doc("running", now - status.SILENT_MS),  # killed: silent
        "member/d": member_doc("stopped", now - status.SILENT_MS),  # its last word stays
        "member/e": member_doc("running", now - status.MEMBER_WINDOW_MS),  # too old to show
    }
    members = status.members_of(found, now)
    assert [(m["member"], m["state"]) for m in members] == [
        ("a", "running"),
        ("b", "paused"),
        ("c", "silent"),
        ("d", "stopped"),
    ]
    assert members[0]["counters"] == {"delivered": 5} and members[0]["age_ms"] == 1_000
    assert members[0]["circuit"] is None  # a document without one (a member before the circuit)
    assert members[0]["waiting"] is None  # not at a storage-topic boundary
    assert status.running_members(_sub(paused=False), members) == {"a": "running", "b": "paused"}
    assert status.running_members(_sub(paused=True), members) == {"a": "running"}


def test_group_lag_counts_past_the_committed_offsets():
    ends = {"orders.0": [10, 5], "orders-http.rq.0": [3, 0, 0, 0]}
    committed = {TopicPartition("orders.0", 0): 7, TopicPartition("orders-http.rq.0", 0): 3}
    assert status.group_lag(committed, ends, ["orders.0"]) == 3 + 5  # no commit: from 0
    assert status.group_lag(committed, ends, ["orders-http.rq.0"]) == 0
    assert status.group_lag({}, ends, ["orders.0"]) == 15


def test_library_status_text():
    doc = {
        "subscription": "orders-http",
        "shard_count": 2,
        "library": {
            "group": "varadhi-library.orders-http",
            "main_lag": 12,
            "rq_lag": 1,
            "dlq_depth": 2,
            "members": [
                {
                    "member": "host-7-abc",
                    "state": "paused",
                    "age_ms": 2_400,
                    "slots": [0, 1],
                    "counters": {"pending": 4, "delivered": 90, "retried": 3},
                    "circuit": {
                        "state": "open",
                        "enabled": True,
                        "open_until_ms": 1_003_000,
                        "consecutive_opens": 2,
                    },
                    "error": None,
                },
                {
                    "member": "host-8-def",
                    "state": "failed",
                    "age_ms": 30_000,
                    "slots": [],
                    "counters": {},
                    "error": "subscription orders-http has runtime: spark\x1b[2J",
                },
            ],
        },
        "stats": {"inserted": 100, "routed": 95, "emitted": 93, "acknowledged": 90},
        "operations": {},
    }
    lines = library_lines(doc, " (paused)", 1_000_000)
    assert lines[0] == (
        "subscription orders-http (paused): runtime library, 2 slots, consumer group"
        " varadhi-library.orders-http"
    )
    assert lines[1].startswith("main lag 12, rq lag 1") and lines[1].endswith("dlq depth 2")
    assert lines[2].split() == [
        "member", "state", "circuit", "slots", "seen", "pending", "in", "flight", "delivered", "retried",
        "dead",
    ]  # fmt: skip
    assert lines[3].split() == [
        "host-7-abc", "paused", "open", "3s", "x2", "0,1", "2s", "4", "0", "90", "3", "0",
    ]  # fmt: skip
    assert lines[4].split()[:4] == ["host-8-def", "failed", "-", "-"]  # no circuit reported
    assert "\x1b" not in lines[5] and "runtime: spark" in lines[5]
    assert lines[6].startswith("messages: inserted 100;")
    waiting = "waits at the end of orders.1 before orders.2 (groups move to other slots): ..."
    doc["library"]["members"][0]["waiting"] = waiting  # `crossing.waiting_text`
    lines = library_lines(doc, "", 1_000_000)
    assert lines[4] == f"  {waiting}" and lines[5].startswith("host-8-def")
    doc["library"]["members"] = []
    assert "no member reported" in library_lines(doc, "", 0)[2]
