"""Offset reset against the real broker, Delta and an HTTP endpoint (in-process shards)."""

from __future__ import annotations

import json

import pytest

from varadhi.cli import main as cli
from varadhi.kafka import dlq
from varadhi.kafka.subscriptions import from_snapshot
from varadhi.ops import status
from varadhi.testing.harness import delivered, produce, run_until, run_until_idle

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


@pytest.mark.compat  # also run on the older Spark lines (scripts/test --spark-line)
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


def test_fast_forward_rq_skips_a_pending_retry_and_releases_its_group(
    settings, spark, make_subscription, catalog
):
    """m1 fails with 503 and a Retry-After of an hour: its retry goes to the RQ, is read back
    before it is due and held in the shard's state, and g's later messages wait behind it. A
    fast-forward of the RQ skips that retry, which is never delivered, and releases the group."""
    from varadhi.spark import layouts
    from varadhi.spark.state_store import StateStore
    from varadhi.testing.endpoint import TestEndpoint

    def located(msg_id: str) -> set[str]:
        path = layouts.state_path(settings.warehouse, spec.name, 1, 0)
        f = StateStore(spark, path, "-").frame
        return set(f[f["msg_id"] == msg_id]["location"])

    with TestEndpoint(script={"m1": [503]}, retry_after_s=3600) as endpoint:
        spec = make_subscription(endpoint.url)
        produce(settings, spec.topic, [("g", f"m{i}") for i in range(4)] + [("h", "h0")])
        run_until(
            settings,
            spark,
            spec.name,
            lambda: located("m1") == {"held"} and located("m3") == {"held"},
            "m1's retry read back from the RQ and held, m3 behind it",
        )
        assert delivered(endpoint, "g") == ["m0"] and delivered(endpoint, "h") == ["h0"]

        reset = ["offsets", "reset", spec.name, "--queue", "rq", "--to-latest", "--execute"]
        assert cli(reset) == 0
        produce(settings, spec.topic, [("g", "m4")])
        run_until(
            settings,
            spark,
            spec.name,
            lambda: len(delivered(endpoint, "g")) >= 4,
            "g's later messages delivered",
        )
        assert delivered(endpoint, "g") == ["m0", "m2", "m3", "m4"]  # m1's retry was skipped
        assert [r.status for r in endpoint.records() if r.message_id == "m1"] == [503]
        assert located("m1") == set()


# The step boundaries of `OffsetReset.execute` (crash points, `varadhi.core.faults`): the plan
# recorded (catalog write 1), GroupState advanced, the positions written and the reset marked
# done (catalog write 2). A `varadhi offsets reset` process is ended at each.
CRASH_POINTS = {
    "recorded": "offset_reset_recorded",
    "state-advanced": "offset_reset_state_advanced",
    "done": "offset_reset_done",
}


@pytest.mark.parametrize("crash", [None, *CRASH_POINTS])
@pytest.mark.parametrize(
    "queue,target",
    [("main", ["--shift-by", "-3"]), ("main", ["--to-latest"]), ("dlq", ["--shift-by", "1"])],
)
def test_a_crash_at_any_step_then_a_rerun_ends_where_one_clean_run_does(
    settings, spark, make_subscription, catalog, varadhi_killed_at, capsys, queue, target, crash
):
    from kafka import KafkaProducer

    from varadhi.core import messages as m
    from varadhi.kafka.catalog import key
    from varadhi.kafka.topics import from_snapshot as topic_of
    from varadhi.ops import offsets
    from varadhi.spark import layouts
    from varadhi.spark.checkpoints import shard_position
    from varadhi.spark.layouts import READER_KIND, Layout

    spec = make_subscription("http://127.0.0.1:9/")
    mq = topic_of(catalog.snapshot(), spec.topic).storage_topics[0].name
    dlq_topic = topic_of(catalog.snapshot(), spec.dlq_topic).storage_topics[0].name
    produce(settings, spec.topic, [(f"g{i}", f"m{i}") for i in range(12)])
    with KafkaProducer(bootstrap_servers=settings.bootstrap) as producer:
        for i in range(3):  # dead letters of shard 0
            headers = [(m.H_ORIGIN, f"0:0:{i}".encode()), (m.H_ATTEMPTS, b"1")]
            producer.send(dlq_topic, b"x", partition=0, headers=headers)
        producer.flush()
    # The shard consumed up to 2 before each partition's end (as if it had run).
    ends = offsets.kafka_offsets(
        catalog, list(topic_of(catalog.snapshot(), spec.topic).storage_topics), None
    ).end[mq]
    assert min(ends) >= 3
    consumed = {mq: {str(p): end - 2 for p, end in enumerate(ends)}}
    catalog.mutate(
        lambda _s: {
            key(READER_KIND, layouts.owner(spec.name, 1, 0)): Layout(0, 0, 0, consumed).to_dict()
        }
    )

    reset = offsets.OffsetReset(catalog)
    mode = target[0][2:]
    value = int(target[1]) if len(target) > 1 else None
    clean = reset.plan(spec.name, queue, mode, value)  # what one clean run does
    command = ["offsets", "reset", spec.name, "--queue", queue, *target, "--execute"]
    if crash is not None:
        varadhi_killed_at(CRASH_POINTS[crash], *command)
        produce(settings, spec.topic, [("late", "late1")])  # --to-latest must not see it
    assert cli(command + ["--output", "json"]) == 0
    outcome = json.loads(capsys.readouterr().out).get("outcome")

    sub = from_snapshot(catalog.snapshot(), spec.name)
    doc = catalog.snapshot().get("operation", f"{spec.name}/offset-reset")
    assert doc["step"] == "done"
    if queue == "main":
        assert sub.generation == 1
        layout, position = shard_position(catalog, sub, 0)
        assert layout == clean.layouts[0]
        assert position == clean.layouts[0].starting_offsets
        if mode == "shift-by":
            assert position[mq] == {str(p): end - 5 for p, end in enumerate(ends)}
    else:
        assert sub.generation == 0
        assert (
            dlq.dlq_start(catalog.snapshot(), spec.name) == clean.dlq_start == {dlq_topic: {"0": 1}}
        )
        assert shard_position(catalog, sub, 0)[1] == consumed
    assert outcome == {None: "new", "done": "done"}.get(crash, "resume")
    # Run again once more: still nothing changes.
    assert cli(command) == 0
    assert "nothing changed" in capsys.readouterr().out
    assert generation(catalog, spec.name) == sub.generation
