"""bench/floors.py's pure helpers (the job's events, the first-batch timeline, latency
percentiles, CPU per message, the verdicts) and bench/floor_job.py's source options, which must
stay those of a shard's query (no service, no Spark session)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from varadhi.kafka import clients as kafka_clients
from varadhi.spark.records import Source

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def floors():
    sys.path.insert(0, str(BENCH))
    try:
        yield _load("floors")
    finally:
        sys.modules.pop("floors_under_test", None)
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def floor_job():
    try:
        yield _load("floor_job")
    finally:
        sys.modules.pop("floor_job_under_test", None)


def test_source_options_are_a_shards(floor_job):
    kafka = kafka_clients.spark_source_options(SimpleNamespace(bootstrap="127.0.0.1:9", kafka=None))
    shard = Source({"t.0": [0, 1, 2]}, {"t.0": {"0": -2, "1": -2, "2": -2}}, 3)
    assert floor_job.source_options("127.0.0.1:9", "t.0", 3, -2, 50_000) == shard.options(
        kafka, 50_000
    )


def test_read_events_leaves_out_a_line_being_written(floors):
    text = json.dumps({"event": "a", "t": 1.0}) + "\n\n" + json.dumps({"event": "b", "t": 2})
    assert floors.read_events(text) == [{"event": "a", "t": 1.0}]
    assert floors.read_events(text + "\n")[-1] == {"event": "b", "t": 2}
    assert floors.read_events("") == []


def test_first_batch_timeline(floors):
    events = [
        {"event": "python_started", "t": 102.0},
        {"event": "session_ready", "t": 105.5},
        {"event": "query_started", "t": 106.0},
        {"event": "batch_started", "t": 107.0, "batch": 0},
        {"event": "batch_done", "t": 110.0, "batch": 0, "first_record_in_python": 109.25},
        {"event": "batch_started", "t": 111.0, "batch": 1},  # a later batch does not count
        {"event": "batch_committed", "t": 110.5, "batch": 0},
    ]
    assert floors.first_batch_timeline(events, 100.0) == {
        "JVM up, Python started": 2.0,
        "Spark session ready": 5.5,
        "query started": 6.0,
        "first batch planned": 7.0,
        "first record in a Python task": 9.25,
        "first batch done": 10.0,
        "first batch committed": 10.5,
    }


def test_first_batch_timeline_without_python_records(floors):
    events = [
        {"event": "python_started", "t": 1.0},
        {"event": "batch_done", "t": 3.0, "first_record_in_python": None},
    ]
    assert floors.first_batch_timeline(events, 0.0) == {
        "JVM up, Python started": 1.0,
        "first batch done": 3.0,
    }


def test_latency_summary_counts_only_what_was_sent_in_the_window(floors):
    pairs = [(1000.0 + i, 1000.0 + i + lat) for i, lat in enumerate(range(1, 101))]
    pairs.append((10.0, 99_999.0))  # sent before the window: left out
    out = floors.latency_summary(pairs, since_ms=1000.0)
    assert out == {"samples": 100, "p50_ms": 50, "p90_ms": 90, "p99_ms": 100, "max_ms": 100}
    assert floors.latency_summary(pairs, since_ms=5000.0) == {}


def test_cpu_passes_pair_starts_with_ends(floors):
    events = [
        {"event": "stage_start", "t": 1.0, "stage": "http", "label": "warmup"},
        {"event": "stage_end", "t": 4.0, "stage": "http", "label": "warmup", "records": 10},
        {"event": "stage_start", "t": 5.0, "stage": "noop", "label": "round 1"},
        {"event": "stage_end", "t": 6.5, "stage": "noop", "label": "round 1", "records": 10},
        {"event": "stage_start", "t": 7.0, "stage": "arrow", "label": "round 1"},  # never ended
    ]
    assert floors.cpu_passes(events) == [
        floors.Pass("http", "warmup", 1.0, 4.0, 10),
        floors.Pass("noop", "round 1", 5.0, 6.5, 10),
    ]


def test_us_per_message_and_medians(floors):
    us = floors.us_per_message({"jvm": 2.0, "python_workers": 1.0, "python": 0.5}, 100_000)
    assert us == {"jvm": 20.0, "python_workers": 10.0, "python": 5.0, "total": 35.0}
    rows = [{"jvm": 20.0, "total": 30.0}, {"jvm": 22.0, "total": 35.0}, {"jvm": 30.0, "total": 31}]
    assert floors.median_by_key(rows) == {"jvm": 22.0, "total": 31.0}
    assert floors.median_by_key([]) == {}
    assert floors.spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert floors.spread([]) == {}


def test_verdict(floors):
    assert floors.verdict(None, 8, "x", 0.1, 2) == "not measured"
    above = floors.verdict(8.0, 8, "14 s", 0.5, 2)
    assert above.startswith("floor 8 >= target 8: cannot be met") and "load" not in above
    below = floors.verdict(40.5, 50, "71 µs", 0.5, 2)
    assert below.startswith("floor 40.5 < target 50: reachable") and "71 µs" in below
    assert "measured at load 3.5 on 2 cores" in floors.verdict(40.5, 50, "71 µs", 3.5, 2)


def test_verdicts_take_each_parts_floor(floors):
    doc = {
        "machine": {"cpus": 2},
        "first": {
            "runs": [{"load_1m_at_start": 0.4}, {"load_1m_at_start": 0.9}],
            "summary_s": {"first record in a Python task": {"min": 6.5, "median": 7, "max": 9}},
        },
        "latency": {
            "variants": {
                "arrow": {"load_1m_at_start": 0.5, "latency": {"p99_ms": 300}},
                "http": {"load_1m_at_start": 3.0, "latency": {"p99_ms": 420}},
            }
        },
        "cpu": {
            "load_1m_at_start": 0.7,
            "cpu_us_per_msg": {"arrow": {"total": 30.0}, "http": {"total": 55.0}},
        },
    }
    out = floors.verdicts(doc)
    assert out["first delivery <= 8 s"].startswith("floor 6.5 < target 8")
    assert out["p99 < 500 ms at 1,000 msg/s"].startswith("floor 300 < target 500")
    assert "load" not in out["p99 < 500 ms at 1,000 msg/s"]
    assert out["<= 50 µs CPU per message"].startswith("floor 55 >= target 50")
    assert floors.verdicts({"machine": {"cpus": 2}})["first delivery <= 8 s"] == "not measured"
