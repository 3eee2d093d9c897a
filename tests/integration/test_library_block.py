"""`on_dead_letter: block` on the library runtime against the real broker and a real HTTP
endpoint: a key whose message is dead-lettered delivers none of its later messages (sidelined to
the DLQ behind it) while other keys go on; a restarted member, a member that gets the key's
slot in a rebalance, and the member after one killed, still hold it blocked (the GroupState
topic); `dlq unsideline` unblocks it and its messages are delivered in order, then its new ones;
re-driving only the dead letter leaves it blocked at its mark; a rate-capped re-drive holds it
at its next re-driven message; a DLQ offset reset is refused while it is blocked; a merge of the
slots (`change-shards`) keeps every block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from varadhi import Client
from varadhi.core import messages as m
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import OVER_LIMIT
from varadhi.core.policies import Endpoint
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer
from varadhi.library.blocked_keys import decode
from varadhi.library.group_state_topic import partition_of, topic_name
from varadhi.ops import lifecycle
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import read_queue
from varadhi.testing.library import (
    DEADLINE_S,
    FAST_RETRY,
    ConsumerProcess,
    subscription_spec,
    wait_for,
)
from varadhi.testing.library import (
    produce_rounds as produce,
)

pytestmark = pytest.mark.kafka


def delivered(endpoint: TestEndpoint) -> list[str]:
    """Message ids of the endpoint's 2xx answers, in the order it answered them."""
    return [r.message_id for r in endpoint.records() if r.status == 200]


def dlq_ids(settings, spec) -> list[tuple[str, str]]:
    return [
        (r["headers"][m.H_MSG_ID], r["headers"][m.H_REASON])
        for r in read_queue(settings, f"{spec.dlq_topic}.0")
    ]


def test_a_blocked_key_stays_blocked_across_restart_and_rebalance_until_unsidelined(
    settings, catalog, make_topic, unique_name
):
    with TestEndpoint() as endpoint, Client(settings) as client:
        topic = make_topic(4)
        spec = subscription_spec(
            unique_name("lib"), topic, Endpoint(endpoint.url + "/hook"), on_dead_letter="block"
        )
        SubscriptionService(catalog).create(spec)
        endpoint.set_script("g1-2", [400])  # dead-lettered; 200 when re-driven
        first = produce(settings, topic, groups=6, start=0, stop=6)
        blocked = {f"g1-{n}" for n in range(2, 6)}
        a = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: (
                    set(delivered(endpoint)) == set(first) - blocked
                    and a.counters()["dead_lettered"] == 4
                ),
                "the other keys delivered, g1 blocked",
                a,
            )
            assert (a.counters()["sidelined"], a.counters()["blocked"]) == (3, 1)
        finally:
            a.stop()
        # the dead letter first, then g1's later messages in order behind it
        assert dlq_ids(settings, spec) == [("g1-2", "fatal response 400")] + [
            (f"g1-{n}", OVER_LIMIT) for n in range(3, 6)
        ]
        # a DLQ reset would skip the dead letter of a blocked key: refused
        with pytest.raises(InvalidArgument, match="1 keys .* blocked behind dead letters"):
            client.reset_offsets(spec.name, "dlq", "to-latest", execute=True)

        # A restart reads the block from the GroupState topic.
        second = produce(settings, topic, groups=6, start=6, stop=8)
        b = Consumer(spec.name, settings).start()
        c = None
        try:
            wait_for(
                lambda: (
                    set(delivered(endpoint)) >= {i for i in second if not i.startswith("g1-")}
                    and b.counters()["sidelined"] == 2
                ),
                "the restarted member's deliveries",
                b,
            )
            assert b.counters()["blocked"] == 1
            # A second member joins, then the first leaves: the key's slot moves to a member
            # that never saw the dead letter.
            c = Consumer(spec.name, settings).start()
            wait_for(lambda: len(c.health()["slots"]) == 1, "the second member's slot", b, c)
            b.stop()
            wait_for(lambda: c.health()["slots"] == [0, 1], "every slot on the second", c)
            third = produce(settings, topic, groups=6, start=8, stop=10)
            wait_for(
                lambda: (
                    set(delivered(endpoint)) >= {i for i in third if not i.startswith("g1-")}
                    and c.counters()["blocked"] == 1
                    and any(i == "g1-9" for i, _ in dlq_ids(settings, spec))
                ),
                "the new owner's deliveries, g1 still blocked",
                c,
            )
            assert [i for i in delivered(endpoint) if i.startswith("g1-")] == ["g1-0", "g1-1"]

            # `dlq unsideline` re-drives the key: everything in order, then its new messages.
            op_id = client.redrive(spec.name, group_ids=["g1"])
            client.wait_for_redrive(spec.name, op_id, DEADLINE_S)
            g1 = [f"g1-{n}" for n in range(10)]
            wait_for(
                lambda: [i for i in delivered(endpoint) if i.startswith("g1-")] == g1,
                "g1 delivered in order",
                c,
            )
            wait_for(lambda: c.counters()["blocked"] == 0, "g1 unblocked", c)
            produce(settings, topic, groups=6, start=10, stop=11)
            wait_for(
                lambda: [i for i in delivered(endpoint) if i.startswith("g1-")] == [*g1, "g1-10"],
                "g1's new message",
                c,
            )
        finally:
            b.stop()
            if c is not None:
                c.stop()
        records = read_queue(settings, topic_name(spec.name))
        last = {r["key"]: r["value"] for r in records}
        assert decode(last[b"g1"]) == ()  # the key's record is a tombstone now
        # `subscription delete` deletes the GroupState topic with the queues
        client.delete_subscription(spec.name)
        assert lifecycle.existing_topics(settings, [topic_name(spec.name)]) == []


