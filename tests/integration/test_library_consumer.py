"""The library runtime (varadhi.library) against the real broker and a real HTTP endpoint, no
Spark: per-key order with keys delivered concurrently, a retry through the RQ, a dead letter in
the DLQ, a restart that delivers nothing finished again, a filter, shaped requests, the delivery
trace and a member's share of the rate limit, two members sharing the work through a rebalance,
pause and resume followed, status showing a member, and the refusals: a subscription using what
the runtime does not support, or of the other runtime."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from functools import partial

import pytest
from kafka import KafkaProducer

from varadhi import Client
from varadhi.core import filters, routing
from varadhi.core import messages as m
from varadhi.core.policies import (
    Endpoint,
    RequestShaping,
    SubscriptionSpec,
    TracePolicy,
)
from varadhi.core.record_ids import text_id
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer, Options, Success, Unsupported
from varadhi.library import Retry as HandlerRetry
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import DEADLINE_S, produce_rounds, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka


def subscription(
    catalog, make_topic, unique_name, url: str, endpoint: Endpoint | None = None, **fields
) -> SubscriptionSpec:
    topic = make_topic(4)
    spec = library_spec(unique_name("lib"), topic, endpoint or Endpoint(url), **fields)
    SubscriptionService(catalog).create(spec)
    return spec


def produce(settings, topic: str, groups: int, per_group: int, start: int = 0) -> list[str]:
    """`per_group` rounds of `produce_rounds` from round `start`."""
    return produce_rounds(settings, topic, groups, start, start + per_group)


def at_once(coroutine) -> None:
    """Run a coroutine that must end without suspending (a rebalance listener's, called as
    kafka-python's event loop would)."""
    with pytest.raises(StopIteration):
        coroutine.send(None)


def assert_in_order(delivered: list[tuple[str, str]]) -> None:
    """(group, message id) pairs in delivery order: each group's in produce order."""
    last: dict[str, int] = {}
    for group, msg_id in delivered:
        n = int(msg_id.rsplit("-", 1)[1])
        assert n > last.get(group, -1), f"{msg_id} delivered after message {last[group]}"
        last[group] = n


def test_http_order_retry_dead_letter_and_restart(settings, catalog, make_topic, unique_name):
    # A 503 asks for a retry in 10 minutes (Retry-After): it stays pending through the restarts.
    # Each answer takes 50 ms, so requests the member has out at once meet at the endpoint
    # (`max_concurrent` below); answered at once, a loaded machine's endpoint saw them one by
    # one (a fresh-clone run with a core kept busy).
    with TestEndpoint(retry_after_s=600, latency_ms=50) as endpoint:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        endpoint.set_script("g1-2", [500, 200])  # retried once, through the RQ
        endpoint.set_script("g2-3", [400])  # dead-lettered; g2 goes on (skip)
        first = produce(settings, spec.topic, groups=20, per_group=10)
        consumer = Consumer(spec.name, settings, options=Options(max_in_flight=16)).start()
        try:
            wait_for(
                lambda: consumer.counters()["delivered"] == len(first) - 1, "delivery", consumer
            )
            counts = consumer.counters()
            assert (counts["retried"], counts["dead_lettered"]) == (1, 1)
            wait_for(lambda: consumer.counters()["pending"] == 0, "nothing pending", consumer)
        finally:
            consumer.stop()
        assert consumer.health()["state"] == "stopped"
        ok = [(r.group_id, r.message_id) for r in endpoint.records() if r.status == 200]
        assert sorted(i for _, i in ok) == sorted(i for i in first if i != "g2-3")
        assert_in_order(ok)  # g1's later messages waited for g1-2's retry
        assert endpoint.stats()["max_concurrent"] > 1  # keys concurrently
        g1 = [i for g, i in ok if g == "g1"]
        assert g1 == [f"g1-{n}" for n in range(10)]
        rq = read_queue(settings, f"{spec.rq_topic}.0")
        assert [r["headers"][m.H_MSG_ID] for r in rq] == ["g1-2"]
        assert rq[0]["headers"][m.H_ATTEMPTS] == "1" and rq[0]["key"] == b"g1"
        dlq = read_queue(settings, f"{spec.dlq_topic}.0")
        assert [r["headers"][m.H_MSG_ID] for r in dlq] == ["g2-3"]
        assert dlq[0]["headers"][m.H_REASON] == "fatal response 400"

        # A stop while g5-10 waits in the RQ (g5-11 and g5-12 behind it, unfinished): the
        # commit keeps what finished above them, so a restart delivers none of it again, and g5
        # stays blocked behind its retry.
        seen = len(endpoint.records())
        endpoint.set_script("g5-10", [503])
        second = produce(settings, spec.topic, groups=20, per_group=3, start=10)
        again = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: again.counters()["delivered"] == len(second) - 3, "second delivery", again
            )
        finally:
            again.stop()
        later = [r.message_id for r in endpoint.records(since=seen) if r.status == 200]
        assert sorted(later) == sorted(i for i in second if not i.startswith("g5-"))
        seen = len(endpoint.records())
        third = Consumer(spec.name, settings).start()
        try:
            # g5-10's RQ copy (not due), g5-11 and g5-12 are held; the rest was finished
            wait_for(
                lambda: third.counters()["pending"] == 3 and third.counters()["skipped_finished"],
                "the restart's reading",
                third,
            )
        finally:
            third.stop()
        assert third.counters()["attempts"] == 0
        assert endpoint.records(since=seen) == []


