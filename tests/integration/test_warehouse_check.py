"""A warehouse Spark cannot write is refused with one line before any side effect: at a shard's
start, before it takes its lease (which would fence a running instance), and by every operation
that writes the warehouse (an RQ/DLQ offset reset, a shard-count change, a subscription delete)
before it records or deletes anything."""

from __future__ import annotations

import dataclasses

import pytest
from kafka.admin import KafkaAdminClient

from varadhi.core.errors import InvalidArgument
from varadhi.kafka import leases, subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.ops import change_shards, change_shards_plan, lifecycle, offsets
from varadhi.spark import layouts
from varadhi.spark.shard.job import ShardJob

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def test_a_shard_refuses_a_warehouse_it_cannot_write_before_its_lease(
    catalog, settings, spark, make_subscription, tmp_path
):
    spec = make_subscription("http://127.0.0.1:9/never-called")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = dataclasses.replace(settings, warehouse=f"file://{blocker}/warehouse")
    with pytest.raises(InvalidArgument) as refused:
        ShardJob(spec.name, 0, bad, spark=spark).run()
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"warehouse: the warehouse file://{blocker}/warehouse is not writable")
    owner = layouts.owner(spec.name, 1, 0)
    assert catalog.snapshot().get(leases.KIND, owner) is None
    assert blocker.read_text() == "not a folder"


@pytest.fixture
def unwritable(settings, tmp_path):
    """A catalog client whose settings name a warehouse under a regular file: nothing can be
    created there, by root either."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cat = Catalog(dataclasses.replace(settings, warehouse=f"file://{blocker}/warehouse"))
    yield cat
    cat.close()


def refused_line(refused: pytest.ExceptionInfo) -> str:
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("warehouse: the warehouse file://"), line
    assert "is not writable" in line
    return line


def test_an_rq_offset_reset_refuses_an_unwritable_warehouse_before_recording(
    catalog, make_subscription, unwritable, spark
):
    spec = make_subscription("http://127.0.0.1:9/never-called")
    reset = offsets.OffsetReset(unwritable)
    plan, _ = reset.prepare(spec.name, "rq", "to-latest")
    with pytest.raises(InvalidArgument) as refused:
        reset.execute(spec.name, plan, spark)
    refused_line(refused)
    assert catalog.snapshot().get(offsets.OPERATION, f"{spec.name}/offset-reset") is None


def test_a_shard_count_change_refuses_an_unwritable_warehouse_before_its_first_step(
    catalog, make_subscription, unwritable, spark
):
    spec = make_subscription("http://127.0.0.1:9/never-called")
    with pytest.raises(InvalidArgument) as refused:
        change_shards.ChangeShards(unwritable, spark=lambda: spark).execute(spec.name, 2)
    refused_line(refused)
    snap = catalog.snapshot()
    assert snap.get(offsets.OPERATION, change_shards_plan.operation_name(spec.name)) is None
    owner = layouts.owner(spec.name, 1, 0)
    assert snap.get(leases.KIND, owner) is None  # not fenced


def test_a_subscription_delete_refuses_an_unwritable_warehouse_before_deleting_anything(
    catalog, make_subscription, unwritable, spark, bootstrap
):
    spec = make_subscription("http://127.0.0.1:9/never-called")
    sub = subscriptions.from_snapshot(catalog.snapshot(), spec.name)
    rq = topics.from_snapshot(catalog.snapshot(), sub.spec.rq_topic).storage(0).name
    with pytest.raises(InvalidArgument) as refused:
        lifecycle.SubscriptionDeleter(unwritable).execute(spec.name, spark=spark)
    assert "--keep-data" in refused_line(refused)
    assert catalog.snapshot().get(subscriptions.KIND, spec.name) is not None
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        assert rq in admin.list_topics()
    finally:
        admin.close()
