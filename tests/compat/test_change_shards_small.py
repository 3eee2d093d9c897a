"""A small shard-count change for the compatibility tier: 1 -> 2 shards with a retry waiting in
the RQ and a dead letter blocking its group, so both feeders carry a record; then the two new
shards deliver everything in group order and a re-drive of the dead letter unblocks its group.

tests/integration/test_change_shards.py is the full scenario (2 -> 4 -> 3, a producer between
the steps, a refusal while shards run); this one exercises the same code paths with a third of
the shard runs, so the tier stays within its time on every older Spark line.
"""

from __future__ import annotations

import json
import threading

import pytest

from varadhi.cli import main as cli
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, produce, wait_for

pytestmark = [pytest.mark.compat, pytest.mark.kafka, pytest.mark.spark]

GROUPS = ["g0", "g1", "g2", "g3"]
RETRIED, DEAD = "g1-0", "g2-0"


def run_shards(settings, spark, name: str, count: int, idle_s: float | None = 3.0, until=None):
    """Run every shard in a thread of this process: until idle, or (idle_s=None) until `until()`
    holds, then stop them. Each must end with code 0."""
    jobs = [ShardJob(name, i, settings, spark=spark, stop_when_idle_s=idle_s) for i in range(count)]
    codes: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda i=i, j=j: codes.__setitem__(i, j.run()), daemon=True)
        for i, j in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    if until is not None:
        wait_for(until, 240, "the shards' first attempts")
        for job in jobs:
            job.request_stop()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a shard did not stop"
    assert codes == dict.fromkeys(range(count), 0)


def test_one_to_two_shards_moves_a_pending_retry_and_a_dead_letter(
    settings, spark, catalog, unique_name, capsys
):
    # RETRIED fails three times, 1 s apart: it waits in the RQ when the first shard stops.
    script = {RETRIED: [500, 500, 500], DEAD: [404]}
    with TestEndpoint(script=script) as endpoint:
        topic = unique_name("compat-reshard")
        TopicService(catalog).create(topic, 4)
        spec = parse_spec(
            {
                "name": unique_name("compat-reshard-sub"),
                "topic": topic,
                "endpoint": {"url": endpoint.url},
                "shards": 1,
                "retry": {
                    "max_attempts": 10,
                    "backoff": "fixed",
                    "min_backoff": "1s",
                    "max_backoff": "1s",
                    "jitter": 0,
                    "in_place_window": 0,  # retries wait in the RQ, which is resharded
                },
                "consumption": {"trigger_interval": "100ms"},
            }
        )
        SubscriptionService(catalog).create(spec)
        name = spec.name
        sent = [(g, f"{g}-{n}") for n in range(2) for g in GROUPS]
        produce(settings, topic, sent)

        first = {RETRIED, DEAD, "g0-1", "g3-1"}
        attempted = lambda: first <= {r.message_id for r in endpoint.records()}  # noqa: E731
        run_shards(settings, spark, name, 1, idle_s=None, until=attempted)
        assert {p["msg_id"] for p in dlq.list_parked(catalog, name)} == {DEAD}

        capsys.readouterr()
        assert cli(["subscription", "change-shards", name, "--to", "2", "--output", "json"]) == 0
        op = json.loads(capsys.readouterr().out)
        assert op["step"] == "done" and all(f["done"] for f in op["feeders"])
        assert [f["source"] for f in op["feeders"]] == [f"{name}.rq.0", f"{name}.dlq.0"]
        assert op["feeders"][1]["records"] == 1  # the dead letter
        assert op["state"]["pending"] >= 1 and op["state"]["groups"] >= 1  # g2-1 behind it

        run_shards(settings, spark, name, 2)
        for group in ("g0", "g1", "g3"):
            assert delivered(endpoint, group) == [f"{group}-0", f"{group}-1"], group
        assert delivered(endpoint, "g2") == []  # still blocked behind its dead letter
        statuses = [r.status for r in endpoint.records() if r.message_id == RETRIED]
        assert statuses[:4] == [500, 500, 500, 200]

        dlq.request_unsideline(catalog, name, dlq.Selector(group_ids=("g2",)))
        run_shards(settings, spark, name, 2)
        assert delivered(endpoint, "g2") == ["g2-0", "g2-1"]
