"""`varadhi.Client` without a broker: the public exports, the typed results, and that bad
requests are refused before the client touches the catalog (it points at a closed port here, so
any Kafka access would fail differently, and slowly)."""

from __future__ import annotations

import pytest

import varadhi
from varadhi import Client, OffsetResetResult, RedriveProgress, Settings, VaradhiError
from varadhi.core.errors import InvalidArgument
from varadhi.ops.offsets import Move, Plan

NOWHERE = Settings(bootstrap="127.0.0.1:9", catalog_topic="__varadhi_catalog_unit")


def test_the_package_exports_the_api():
    assert set(varadhi.__all__) >= {"Client", "Settings", "VaradhiError"}
    assert all(hasattr(varadhi, name) for name in varadhi.__all__)


def test_a_client_connects_to_nothing_until_used():
    client = Client(NOWHERE)
    assert client._catalog is None and client.settings is NOWHERE
    client.close()  # nothing to close: no error
    with Client(NOWHERE) as c:
        assert c.spark is None


@pytest.mark.parametrize(
    "queue,mode,value,field",
    [
        ("rq", "to-storage-topic", 0, "queue"),
        ("main", "to-datetime", "last tuesday", "to_datetime"),
        ("main", "shift-by", "two", "shift_by"),
        ("main", "to-storage-topic", "x", "to_storage_topic"),
    ],
)
def test_bad_offset_resets_are_refused_before_any_io(queue, mode, value, field):
    client = Client(NOWHERE)
    with pytest.raises(InvalidArgument) as refused:
        client.reset_offsets("orders", queue, mode, value, execute=True)
    assert refused.value.field == field and refused.value.exit_code == 2
    assert client._catalog is None


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({}, "say which messages to re-drive"),
        ({"failed_until": "2026-11-25T10:00:00Z"}, "--failed-until needs --failed-since"),
        ({"failed_since": "yesterday"}, "is not a time"),
        (
            {"failed_since": "2026-11-25T10:00:00Z", "failed_until": "2026-11-24T10:00:00Z"},
            "before --failed-since",
        ),
        ({"group_ids": ["g"], "rate": 0}, "--rate must be a positive number"),
        ({"group_ids": ["g"], "rate": "fast"}, "--rate must be a positive number"),
    ],
)
def test_bad_redrives_are_refused_before_any_io(kwargs, needle):
    client = Client(NOWHERE)
    with pytest.raises(InvalidArgument, match=needle):
        client.redrive("orders", **kwargs)
    assert client._catalog is None


def test_offset_reset_result_is_what_the_cli_prints_as_json():
    moves = (Move(0, "orders.0", 0, 10, 7), Move(0, "orders.0", 1, None, 2))
    plan = Plan("main", "shift-by", -3, moves, {}, {})
    result = OffsetResetResult(plan, "new", False)
    assert result.summary["replayed"] == 3 and result.summary["skipped"] == 2
    assert result.to_dict() == plan.summary() | {"executed": False, "outcome": "new"}


def test_redrive_progress_is_complete_once_every_shard_applied_it():
    assert not RedriveProgress("r1", (0,), 2).complete
    assert RedriveProgress("r1", (1, 0), 2).complete


def test_a_redrive_not_applied_in_time_is_a_failure_not_a_refusal():
    from varadhi.kafka.dlq import RedriveNotApplied

    error = RedriveNotApplied("r1", 2.5)
    assert isinstance(error, VaradhiError) and error.exit_code == 1
    assert str(error) == (
        "re-drive r1 not applied by every shard within 2.5 s (are the shards running?)"
    )
