"""The three notebooks run end to end against the local stack (see conftest.py): each after a
shard delivered to an endpoint that failed some messages, so the DLQ holds records."""

from __future__ import annotations

import struct
import zlib

import pytest

from varadhi import Client
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, run_until_idle

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

G = [f"g{i}" for i in range(6)]
H = [f"h{i}" for i in range(4)]


def test_dlq_notebook_lists_parked_messages_and_redrives_a_group(
    settings, spark, catalog, failing_subscription, notebook, monkeypatch
):
    from varadhi.kafka import dlq

    with TestEndpoint(script={"g1": [404], "h2": [404]}) as endpoint:
        spec = failing_subscription(endpoint, [("g", i) for i in G] + [("h", i) for i in H])
        assert delivered(endpoint, "g") == ["g0"] and delivered(endpoint, "h") == ["h0", "h1"]

        # Run all without `execute`: the same selection, nothing recorded.
        nb = notebook("dlq_inspection.py", subscription=spec.name, redrive_group_ids="g")
        nb.run()
        assert nb["op_id"] is None and nb["picked"]["msg_id"].tolist() == ["g1"]
        assert dlq.redrives(catalog.snapshot(), spec.name) == {}

        monkeypatch.setenv("VARADHI_NB_EXECUTE", "yes")
        nb = notebook("dlq_inspection.py", wait_seconds="120")
        nb.run(until="## 5. Watch until applied")
        parked = nb["parked"]
        assert sorted(parked["msg_id"]) == ["g1", "h2"]
        assert set(parked["state"]) == {"parked"}
        assert set(parked["status"]) == {404}
        assert nb["by_reason"]["messages"].sum() == 2 and set(nb["by_reason"]["status"]) == {404}
        assert nb["picked"]["msg_id"].tolist() == ["g1"]  # the widget picked group g only
        op_id = nb["op_id"]
        assert list(dlq.redrives(catalog.snapshot(), spec.name)) == [op_id]

        run_until_idle(settings, spark, spec.name)  # the shard applies the re-drive
        nb.run()
        assert nb["progress"].complete and nb["progress"].op_id == op_id
        after = nb["after"]
        assert after[after["msg_id"] == "g1"]["state"].tolist() == ["redriven"]
        # Re-driven in order, the group's waiting messages behind it; h stays blocked on h2.
        assert delivered(endpoint, "g") == G
        assert delivered(endpoint, "h") == ["h0", "h1"]


def test_offset_reset_notebook_dry_run_then_execute_moves_the_offsets(
    settings, spark, failing_subscription, notebook
):
    with TestEndpoint(script={"g1": [404]}) as endpoint:
        # g1 parks (a DLQ record); with `skip` its group moves on, so the rewind re-delivers all
        # it replays. g and h are on different partitions of the topic.
        messages = [("g", "g0"), ("g", "g1")] + [("h", i) for i in H]
        spec = failing_subscription(endpoint, messages, on_dead_letter="skip")
        assert sorted(delivered(endpoint)) == ["g0", *H]
        client = Client(settings)
        generation = client.subscription(spec.name).generation

        nb = notebook(
            "offset_reset.py",
            subscription=spec.name,
            queue="main",
            mode="shift-by",
            shift_by="-2",
            execute="yes",
            wait_seconds="0",
        )
        nb.run(until="## 5. Execute")
        dry = nb["dry_run"]
        assert not dry.executed and dry.outcome == "new"
        assert dry.summary["replayed"] == 4 and dry.summary["skipped"] == 0  # 2 per partition
        assert all(mv.new == mv.current - 2 for mv in dry.plan.moves)
        assert client.subscription(spec.name).generation == generation  # nothing changed
        assert client.subscription(spec.name).paused  # step 3 paused it (execute is `yes`)

        nb.run()
        done = nb["executed"]
        assert done.executed and done.plan.moves == dry.plan.moves
        assert client.subscription(spec.name).generation == generation + 1
        assert not client.subscription(spec.name).paused  # step 6 resumed it
        # The positions recorded are the plan's: the same request again has nothing to do.
        assert client.reset_offsets(spec.name, "main", "shift-by", -2).outcome == "done"
        client.close()

        before = len(delivered(endpoint))
        run_until_idle(settings, spark, spec.name)
        replayed = delivered(endpoint)[before:]
        # The last two messages of each partition again (g1 now accepted), each group in order.
        assert sorted(replayed) == ["g0", "g1", "h2", "h3"]
        assert [m for m in replayed if m[0] == "g"] == ["g0", "g1"]
        assert [m for m in replayed if m[0] == "h"] == ["h2", "h3"]


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG; raises AssertionError unless it is a whole, valid PNG (the
    signature, an IHDR first, every chunk's CRC, an IEND last)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in chunk {kind!r}"
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    first = data[16:24]
    return struct.unpack(">II", first)


def test_status_notebook_writes_its_plots_as_png_files(
    settings, spark, failing_subscription, notebook, tmp_path
):
    with TestEndpoint(script={"g1": [404]}) as endpoint:
        spec = failing_subscription(endpoint, [("g", i) for i in G] + [("h", i) for i in H])
        nb = notebook("status.py", subscription=spec.name, plot_dir=str(tmp_path), hours="1")
        nb.run()

    now = nb["now"]
    assert now["shards"][0]["queues"]["dlq"]["parked"] == 1
    assert now["shards"][0]["blocked_groups"] == 1
    history = nb["history"]
    assert len(history) >= 2 and set(history["shard"]) == {0}
    assert nb["lags"]["main_lag"].iloc[-1] == 0  # the shard read everything before it stopped
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"{spec.name}-{kind}.png" for kind in ("lag", "rates", "waiting")]
    for name in files:
        width, height = png_size((tmp_path / name).read_bytes())
        assert width > 100 and height > 100, name


def test_png_check_rejects_a_damaged_file(tmp_path):
    """The PNG check above can fail: a flipped byte breaks a chunk's CRC, a cut file its end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    fig.savefig(tmp_path / "ok.png")
    plt.close(fig)
    data = (tmp_path / "ok.png").read_bytes()
    assert png_size(data) == (640, 480)
    damaged = bytearray(data)
    damaged[40] ^= 0xFF
    for bad in (bytes(damaged), data[: len(data) // 2], b"GIF89a" + data[6:]):
        with pytest.raises((AssertionError, struct.error)):
            png_size(bad)
