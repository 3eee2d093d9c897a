"""bench/common.py's and bench/harness.py's pure parts: the options the shard benches share, a
results file's head and the tables they print (no service)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """bench/common.py, bench/harness.py and the benches that use them (imported as the scripts
    import them: bench/ on the path)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {
            n: load(n) for n in ("common", "harness", "filter", "batch_delivery", "blocked_group")
        }
    finally:
        sys.path.remove(str(BENCH))


def test_a_backlog_bench_has_the_shared_options_and_its_own(bench):
    p = bench["harness"].parser("What it measures.\n\nMore.", Path("/r.json"), backlog=20_000)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(["--groups", "60", "--keep"])
    assert vars(args) == {
        "messages": 20_000,
        "groups": 60,
        "partitions": 4,
        "batch": 100_000,
        "keep": True,
        "out": Path("/r.json"),
        "repeat": 2,
    }
    assert p.description == "What it measures."


def test_a_bench_without_a_backlog_has_no_message_count(bench):
    args = bench["harness"].parser("Doc.", Path("/r.json")).parse_args([])
    assert vars(args) == {"groups": 1_000, "partitions": 4, "keep": False, "out": Path("/r.json")}


def test_the_results_head_names_the_bench_its_command_and_machine(bench, monkeypatch):
    common = bench["common"]
    head = common.results_head("filter", ["--messages", "2000"], {"cpus": 2})
    assert list(head) == ["benchmark", "command", "date", "machine"]
    assert head["command"] == "python bench/filter.py --messages 2000"
    assert head["machine"] == {"cpus": 2}
    monkeypatch.setattr(sys, "argv", ["filter.py", "--repeat", "3"])
    assert common.results_head("filter", None, {})["command"] == "python bench/filter.py --repeat 3"


def test_the_tables_print_as_the_benches_printed_them(bench, capsys):
    """Each bench's columns give the lines its own f-strings printed before they were shared."""
    common = bench["common"]
    filter_row = {
        "run": "drop90",
        "batches": 3,
        "drain_s": 12.5,
        "read_per_s": 4_000,
        "delivered": 5_000,
        "filtered": 45_000,
        "delivered_per_s": 400,
    }
    common.print_table([filter_row], bench["filter"].COLUMNS)
    r = filter_row
    assert capsys.readouterr().out.splitlines() == [
        f"{'run':>7} {'batches':>8} {'drain s':>8} {'read/s':>8} {'delivered':>10} "
        f"{'filtered':>9} {'deliv/s':>8}",
        f"{r['run']:>7} {r['batches']:>8} {r['drain_s']:>8} {r['read_per_s']:>8,} "
        f"{r['delivered']:>10,} {r['filtered']:>9,} {r['delivered_per_s']:>8,}",
    ]
    batch_row = {
        "run": "batch100",
        "batches": 1,
        "drain_s": 3.25,
        "delivered": 20_000,
        "delivered_per_s": 6_154,
        "requests": 1_210,
        "messages_per_request": 16.5,
    }
    common.print_table([batch_row], bench["batch_delivery"].COLUMNS)
    r = batch_row
    assert capsys.readouterr().out.splitlines() == [
        f"{'run':>9} {'batches':>8} {'drain s':>8} {'delivered':>10} {'deliv/s':>8} "
        f"{'requests':>9} {'msg/req':>8}",
        f"{r['run']:>9} {r['batches']:>8} {r['drain_s']:>8} {r['delivered']:>10,} "
        f"{r['delivered_per_s']:>8,} {r['requests']:>9,} {r['messages_per_request']:>8}",
    ]
    bucket = {
        "from_s": 60,
        "batches": 40,
        "records": 61_200,
        "batch_s_median": 1.2,
        "batch_s_max": 3.4,
        "state_rows": 1_002,
        "blocked_rows": 1_001,
        "state_mib": 1.25,
        "driver_rss_mib": 171.5,
        "jvm_heap_mib": 312.0,
    }
    common.print_table([bucket], bench["blocked_group"].COLUMNS)
    r = bucket
    assert capsys.readouterr().out.splitlines() == [
        f"{'from s':>6} {'batches':>7} {'records':>8} {'batch s':>7} {'max s':>6} "
        f"{'state rows':>10} {'blocked':>7} {'state MiB':>9} {'RSS MiB':>8} {'JVM MiB':>8}",
        f"{r['from_s']:>6.0f} {r['batches']:>7} {r['records']:>8,} {r['batch_s_median']:>7} "
        f"{r['batch_s_max']:>6} {r['state_rows']:>10,} {r['blocked_rows']:>7,} "
        f"{r['state_mib']:>9} {r['driver_rss_mib']:>8} {r['jvm_heap_mib']:>8}",
    ]