def test_filter_shaped_requests_trace_and_rate_share(settings, catalog, make_topic, unique_name):
    """A subscription with a filter (type: keep), forward_headers / path / key_header, a trace
    and a rate limit, its share taken by one member and then by two. Records are written as another producer would: the group id in a header,
    a Kafka key of their own (none for g3), a forged `varadhi-key`. Filtered messages (type
    skip, a type that is not UTF-8) never reach the endpoint; the rest arrive shaped, with
    their own key, in key order, g1-2 through the RQ (its copy keeps the key); gx-0 has no
    tenant for the path: dead-lettered as malformed. The trace shows each step."""
    with TestEndpoint(retry_after_s=0, record_headers=True) as endpoint:
        shaped = Endpoint(
            endpoint.url + "/hook",
            max_rate=600.0,
            shaping=RequestShaping(
                (("tenant", "X-Tenant"),), path="/t/{header:tenant}", key_header="X-Record-Key"
            ),
        )
        spec = subscription(
            catalog,
            make_topic,
            unique_name,
            "",
            endpoint=shaped,
            filter=filters.parse({"header": "type", "in": ["keep"]}),
            trace=TracePolicy(3600 * 1000),
        )
        endpoint.set_script("g1-2", [500, 200])
        keys = {"g0": b"k0", "g1": b"order-1", "g2": b"\xff\x00", "g3": None}
        kept, dropped = [], []
        kafka = KafkaProducer(
            bootstrap_servers=settings.bootstrap, max_in_flight_requests_per_connection=1
        )
        try:
            for n in range(6):
                for group, key in keys.items():
                    msg_id = f"{group}-{n}"
                    kind = b"keep" if n % 2 == 0 else b"skip" if n == 1 else b"\xffkeep"
                    (kept if kind == b"keep" else dropped).append(msg_id)
                    headers = [
                        (m.H_MSG_ID, msg_id.encode()),
                        (m.H_GROUP_ID, group.encode()),
                        ("tenant", b"acme/eu"),
                        ("type", kind),
                        (m.H_KEY, b"forged"),
                    ]
                    kafka.send(
                        f"{spec.topic}.0",
                        key=key,
                        value=msg_id.encode(),
                        headers=headers,
                        partition=routing.route_group(group, 4, 1),
                    )
            no_tenant = [(m.H_MSG_ID, b"gx-0"), (m.H_GROUP_ID, b"gx"), ("type", b"keep")]
            kafka.send(f"{spec.topic}.0", value=b"gx-0", headers=no_tenant, partition=0).get(
                DEADLINE_S
            )
            kafka.flush()
        finally:
            kafka.close()

        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: (
                    consumer.counters()["delivered"] == len(kept)
                    and consumer.counters()["dead_lettered"] == 1
                ),
                "delivery",
                consumer,
            )
            # one member holds both slots: the whole limit (a member of k of S slots: k/S)
            assert consumer.health()["rate_limit"] == 600.0
        finally:
            consumer.stop()  # the trace's last events are written by now
        counts = consumer.counters()
        assert (counts["filtered"], counts["retried"]) == (len(dropped), 1)

        records = endpoint.records()
        ok = [(r.group_id, r.message_id) for r in records if r.status == 200]
        assert sorted(i for _, i in ok) == sorted(kept)
        assert_in_order(ok)
        for r in records:
            assert (r.path, r.headers["X-Tenant"]) == ("/hook/t/acme%2Feu", "acme/eu"), r
            key = text_id(keys[r.group_id])
            assert r.headers.get("X-Record-Key") == key, r  # the record's own, never forged
        assert text_id(keys["g2"]) == "b64:/wA="  # a key that is not UTF-8: its b64 form
        rq = read_queue(settings, f"{spec.rq_topic}.0")
        assert [(r["headers"][m.H_MSG_ID], r["headers"][m.H_KEY]) for r in rq] == [
            ("g1-2", "order-1")
        ]
        dlq = read_queue(settings, f"{spec.dlq_topic}.0")
        assert [r["headers"][m.H_MSG_ID] for r in dlq] == ["gx-0"]
        assert dlq[0]["headers"][m.H_REASON].startswith("malformed: ")
        assert "tenant" in dlq[0]["headers"][m.H_REASON]

        # Two members on the drained subscription: each holds one slot, and takes half.
        members = [Consumer(spec.name, settings).start() for _ in range(2)]
        try:
            wait_for(
                lambda: [c.health()["rate_limit"] for c in members] == [300.0, 300.0],
                "each member's share",
                *members,
            )
            assert sorted(c.health()["slots"] for c in members) == [[0], [1]]
        finally:
            for c in members:
                c.stop()
        assert len(endpoint.records()) == len(records)  # the stop committed everything

        client = Client(settings)
        steps = [(e["kind"], e.get("status"), e["next"]) for e in client.trace(spec.name, "g1-2")]
        assert steps == [("attempt", 500, "rq"), ("attempt", 200, "delivered")]
        slot = {e["shard"] for e in client.trace(spec.name, "g1-2")}
        assert slot <= {0, 1} and len(slot) == 1
        for msg_id in ("g0-1", "g2-3"):  # type skip; a type that is not UTF-8
            assert [e["next"] for e in client.trace(spec.name, msg_id)] == ["filtered"]
        malformed = client.trace(spec.name, "gx-0")
        assert [(e["kind"], e["next"]) for e in malformed] == [("routed", "dlq")]
        assert malformed[0]["reason"].startswith("malformed: ")


class Handled:
    """A Python handler per member that records (member, message id) of what it handled, after
    `before(member, message)` (which may block); `ids(member)` what that member handled."""

    def __init__(self, before=None):
        self._lock = threading.Lock()
        self._handled: list[tuple[str, str]] = []
        self._before = before

    def handler(self, member: str):
        def handle(message):
            if self._before is not None:
                self._before(member, message)
            with self._lock:
                self._handled.append((member, message.msg_id))
            return Success()

        return handle

    def ids(self, member: str) -> set[str]:
        with self._lock:
            return {i for who, i in self._handled if who == member}


def test_a_slot_a_rebalance_moves_is_committed_at_the_revoke_and_not_delivered_again(
    settings, catalog, make_topic, unique_name
):
    """A member commits what finished of the slots a rebalance takes from it, so that their
    next owner delivers none of it again (only what was in flight would come twice). The first
    member here never commits on its own (a commit interval of an hour): it delivers everything,
    then a second member joins and takes a slot; the second delivers the messages produced after
    that, and none of the first ones."""
    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    handled = Handled()
    handler_of, ids_of = handled.handler, handled.ids

    ids = produce(settings, spec.topic, groups=30, per_group=5)
    never = Options(commit_interval_s=3600)
    a = Consumer(spec.name, settings, handler=handler_of("a"), options=never).start()
    b = None
    try:
        wait_for(lambda: ids_of("a") >= set(ids), "the first member's deliveries", a)
        b = Consumer(spec.name, settings, handler=handler_of("b")).start()
        wait_for(
            lambda: b.health()["slots"] != [] and a.health()["slots"] != [], "a slot each", a, b
        )
        more = produce(settings, spec.topic, groups=30, per_group=5, start=5)
        # the second member's later messages, behind the earlier ones of each of its keys
        wait_for(lambda: ids_of("a") | ids_of("b") >= set(more), "the later messages", a, b)
    finally:
        a.stop()
        if b is not None:
            b.stop()
    assert ids_of("b"), "the second member delivered nothing: the slot did not move"
    again = ids_of("b") & set(ids)
    assert not again, f"delivered again after the rebalance: {sorted(again)[:10]}"