def test_a_redrive_of_the_dead_letter_alone_leaves_the_key_blocked_at_its_mark_and_a_paced_one_holds_it(
    settings, catalog, make_topic, unique_name
):
    """A key blocked after its retries ran out had its later messages held behind the retry:
    they are sidelined behind the dead letter, in order. Re-driving only a dead letter
    delivers it and leaves the key blocked at its mark (the first sidelined message), as on a
    shard; re-driving the key then delivers the rest in order. A rate-capped re-drive of a key
    holds it at its next message a later portion puts back: a message produced meanwhile is
    not delivered before them (it is sidelined, and blocks the key once they are back)."""
    with TestEndpoint() as endpoint, Client(settings) as client:
        topic = make_topic(4)
        spec = subscription_spec(
            unique_name("lib"),
            topic,
            Endpoint(endpoint.url + "/hook"),
            on_dead_letter="block",
            retry=replace(FAST_RETRY, max_attempts=2),
        )
        SubscriptionService(catalog).create(spec)
        endpoint.set_script("g1-1", [400])
        endpoint.set_script("g2-1", [500, 500])  # retried once, then dead-lettered
        first = produce(settings, topic, groups=4, start=0, stop=5)
        g1, g2 = [f"g1-{n}" for n in range(5)], [f"g2-{n}" for n in range(5)]
        consumer = Consumer(spec.name, settings).start()

        def got(prefix: str) -> list[str]:
            return [i for i in delivered(endpoint) if i.startswith(prefix)]

        try:
            wait_for(
                lambda: (
                    set(delivered(endpoint)) == set(first) - set(g1[1:]) - set(g2[1:])
                    and consumer.counters()["dead_lettered"] == 8
                ),
                "the other keys delivered, g1 and g2 blocked",
                consumer,
            )
            dlq = dlq_ids(settings, spec)
            for key in ("g1", "g2"):
                mine = [(i, reason) for i, reason in dlq if i.startswith(key)]
                assert [i for i, _ in mine] == [f"{key}-{n}" for n in range(1, 5)]
                assert {reason for _, reason in mine[1:]} == {OVER_LIMIT}
            assert consumer.counters()["blocked"] == 2

            # only the dead letter: g1 blocked again at its mark g1-2
            op = client.redrive(spec.name, message_ids=["g1-1"])
            client.wait_for_redrive(spec.name, op, DEADLINE_S)
            wait_for(lambda: got("g1-") == g1[:2], "g1-1 re-driven", consumer)
            produce(settings, topic, groups=4, start=5, stop=6)
            wait_for(
                lambda: (
                    consumer.counters()["dead_lettered"] == 10 and "g0-5" in delivered(endpoint)
                ),
                "g1-5 and g2-5 sidelined",
                consumer,
            )
            assert got("g1-") == g1[:2] and consumer.counters()["blocked"] == 2
            op = client.redrive(spec.name, group_ids=["g1"])
            client.wait_for_redrive(spec.name, op, DEADLINE_S)
            wait_for(lambda: got("g1-") == [*g1, "g1-5"], "g1 in order", consumer)

            # g2 at 1 message a second (each slot one every 2 s): g2-6, produced once its dead
            # letter and mark are back (only the re-drive's barrier holds it), waits behind the rest
            op = client.redrive(spec.name, group_ids=["g2"], rate=1)
            wait_for(lambda: got("g2-") == g2[:3], "the first portions", consumer)
            produce(settings, topic, groups=4, start=6, stop=7)
            client.wait_for_redrive(spec.name, op, DEADLINE_S)
            wait_for(lambda: got("g2-") == [*g2, "g2-5"], "g2's re-driven messages", consumer)
            wait_for(lambda: "g1-6" in delivered(endpoint), "g1's newer message", consumer)
            assert got("g2-") == [*g2, "g2-5"]  # g2-6 sidelined behind them
            assert ("g2-6", OVER_LIMIT) in dlq_ids(settings, spec)
            assert consumer.counters()["blocked"] == 1
        finally:
            consumer.stop()


