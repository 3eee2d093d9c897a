"""Planning `subscription delete` and `topic delete` (`varadhi.ops.lifecycle`): what is removed, and
when it is refused, from catalog snapshots alone."""

from __future__ import annotations

import json

import pytest

from varadhi.cli import build_parser, version
from varadhi.core.errors import InvalidArgument, NotFound
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.catalog import Snapshot
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import add_storage, new_topic
from varadhi.ops import lifecycle as lc
from varadhi.spark.warehouse_fs import LocalFS

WH = "/wh"


def sub_doc(name: str = "s", topic: str = "orders", shards: int = 2, **state) -> dict:
    spec = parse_spec(
        {"name": name, "topic": topic, "endpoint": {"url": "http://h/x"}, "shards": shards}
    )
    doc = Subscription(spec, shard_count=shards, created_ms=1).to_dict()
    doc["state"].update(state)
    return doc


def catalog(**extra) -> dict:
    """A catalog with topic `orders`, subscription `s` (2 shards, RQ with two storage topics),
    its leases, reader layouts and a finished change-shards, a second subscription `s2` of
    the same topic, and a subscription-like neighbour `s-x` whose keys are not `s`'s."""
    rq, _ = add_storage(new_topic("s.rq", 4, internal=True), 8, allow_uneven=True)
    entries = {
        "topic/orders": new_topic("orders", 4).to_dict(),
        "topic/other": new_topic("other", 2).to_dict(),
        "topic/s": new_topic("s", 2).to_dict(),  # a topic named like the subscription
        "subscription/s": sub_doc(),
        "topic/s.rq": rq.to_dict(),
        "topic/s.dlq": new_topic("s.dlq", 2, internal=True).to_dict(),
        "lease/s/s2/0": {"epoch": 1},
        "lease/s/s2/1": {"epoch": 3},
        "reader/s/s2/0": {"generation": 0, "seq": 0, "mq_index": 0},
        "operation/s/change-shards": {"step": "done", "from": 1, "to": 2},
        "operation/s/replay-1": {"kind": "replay", "step": "failed"},
        "operation/s/redrive-1-abc": {"kind": "unsideline", "done": [0, 1], "selector": {}},
        "subscription/s-x": sub_doc("s-x"),
        "topic/s-x.rq": new_topic("s-x.rq", 4, internal=True).to_dict(),
        "lease/s-x/s2/0": {"epoch": 1},
        "subscription/s2": sub_doc("s2", "other"),
    }
    entries.update(extra)
    return {k: v for k, v in entries.items() if v is not None}


def test_subscription_plan_lists_every_record_topic_and_folder_of_it_only():
    plan = lc.plan_subscription_delete(Snapshot(catalog()), "s", WH, progress_keys=["s/1", "s/0"])
    assert plan.catalog_keys == (
        "lease/s/s2/0",
        "lease/s/s2/1",
        "operation/s/change-shards",
        "operation/s/redrive-1-abc",
        "operation/s/replay-1",
        "reader/s/s2/0",
        "subscription/s",
        "topic/s.dlq",
        "topic/s.rq",
    )
    assert plan.kafka_topics == ("s.rq.0", "s.rq.1", "s.dlq.0")
    assert plan.warehouse == lc.WarehouseFolder("/wh/s")
    assert plan.progress_keys == ("s/0", "s/1")
    assert plan.exists and not plan.resuming and not plan.keep_data
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["kafka_topics"] == ["s.rq.0", "s.rq.1", "s.dlq.0"]
    assert doc["warehouse"] == {"path": "/wh/s"}
    text = "\n".join(lc.text_subscription_plan(plan))
    assert text.startswith("would delete subscription s:")
    assert "s.rq.1" in text and "/wh/s" in text and "topic/orders" not in text


def test_keep_data_keeps_topics_and_folder_but_lists_them():
    plan = lc.plan_subscription_delete(Snapshot(catalog()), "s", WH, keep_data=True)
    assert plan.kafka_topics == () and plan.warehouse is None
    assert "subscription/s" in plan.catalog_keys and "topic/s.rq" in plan.catalog_keys
    assert plan.kept == {
        "kafka_topics": ["s.rq.0", "s.rq.1", "s.dlq.0"],
        "warehouse": {"path": "/wh/s"},
    }
    assert "kept (--keep-data)" in "\n".join(lc.text_subscription_plan(plan))