def test_deliveries_in_flight_at_a_revoke_end_before_its_commit_and_are_not_delivered_again(
    settings, catalog, make_topic, unique_name
):
    """A revoke waits (on kafka-python's event loop, bounded) for the revoked slots' deliveries
    in flight, so that its commit covers them and their next owner does not deliver them
    again. Here the first member (never committing on its own) holds the last message of each
    key in its handler until its revoke has begun; a second member joins and takes a slot; no
    message comes from both. (The revoke once committed at once: those in flight then came
    twice.)"""
    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    release = threading.Event()
    held = []

    def hold(member: str, message) -> None:
        if member == "a" and message.msg_id.endswith("-4"):
            held.append(message.msg_id)
            release.wait()

    handled = Handled(hold)
    handler_of, ids_of = handled.handler, handled.ids

    ids = produce(settings, spec.topic, groups=30, per_group=5)
    options = Options(commit_interval_s=3600, max_in_flight=40)
    a = Consumer(spec.name, settings, handler=handler_of("a"), options=options).start()
    b = None
    try:
        wait_for(lambda: len(ids_of("a")) == 120 and len(held) == 30, "the last ones held", a)
        b = Consumer(spec.name, settings, handler=handler_of("b")).start()
        wait_for(lambda: bool(a._revoked), "the first member's revoke", a, b)
        release.set()
        wait_for(
            lambda: b.health()["slots"] != [] and a.health()["slots"] != [], "a slot each", a, b
        )
        more = produce(settings, spec.topic, groups=30, per_group=5, start=5)
        # the second member's later messages, behind any earlier one of its keys
        wait_for(lambda: ids_of("a") | ids_of("b") >= set(more), "the later messages", a, b)
    finally:
        release.set()
        a.stop()
        if b is not None:
            b.stop()
    assert ids_of("a") >= set(ids)
    assert ids_of("b"), "the second member delivered nothing: the slot did not move"
    again = ids_of("b") & set(ids)
    assert not again, f"delivered again after the rebalance: {sorted(again)[:10]}"


def test_two_members_share_the_work_through_a_rebalance(settings, catalog, make_topic, unique_name):
    """Handlers instead of HTTP: a second member joins while the first delivers; every message
    is handled, each key in order, and both members hold slots at the end."""
    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    lock = threading.Lock()
    handled: list[tuple[str, str, str]] = []  # (member, group, message id)
    failed_once: set[str] = set()

    def handler_of(member: str):
        def handle(message):
            if message.msg_id == "g3-1" and message.msg_id not in failed_once:
                failed_once.add(message.msg_id)
                return HandlerRetry(reason="not yet")
            time.sleep(0.002)
            with lock:
                handled.append((member, message.group_id, message.msg_id))
            return Success()

        return handle

    ids = produce(settings, spec.topic, groups=30, per_group=20)
    a = Consumer(spec.name, settings, handler=handler_of("a")).start()
    b = None
    try:
        wait_for(lambda: len(handled) >= 50, "the first member's deliveries", a)
        b = Consumer(spec.name, settings, handler=handler_of("b")).start()
        wait_for(
            lambda: (
                sorted(a.health()["slots"] + b.health()["slots"]) == [0, 1]
                and a.health()["slots"] != b.health()["slots"]
            ),
            "each member holding one slot",
            a,
            b,
        )
        more = produce(settings, spec.topic, groups=30, per_group=5, start=20)

        def done() -> bool:
            with lock:
                return {i for _, _, i in handled} >= set(ids + more)

        wait_for(done, "every message handled")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    by_group: dict[str, list[str]] = defaultdict(list)
    for _, group, msg_id in handled:
        by_group[group].append(msg_id)
    for group, got in by_group.items():
        # at least once: a message in flight at the rebalance may come twice, never out of order
        firsts = list(dict.fromkeys(got))
        assert firsts == [f"{group}-{n}" for n in range(25)]
    # each handled its share while it held its slot (which one handled the later messages
    # depends on the rebalances kafka-python makes after a join)
    assert a.counters()["delivered"] + b.counters()["delivered"] >= len(ids) + len(more)


def test_a_subscription_using_unsupported_features_is_refused(
    settings, catalog, make_topic, unique_name
):
    from varadhi.kafka.topics import TopicService

    topic = make_topic(2, 2, switches=1)  # two storage topics: read across (test_library_storage)
    spec = SubscriptionSpec(
        unique_name("lib"), topic, Endpoint("http://127.0.0.1:9/"), runtime="library"
    )
    SubscriptionService(catalog).create(spec)  # block mode and the circuit: supported defaults
    # an RQ storage topic the subscription's shard count does not use (rq_from stays 0)
    TopicService(catalog).add_storage(spec.rq_topic, 8)
    TopicService(catalog).switch_produce(spec.rq_topic)
    consumer = Consumer(spec.name, settings)
    with pytest.raises(Unsupported, match="storage topics after the one") as refused:
        consumer.start()
    assert refused.value.exit_code == 2
    assert consumer.health()["state"] == "failed"


