"""Offset reset against the real broker, Delta and an HTTP endpoint (in-process shards)."""

from __future__ import annotations

import json

import pytest

from varadhi import dlq, status
from varadhi.cli import main as cli
from varadhi.subscriptions import from_snapshot
from varadhi.testing.harness import delivered, produce, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]


def generation(catalog, name: str) -> int:
    return from_snapshot(catalog.snapshot(), name).generation


def test_rewind_main_redelivers_in_order_and_dry_run_changes_nothing(
    settings, spark, make_subscription, catalog, capsys
):
    from varadhi.testing.endpoint import TestEndpoint

    ids = [f"m{i}" for i in range(10)]
    with TestEndpoint() as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", i) for i in ids])
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ids

        capsys.readouterr()
        reset = ["offsets", "reset", spec.name, "--queue", "main", "--shift-by", "-4"]
        assert cli(reset + ["--dry-run", "--output", "json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["replayed"] == 4 and plan["executed"] is False
        assert generation(catalog, spec.name) == 0

        assert cli(reset + ["--execute"]) == 0
        assert generation(catalog, spec.name) == 1
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ids + ids[6:]


def test_refusals_change_nothing(settings, make_subscription, catalog, capsys):
    spec = make_subscription("http://127.0.0.1:9/")
    capsys.readouterr()
    for args in (
        ["--queue", "rq", "--to-earliest", "--execute"],
        ["--queue", "dlq", "--shift-by", "-3", "--execute"],
        ["--queue", "rq", "--to-storage-topic", "0", "--execute"],
        ["--queue", "main", "--to-storage-topic", "5", "--execute"],
        ["--queue", "main", "--to-datetime", "last tuesday", "--execute"],
    ):
        assert cli(["offsets", "reset", spec.name, *args]) == 2, args
    assert (
        cli(
            [
                "offsets",
                "reset",
                "no-such-subscription",
                "--queue",
                "main",
                "--to-latest",
                "--execute",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "only be fast-forwarded" in err and "does not exist" in err and "not a time" in err
    assert generation(catalog, spec.name) == 0


def test_fast_forward_dlq_unblocks_groups_parked_on_skipped_messages(
    settings, spark, make_subscription, catalog
):
    from varadhi.testing.endpoint import TestEndpoint

    with TestEndpoint(script={"m1": [404]}) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", f"m{i}") for i in range(4)])
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["m0"]
        assert status.collect(catalog, spec.name)["shards"][0]["blocked_groups"] == 1

        assert (
            cli(["offsets", "reset", spec.name, "--queue", "dlq", "--to-latest", "--execute"]) == 0
        )
        assert dlq.list_parked(catalog, spec.name) == []  # the DLQ now starts after m1
        run_until_idle(settings, spark, spec.name)
        assert delivered(endpoint, "g") == ["m0", "m2", "m3"]  # m1 was skipped by the reset
        assert status.collect(catalog, spec.name)["shards"][0]["blocked_groups"] == 0