def test_subscription_named_checkpoints_keeps_the_delta_outbox_folder():
    entries = {
        "subscription/checkpoints": sub_doc("checkpoints"),
        "topic/orders": new_topic("orders", 4).to_dict(),
    }
    plan = lc.plan_subscription_delete(Snapshot(entries), "checkpoints", WH)
    assert plan.warehouse == lc.WarehouseFolder("/wh/checkpoints", ("delta_outbox",))


def test_unknown_subscription_is_not_found_but_leftovers_are_cleaned():
    with pytest.raises(NotFound):
        lc.plan_subscription_delete(Snapshot(catalog()), "nope", WH)
    with pytest.raises(InvalidArgument):
        lc.plan_subscription_delete(Snapshot(catalog()), "bad.name", WH)
    # a create that crashed after making the queues, before recording the subscription
    left = {"topic/z.rq": new_topic("z.rq", 2, internal=True).to_dict()}
    plan = lc.plan_subscription_delete(Snapshot(left), "z", WH)
    assert not plan.exists and plan.catalog_keys == ("topic/z.rq",)
    assert plan.kafka_topics == ("z.rq.0",)


@pytest.mark.parametrize(
    "op_key, doc, what",
    [
        (
            "operation/s/change-shards",
            {"step": "state", "kind": "change-shards"},
            "change-shards at step state",
        ),
        (
            "operation/s/offset-reset",
            {"step": "advancing-state"},
            "offset-reset at step advancing-state",
        ),
        (
            "operation/s/redrive-2-def",
            {"kind": "unsideline", "done": [1]},
            "not yet applied by shards [0]",
        ),
        ("operation/s/replay-2", {"kind": "replay", "step": "running"}, "replay at step running"),
    ],
)
def test_refused_while_an_operation_is_in_progress(op_key, doc, what):
    snap = Snapshot(catalog(**{op_key: doc}))
    assert op_key in lc.operations_in_progress(snap, "s", 2)
    with pytest.raises(InvalidArgument, match="operation is in progress") as e:
        lc.plan_subscription_delete(snap, "s", WH)
    assert what in str(e.value) and "\n" not in str(e.value)


def test_finished_operations_and_the_delete_itself_do_not_hold_it_back():
    snap = Snapshot(catalog(**{"operation/s/delete": {"kind": "delete", "step": "deleting"}}))
    assert lc.operations_in_progress(snap, "s", 2) == {}
    plan = lc.plan_subscription_delete(snap, "s", WH)
    assert plan.resuming and "operation/s/delete" in plan.catalog_keys
    assert "finishing an earlier delete" in lc.text_subscription_plan(plan)[0]


def test_refused_while_shards_or_library_members_may_run():
    from varadhi.kafka.subscriptions import Subscription as S
    from varadhi.ops.status import SILENT_MS

    now = 10_000_000
    fresh = now - 1_000
    sub = S.from_dict(sub_doc())
    lc.check_stopped(sub, {0: {"state": "stopped", "updated_ms": fresh}}, {}, now, {})
    lc.check_stopped(sub, {0: {"state": "running", "updated_ms": now - SILENT_MS}}, {}, now, {})
    with pytest.raises(InvalidArgument, match=r"may be running: 1 \(running\)"):
        lc.check_stopped(sub, {1: {"state": "running", "updated_ms": fresh}}, {}, now, {})
    # paused counts as stopped only while the subscription is paused
    with pytest.raises(InvalidArgument):
        lc.check_stopped(sub, {0: {"state": "paused", "updated_ms": fresh}}, {}, now, {})
    paused = S.from_dict(sub_doc(paused=True))
    lc.check_stopped(paused, {0: {"state": "paused", "updated_ms": fresh}}, {}, now, {})
    # a library member (`status.running_members`) counts as a shard does
    with pytest.raises(InvalidArgument, match=r"may be running: member h-1-a \(running\)"):
        lc.check_stopped(sub, {}, {}, now, {"h-1-a": "running"})