def test_the_console_script_delivers_until_sigterm_and_refuses_clearly(
    settings, catalog, make_topic, unique_name, capsys
):
    from varadhi.library import console

    assert console.main([unique_name("absent"), "--bootstrap", settings.bootstrap]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert console.main(["s", "--ordering-key", "json:x"]) == 2
    assert "ordering-key" in capsys.readouterr().err
    with pytest.raises(SystemExit) as shown:
        console.main(["--help"])
    assert shown.value.code == 0 and "SUBSCRIPTION" in capsys.readouterr().out

    with TestEndpoint() as endpoint:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        ids = produce(settings, spec.topic, groups=3, per_group=2)
        script = os.path.join(os.path.dirname(sys.executable), "varadhi-consumer")
        proc = subprocess.Popen(
            [script, spec.name, "--bootstrap", settings.bootstrap],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_for(
                lambda: proc.poll() is not None or len(endpoint.records()) >= len(ids),
                "the script's deliveries",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0, err
        assert len(endpoint.records()) >= len(ids), err
        assert sorted(r.message_id for r in endpoint.records()) == sorted(ids)


def test_a_consumer_held_at_max_pending_reads_everything(
    settings, catalog, make_topic, unique_name
):
    """Reading stops and goes on many times over (`max_pending` 20): no record is left unread.
    (Pausing partitions for this, kafka-python stopped fetching some of them for good.)"""
    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    ids = produce(settings, spec.topic, groups=200, per_group=15)
    consumer = Consumer(
        spec.name, settings, handler=lambda _m: Success(), options=Options(max_pending=20)
    ).start()
    try:
        wait_for(lambda: consumer.counters()["delivered"] == len(ids), "every message", consumer)
    finally:
        consumer.stop()


def test_members_follow_pause_and_resume_show_in_status_and_stop_on_a_runtime_change(
    settings, catalog, make_topic, unique_name, monkeypatch, capsys
):
    """While the subscription is paused a member delivers nothing and reads nothing (what is
    produced meanwhile waits in Kafka: the group's lag shows it) and reports `paused`; a
    member started meanwhile waits too, with the slot the rebalance gives it; after the resume
    everything is delivered in key order; `varadhi status` shows the members. The runtime
    changes only while paused, and the members, still running, then stop; a Spark shard
    refuses the `runtime: library` subscription before its session starts."""
    from varadhi.client import Client
    from varadhi.core.errors import InvalidArgument, WrongRuntime
    from varadhi.jobs import shard as shard_job
    from varadhi.kafka.progress import member_documents, progress_documents
    from varadhi.ops import status
    from varadhi.spark import session

    def no_spark(*_args, **_kwargs):
        raise AssertionError("the refused shard started Spark")

    monkeypatch.setattr(session, "get_spark", no_spark)
    with TestEndpoint() as endpoint:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        code = shard_job.main(["--subscription", spec.name, "--shard", "0"])
        assert code == 2
        assert "has runtime: library; a Spark shard does not deliver it" in capsys.readouterr().err

        first = produce(settings, spec.topic, groups=6, per_group=3)
        consumer = Consumer(spec.name, settings).start()
        late = None  # a member started while the subscription is paused
        service = SubscriptionService(catalog)
        try:
            wait_for(lambda: consumer.counters()["delivered"] == len(first), "delivery", consumer)
            member = consumer.health()["member"]

            def shown() -> dict:
                doc = status.collect(catalog, spec.name)
                return {m["member"]: m for m in doc["library"]["members"]}.get(member, {})

            wait_for(
                lambda: (
                    shown().get("slots") == [0, 1]
                    and shown()["counters"].get("delivered") == len(first)
                ),
                "status showing the member",
                consumer,
            )
            assert status.collect(catalog, spec.name)["shards"] == []

            refused = pytest.raises(InvalidArgument, match="subscription pause")
            with Client(settings) as client, refused:  # not while the subscription runs
                client.apply([replace(spec, runtime="spark")])

            service.set_paused(spec.name, True)
            wait_for(lambda: consumer.health()["state"] == "paused", "the pause", consumer)
            read = consumer.counters()["read"]
            produced_ms = int(time.time() * 1000)
            second = produce(settings, spec.topic, groups=6, per_group=3, start=3)

            def paused_with_the_records_waiting() -> bool:
                found = progress_documents(settings, spec.name, None, produced_ms)
                doc = member_documents(found).get(member, {})
                lib = status.collect(catalog, spec.name)["library"]
                return (
                    doc.get("state") == "paused"
                    and doc["updated_ms"] > produced_ms + 1_000
                    and lib["main_lag"] >= len(second)
                )

            wait_for(paused_with_the_records_waiting, "the paused member's report", consumer)
            assert consumer.counters()["read"] == read
            assert consumer.counters()["paused"] == 1

            # A member started while paused waits too, and so do the partitions the rebalance
            # gives each member.
            late = Consumer(spec.name, settings).start()
            both = (consumer, late)

            def a_slot_each(state: str) -> bool:
                slots = [c.health()["slots"] for c in both]
                states = {c.health()["state"] for c in both}
                return states == {state} and sorted(slots[0] + slots[1]) == [0, 1] and all(slots)

            wait_for(lambda: a_slot_each("paused"), "a slot each, paused", *both)
            assert not {r.message_id for r in endpoint.records()} & set(second)
            assert late.counters()["delivered"] == 0

            service.set_paused(spec.name, False)

            def all_delivered() -> bool:
                return {r.message_id for r in endpoint.records() if r.status == 200} >= set(second)

            wait_for(all_delivered, "delivery after the resume", *both)
            assert a_slot_each("running")
            delivered = [(r.group_id, r.message_id) for r in endpoint.records() if r.status == 200]
            assert {i for _, i in delivered} == set(first + second)
            # at least once: each group's first deliveries in produce order
            assert_in_order(list(dict.fromkeys(delivered)))

            # Paused and reported paused: the runtime may change; the members stop on it.
            service.set_paused(spec.name, True)
            wait_for(lambda: a_slot_each("paused"), "the second pause", *both)
            names = {c.health()["member"] for c in both}

            def reported_paused() -> bool:
                doc = status.collect(catalog, spec.name)
                return {m["member"]: m["state"] for m in doc["library"]["members"]} == {
                    name: "paused" for name in names
                }

            wait_for(reported_paused, "status: both paused", *both)
            with Client(settings) as client:
                ((action, changed),) = client.apply([replace(spec, runtime="spark")])
            assert (action, changed.spec.runtime) == ("updated", "spark")
            for c in both:
                wait_for(lambda c=c: c.wait(0.1), "the member's end", c)
                health = c.health()
                assert health["state"] == "failed" and "has runtime: spark" in health["error"]
            found = member_documents(progress_documents(settings, spec.name, None, produced_ms))
            assert {found[name]["state"] for name in names} == {"failed"}  # their last word
        finally:
            consumer.stop()
            if late is not None:
                late.stop()
        with pytest.raises(WrongRuntime):
            Consumer(spec.name, settings).start()


def test_dead_letters_are_redriven_once_and_an_offset_reset_delivers_again(
    settings, catalog, make_topic, unique_name
):
    """`dlq unsideline` of a `runtime: library` subscription: the member holding each slot puts
    the selected dead letters back through the RQ, attempts reset, marked with the re-drive;
    each is delivered once more, with `X-Varadhi-Redriven`, and `dlq list` shows it `redriven`;
    the same selector again re-drives nothing; one with a rate puts them back in portions, a
    key's in their order. Then `offsets reset` of its
    consumer group: refused while the member runs; once it is paused and reported paused, the
    reset to earliest stops it, and a member started afterwards delivers everything again."""
    from varadhi.core.errors import InvalidArgument
    from varadhi.ops import status

    with TestEndpoint(record_headers=True) as endpoint, Client(settings) as client:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        dead, paced = {"g1-1", "g3-2"}, {"g0-0", "g0-2", "g2-1"}
        for msg_id in dead | paced:
            endpoint.set_script(msg_id, [400])  # dead-lettered at once; 200 when re-driven
        first = produce(settings, spec.topic, groups=4, per_group=3)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: (
                    consumer.counters()["dead_lettered"] == 5
                    and consumer.counters()["delivered"] == len(first) - 5
                ),
                "delivery and five dead letters",
                consumer,
            )
            op_id = client.redrive(spec.name, group_ids=["g1", "g3"])
            client.wait_for_redrive(spec.name, op_id, DEADLINE_S)

            def redelivered() -> list:
                return [r for r in endpoint.records() if r.message_id in dead and r.status == 200]

            wait_for(lambda: len(redelivered()) == 2, "the re-driven deliveries", consumer)
            for r in redelivered():
                headers = {k.lower(): v for k, v in (r.headers or {}).items()}
                assert headers["x-varadhi-redriven"] == op_id
                assert r.attempt == 1  # attempts reset
            states = {r["msg_id"]: r["state"] for r in client.dlq_messages(spec.name)}
            assert states == dict.fromkeys(dead, "redriven") | dict.fromkeys(paced, "parked")
            rq = read_queue(settings, f"{spec.rq_topic}.0")
            assert sorted(r["headers"][m.H_MSG_ID] for r in rq) == sorted(dead)
            assert {r["headers"][m.H_REDRIVEN] for r in rq} == {op_id}
            assert {r["headers"][m.H_ATTEMPTS] for r in rq} == {"0"}

            # 1 a second in all: each of the 2 slots puts one back every 2 s
            paced_op = client.redrive(spec.name, message_ids=sorted(paced), rate=1)
            client.wait_for_redrive(spec.name, paced_op, DEADLINE_S)

            def paced_back() -> list:
                return [r for r in endpoint.records() if r.message_id in paced and r.status == 200]

            wait_for(lambda: len(paced_back()) == 3, "the rate-capped re-drive", consumer)
            for r in paced_back():
                headers = {k.lower(): v for k, v in (r.headers or {}).items()}
                assert headers["x-varadhi-redriven"] == paced_op
            assert [r.message_id for r in paced_back() if r.group_id == "g0"] == ["g0-0", "g0-2"]
            states = {r["msg_id"]: r["state"] for r in client.dlq_messages(spec.name)}
            assert states == dict.fromkeys(dead | paced, "redriven")

            again = client.redrive(spec.name, group_ids=["g1", "g3"])
            client.wait_for_redrive(spec.name, again, DEADLINE_S)
            assert len(read_queue(settings, f"{spec.rq_topic}.0")) == 5  # nothing more put back
            wait_for(lambda: consumer.counters()["pending"] == 0, "nothing pending", consumer)
            assert len(redelivered()) == 2
            assert consumer.counters()["dead_lettered"] == 5

            with pytest.raises(InvalidArgument, match="may still deliver"):
                client.reset_offsets(spec.name, "main", "to-earliest", execute=True)
            client.pause(spec.name)
            member = consumer.health()["member"]

            def reported_paused() -> bool:
                members = status.collect(catalog, spec.name)["library"]["members"]
                return {m["member"]: m["state"] for m in members}.get(member) == "paused"

            wait_for(reported_paused, "status: the member paused", consumer)
            dry = client.reset_offsets(spec.name, "main", "to-earliest")
            assert (dry.summary["replayed"], dry.executed) == (len(first), False)
            with pytest.raises(InvalidArgument, match="can only be fast-forwarded"):
                client.reset_offsets(spec.name, "rq", "to-earliest", execute=True)
            reset = client.reset_offsets(spec.name, "main", "to-earliest", execute=True)
            assert (reset.outcome, reset.summary["replayed"]) == ("new", len(first))
            health = consumer.health()  # it left the group for the reset
            assert health["state"] == "failed" and "offset reset" in health["error"]
            again = client.reset_offsets(spec.name, "main", "to-earliest", execute=True)
            assert again.outcome == "done"  # nothing consumed since: nothing changes
        finally:
            consumer.stop()
        seen = len(endpoint.records())
        client.resume(spec.name)
        restarted = Consumer(spec.name, settings).start()
        try:

            def all_again() -> bool:
                since = endpoint.records(since=seen)
                return {r.message_id for r in since if r.status == 200} == set(first)

            wait_for(all_again, "everything delivered again", restarted)
        finally:
            restarted.stop()


def test_a_revoke_of_an_assignment_not_yet_set_up_leaves_nothing_handed_out(
    settings, catalog, make_topic, unique_name
):
    """kafka-python calls the rebalance listener on its own thread, whenever the group
    rebalances: an assignment can be revoked before the member's Kafka thread set it up (a
    rebalance right after another, as when members start together). Here a member holding
    both slots gets, as one step for its Kafka thread, the revoke of both, their assignment
    and its revoke (the listener's calls in that order, the member's lock held so that its
    Kafka thread sees them together): it must hold no slot after, with nothing pending. (It
    once set the revoked assignment up and delivered those slots next to their new owner.)"""
    from varadhi.library.runtime import _Listener

    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    ids = produce(settings, spec.topic, groups=10, per_group=3)
    consumer = Consumer(spec.name, settings, handler=lambda _m: Success()).start()
    try:
        wait_for(lambda: consumer.counters()["delivered"] == len(ids), "delivery", consumer)
        assert consumer.health()["slots"] == [0, 1]
        held = set(consumer._consumer.assignment())
        rebalances = consumer.counters()["rebalances"]
        listener = _Listener(consumer)
        with consumer._lock:  # nothing in flight: the revokes' coroutines end at once
            at_once(listener.on_partitions_revoked(held))
            listener.on_partitions_assigned(held)
            at_once(listener.on_partitions_revoked(held))
        wait_for(
            lambda: consumer.counters()["rebalances"] > rebalances, "the member's set-up", consumer
        )
        assert consumer.health()["slots"] == []
        assert consumer.counters()["pending"] == 0
    finally:
        consumer.stop()


def test_a_member_put_out_of_the_group_forgets_what_it_held_even_if_given_it_again(
    settings, catalog, make_topic, unique_name
):
    """A member that hung past its session was put out of the group; others held its slots
    meanwhile. kafka-python tells it with `on_partitions_lost` when it goes on, then gives it
    slots again, maybe the same ones. What it held of them is stale (here g1 waits for an RQ
    copy that, in the real case, another member may have delivered and committed past): it
    must forget it and read the slots again from the commit, not go on where it was. (It once
    went on, and a key waited for good behind a copy it would never read again.) The
    listener's calls are made as kafka-python makes them, the member's lock held so that its
    Kafka thread sees them together."""
    from varadhi.library.runtime import _Listener

    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
    ids = produce(settings, spec.topic, groups=10, per_group=3)

    def handle(message):  # g1-0 waits for its retry, due in 10 minutes; g1-1, g1-2 behind it
        if message.msg_id == "g1-0":
            return HandlerRetry(after_ms=600_000, reason="later")
        return Success()

    consumer = Consumer(spec.name, settings, handler=handle).start()
    try:
        wait_for(
            lambda: (
                consumer.counters()["delivered"] == len(ids) - 3
                and consumer.counters()["pending"] == 3  # g1-0's copy, read back; g1-1, g1-2
            ),
            "g1 waiting behind its retry",
            consumer,
        )
        # paused, the member reads nothing after its set-up: what it holds then is what the
        # set-up left (its fetcher reads the slots again from the commit once resumed)
        client = Client(settings)
        client.pause(spec.name)
        wait_for(lambda: consumer.health()["state"] == "paused", "the member paused", consumer)
        held = set(consumer._consumer.assignment())
        rebalances = consumer.counters()["rebalances"]
        listener = _Listener(consumer)
        with consumer._lock:
            listener.on_partitions_lost(held)
            listener.on_partitions_assigned(held)
        wait_for(
            lambda: consumer.counters()["rebalances"] > rebalances, "the member's set-up", consumer
        )
        assert consumer.counters()["pending"] == 0  # forgotten, to be read from the commit
        assert consumer.health()["slots"] == [0, 1]
        read = consumer.counters()["read"]
        client.resume(spec.name)
        wait_for(
            lambda: consumer.counters()["pending"] == 3 and consumer.counters()["read"] > read,
            "g1 read again from the commit, waiting behind its retry",
            consumer,
        )
        assert consumer.counters()["delivered"] == len(ids) - 3  # all else was committed
    finally:
        consumer.stop()


def test_a_member_that_hung_past_its_session_hands_out_nothing_when_it_goes_on(
    settings, catalog, make_topic, unique_name, tmp_path
):
    """A member (a process) hangs (SIGSTOP) past its session while it holds a slot's backlog
    (one key: one message at a time); another member takes the slot and delivers everything.
    When the hung one goes on (SIGCONT), it must not hand out what it still holds: its session
    lapsed, so the slot may be another's (`fence`). At most the one message it may have taken
    and not sent when it stopped arrives after SIGCONT (in flight at the hang). It once handed
    out its held messages until its next poll told it that it had left the group: each one a
    duplicate of the new owner's delivery."""
    from varadhi.testing.library import ConsumerProcess, first_successes

    session = ["--session-timeout-ms", "6000", "--max-in-flight", "1"]
    with TestEndpoint(latency_ms=5) as endpoint:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook", shards=1)
        ids = produce(settings, spec.topic, groups=1, per_group=400)
        hung = ConsumerProcess(settings, spec.name, tmp_path / "hung.log", *session)
        other = None
        try:
            wait_for(lambda: len(first_successes(endpoint.records())) >= 20, "deliveries")
            hung.signal(signal.SIGSTOP)
            other = Consumer(
                spec.name, settings, options=Options(session_timeout_ms=6000, max_in_flight=1)
            ).start()
            wait_for(
                lambda: set(first_successes(endpoint.records())) >= set(ids),
                "every message delivered by the other member",
                other,
            )
            rebalances = other.counters()["rebalances"]
            went_on_ms = time.time() * 1000
            hung.signal(signal.SIGCONT)
            # it learns that it left the group and joins again: the other member rebalances
            wait_for(lambda: other.counters()["rebalances"] > rebalances, "the rejoin", other)
        finally:
            if other is not None:
                other.stop()
            code = hung.stop()
        assert code == 0, hung.log()
        after = [r.message_id for r in endpoint.records() if r.received_ms >= went_on_ms]
        assert len(after) <= 1, f"delivered after the hung member went on: {after}"


def test_a_member_whose_join_is_redone_for_new_metadata_still_gets_its_assignment(
    settings, catalog, make_topic, unique_name, monkeypatch
):
    """kafka-python 3.0.12 joins again when the leader's topic metadata changed since it
    assigned; if a poll gave up (its timeout) in the middle of that join, and the leader had
    assigned meanwhile, the next poll thought the member joined and never took the answer: the
    member held nothing, for good (a CI run, waiting for a first member's deliveries). Forced
    here: the member's client starts without the topics' metadata (its first join assigns
    nothing; the metadata that comes next makes it join again) and the assignment takes longer
    than a poll. The member must get its slots and deliver (`join_guard`)."""
    import kafka

    from varadhi.library.assign import SlotAssignor

    monkeypatch.setattr(kafka.KafkaConsumer, "partitions_for_topic", lambda self, topic: set())
    assign = SlotAssignor.assign

    def slow_assign(self, cluster, members):
        time.sleep(0.5)  # longer than the member's poll (runtime.POLL_MS): the poll gives up
        return assign(self, cluster, members)

    monkeypatch.setattr(SlotAssignor, "assign", slow_assign)

    def handle_into(handled: list, message):
        handled.append(message.msg_id)
        return Success()

    def has_at_least(handled: list, n: int) -> bool:
        return len(handled) >= n

    # Whether the metadata comes before the first join's assignment or after it is up to the
    # broker: three members, one after the other, so that the join is redone at least once
    for _ in range(3):
        spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")
        handled: list[str] = []
        produce(settings, spec.topic, groups=10, per_group=5)
        member = Consumer(spec.name, settings, handler=partial(handle_into, handled)).start()
        try:
            wait_for(partial(has_at_least, handled, 50), "the member's deliveries", member)
            assert member.health()["slots"] == [0, 1]
        finally:
            member.stop()


def test_delete_removes_the_consumer_group_and_is_refused_while_a_member_is_in_it(
    settings, catalog, make_topic, unique_name, varadhi_cli
):
    """`subscription delete` of a `runtime: library` subscription deletes its consumer group
    too, so a subscription created again with the name starts without the old commits. A
    member paused and reported paused counts as stopped for the delivery check, but it is still
    in the group (Kafka deletes only an empty group): the delete is refused, exit 2, naming it,
    and nothing is changed; once it stopped, the delete removes the group with the rest."""
    from varadhi.library.runtime import group_id
    from varadhi.ops import lifecycle, status

    with TestEndpoint() as endpoint, Client(settings) as client:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        group, queues = group_id(spec.name), [f"{spec.rq_topic}.0", f"{spec.dlq_topic}.0"]
        first = produce(settings, spec.topic, groups=4, per_group=2)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] == len(first), "delivery", consumer)
            member = consumer.health()["member"]
            client.pause(spec.name)

            def reported_paused() -> bool:
                members = status.collect(catalog, spec.name)["library"]["members"]
                return {m["member"]: m["state"] for m in members}.get(member) == "paused"

            wait_for(reported_paused, "status: the member paused", consumer)
            assert status.group_committed(catalog, group)  # the member's commits
            (in_group,) = status.group_members(settings, group)
            assert in_group.startswith(f"{member}@")  # Kafka knows the member by its name
            code, _, err = varadhi_cli("subscription", "delete", spec.name)
            assert code == 2, err
            assert f"consumer group {group} has members: {in_group}; stop them" in err
            # nothing changed: no delete recorded, the queues, the group and its member are there
            assert f"{spec.name}/delete" not in catalog.snapshot().items("operation")
            assert lifecycle.existing_topics(settings, queues) == queues
            assert status.group_members(settings, group) == [in_group]
            assert consumer.health()["state"] == "paused"
        finally:
            consumer.stop()

        wait_for(lambda: status.group_members(settings, group) == [], "the member's leave")
        assert client.delete_subscription(spec.name, dry_run=True).consumer_group == group
        code, out, err = varadhi_cli("subscription", "delete", spec.name)
        assert code == 0, err
        assert f"consumer group: {group}" in out
        assert status.group_members(settings, group) is None
        assert status.group_committed(catalog, group) == {}
        assert lifecycle.existing_topics(settings, queues) == []


