"""The pure parts of `varadhi.spark.metrics`: a micro-batch's counters to metric values, the lag from a
query progress, the Prometheus text the exporter serves and the JSON log line.
No service starts here (tests/integration/test_metrics.py scrapes a real shard run)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from varadhi.core.delivery import LATENCY_BOUNDS_MS, DeliveryStats
from varadhi.spark import metrics
from varadhi.spark.batch import http_counts

BUCKETS = len(LATENCY_BOUNDS_MS) + 1


def latency(**at: int) -> tuple[int, ...]:
    """Per-bucket counts: latency(b5=2, inf=1) -> 2 requests within 5 ms, 1 above every bound."""
    keys = [f"b{b}" for b in LATENCY_BOUNDS_MS] + ["inf"]
    return tuple(at.get(k, 0) for k in keys)


def a_batch(batch_id: int, stats: DeliveryStats, seconds: float, **counts: int) -> dict:
    """A `last_batch` as the shard builds it: its counters plus the tasks' `http_counts`."""
    return {"batch_id": batch_id, "seconds": seconds, **counts, **http_counts(stats)}


FIRST = a_batch(
    0,
    DeliveryStats(
        requests=6,
        streams=3,
        by_status={200: 4, 503: 1},
        errors={"timeout": 1},
        latency_ms=latency(b5=3, b10=2, inf=1),
        latency_sum_ms=30_040.5,
    ),
    0.8,
    records=7,
    delivered=4,
    failures=2,
    retried=1,
    dead_lettered=1,
    filtered=1,
    attempts=6,
)
SECOND = a_batch(
    1,
    DeliveryStats(
        requests=2,
        streams=1,
        by_status={200: 1, 500: 1},
        latency_ms=latency(b100=2),
        latency_sum_ms=120.0,
    ),
    3.0,
    records=2,
    delivered=1,
    failures=1,
    retried=1,
    attempts=2,
)
SUMMARY = {"blocked_groups": 2, "held": 3, "rq_pending": 1, "dlq_pending": 0, "blocked": []}


def scrape(m: metrics.ShardMetrics) -> dict[tuple[str, tuple], float]:
    """What a Prometheus server would read: (sample name, sorted labels) -> value."""
    registry = CollectorRegistry()
    registry.register(m)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def ids(**extra: str) -> tuple:
    return tuple(sorted({"subscription": "orders", "shard": "3", **extra}.items()))


def test_http_counts_are_flat_integers_that_the_driver_can_add_up():
    got = http_counts(
        DeliveryStats(4, 2, {200: 3}, {"connection_error": 1}, 0.1, latency(b5=3, inf=1), 1.25)
    )
    assert got == {
        "status_200": 3,
        "error_connection_error": 1,
        "latency_le_5": 3,
        "latency_le_inf": 1,
        "latency_sum_us": 1250,
    }
    assert all(isinstance(v, int) for v in got.values())
    assert http_counts(None) == {}


def test_a_batch_delta_reads_the_counters_statuses_and_latency_of_last_batch():
    d = metrics.batch_delta(FIRST)
    assert d.counters["delivered"] == 4 and d.counters["failures"] == 2
    assert d.counters["duplicates"] == 0  # missing: 0
    assert d.statuses == {"200": 4, "503": 1} and d.errors == {"timeout": 1}
    assert d.latency == latency(b5=3, b10=2, inf=1)
    assert d.latency_sum_s == pytest.approx(30.0405)
    assert d.seconds == 0.8


def test_the_exporter_serves_running_totals_histograms_and_the_last_summary():
    m = metrics.ShardMetrics("orders", 3)
    before = scrape(m)
    assert ("varadhi_delivered_total", ids()) in before  # counters start at 0
    assert not any(name == "varadhi_blocked_groups" for name, _ in before)  # unknown yet

    m.add_batch(metrics.batch_delta(FIRST), SUMMARY)
    m.add_batch(metrics.batch_delta(SECOND), {**SUMMARY, "blocked_groups": 1, "held": 0})
    got = scrape(m)
    assert got[("varadhi_batches_total", ids())] == 2
    assert got[("varadhi_records_total", ids())] == 9
    assert got[("varadhi_delivered_total", ids())] == 5
    assert got[("varadhi_failed_total", ids())] == 3
    assert got[("varadhi_retried_total", ids())] == 2
    assert got[("varadhi_dead_lettered_total", ids())] == 1
    assert got[("varadhi_filtered_total", ids())] == 1
    assert got[("varadhi_attempts_total", ids())] == 8
    responses = {
        dict(k[1])["code"]: v for k, v in got.items() if k[0] == "varadhi_endpoint_responses_total"
    }
    assert responses == {"200": 5, "500": 1, "503": 1}
    assert got[("varadhi_endpoint_errors_total", ids(error="timeout"))] == 1
    # The latency histogram is cumulative per bound, in seconds.
    le = {
        dict(k[1])["le"]: v
        for k, v in got.items()
        if k[0] == "varadhi_delivery_latency_seconds_bucket"
    }
    assert le["0.005"] == 3 and le["0.01"] == 5 and le["0.05"] == 5 and le["0.1"] == 7
    assert le["30.0"] == 7 and le["+Inf"] == 8
    assert got[("varadhi_delivery_latency_seconds_count", ids())] == 8
    assert got[("varadhi_delivery_latency_seconds_sum", ids())] == pytest.approx(30.1605)
    assert got[("varadhi_batch_duration_seconds_bucket", ids(le="1.0"))] == 1
    assert got[("varadhi_batch_duration_seconds_bucket", ids(le="5.0"))] == 2
    assert got[("varadhi_batch_duration_seconds_sum", ids())] == pytest.approx(3.8)
    # Gauges: the state after the last batch.
    assert got[("varadhi_blocked_groups", ids())] == 1
    assert got[("varadhi_pending_messages", ids(where="held"))] == 0
    assert got[("varadhi_pending_messages", ids(where="rq"))] == 1
    assert got[("varadhi_pending_messages", ids(where="dlq"))] == 0


