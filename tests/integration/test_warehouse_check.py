"""A warehouse Spark cannot write is refused at a shard's start with one line, before the shard
takes its lease (which would fence a running instance) or writes anything."""

from __future__ import annotations

import dataclasses

import pytest

from varadhi import layouts, leases
from varadhi.errors import InvalidArgument
from varadhi.shard import ShardJob

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