def paused_in_status(catalog, name: str, member: str):
    """A condition: `varadhi status` shows library member `member` of `name` paused."""
    from varadhi.ops import status

    def shown() -> bool:
        members = status.collect(catalog, name)["library"]["members"]
        return {m["member"]: m["state"] for m in members}.get(member) == "paused"

    return shown


def test_change_shards_is_in_place_and_refused_while_a_member_may_run_or_is_in_the_group(
    settings, catalog, make_topic, unique_name, varadhi_cli, monkeypatch
):
    """`subscription change-shards` of a `runtime: library` subscription: refused (exit 2,
    nothing changed) while a member runs, and while a paused one is still in the consumer group
    (each reads the count when it starts), naming it; with the members stopped, a merge from 2
    to 1 is one catalog write: the same RQ and DLQ (no new storage topics),
    no Spark; a count that does not divide the DLQ's partitions is refused; the same command
    again does nothing; a member started afterwards holds the one slot and delivers in order."""
    from varadhi.kafka import topics
    from varadhi.library.runtime import group_id
    from varadhi.ops import status
    from varadhi.spark import session

    def no_spark(*_args, **_kwargs):
        raise AssertionError("change-shards of a library subscription started Spark")

    monkeypatch.setattr(session, "get_spark", no_spark)
    change = ("subscription", "change-shards")
    with TestEndpoint() as endpoint, Client(settings) as client:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        group = group_id(spec.name)

        def unchanged() -> None:
            snap = catalog.snapshot()
            assert client.subscription(spec.name).shard_count == 2
            assert f"{spec.name}/change-shards" not in snap.items("operation")
            for queue in (spec.rq_topic, spec.dlq_topic):
                assert len(topics.from_snapshot(snap, queue).storage_topics) == 1

        first = produce(settings, spec.topic, groups=6, per_group=2)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] == len(first), "delivery", consumer)
            member = consumer.health()["member"]
            code, _, err = varadhi_cli(*change, spec.name, "--to", "1")
            assert code == 2 and "must be paused" in err, err
            unchanged()
            client.pause(spec.name)
            wait_for(paused_in_status(catalog, spec.name, member), "the member paused", consumer)
            for dry_run in ([], ["--dry-run"]):
                code, _, err = varadhi_cli(*change, spec.name, "--to", "1", *dry_run)
                assert code == 2, err
                assert f"consumer group {group} has members: {member}@" in err
            unchanged()
            assert consumer.health()["state"] == "paused"
        finally:
            consumer.stop()
        wait_for(lambda: status.group_members(settings, group) == [], "the member's leave")
        code, _, err = varadhi_cli(*change, spec.name, "--to", "4")
        assert code == 2 and "4 does not divide" in err and f"{spec.dlq_topic}.0" in err, err
        code, out, err = varadhi_cli(*change, spec.name, "--to", "1", "--dry-run")
        assert code == 0 and "2 -> 1 slots, a merge" in out, err
        unchanged()
        code, out, err = varadhi_cli(*change, spec.name, "--to", "1")
        assert code == 0 and "now has 1 slots" in out, err
        changed = client.subscription(spec.name)
        assert (changed.shard_count, changed.spec.shards, changed.paused) == (1, 1, True)
        snap = catalog.snapshot()
        for queue in (spec.rq_topic, spec.dlq_topic):
            assert [st.name for st in topics.from_snapshot(snap, queue).storage_topics] == [
                f"{queue}.0"
            ]
        op = snap.get("operation", f"{spec.name}/change-shards")
        assert (op["runtime"], op["from"], op["to"], op["step"]) == ("library", 2, 1, "done")
        code, out, _ = varadhi_cli(*change, spec.name, "--to", "1")
        assert code == 0 and "nothing to do" in out

        client.resume(spec.name)
        seen = len(endpoint.records())
        second = produce(settings, spec.topic, groups=6, per_group=2, start=2)
        restarted = Consumer(spec.name, settings).start()
        try:

            def delivered() -> list:
                return [
                    (r.group_id, r.message_id)
                    for r in endpoint.records(since=seen)
                    if r.status == 200
                ]

            wait_for(lambda: {i for _, i in delivered()} == set(second), "delivery", restarted)
            assert restarted.health()["slots"] == [0]
            assert_in_order(list(dict.fromkeys(delivered())))
        finally:
            restarted.stop()


