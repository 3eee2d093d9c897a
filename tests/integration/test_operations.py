"""Operations on a running subscription against the real broker, Delta and an HTTP endpoint:
DLQ browse and re-drive, pause and resume, status. One in-process shard per test."""

from __future__ import annotations

import threading
import time

import pytest

from varadhi.cli import main as cli
from varadhi.core.errors import VaradhiError
from varadhi.kafka import dlq, subscriptions
from varadhi.ops import status
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, run_until_idle, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_unsideline_redrives_in_order_and_unblocks_the_group(
    settings, spark, make_subscription, catalog
):
    ids = [f"m{i}" for i in range(6)]
    with TestEndpoint(script={"m1": [404]}) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", i) for i in ids] + [("other", "o1")])
        run_until_idle(settings, spark, spec.name)
        # m1 is parked, m2.. wait behind it (block mode); other groups flow.
        assert delivered(endpoint, "g") == ["m0"]
        assert delivered(endpoint, "other") == ["o1"]
        parked = dlq.list_parked(catalog, spec.name)
        assert [(p["msg_id"], p["status"], p["attempts"], p["state"]) for p in parked] == [
            ("m1", 404, 1, "parked")
        ]
        assert parked[0]["reason"].startswith("fatal response 404")
        doc = status.collect(catalog, spec.name)
        assert doc["shards"][0]["blocked_groups"] == 1
        assert doc["shards"][0]["queues"]["dlq"]["parked"] == 1
        # Seed 002's counters: 7 produced and read; m0, m1 (404) and o1 sent; m0 and o1 acked.
        assert doc["stats"] == {"inserted": 7, "routed": 7, "emitted": 3, "acknowledged": 2}
        by_topic = status.topic_statistics(catalog, spec.topic)
        assert by_topic["inserted"] == 7
        assert by_topic["subscriptions"][spec.name] == {
            "routed": 7,
            "emitted": 3,
            "acknowledged": 2,
        }

        # A restarted shard shows what waits before its first batch, the blocked group by
        # name, and goes on counting where it stopped.
        run_until_idle(settings, spark, spec.name)  # nothing new to read
        shard = status.collect(catalog, spec.name)["shards"][0]
        assert shard["blocked_groups"] == 1 and shard["held"] == 4
        assert shard["queues"]["main"]["lag"] == 0  # not the whole log before its first batch
        assert shard["blocked"] == [
            {
                "group": "g",
                "head": "m1",
                "where": "dlq",
                "reason": parked[0]["reason"],
                "waiting": 5,
            }
        ]

        assert cli(["dlq", "unsideline", spec.name, "--group-ids", "g"]) == 0
        produce(settings, spec.topic, [("g", "m6")])  # live traffic stays behind the re-drive
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ids + ["m6"]
        # m1 (again), m2..m5 and m6 sent and acknowledged by the later runs, counted on.
        stats = status.collect(catalog, spec.name)["stats"]
        assert stats == {"inserted": 8, "routed": 8, "emitted": 9, "acknowledged": 8}
        attempts = [r.attempt for r in endpoint.records() if r.message_id == "m1"]
        assert attempts == [1, 1]  # attempts were reset by the re-drive
        assert [p["state"] for p in dlq.list_parked(catalog, spec.name)] == ["redriven"]
        assert status.collect(catalog, spec.name)["shards"][0]["blocked_groups"] == 0