def test_a_member_killed_after_a_dead_letter_leaves_the_key_blocked(
    settings, catalog, make_topic, unique_name, tmp_path
):
    """The console script, SIGKILLed once a key is blocked, its later messages sidelined and
    all of it committed (so only the GroupState topic can say the key is blocked): the next
    member holds the key blocked (nothing of it delivered, its new messages sidelined) while
    the others go on."""
    from varadhi.library.runtime import group_id
    from varadhi.ops import status

    with TestEndpoint() as endpoint:
        topic = make_topic(4)
        spec = subscription_spec(
            unique_name("lib"), topic, Endpoint(endpoint.url + "/hook"), on_dead_letter="block"
        )
        SubscriptionService(catalog).create(spec)
        endpoint.set_script("g1-1", [400])
        first = produce(settings, topic, groups=3, start=0, stop=4)
        args = ("--session-timeout-ms", "6000")  # the killed member's slots move within 6 s

        def committed() -> int:
            found = status.group_committed(catalog, group_id(spec.name))
            return sum(offset for tp, offset in found.items() if tp.topic == f"{topic}.0")

        member = ConsumerProcess(settings, spec.name, tmp_path / "first.log", *args)
        try:
            wait_for(
                lambda: (
                    [i for i, _ in dlq_ids(settings, spec)] == ["g1-1", "g1-2", "g1-3"]
                    and committed() == len(first)
                ),
                "g1 blocked, everything committed",
            )
        finally:
            member.kill()
        assert delivered(endpoint) and "g1-2" not in delivered(endpoint)
        second = produce(settings, topic, groups=3, start=4, stop=6)
        again = ConsumerProcess(settings, spec.name, tmp_path / "second.log", *args)
        try:
            wait_for(
                lambda: (
                    set(delivered(endpoint)) >= {i for i in second if not i.startswith("g1-")}
                    and {"g1-4", "g1-5"} <= {i for i, _ in dlq_ids(settings, spec)}
                ),
                "the next member's deliveries",
            )
            assert again.alive(), again.log()
        finally:
            assert again.stop() == 0, again.log()
        assert [i for i in delivered(endpoint) if i.startswith("g1-")] == ["g1-0"]


def test_blocked_keys_survive_a_merge_of_the_slots_and_their_old_records_are_tombstoned(
    settings, catalog, make_topic, unique_name, varadhi_cli
):
    """`change-shards` 2 -> 1 in place: the one slot's member reads both GroupState partitions
    and holds every blocked key; a key whose record lay on a partition its new slot would not
    write it to is rewritten and the old record tombstoned when the re-drive lifts it."""
    from varadhi.library.runtime import group_id
    from varadhi.ops import status

    with TestEndpoint() as endpoint, Client(settings) as client:
        topic = make_topic(4)
        spec = subscription_spec(
            unique_name("lib"), topic, Endpoint(endpoint.url + "/hook"), on_dead_letter="block"
        )
        SubscriptionService(catalog).create(spec)
        keys = [f"g{k}" for k in range(8)]
        for key in keys:
            endpoint.set_script(f"{key}-1", [400])
        produce(settings, topic, groups=8, start=0, stop=3)
        a = Consumer(spec.name, settings).start()
        try:
            wait_for(
                lambda: a.counters()["dead_lettered"] == 16 and a.counters()["delivered"] == 8,
                "every key blocked",
                a,
            )
            client.pause(spec.name)
        finally:
            a.stop()
        wait_for(lambda: not status.group_members(settings, group_id(spec.name)), "an empty group")
        code, out, err = varadhi_cli("subscription", "change-shards", spec.name, "--to", "1")
        assert code == 0 and "now has 1 slots" in out, err
        where = {
            r["key"].decode(): r["partition"] for r in read_queue(settings, topic_name(spec.name))
        }
        moved = {k for k, p in where.items() if p != partition_of(k, 0, 1, 2)}
        assert moved  # some key's record is not where its new slot writes it

        client.resume(spec.name)
        b = Consumer(spec.name, settings).start()
        try:
            produce(settings, topic, groups=8, start=3, stop=4)
            wait_for(
                lambda: b.counters()["sidelined"] == 8 and b.counters()["blocked"] == 8,
                "the merged slot's keys still blocked",
                b,
            )
            assert sorted(delivered(endpoint)) == sorted(f"{k}-0" for k in keys)
            op = client.redrive(spec.name, group_ids=keys)
            client.wait_for_redrive(spec.name, op, DEADLINE_S)
            wait_for(
                lambda: all(
                    [i for i in delivered(endpoint) if i.startswith(f"{k}-")]
                    == [f"{k}-{n}" for n in range(4)]
                    for k in keys
                ),
                "every key in order",
                b,
            )
            wait_for(lambda: b.counters()["blocked"] == 0, "every key unblocked", b)
        finally:
            b.stop()
        last = {
            (r["partition"], r["key"]): r["value"]
            for r in read_queue(settings, topic_name(spec.name))
        }
        assert {value for value in last.values()} == {None}  # tombstones, old partitions too
        assert {(p, k.decode()) for p, k in last} >= {(where[k], k) for k in moved}
