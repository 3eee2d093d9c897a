"""`varadhi subscription delete` and `varadhi topic delete` against the real local broker: the
refusals change nothing, a dry run changes nothing, a delete removes the catalog records, the
Kafka topics and the warehouse folder, a crash part way is finished by running it again, and a
subscription created again with the same name starts fresh."""

from __future__ import annotations

import json
import os
import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from varadhi.core import trace
from varadhi.kafka import progress
from varadhi.kafka import trace as kafka_trace
from varadhi.kafka.clients import topic_configs
from varadhi.ops import lifecycle
from varadhi.ops.lifecycle import SubscriptionDeleter
from varadhi.spark import journal
from varadhi.testing.harness import wait_for

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def admin(bootstrap):
    client = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-lifecycle")
    yield client
    client.close()


@pytest.fixture(scope="module")
def snapshot(catalog, settings):
    """snapshot() -> the catalog once every committed transaction is visible (the CLI commits
    and returns before the commit markers are written)."""
    tp = TopicPartition(settings.catalog_topic, 0)
    raw = KafkaConsumer(bootstrap_servers=settings.bootstrap, isolation_level="read_uncommitted")
    committed = KafkaConsumer(
        bootstrap_servers=settings.bootstrap, isolation_level="read_committed"
    )

    def read():
        deadline = time.monotonic() + 60  # Kafka work on a loaded machine
        while committed.end_offsets([tp])[tp] < raw.end_offsets([tp])[tp]:
            assert time.monotonic() < deadline, "a catalog transaction stayed open"
            time.sleep(0.01)
        return catalog.snapshot()

    yield read
    raw.close()
    committed.close()


@pytest.fixture
def setup(varadhi_cli, unique_name, settings):
    """A topic, a one-shard subscription of it with a GroupState folder, and a stopped shard's
    progress document: (topic, subscription, folder)."""

    def make(shards: int = 1) -> tuple[str, str, str]:
        topic, sub = unique_name("lt"), unique_name("ls")
        assert varadhi_cli("topic", "create", topic, "--partitions", "2")[0] == 0
        code, _, err = varadhi_cli(
            "subscription", "create", sub, "--topic", topic,
            "--endpoint", "http://127.0.0.1:9/hook", "--shards", str(shards),
        )  # fmt: skip
        assert code == 0, err
        folder = os.path.join(settings.warehouse, sub)
        os.makedirs(os.path.join(folder, "state", f"s{shards}", "shard-0"))
        with open(os.path.join(folder, "state", f"s{shards}", "shard-0", "part"), "w") as f:
            f.write("x")
        publish(settings, sub, 0, "stopped")
        return topic, sub, folder

    return make


def publish(settings, sub: str, shard: int, state: str) -> None:
    pub = progress.ProgressPublisher(settings, sub, shard)
    try:
        pub.publish({"state": state, "shard": shard}, force=True, flush=True)
    finally:
        pub.close()


def publish_member(settings, sub: str, member: str, state: str) -> None:
    pub = progress.ProgressPublisher(settings, sub, None, member=member)
    try:
        pub.publish({"state": state, "member": member}, force=True, flush=True)
    finally:
        pub.close()


def kafka_topics(admin, prefix: str) -> list[str]:
    return sorted(t for t in admin.list_topics() if t.startswith(prefix + "."))


def sub_keys(snapshot, name: str) -> list[str]:
    return lifecycle.subscription_keys(snapshot(), name)


