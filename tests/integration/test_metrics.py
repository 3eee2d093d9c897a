"""The shard's metrics exporter and JSON batch lines against a real run: real Kafka, real Spark,
real Delta and `TestEndpoint`. The endpoint's own count (every request it answered, by status)
is the reference the scraped numbers must match."""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections import Counter, defaultdict

import pytest

from varadhi.core.subscription_spec import parse_spec
from varadhi.core.version import __version__
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark import metrics
from varadhi.spark.shard.job import ShardJob
from varadhi.spark.telemetry import MetricsOptions
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.prometheus import scrape, value

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

GROUPS, PER_GROUP = 20, 10
MAX_ATTEMPTS = 2
# The endpoint's answers to a few messages (every other attempt is answered 200): retried and
# then delivered, dead-lettered after every attempt failed (blocking its group: the rest of it is
# parked), and dead-lettered at once (404 is not retried). All in the first batch (n <= 2: it
# reads 60 records of each partition), so their retries ride with the second: two batches in
# all, each a Delta commit.
SCRIPT = {"g1.2": [500], "g2.1": [503], "g0.0": [503, 500], "g3.2": [404]}
WAIT_S = 600  # generous: the machine may be shared; a test that waits this long has failed


def test_a_scrape_during_a_shard_run_matches_what_the_endpoint_counted(
    settings, catalog, spark, caplog
):
    suffix = uuid.uuid4().hex[:8]
    topic, name = f"met-{suffix}", f"mets-{suffix}"
    TopicService(catalog).create(topic, 2)
    ep = TestEndpoint(script=SCRIPT)
    ep.start()
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": ep.url},
        "retry": {
            "max_attempts": MAX_ATTEMPTS,
            "min_backoff": "100ms",
            "max_backoff": "200ms",
            "jitter": 0,
            "in_place_window": 0,
        },
        # Two batches of the main topic, so a scrape sees its lag before they catch up.
        "consumption": {"trigger_interval": "100ms", "max_messages_per_batch": 120},
        "circuit_breaker": {"enabled": False},
    }
    SubscriptionService(catalog).create(parse_spec(doc))
    total = GROUPS * PER_GROUP
    with Producer(topic, settings) as producer:
        for n in range(PER_GROUP):
            for g in range(GROUPS):
                producer.send(f"body {g}.{n}".encode(), group_id=f"g{g}", message_id=f"g{g}.{n}")
        producer.flush(30)

    job = ShardJob(name, 0, settings, spark=spark)
    options = MetricsOptions(port=0, addr="127.0.0.1", json_logs=True)
    telemetry = metrics.attach(job, options)
    assert telemetry is not None and telemetry.port
    seen: dict[str, object] = {"main_lag": []}

    def operator() -> None:
        """Scrape while the shard runs, until every message is delivered, dead-lettered or
        parked behind a dead letter (nothing more can reach the endpoint) and Spark's progress
        of the last batch is in (it comes after the batch's counts), then stop it. A retry read
        back from the RQ before its due time is parked (`held`) too, in a group without a dead
        letter: every blocked group must be blocked by one (a DLQ head each) to be settled."""
        try:
            deadline = time.monotonic() + WAIT_S
            while True:
                got = scrape(telemetry.port)
                seen["main_lag"].append(value(got, "varadhi_lag_records", queue="main"))
                settled = (
                    value(got, "varadhi_delivered_total")
                    + value(got, "varadhi_pending_messages", where="held")
                    + value(got, "varadhi_pending_messages", where="dlq")
                )
                behind = [value(got, "varadhi_lag_records", queue=q) for q in ("main", "rq")]
                if (
                    settled == total
                    and not value(got, "varadhi_pending_messages", where="rq")
                    and value(got, "varadhi_blocked_groups")
                    == value(got, "varadhi_pending_messages", where="dlq")
                    and behind == [0, 0]
                ):
                    break
                assert time.monotonic() < deadline, f"waited {WAIT_S} s; last scrape {got}"
                time.sleep(0.2)
            seen["final"] = scrape(telemetry.port)
            seen["endpoint"] = ep.stats()
            # Spark's metrics system has the running query's own source (metricsEnabled).
            query = job.query  # the query that runs now
            system = spark._jsc.sc().env().metricsSystem()
            seen["spark_source"] = system.getSourcesByName(f"spark.streaming.{query.name}").size()
            # ... and varadhi's source, whose registry Spark's sinks read.
            ours = system.getSourcesByName(f"varadhi.{name}.0")
            seen["varadhi_source"] = ours.size()
            registry = ours.head().metricRegistry()
            counters, gauges = registry.getCounters(), registry.getGauges()
            seen["spark_counts"] = {n: counters.get(n).getCount() for n in metrics.SPARK_COUNTERS}
            seen["spark_gauges"] = {n: gauges.get(n).getValue() for n in metrics.SPARK_GAUGES}
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            seen["error"] = e
        finally:
            job.request_stop()

    caplog.set_level(logging.INFO, logger="varadhi.spark.metrics")
    helper = threading.Thread(target=operator, daemon=True)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    helper.start()
    try:
        code = job.run()
    finally:
        for s, handler in saved.items():  # ShardJob installs its own handlers
            signal.signal(s, handler)
        helper.join(WAIT_S)
        telemetry.close()
        ep.stop()
    if "error" in seen:
        raise seen["error"]  # type: ignore[misc]
    assert code == 0, f"shard run ended with {code}: {job.stats}"

    # The endpoint's own account: answers by status, and per message its outcomes.
    final, counted = seen["final"], seen["endpoint"]
    assert isinstance(final, dict) and isinstance(counted, dict)
    outcomes: dict[str, list[int]] = defaultdict(list)
    group_of = {}
    for r in ep.records():
        outcomes[r.message_id].append(r.status)
        group_of[r.message_id] = r.group_id
    # Settled, a message the endpoint never accepted was dead-lettered (its retries are over).
    ok = {i for i, s in outcomes.items() if any(200 <= c < 300 for c in s)}
    dead = set(outcomes) - ok
    failed = sum(1 for s in outcomes.values() for c in s if not 200 <= c < 300)
    assert dead == {"g0.0", "g3.2"} and failed == 5  # the script, as the endpoint saw it
    # which job and release the driver runs, as every long-running job says (varadhi_job_info)
    assert value(final, "varadhi_job_info", job="shard", version=__version__) == 1

    responses = {
        dict(k[1])["code"]: int(v)
        for k, v in final.items()
        if k[0] == "varadhi_endpoint_responses_total"
    }
    assert responses == counted["by_status"]
    assert value(final, "varadhi_attempts_total") == counted["requests"]
    assert value(final, "varadhi_delivery_latency_seconds_count") == counted["requests"]
    assert value(final, "varadhi_delivery_latency_seconds_bucket", le="+Inf") == counted["requests"]
    assert value(final, "varadhi_delivery_latency_seconds_sum") > 0
    assert value(final, "varadhi_delivered_total") == len(ok)
    assert value(final, "varadhi_failed_total") == failed
    assert value(final, "varadhi_dead_lettered_total") == len(dead)
    assert value(final, "varadhi_retried_total") == failed - len(dead)
    assert value(final, "varadhi_blocked_groups") == len({group_of[i] for i in dead})
    assert value(final, "varadhi_pending_messages", where="dlq") == len(dead)
    assert value(final, "varadhi_pending_messages", where="held") == total - len(ok) - len(dead)
    assert not any(k[0] == "varadhi_endpoint_errors_total" for k in final)
    batches = value(final, "varadhi_batches_total")
    assert batches >= 2 and value(final, "varadhi_batch_duration_seconds_count") == batches
    # Spark's listener fed the lag: the main topic was behind while the first batches ran (100
    # records each), and nothing readable is left unread now.
    assert max(seen["main_lag"]) > 0  # type: ignore[type-var]
    assert ("varadhi_lag_records", (("queue", "rq"),)) in final
    assert value(final, "varadhi_spark_trigger_seconds") > 0
    assert seen["spark_source"] == 1
    assert seen["varadhi_source"] == 1
    system = spark._jsc.sc().env().metricsSystem()
    assert system.getSourcesByName(f"varadhi.{name}.0").size() == 0  # removed by close()
    in_spark, gauges = seen["spark_counts"], seen["spark_gauges"]
    by_class: Counter[str] = Counter()
    for code, n in counted["by_status"].items():
        by_class[f"endpoint_responses_{code[0]}xx"] += n
    assert {k: v for k, v in in_spark.items() if k.startswith("endpoint_responses_") and v} == (
        dict(by_class)
    )
    assert in_spark["delivered"] == len(ok) and in_spark["failed"] == failed
    assert in_spark["dead_lettered"] == len(dead) and in_spark["attempts"] == counted["requests"]
    assert in_spark["batches"] == batches
    assert gauges["blocked_groups"] == value(final, "varadhi_blocked_groups")
    assert gauges["pending_held"] == value(final, "varadhi_pending_messages", where="held")

    # One JSON batch line per micro-batch, whose counts add up to the same totals.
    lines = [r.fields for r in caplog.records if getattr(r, "fields", None)]
    assert len(lines) == batches
    assert sum(f["delivered"] for f in lines) == len(ok)
    assert sum(f["dead_lettered"] for f in lines) == len(dead)
    codes: Counter[str] = Counter()
    for f in lines:
        codes.update(f["endpoint_responses"])
    assert dict(codes) == counted["by_status"]
    assert {"lag_records", "blocked_groups", "pending_messages", "latency_ms"} <= set(lines[0])
