"""The library runtime across storage-topic switches of the main topic (`varadhi.library.crossing`)
against the real broker and a real HTTP endpoint: members started before the switches follow
the topic, messages produced before and after a K>1 switch and a K=1 switch are all delivered,
each group in produce order, with retries pending across each boundary; at a K=1 boundary the
members wait together (status says so) until nothing of the old storage topic is pending."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from varadhi import Client
from varadhi.cli.status import library_lines
from varadhi.core import messages as m
from varadhi.core import routing
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint
from varadhi.kafka import topics as composite_topics
from varadhi.kafka.catalog import key
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.library import Consumer, Options, Unsupported
from varadhi.library.assign import slot_of
from varadhi.library.runtime import group_id
from varadhi.ops import status
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import FAST_RETRY, produce_rounds, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka

GROUPS = 8
#: A retry held failing until the test lets it succeed: never dead-lettered meanwhile.
PATIENT = replace(FAST_RETRY, max_attempts=10_000)


def first_deliveries(endpoint: TestEndpoint) -> list[str]:
    """Message ids in the order of their first successful delivery."""
    seen: dict[str, None] = {}
    for r in endpoint.records():
        if r.status == 200 and r.message_id not in seen:
            seen[r.message_id] = None
    return list(seen)


def assert_each_group_in_order(delivered: list[str], produced: list[str]) -> None:
    assert sorted(delivered) == sorted(produced)  # nothing lost, none twice
    for g in range(GROUPS):
        mine = [i for i in delivered if i.startswith(f"g{g}-")]
        assert mine == [i for i in produced if i.startswith(f"g{g}-")], f"g{g}: {mine}"


def moving_group(old_partitions: int, new_partitions: int, slots: int) -> str:
    """A group of `produce_rounds` whose slot differs on a K=1 storage topic."""
    for g in range(GROUPS):
        before = slot_of(routing.route_group(f"g{g}", old_partitions, 1), old_partitions, slots)
        after = slot_of(routing.route_group(f"g{g}", new_partitions, 1), new_partitions, slots)
        if before != after:
            return f"g{g}"
    raise AssertionError("no group moves")


def waits_in_status(client: Client, name: str, old: str, new: str) -> bool:
    lines = library_lines(client.status(name), "", int(time.time() * 1000))
    return any(f"waits at the end of {old} before {new}" in line for line in lines)


@pytest.fixture
def short_grace(monkeypatch):
    # Everything is produced before the switch is made here (each produce flushes): a second
    # of grace keeps the tests short without a writer that could still be late.
    monkeypatch.setattr(composite_topics, "SEAL_GRACE_MS", 1_000)


def test_one_member_across_a_k2_and_a_k1_switch_with_retries_pending(
    settings, catalog, unique_name, short_grace
):
    topics = TopicService(catalog)
    topic = unique_name("lib-switch")
    topics.create(topic, 2)
    with TestEndpoint() as endpoint:
        spec = library_spec(unique_name("lib"), topic, Endpoint(endpoint.url), retry=PATIENT)
        SubscriptionService(catalog).create(spec)
        client = Client(settings)
        # the last message of g1 on T_0 fails until T_1's messages of g1 were read
        endpoint.set_script("g1-5", [500] * 10_000)
        produced = produce_rounds(settings, topic, GROUPS, 0, 6)
        consumer = Consumer(spec.name, settings, options=Options(max_in_flight=8)).start()
        try:
            wait_for(lambda: consumer.counters()["delivered"] >= len(produced) - 1, "T_0", consumer)
            topics.add_storage(topic, 4)  # K = 2: groups stay in their slots
            topics.switch_produce(topic)
            # The last of T_1 of a group that moves at the K=1 switch below fails until the
            # member waits there.
            held = moving_group(4, 3, 2)
            endpoint.set_script(f"{held}-11", [500] * 10_000)
            produced += produce_rounds(settings, topic, GROUPS, 6, 12)
            t1 = f"{topic}.1"
            g1_waits = [f"g1-{n}" for n in range(5, 12)]  # g1-5 and g1's T_1 messages
            failing = {*g1_waits, f"{held}-11"}
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced) - len(failing),
                "T_1 but g1 delivered (the member followed the topic)",
                consumer,
            )
            assert not set(g1_waits) & set(first_deliveries(endpoint))
            endpoint.set_script("g1-5", [])  # g1's T_1 messages waited behind its retry
            topics.add_storage(topic, 3)  # K = 1: groups move to other slots
            topics.switch_produce(topic)
            produced += produce_rounds(settings, topic, GROUPS, 12, 16)
            t2 = f"{topic}.2"
            wait_for(lambda: waits_in_status(client, spec.name, t1, t2), "the wait", consumer)
            assert "waits at the end of" in consumer.health()["waiting"]
            endpoint.set_script(f"{held}-11", [])
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced), "everything", consumer
            )
            wait_for(lambda: consumer.health()["waiting"] is None, "the wait's end", consumer)
            assert not waits_in_status(client, spec.name, t1, t2)
        finally:
            consumer.stop()
        assert consumer.health()["state"] == "stopped"
        assert consumer.counters()["retried"] >= 2
        assert_each_group_in_order(first_deliveries(endpoint), produced)


def test_two_members_follow_a_k1_switch_and_cross_it_together(
    settings, catalog, unique_name, short_grace
):
    """Two members running when the storage topic is added: each subscribes to it at its own
    next look at the catalog (the assignor assigns it once both do), and neither hands out
    anything of it while a message of T_0 is pending at the other."""
    topics = TopicService(catalog)
    topic = unique_name("lib-k1")
    topics.create(topic, 2)
    with TestEndpoint() as endpoint:
        spec = library_spec(unique_name("lib"), topic, Endpoint(endpoint.url), retry=PATIENT)
        SubscriptionService(catalog).create(spec)
        held = moving_group(2, 3, 2)  # its T_1 messages are read by the other slot's member
        endpoint.set_script(f"{held}-5", [500] * 10_000)
        produced = produce_rounds(settings, topic, GROUPS, 0, 6)
        members = [Consumer(spec.name, settings).start() for _ in range(2)]
        try:
            wait_for(
                lambda: all(len(c.health()["slots"]) == 1 for c in members),
                "a slot each",
                *members,
            )
            topics.add_storage(topic, 3)  # K = 1
            topics.switch_produce(topic)
            produced += produce_rounds(settings, topic, GROUPS, 6, 10)
            t1 = f"{topic}.1"
            wait_for(
                lambda: all(
                    any(p.startswith(t1) for p in c.health()["partitions"]) for c in members
                ),
                "both reading T_1's slots",
                *members,
            )
            # Both members wait: neither hands out anything of T_1 while held-5 is pending.
            wait_for(lambda: all(c.health()["waiting"] for c in members), "both waiting", *members)
            assert not [i for i in first_deliveries(endpoint) if int(i.rsplit("-", 1)[1]) >= 6]
            endpoint.set_script(f"{held}-5", [])
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced), "everything", *members
            )
        finally:
            for c in members:
                c.stop()
        assert_each_group_in_order(first_deliveries(endpoint), produced)


def produce_large(settings, topic: str, start: int, stop: int) -> list[str]:
    """`produce_rounds`' messages with 64 KiB bodies: a fetch (1 MiB a partition) then brings a
    few of each partition at a time."""
    ids = []
    with Producer(topic, settings) as producer:
        for n in range(start, stop):
            for g in range(GROUPS):
                msg_id = f"g{g}-{n}"
                producer.send(msg_id.encode().ljust(65_536), group_id=f"g{g}", message_id=msg_id)
                ids.append(msg_id)
        producer.flush()
    return ids


def test_a_backlog_on_both_sides_of_a_k2_switch_is_delivered_in_order(
    settings, catalog, unique_name, short_grace
):
    """A member started after the switch reads T_0 and T_1 at once, each a few records of a
    partition per fetch: T_1's records come while T_0's of the same groups are still unread.
    They are held (read again later), never handed out before, and the back-pressure
    (`max_pending`) still lets T_0 be read to its end."""
    topics = TopicService(catalog)
    topic = unique_name("lib-backlog")
    topics.create(topic, 2)
    with TestEndpoint() as endpoint:
        spec = library_spec(unique_name("lib"), topic, Endpoint(endpoint.url))
        SubscriptionService(catalog).create(spec)
        produced = produce_large(settings, topic, 0, 30)
        topics.add_storage(topic, 4)  # K = 2
        topics.switch_produce(topic)
        produced += produce_large(settings, topic, 30, 60)
        options = Options(max_pending=20, max_in_flight=4)
        consumer = Consumer(spec.name, settings, options=options).start()
        try:
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced), "everything", consumer
            )
        finally:
            consumer.stop()
        assert consumer.health()["frontier"] == {0: 1, 1: 1}
        assert_each_group_in_order(first_deliveries(endpoint), produced)


def test_the_queues_of_a_spark_shard_count_change_once_it_is_done(settings, catalog, unique_name):
    """A subscription changed from 2 to 4 shards on Spark (new RQ/DLQ storage topics, `rq_from`
    and `dlq_from` 1, as `change_shards.activated` leaves them) and moved to the library: its
    members refuse it while the change's feeders copy, and once it is done read and write the
    new queues with 4 slots."""
    topics = TopicService(catalog)
    topic = unique_name("lib-queues")
    topics.create(topic, 4)
    with TestEndpoint() as endpoint:
        spec = library_spec(unique_name("lib"), topic, Endpoint(endpoint.url))
        SubscriptionService(catalog).create(spec)
        for queue, partitions in ((spec.rq_topic, 8), (spec.dlq_topic, 4)):
            topics.add_storage(queue, partitions)
            topics.switch_produce(queue)
        op_name = key(DocKind.OPERATION, f"{spec.name}/{OpKind.CHANGE_SHARDS}")

        def change(step: str):
            def mutate(snap):
                doc = snap.get(DocKind.SUBSCRIPTION, spec.name)
                state = dict(doc["state"], shard_count=4, rq_from=1, dlq_from=1)
                new_spec = dict(doc["spec"], shards=4, rq_partitions=8, dlq_partitions=4)
                return {
                    key(DocKind.SUBSCRIPTION, spec.name): {**doc, "spec": new_spec, "state": state},
                    op_name: {"kind": str(OpKind.CHANGE_SHARDS), "from": 2, "to": 4, "step": step},
                }

            catalog.mutate(mutate)

        change("feed")
        with pytest.raises(Unsupported, match="at step feed: its feeders have not yet copied"):
            Consumer(spec.name, settings).start()
        change("done")
        endpoint.set_script("g1-2", [500, 200])  # retried through the new RQ
        endpoint.set_script("g2-3", [400])  # dead-lettered to the new DLQ
        produced = produce_rounds(settings, topic, GROUPS, 0, 5)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced) - 1, "delivery", consumer
            )
            assert consumer.health()["slots"] == [0, 1, 2, 3]
        finally:
            consumer.stop()
        assert_each_group_in_order(first_deliveries(endpoint), [i for i in produced if i != "g2-3"])
        assert [r["headers"][m.H_MSG_ID] for r in read_queue(settings, f"{spec.rq_topic}.1")] == [
            "g1-2"
        ]
        assert [r["headers"][m.H_MSG_ID] for r in read_queue(settings, f"{spec.dlq_topic}.1")] == [
            "g2-3"
        ]
        assert read_queue(settings, f"{spec.rq_topic}.0") == []


def test_a_blocked_key_holds_the_members_at_a_k1_switch_until_it_is_redriven(
    settings, catalog, unique_name, short_grace
):
    """Block mode: a key blocked behind a dead letter of T_0 (its later T_0 messages sidelined)
    holds every slot at a K=1 boundary (status counts it); `dlq unsideline` delivers its
    messages in order, and only then its T_1 messages."""
    topics = TopicService(catalog)
    topic = unique_name("lib-block")
    topics.create(topic, 2)
    with TestEndpoint() as endpoint:
        spec = library_spec(
            unique_name("lib"), topic, Endpoint(endpoint.url), on_dead_letter="block"
        )
        SubscriptionService(catalog).create(spec)
        client = Client(settings)
        held = moving_group(2, 3, 2)
        endpoint.set_script(f"{held}-2", [400])  # dead-lettered: the key is blocked
        produced = produce_rounds(settings, topic, GROUPS, 0, 5)
        topics.add_storage(topic, 3)  # K = 1
        topics.switch_produce(topic)
        produced += produce_rounds(settings, topic, GROUPS, 5, 8)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: "(1 blocked)" in (consumer.health()["waiting"] or ""),
                "the wait behind the blocked key",
                consumer,
            )
            t0, t1 = f"{topic}.0", f"{topic}.1"
            assert waits_in_status(client, spec.name, t0, t1)
            assert not [i for i in first_deliveries(endpoint) if int(i.rsplit("-", 1)[1]) >= 5]
            client.wait_for_redrive(spec.name, client.redrive(spec.name, group_ids=[held]), 60)
            wait_for(
                lambda: len(first_deliveries(endpoint)) == len(produced), "everything", consumer
            )
        finally:
            consumer.stop()
        assert consumer.counters()["sidelined"] == 2  # held-3 and held-4, behind held-2
        assert_each_group_in_order(first_deliveries(endpoint), produced)


def test_offset_resets_across_a_k1_switch_then_a_member_delivers_from_there_in_order(
    settings, catalog, unique_name, short_grace, varadhi_cli, varadhi_killed_at
):
    """`offsets reset --queue main` of a main topic with two storage topics (K = 1 between):
    to a time in T_0 (interrupted after its commits, then finished by the same command) and to
    the start of T_1. After each, a member started afresh delivers exactly the messages from
    there, each group in order; after the first it crosses to T_1 only once the group finished
    T_0 (a retry of T_0 pending holds it: the reset left no commit on T_1 that would say a
    member crossed already)."""
    topics = TopicService(catalog)
    topic = unique_name("lib-reset")
    topics.create(topic, 2)
    with TestEndpoint() as endpoint:
        spec = library_spec(unique_name("lib"), topic, Endpoint(endpoint.url), retry=PATIENT)
        SubscriptionService(catalog).create(spec)
        t0, t1 = f"{topic}.0", f"{topic}.1"
        produced = produce_rounds(settings, topic, GROUPS, 0, 3)
        at_ms = int(time.time() * 1000) + 1  # after every record produced so far
        wait_for(lambda: time.time() * 1000 >= at_ms, "the next millisecond")
        produced += produce_rounds(settings, topic, GROUPS, 3, 6)
        topics.add_storage(topic, 3)  # K = 1: groups move to other slots
        topics.switch_produce(topic)
        produced += produce_rounds(settings, topic, GROUPS, 6, 10)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: len(first_deliveries(endpoint)) == len(produced), "all", consumer)
        finally:
            consumer.stop()
        group = group_id(spec.name)
        wait_for(lambda: status.group_members(settings, group) == [], "the member's leave")
        assert {tp.topic for tp in status.group_committed(catalog, group)} == {t0, t1}

        # 1. to the time: T_0 from round 3, and T_1's commits removed
        args = ("offsets", "reset", spec.name, "--queue", "main", "--to-datetime", str(at_ms))
        code, out, err = varadhi_cli(*args, "--dry-run")
        assert code == 0, err
        assert "commits removed (read from the log start once reached)" in out
        assert f"{t1}/0, {t1}/1, {t1}/2" in out
        varadhi_killed_at("library_offset_reset_committed", *args, "--execute")
        committed = status.group_committed(catalog, group)
        assert {tp.topic for tp in committed} == {t0, t1}  # T_0's commits made, T_1's not removed
        with pytest.raises(InvalidArgument, match="is under way"):
            Consumer(spec.name, settings).start()
        code, out, err = varadhi_cli(*args, "--execute")
        assert code == 0 and "resumed and finished" in out, err
        assert {tp.topic for tp in status.group_committed(catalog, group)} == {t0}
        # the moving group's last message of T_0 fails until the member waits at the boundary
        held = moving_group(2, 3, 2)
        endpoint.set_script(f"{held}-5", [500] * 10_000)
        seen = len(endpoint.records())
        member = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: member.health()["waiting"], "the wait at the K=1 switch", member)
            assert not [i for i in successes(endpoint, seen) if round_of(i) >= 6]
            endpoint.set_script(f"{held}-5", [])
            expected = [i for i in produced if round_of(i) >= 3]
            wait_for(lambda: len(successes(endpoint, seen)) >= len(expected), "delivery", member)
        finally:
            member.stop()
        assert member.health()["frontier"] == {0: 1, 1: 1}
        delivered = successes(endpoint, seen)
        assert len(delivered) == len(set(delivered)) == len(expected)  # none twice
        assert_each_group_in_order(delivered, expected)

        # 2. to the start of T_1: T_0 read to its end, T_1 from its start
        wait_for(lambda: status.group_members(settings, group) == [], "the member's leave")
        args = ("offsets", "reset", spec.name, "--queue", "main", "--to-storage-topic", "1")
        code, out, err = varadhi_cli(*args, "--execute")
        assert code == 0 and "reset:" in out, err
        seen = len(endpoint.records())
        member = Consumer(spec.name, settings).start()
        try:
            expected = [i for i in produced if round_of(i) >= 6]
            wait_for(lambda: len(successes(endpoint, seen)) >= len(expected), "delivery", member)
        finally:
            member.stop()
        delivered = successes(endpoint, seen)
        assert len(delivered) == len(set(delivered)) == len(expected)
        assert_each_group_in_order(delivered, expected)


def successes(endpoint: TestEndpoint, since: int) -> list[str]:
    """Message ids answered 200 among the endpoint's records from `since` on, in order."""
    return [r.message_id for r in endpoint.records(since=since) if r.status == 200]


def round_of(message_id: str) -> int:
    """n of a `produce_rounds` message id `g<i>-<n>`."""
    return int(message_id.rsplit("-", 1)[1])