def test_replay_is_refused_while_a_library_member_may_deliver(
    settings, catalog, make_topic, unique_name, varadhi_cli, monkeypatch
):
    """`varadhi replay` of a `runtime: library` subscription is refused (exit 2, before Spark)
    while a member may deliver: the replay orders by group id, a member perhaps by another key.
    Once the member is paused and reported paused, the replay is planned as for shards."""
    from varadhi.spark import session

    def no_spark(*_args, **_kwargs):
        raise AssertionError("the refused replay started Spark")

    monkeypatch.setattr(session, "get_spark", no_spark)
    with TestEndpoint() as endpoint, Client(settings) as client:
        spec = subscription(catalog, make_topic, unique_name, endpoint.url + "/hook")
        since = str(int(time.time() * 1000) - 60_000)
        first = produce(settings, spec.topic, groups=4, per_group=2)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] == len(first), "delivery", consumer)
            member = consumer.health()["member"]
            code, _, err = varadhi_cli("replay", spec.name, "--from", since)
            assert code == 2, err
            assert f"cannot replay {spec.name}: its library members may still deliver" in err
            assert f"{member} (running)" in err
            assert len(endpoint.records()) == len(first)  # nothing replayed
            client.pause(spec.name)
            wait_for(paused_in_status(catalog, spec.name, member), "the member paused", consumer)
            plan = client.plan_replay(spec.name, since)
            assert plan.max_messages == len(first)
        finally:
            consumer.stop()