def test_the_library_consumer_group_is_deleted_unless_the_data_is_kept():
    """The group `varadhi-library.<sub>` (the members' commits) goes with the subscription when
    Kafka has it, whatever the runtime is now; `--keep-data` keeps it and says so."""
    plan = lc.plan_subscription_delete(Snapshot(catalog()), "s", WH, group_exists=True)
    assert plan.consumer_group == "varadhi-library.s"
    assert plan.to_dict()["consumer_group"] == "varadhi-library.s"
    assert "consumer group: varadhi-library.s" in "\n".join(lc.text_subscription_plan(plan))
    assert lc.plan_subscription_delete(Snapshot(catalog()), "s", WH).consumer_group is None
    kept = lc.plan_subscription_delete(Snapshot(catalog()), "s", WH, True, group_exists=True)
    assert kept.consumer_group is None and kept.kept["consumer_group"] == "varadhi-library.s"
    assert "consumer group varadhi-library.s" in "\n".join(lc.text_subscription_plan(kept))


def test_refused_while_the_library_consumer_group_has_members():
    """Kafka deletes only an empty group: a member in it (paused ones stay in it) is named, with
    how to stop it, before anything is deleted."""
    lc.check_group_empty("s", None)
    lc.check_group_empty("s", [])
    refused = r"consumer group varadhi-library\.s has members: h-1-a@/10\.0\.0\.1; stop them"
    with pytest.raises(InvalidArgument, match=refused) as e:
        lc.check_group_empty("s", ["h-1-a@/10.0.0.1"])
    assert e.value.exit_code == 2 and "--keep-data" in str(e.value)


def test_topic_delete_refused_while_subscriptions_use_it():
    snap = Snapshot(catalog())
    with pytest.raises(InvalidArgument, match="subscription\\(s\\) s, s-x use it") as e:
        lc.plan_topic_delete(snap, "orders")
    assert "\n" not in str(e.value)
    with pytest.raises(InvalidArgument, match="queue of subscription s"):
        lc.plan_topic_delete(snap, "s.rq")
    with pytest.raises(NotFound):
        lc.plan_topic_delete(snap, "nope")


def test_topic_delete_plan():
    snap = Snapshot(catalog(**{"subscription/s2": None}))
    plan = lc.plan_topic_delete(snap, "other")
    assert plan.catalog_keys == ("topic/other",) and plan.kafka_topics == ("other.0",)
    kept = lc.plan_topic_delete(snap, "other", keep_data=True)
    assert kept.kafka_topics == () and kept.kept == {"kafka_topics": ["other.0"]}
    assert lc.text_topic_plan(plan)[0] == "would delete topic other:"
    # the topic named like subscription `s` is not the subscription's
    assert lc.plan_topic_delete(snap, "s").kafka_topics == ("s.0",)


def test_local_files_delete_a_folder_but_keep_foreign_children(tmp_path, monkeypatch):
    from pyspark.sql import SparkSession

    # No Spark session in this process (earlier tiers of a full run leave one active).
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    folder = tmp_path / "checkpoints"
    for child in ("state/s2/shard-0", "checkpoints/g0", "delta_outbox/x"):
        (folder / child).mkdir(parents=True)
        (folder / child / "f").write_text("x")
    files = lc.files_for(str(tmp_path))
    assert isinstance(files, LocalFS)
    lc.delete_folder(files, lc.WarehouseFolder(str(folder), ("delta_outbox",)))
    assert sorted(p.name for p in folder.iterdir()) == ["delta_outbox"]
    lc.delete_folder(files, lc.WarehouseFolder(f"file://{folder}"))
    assert not folder.exists()
    lc.delete_folder(files, lc.WarehouseFolder(str(folder)))  # gone already: nothing to do


def test_version(capsys, monkeypatch):
    import importlib.metadata

    import varadhi

    assert version() == importlib.metadata.version("varadhi-spark")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"varadhi-spark {version()}"

    def missing(_name):
        raise importlib.metadata.PackageNotFoundError(_name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version() == varadhi.__version__
