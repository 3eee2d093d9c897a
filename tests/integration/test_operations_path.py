"""The documented shard-count change path (docs/operations.md, "Changing the shard count"), end
to end and in order, with the real CLI, broker, Spark, Delta and an HTTP endpoint: create,
deliver with two shards running, pause (they report paused), change to three shards with
retries pending in the RQ and messages waiting in the main topic, run the feeders
(`varadhi.jobs.feeder`), start the new shards, resume, deliver more. Pause and resume must work
before, during (feeders still to run) and after the change, and describe/status must agree.
Shards run in threads of this process on the session's SparkSession."""

from __future__ import annotations

import json
import re
import threading

import pytest

from varadhi.ops import status
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import produce, wait_for

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

GROUPS = [f"g{i}" for i in range(6)]
FAILING = ["A-g1-0", "A-g4-1"]  # two 500s each; a 3 s backoff sends each retry to the RQ


def feeder_main(argv: list[str]) -> int:
    """`varadhi-job feeder ...` without a new JVM: varadhi.jobs.feeder's main()."""
    from varadhi.jobs.feeder import main

    return main(argv)


class Shards:
    """Shards 0..count-1, each `ShardJob.run()` in a thread; `codes` holds their exit codes."""

    def __init__(self, settings, spark, name: str, count: int):
        self.jobs = [ShardJob(name, i, settings, spark=spark) for i in range(count)]
        self.codes: dict[int, int] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        self.codes[i] = self.jobs[i].run()

    def join(self, timeout: float = 90) -> dict[int, int]:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a shard did not stop"
        return self.codes

    def stop(self) -> dict[int, int]:
        for job in self.jobs:
            job.request_stop()
        return self.join()


def first_successes(endpoint: TestEndpoint) -> dict[str, list[str]]:
    """Per group, the message ids in the order of their first 2xx (re-deliveries ignored)."""
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for r in endpoint.records():
        if r.status < 300 and r.message_id not in seen:
            seen.add(r.message_id)
            out.setdefault(r.group_id, []).append(r.message_id)
    return out


def delivered_ids(endpoint: TestEndpoint) -> set[str]:
    return {m for ids in first_successes(endpoint).values() for m in ids}


def messages(phase: str, per_group: int) -> list[tuple[str, str]]:
    return [(g, f"{phase}-{g}-{n}") for n in range(per_group) for g in GROUPS]


def shard_states(catalog, name: str) -> list[str]:
    return [s["state"] for s in status.collect(catalog, name)["shards"]]