def progress(latest: dict | None, end: dict | None, **extra) -> dict:
    """A query progress as Spark's JSON has it: offsets are JSON text inside the document."""
    source = {"description": "KafkaV2[Assign[...]]"}
    if latest is not None:
        source["latestOffset"] = json.dumps(latest)
    if end is not None:
        source["endOffset"] = json.dumps(end)
    return {"name": "varadhi-orders-3-g0-L0", "sources": [source], **extra}


def test_lag_is_latest_minus_read_per_queue():
    latest = {"orders.1": {"0": 500, "1": 40}, "orders-rq.0": {"2": 9}}
    end = {"orders.1": {"0": 300, "1": 40}, "orders-rq.0": {"2": 4}}

    def is_rq(topic: str) -> bool:
        return topic.startswith("orders-rq.")

    assert metrics.lag_of(progress(latest, end), is_rq) == {"main": 200, "rq": 5}
    # A partition not read yet counts from 0; a partition ahead of latest is never negative.
    assert metrics.lag_of(progress({"orders.1": {"0": 7}}, {}), is_rq) == {"main": 7, "rq": 0}
    assert metrics.lag_of(progress({"orders.1": {"0": 7}}, {"orders.1": {"0": 9}}), is_rq) == {
        "main": 0,
        "rq": 0,
    }
    assert metrics.lag_of(progress(None, end), is_rq) is None
    assert metrics.lag_of({"name": "x", "sources": []}, is_rq) is None


def test_the_json_line_of_a_batch_carries_the_same_figures():
    line = metrics.json_fields("orders", 3, FIRST, SUMMARY, {"main": 10, "rq": 0})
    assert json.loads(json.dumps(line)) == line
    assert line["event"] == "batch" and line["batch_id"] == 0 and line["shard"] == 3
    assert (line["delivered"], line["failed"], line["retried"], line["dead_lettered"]) == (
        4,
        2,
        1,
        1,
    )
    assert line["filtered"] == 1 and line["records"] == 7
    assert line["endpoint_responses"] == {"200": 4, "503": 1}
    assert line["endpoint_errors"] == {"timeout": 1}
    assert line["latency_ms"]["5"] == 3 and line["latency_ms"]["inf"] == 1
    assert line["latency_avg_ms"] == pytest.approx(30040.5 / 6, abs=0.001)
    assert line["blocked_groups"] == 2
    assert line["pending_messages"] == {"held": 3, "rq": 1, "dlq": 0}
    assert line["lag_records"] == {"main": 10, "rq": 0}


def test_the_spark_source_values_of_a_batch_and_of_a_progress():
    inc, gauges = metrics.spark_values(metrics.batch_delta(FIRST), SUMMARY, {"main": 9, "rq": 1})
    assert set(inc) <= set(metrics.SPARK_COUNTERS) and set(gauges) <= set(metrics.SPARK_GAUGES)
    assert inc["batches"] == 1 and inc["delivered"] == 4 and inc["failed"] == 2
    assert inc["endpoint_responses_2xx"] == 4 and inc["endpoint_responses_5xx"] == 1
    assert inc["endpoint_errors"] == 1 and inc["delivery_latency_us"] == 30_040_500
    assert gauges == {
        "blocked_groups": 2,
        "pending_held": 3,
        "pending_rq": 1,
        "pending_dlq": 0,
        "lag_main": 9,
        "lag_rq": 1,
        "batch_duration_ms": 800,
    }
    # A progress alone moves the lag gauges and adds nothing.
    assert metrics.spark_values(None, {}, {"main": 0, "rq": 4}) == (
        {},
        {"lag_main": 0, "lag_rq": 4},
    )


def test_a_suspension_is_a_gauge_while_it_lasts_and_counted_once_each_time():
    m = metrics.ShardMetrics("orders", 3)
    assert scrape(m)[("varadhi_suspended", ids())] == 0
    m.set_suspended(True)
    m.set_suspended(True)  # the control loop reports it at every look
    got = scrape(m)
    assert got[("varadhi_suspended", ids())] == 1
    assert got[("varadhi_suspensions_total", ids())] == 1
    m.set_suspended(False)
    m.set_suspended(True)
    got = scrape(m)
    assert got[("varadhi_suspended", ids())] == 1
    assert got[("varadhi_suspensions_total", ids())] == 2