def test_repeated_unsideline_delivers_each_dead_letter_once(
    settings, spark, make_subscription, catalog
):
    since = str(int(time.time() * 1000) - 1_000)
    # g1 and h1 fail once (404, fatal); k1 fails again after its first re-drive.
    script = {"g1": [404], "h1": [404], "k1": [404, 404]}
    with TestEndpoint(script=script, record_headers=True) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", f"g{i}") for i in range(3)] + [("h", "h1")])
        produce(settings, spec.topic, [("k", "k1"), ("h", "h2")])
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint) == ["g0"]

        def ok(msg_id):
            return delivered(endpoint).count(msg_id)

        def parked():
            return sorted((p["msg_id"], p["state"]) for p in dlq.list_parked(catalog, spec.name))

        def new_redrive(before: set[str]) -> str:
            (op_id,) = set(dlq.redrives(catalog.snapshot(), spec.name)) - before
            return op_id

        def redriven_by(msg_id: str) -> list[str | None]:
            """X-Varadhi-Redriven of each request of `msg_id`, in order (None: not sent)."""
            return [
                {k.lower(): v for k, v in r.headers.items()}.get("x-varadhi-redriven")
                for r in endpoint.records()
                if r.message_id == msg_id
            ]

        # By message id, through the command line: g1 and k1 only; h1 stays parked, and h2
        # waits behind it.
        unsideline = ["dlq", "unsideline", spec.name]
        assert cli(unsideline + ["--message-ids", "g1", "k1"]) == 0
        first = new_redrive(set())
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["g0", "g1", "g2"]
        assert ok("k1") == 0  # re-driven, failed again: a new dead letter
        assert delivered(endpoint, "h") == []
        assert parked() == [
            ("g1", "redriven"),
            ("h1", "parked"),
            ("k1", "parked"),
            ("k1", "redriven"),
        ]
        # Re-driven messages say so on every request; g2, which only waited behind g1, does
        # not. k1's new dead letter shows the re-drive that put it back.
        assert redriven_by("g1") == [None, first] and redriven_by("g2") == [None]
        assert redriven_by("k1") == [None, first]
        by = {(p["msg_id"], p["redriven_by"]) for p in dlq.list_parked(catalog, spec.name)}
        assert by == {("g1", None), ("h1", None), ("k1", None), ("k1", first)}

        # An overlapping selector: g1 was re-driven already; k1's new dead letter was not.
        assert cli(unsideline + ["--group-ids", "g", "k"]) == 0
        second = new_redrive({first})
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["g0", "g1", "g2"]
        assert ok("k1") == 1
        assert redriven_by("k1") == [None, first, second]
        assert delivered(endpoint, "h") == []

        # A failure-time selector, twice: h1 once (h2 after it), nothing re-driven before again.
        for _ in range(2):
            assert cli(unsideline + ["--failed-since", since]) == 0
            run_until_idle(settings, spark, spec.name)
            assert [ok(i) for i in ("g1", "g2", "h1", "h2", "k1")] == [1, 1, 1, 1, 1]
        assert delivered(endpoint, "h") == ["h1", "h2"]
        assert [r.message_id for r in endpoint.records()].count("g1") == 2  # 404, then 200
        assert {(p["msg_id"], p["state"]) for p in dlq.list_parked(catalog, spec.name)} == {
            ("g1", "redriven"),
            ("h1", "redriven"),
            ("k1", "redriven"),
        }


def test_unsideline_applied_but_not_marked_done_is_not_applied_again(
    settings, spark, make_subscription, catalog, monkeypatch
):
    """A shard that committed a re-drive's state but stopped before marking the operation done
    (the catalog write fails once) finds it applied and only marks it done."""
    real_mark_done, calls = dlq.mark_done, []

    def mark_done_fails_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("catalog unavailable")
        return real_mark_done(*args, **kwargs)

    with TestEndpoint(script={"m1": [404]}) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", "m0"), ("g", "m1"), ("g", "m2")])
        run_until_idle(settings, spark, spec.name)
        op_id = dlq.request_unsideline(catalog, spec.name, dlq.Selector(group_ids=("g",)))
        monkeypatch.setattr(dlq, "mark_done", mark_done_fails_once)
        with pytest.raises(VaradhiError, match="catalog unavailable"):
            run_until_idle(settings, spark, spec.name)
        monkeypatch.undo()
        assert dlq.redrives(catalog.snapshot(), spec.name)[op_id]["done"] == []
        run_until_idle(settings, spark, spec.name)
        assert dlq.redrives(catalog.snapshot(), spec.name)[op_id]["done"] == [0]
        assert delivered(endpoint, "g") == ["m0", "m1", "m2"]