def test_pause_change_shards_feed_resume_delivers_everything_in_order(
    settings, spark, catalog, unique_name, varadhi_cli
):
    topic, name = unique_name("opspath"), unique_name("opspath-sub")
    with TestEndpoint(script={m: [500, 500] for m in FAILING}) as endpoint:
        # create
        assert varadhi_cli("topic", "create", topic, "--partitions", "6")[0] == 0
        code, out, err = varadhi_cli(
            "subscription", "create", name, "--topic", topic, "--endpoint", endpoint.url,
            "--shards", "2", "--max-attempts", "5", "--backoff", "fixed",
            "--min-backoff", "3s", "--max-backoff", "3s",
        )  # fmt: skip
        assert code == 0, err

        # deliver with two shards running; pause while A's failures wait for their retry
        produced = messages("A", 3)
        produce(settings, topic, produced)
        old = Shards(settings, spark, name, 2)
        wait_for(
            lambda: (
                delivered_ids(endpoint) >= {m for g, m in produced if g not in ("g1", "g4")}
                and {"A-g4-0", *FAILING} <= {r.message_id for r in endpoint.records()}
            ),
            180,
            "A delivered, except the failing messages and their followers",
        )
        assert varadhi_cli("subscription", "pause", name)[0] == 0
        wait_for(lambda: shard_states(catalog, name) == ["paused"] * 2, 60, "shards paused")
        assert not set(FAILING) & delivered_ids(endpoint)
        b = messages("B", 2)
        produce(settings, topic, b)  # waits in the main topic: the shards are paused
        produced += b

        # change-shards 2 -> 3 with external feeders; the paused old shards are fenced (exit 3)
        code, changed, err = varadhi_cli(
            "subscription", "change-shards", name, "--to", "3", "--feeders", "external"
        )
        assert code == 0, err
        moved = re.search(r"state: (\d+) pending entries of (\d+) groups", changed)
        assert moved and int(moved[1]) >= 2 and int(moved[2]) == 2, changed  # g1 and g4 wait
        sources = re.findall(r"--job feeder --subscription \S+ --source (\S+)", changed)
        assert sources == [f"{name}.rq.0", f"{name}.dlq.0"]
        assert old.join() == {0: 3, 1: 3}
        assert not {m for _, m in b} & delivered_ids(endpoint)
        # pause works during the change (feeders still to run), as it did before it
        code, out, err = varadhi_cli("subscription", "pause", name)
        assert (code, err) == (0, ""), err
        assert out.strip() == f"paused subscription {name}"

        def describe() -> dict:
            code, out, err = varadhi_cli("subscription", "describe", name, "--output", "json")
            assert code == 0, err
            return json.loads(out)

        info = describe()
        assert info["state"]["shard_count"] == info["spec"]["shards"] == 3
        assert (info["spec"]["rq_partitions"], info["spec"]["dlq_partitions"]) == (6, 3)
        assert (info["state"]["rq_from"], info["state"]["dlq_from"], info["state"]["paused"]) == (
            1,
            1,
            True,
        )
        assert [s["shard"] for s in info["shards"]] == [0, 1, 2]
        assert [[a["storage_topic"] for a in s["rq"]] for s in info["shards"]] == [
            [f"{name}.rq.1"]
        ] * 3
        assert [a["partitions"] for s in info["shards"] for a in s["rq"]] == [
            [0, 1],
            [2, 3],
            [4, 5],
        ]

        # during the change (feeders still to run): start the new shards (they wait, paused),
        # then run the feeders
        new = Shards(settings, spark, name, 3)
        wait_for(lambda: shard_states(catalog, name) == ["paused"] * 3, 60, "new shards paused")
        doc = status.collect(catalog, name)
        assert (doc["shard_count"], doc["paused"]) == (3, True)
        assert doc["operations"][f"{name}/change-shards"]["step"] == "feed"
        for source in sources:
            assert feeder_main(["--subscription", name, "--source", source]) == 0
        assert status.collect(catalog, name)["operations"][f"{name}/change-shards"]["step"] == (
            "done"
        )

        # resume (change-shards said so: the subscription stayed paused): the new shards deliver
        # what waited (B, A's retries and followers), then C
        assert f"varadhi subscription resume {name}" in changed
        code, out, err = varadhi_cli("subscription", "resume", name)
        assert code == 0, err
        assert out.strip() == f"resumed subscription {name}"
        c = messages("C", 1)
        produce(settings, topic, c)
        produced += c
        wanted = {m for _, m in produced}
        wait_for(
            lambda: delivered_ids(endpoint) >= wanted,
            180,
            "everything delivered after resume",
        )

        def caught_up() -> bool:
            doc = status.collect(catalog, name)
            return all(
                s["state"] == "running"
                and s["queues"]["main"]["lag"] == 0
                and s["queues"]["rq"]["lag"] == 0
                for s in doc["shards"]
            )

        wait_for(caught_up, 60, "status: every shard running with no main or RQ lag")
        doc = status.collect(catalog, name)
        assert (doc["shard_count"], doc["paused"], len(doc["shards"])) == (3, False, 3)
        assert all(s["queues"]["dlq"]["depth"] == 0 for s in doc["shards"])
        assert all(s["blocked_groups"] == 0 for s in doc["shards"])
        # The counts of the two retired shards go on in the subscription's (carried over).
        assert doc["stats"]["acknowledged"] >= len(wanted)
        assert doc["stats"]["routed"] >= len(produced)

        # after the change: pause and resume still work, and the new shards report paused
        assert varadhi_cli("subscription", "pause", name)[0] == 0
        wait_for(lambda: shard_states(catalog, name) == ["paused"] * 3, 60, "paused again")
        assert varadhi_cli("subscription", "resume", name)[0] == 0
        assert new.stop() == {0: 0, 1: 0, 2: 0}

        done = first_successes(endpoint)
        for group in GROUPS:
            assert done[group] == [m for g, m in produced if g == group], group
        assert sorted(m for ids in done.values() for m in ids) == sorted(wanted)
        for m in FAILING:  # both retries really went through the RQ, across the change
            assert [r.status for r in endpoint.records() if r.message_id == m] == [500, 500, 200]

        info = describe()
        assert info["state"]["shard_count"] == info["spec"]["shards"] == 3
        assert info["state"]["paused"] is False
        code, out, _ = varadhi_cli("subscription", "list")
        assert re.search(rf"^{re.escape(name)}\s+{re.escape(topic)}\s+3\s+yes\s+no\s", out, re.M)