def test_delete_refused_then_dry_run_then_delete_then_recreate(
    varadhi_cli, setup, snapshot, admin, settings
):
    topic, sub, folder = setup()
    before = sub_keys(snapshot, sub)
    assert f"subscription/{sub}" in before and f"topic/{sub}.rq" in before
    assert kafka_topics(admin, sub) == [f"{sub}.dlq.0", f"{sub}.rq.0"]

    # the topic is in use: refused, naming the subscription
    code, out, err = varadhi_cli("topic", "delete", topic)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"subscription(s) {sub} use it" in err

    # a shard reports running: refused
    publish(settings, sub, 0, "running")
    code, out, err = varadhi_cli("subscription", "delete", sub)
    assert code == 2 and err.count("\n") == 1 and "may be running: 0 (running)" in err
    assert sub_keys(snapshot, sub) == before and os.path.isdir(folder)
    # paused and reported paused counts as stopped
    assert varadhi_cli("subscription", "pause", sub)[0] == 0
    publish(settings, sub, 0, "paused")
    # a library member reporting running is refused too, named; paused, it counts as stopped
    publish_member(settings, sub, "m1", "running")
    code, out, err = varadhi_cli("subscription", "delete", sub)
    assert code == 2 and "may be running: member m1 (running)" in err
    publish_member(settings, sub, "m1", "paused")

    # dry run: prints the plan, changes nothing
    code, out, err = varadhi_cli("subscription", "delete", sub, "--dry-run", "--output", "json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] is True
    assert plan["kafka_topics"] == [f"{sub}.rq.0", f"{sub}.dlq.0"]
    assert plan["warehouse"] == {"path": folder}
    assert set(plan["catalog_records"]) == set(before)
    assert plan["progress_documents"] == [f"{sub}/0", f"{sub}/member/m1"]
    code, out, _ = varadhi_cli("subscription", "delete", sub, "--dry-run")
    assert code == 0 and out.startswith(f"would delete subscription {sub}:")
    assert sub_keys(snapshot, sub) == before and os.path.isdir(folder)
    assert kafka_topics(admin, sub) == [f"{sub}.dlq.0", f"{sub}.rq.0"]

    # delete
    code, out, err = varadhi_cli("subscription", "delete", sub)
    assert code == 0, err
    assert f"deleted subscription {sub}:" in out
    assert sub_keys(snapshot, sub) == []
    assert kafka_topics(admin, sub) == []
    assert not os.path.exists(folder)
    assert progress.latest_progress(settings, sub) == {}
    assert progress.progress_documents(settings, sub) == {}  # the member's too
    code, _, err = varadhi_cli("subscription", "delete", sub)
    assert code == 2 and "does not exist" in err

    # now the topic goes: dry run first
    code, out, _ = varadhi_cli("topic", "delete", topic, "--dry-run", "--output", "json")
    assert code == 0 and json.loads(out)["kafka_topics"] == [f"{topic}.0"]
    assert snapshot().get("topic", topic) is not None and kafka_topics(admin, topic)
    code, out, err = varadhi_cli("topic", "delete", topic, "--output", "json")
    assert code == 0, err
    assert json.loads(out)["dry_run"] is False
    assert snapshot().get("topic", topic) is None
    assert kafka_topics(admin, topic) == []

    # created again with the same names: fresh, empty queues, no state, no progress
    assert varadhi_cli("topic", "create", topic, "--partitions", "2")[0] == 0
    code, _, err = varadhi_cli(
        "subscription", "create", sub, "--topic", topic, "--endpoint", "http://127.0.0.1:9/x",
        "--shards", "2",
    )  # fmt: skip
    assert code == 0, err
    code, out, _ = varadhi_cli("subscription", "describe", sub, "--output", "json")
    info = json.loads(out)
    assert info["state"]["shard_count"] == 2 and info["state"]["paused"] is False
    assert [st["messages"] for st in info["rq"]["storage_topics"]] == [0]
    assert kafka_topics(admin, sub) == [f"{sub}.dlq.0", f"{sub}.rq.0"]
    assert not os.path.exists(folder)
    code, out, _ = varadhi_cli("status", sub, "--output", "json")
    assert code == 0
    assert all(s["state"] == "never started" for s in json.loads(out)["shards"])


def test_delete_removes_the_delivery_journals_and_traces_topics_too(
    varadhi_cli, setup, admin, settings
):
    """A shard with the journal on (the default) creates `<sub>.journal`, one with a trace
    `<sub>.trace`; `subscription delete` left the journal behind (issue 30): the dry run lists
    both and the delete removes them. The trace topic takes the spec's retention when made, and
    a changed one when made again."""
    _, sub, _ = setup()
    journal.ensure_topic(settings, journal.topic_name(sub), 1)
    traces = trace.topic_name(sub)
    assert kafka_trace.ensure_topic(settings, traces, 3_600_000) == kafka_trace.PARTITIONS
    assert kafka_trace.ensure_topic(settings, traces, 7_200_000) == kafka_trace.PARTITIONS
    wanted = {"retention.ms": "7200000", "message.timestamp.type": "LogAppendTime"}
    # The broker applies a config change after acknowledging it: a describe right after the
    # alter may still answer the old value (it did in a CI run), so wait for the new one.
    wait_for(
        lambda: topic_configs(admin, settings, [traces], list(wanted))[traces] == wanted,
        60,
        "the trace topic's new retention",
    )
    assert kafka_topics(admin, sub) == [
        f"{sub}.dlq.0", f"{sub}.journal", f"{sub}.rq.0", f"{sub}.trace",
    ]  # fmt: skip
    code, out, err = varadhi_cli("subscription", "delete", sub, "--dry-run", "--output", "json")
    assert code == 0, err
    assert json.loads(out)["kafka_topics"] == [
        f"{sub}.rq.0", f"{sub}.dlq.0", f"{sub}.journal", f"{sub}.trace",
    ]  # fmt: skip
    code, _, err = varadhi_cli("subscription", "delete", sub)
    assert code == 0, err
    assert kafka_topics(admin, sub) == []


def test_rerun_after_a_crash_part_way_finishes(varadhi_cli, setup, snapshot, admin, catalog):
    _, sub, folder = setup()
    # crashed after the mark and after deleting the RQ, before the rest
    SubscriptionDeleter(catalog)._mark(sub)
    lifecycle.delete_kafka_topics(catalog.settings, [f"{sub}.rq.0"])
    snap = snapshot()
    assert snap.get("operation", f"{sub}/delete") is not None
    assert snap.get("subscription", sub)["state"]["paused"] is True
    code, out, err = varadhi_cli("subscription", "delete", sub, "--dry-run")
    assert code == 0, err
    assert "(finishing an earlier delete)" in out
    code, out, err = varadhi_cli("subscription", "delete", sub, "--output", "json")
    assert code == 0, err
    assert f"operation/{sub}/delete" in json.loads(out)["catalog_records"]
    assert sub_keys(snapshot, sub) == [] and kafka_topics(admin, sub) == []
    assert not os.path.exists(folder)


def test_keep_data_removes_only_the_records(varadhi_cli, setup, snapshot, admin):
    topic, sub, folder = setup()
    code, out, err = varadhi_cli("subscription", "delete", sub, "--keep-data")
    assert code == 0, err
    assert "kept (--keep-data)" in out
    assert sub_keys(snapshot, sub) == []
    assert kafka_topics(admin, sub) == [f"{sub}.dlq.0", f"{sub}.rq.0"]
    assert os.path.isdir(folder)
    code, _, err = varadhi_cli("topic", "delete", topic, "--keep-data")
    assert code == 0, err
    assert snapshot().get("topic", topic) is None
    assert kafka_topics(admin, topic) == [f"{topic}.0"]
    admin.delete_topics([f"{sub}.dlq.0", f"{sub}.rq.0", f"{topic}.0"])


def test_refused_while_an_operation_is_in_progress(varadhi_cli, setup, snapshot, catalog):
    _, sub, _ = setup()
    key = f"operation/{sub}/offset-reset"
    catalog.mutate(lambda _s: {key: {"kind": "offset-reset", "step": "advancing-state"}})
    before = sub_keys(snapshot, sub)
    code, out, err = varadhi_cli("subscription", "delete", sub)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "operation is in progress" in err and key in err
    assert sub_keys(snapshot, sub) == before
    catalog.mutate(lambda _s: {key: {"kind": "offset-reset", "step": "done"}})
    assert varadhi_cli("subscription", "delete", sub)[0] == 0
    assert sub_keys(snapshot, sub) == []