def test_unsideline_refuses_bad_requests_without_side_effects(
    settings, catalog, make_subscription, capsys
):
    spec = make_subscription("http://127.0.0.1:9/")
    before = dlq.redrives(catalog.snapshot(), spec.name)
    assert cli(["dlq", "unsideline", spec.name]) == 2
    assert cli(["dlq", "unsideline", "no-such-sub", "--group-ids", "g"]) == 2
    assert cli(["dlq", "unsideline", spec.name, "--failed-since", "yesterday"]) == 2
    assert cli(["dlq", "unsideline", spec.name, "--failed-until", "2026-01-01T00:00:00Z"]) == 2
    assert cli(["dlq", "unsideline", spec.name, "--group-ids", "g", "--rate", "0/s"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "not a time" in err and "needs --failed-since" in err
    assert "--rate must be a positive number of messages a second" in err
    assert dlq.redrives(catalog.snapshot(), spec.name) == before


def test_pause_stops_consuming_and_resume_carries_on(
    settings, spark, make_subscription, catalog, monkeypatch
):
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", f"a{i}") for i in range(5)])
        job = ShardJob(spec.name, 0, settings, spark=spark)
        thread = threading.Thread(target=job.run, daemon=True)
        # What the shard's control loop decided at each of its reads of the subscription: paused
        # or not. Paused, it reads it once a second (`ShardJob._wait_while`), and would
        # start its query at the first read that says otherwise.
        seen_paused: list[bool] = []
        read_subscription = subscriptions.from_snapshot

        def observed(snap, name):
            sub = read_subscription(snap, name)
            if threading.current_thread() is thread:
                seen_paused.append(sub.paused)
            return sub

        monkeypatch.setattr(subscriptions, "from_snapshot", observed)
        thread.start()
        wait_for(lambda: len(delivered(endpoint, "g")) == 5, 90)
        assert cli(["subscription", "pause", spec.name]) == 0
        wait_for(lambda: status.collect(catalog, spec.name)["shards"][0]["state"] == "paused", 120)
        produce(settings, spec.topic, [("g", f"b{i}") for i in range(5)])
        since = len(seen_paused)

        # Nothing consumed while paused, over time the shard demonstrably had: three of its
        # control-loop ticks after the new messages were acknowledged (some 3 s: 30 triggers of
        # the 100 ms query it would otherwise run), not a sleep in which it may not have run.
        # Throughout, the shard runs no streaming query: nothing could read the messages.
        def three_paused_ticks() -> bool:
            queries = [q.name for q in spark.streams.active]
            assert not [q for q in queries if q.startswith(f"varadhi-{spec.name}-")], queries
            assert len(delivered(endpoint, "g")) == 5, "delivered while paused"
            return len(seen_paused) - since >= 3

        wait_for(three_paused_ticks, 120, "three control-loop ticks of the paused shard")
        assert all(seen_paused[since:]), seen_paused[since:]
        shard = status.collect(catalog, spec.name)["shards"][0]
        assert shard["state"] == "paused" and thread.is_alive()
        # the new messages are in its partitions, and it read none of them
        assert shard["stats"]["inserted"] == 10 and shard["stats"]["routed"] == 5
        assert shard["queues"]["main"]["lag"] == 5
        assert len(delivered(endpoint, "g")) == 5  # nothing consumed while paused
        assert cli(["subscription", "resume", spec.name]) == 0
        wait_for(lambda: len(delivered(endpoint, "g")) == 10, 90)
        assert delivered(endpoint, "g") == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(5)]
        job.request_stop()
        thread.join(60)
        assert not thread.is_alive()