def test_a_split_of_the_slots_waits_for_pending_retries_and_redrivable_dead_letters(
    settings, catalog, make_topic, unique_name, varadhi_cli
):
    """A split (2 -> 4 slots) may read a key's RQ copy or dead letter in another slot than its
    later messages: `change-shards` refuses it (exit 2) while the RQ holds a retry past the
    group's commits or the DLQ a dead letter past its start, each named with how to finish or
    drop it; once the RQ and the DLQ are fast-forwarded, the split is made."""
    from varadhi.library.runtime import group_id
    from varadhi.ops import status

    change = ("subscription", "change-shards")
    with TestEndpoint(retry_after_s=600) as endpoint, Client(settings) as client:
        spec = subscription(
            catalog, make_topic, unique_name, endpoint.url + "/hook", rq_partitions=4,
            dlq_partitions=4,
        )  # fmt: skip
        endpoint.set_script("g0-1", [503])  # a retry due in 10 minutes: pending in the RQ
        endpoint.set_script("g1-1", [400])  # a dead letter
        first = produce(settings, spec.topic, groups=4, per_group=3)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: (
                    consumer.counters()["delivered"] == len(first) - 3  # g0-2 waits for g0-1
                    and consumer.counters()["dead_lettered"] == 1
                    and consumer.counters()["retried"] == 1
                ),
                "delivery, a retry and a dead letter",
                consumer,
            )
            client.pause(spec.name)
        finally:
            consumer.stop()
        group = group_id(spec.name)
        wait_for(lambda: status.group_members(settings, group) == [], "the member's leave")

        code, _, err = varadhi_cli(*change, spec.name, "--to", "4")
        assert code == 2, err
        assert "cannot split" in err and "1 records in the RQ" in err and "1 dead letters" in err
        code, _, err = varadhi_cli("offsets", "reset", spec.name, "--queue", "rq", "--to-latest",
                                   "--execute")  # fmt: skip
        assert code == 0, err
        code, _, err = varadhi_cli(*change, spec.name, "--to", "4")
        assert code == 2 and "records in the RQ" not in err and "1 dead letters" in err, err
        code, _, err = varadhi_cli("offsets", "reset", spec.name, "--queue", "dlq", "--to-latest",
                                   "--execute")  # fmt: skip
        assert code == 0, err
        code, out, err = varadhi_cli(*change, spec.name, "--to", "4")
        assert code == 0 and "now has 4 slots" in out, err
        assert client.subscription(spec.name).shard_count == 4


def test_a_fetcher_that_cannot_be_made_fails_the_start_and_closes_what_it_opened(
    settings, catalog, make_topic, unique_name, monkeypatch
):
    """The librdkafka consumer is made after the member's kafka-python clients (an OAUTHBEARER
    token endpoint that refuses, say): its refusal fails the start and closes them, as any
    other refusal of the start does (they were once left open, the member `starting`)."""
    from varadhi.core.errors import KafkaConfigError
    from varadhi.kafka import clients as kafka_clients

    spec = subscription(catalog, make_topic, unique_name, "http://127.0.0.1:9/unused")

    def refuse(*args, **kwargs):
        raise KafkaConfigError("the token endpoint refused the client")

    monkeypatch.setattr(kafka_clients, "fetch_consumer", refuse)
    consumer = Consumer(spec.name, settings)
    with pytest.raises(KafkaConfigError, match="token endpoint refused"):
        consumer.start()
    assert consumer.health()["state"] == "failed"
    assert consumer._consumer._closed and consumer._offsets._closed
    assert consumer._producer._closed
