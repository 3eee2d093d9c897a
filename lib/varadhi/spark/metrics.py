"""A shard's metrics for operations teams: Prometheus text on a port of the driver, Spark's own
metrics system, and one structured JSON log line per micro-batch.

Two feeds, both on the driver, fill one `ShardMetrics`:

- every completed micro-batch (`ShardJob.batch_hooks`): its counters as the shard summed them
  from its tasks (`last_batch`: delivered, failed, retried, dead-lettered, filtered..., what the
  endpoint answered per status code and the request latency histogram, `batch.http_counts`) and
  the blocked-group summary of its state (`varadhi.spark.shard.stats.summarize`);
- Spark's `StreamingQueryListener` (`ProgressListener`): each query progress of the shard's
  query, for the lag (records readable but not yet read, per queue: main topic and retry queue,
  from the Kafka source's `latestOffset` against the batch's `endOffset`) and Spark's own batch
  duration and rates.

The mapping from those inputs to metric values is pure (`batch_delta`, `lag_of`, `json_fields`,
`spark_values`; `ShardMetrics` only adds up and renders) and tested without services; `attach`
is the thin I/O around it: the HTTP exporter (`varadhi.spark.telemetry.serve`, with the job's
info metric), the listener, the Spark source and the JSON log line. Counters count from the process's start (Prometheus handles restarts of a
counter); `varadhi status` keeps the totals across restarts.

Spark's metrics system: `attach` turns on `spark.sql.streaming.metricsEnabled` for the session
(unless set), so Spark reports the shard query's own gauges (input and processing rate, latency)
to whatever sinks `spark.metrics.conf` configures, and registers a source of its own,
`varadhi.<subscription>.<shard>` (`SparkSource`): Dropwizard counters and gauges in the JVM,
set from Python after each batch and progress (`spark_values`, pure), which the sinks read
without calling back into Python. Histograms are not there (Dropwizard's reservoirs cannot take
bucket counts): the latency's total and the request count are, as counters.

Hazard: the listener matches the shard's query by the name `ShardJob` gives it
(`varadhi-<subscription>-<shard>-g<generation>-L<layout>`); a different name would leave the lag
gauges empty (tests/integration/test_metrics.py scrapes them from a real run).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from varadhi.core.delivery import LATENCY_BOUNDS_MS
from varadhi.spark.telemetry import Exporter, JobInfo, MetricsOptions, serve

log = logging.getLogger("varadhi.spark.metrics")

# last_batch counter -> (metric name without `varadhi_` and `_total`, help)
COUNTERS: dict[str, tuple[str, str]] = {
    "records": ("records", "Kafka records read (main topic and retry queue)"),
    "delivered": ("delivered", "messages the endpoint accepted"),
    "failures": ("failed", "delivery attempts that failed (any non-success answer or error)"),
    "retried": ("retried", "failed messages written to the retry queue"),
    "retried_in_place": ("retried_in_place", "attempts sent again from the task after backoff"),
    "dead_lettered": ("dead_lettered", "messages written to the dead-letter queue"),
    "filtered": ("filtered", "main-topic messages the subscription's filter dropped"),
    "duplicates": ("duplicates", "records dropped as replays or stale retry-queue copies"),
    "deduplicated": ("deduplicated", "messages dropped by the de-duplication window"),
    "attempts": ("attempts", "delivery attempts of messages (batch mode: several a request)"),
}
# Batch duration buckets (seconds): from a trigger's worth of work to a stuck endpoint's timeouts.
BATCH_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LATENCY_BUCKETS_S = tuple(b / 1000 for b in LATENCY_BOUNDS_MS)
_STATUS = re.compile(r"status_(\d{3})")
_ERROR = re.compile(r"error_(\w+)")


@dataclass(frozen=True)
class BatchDelta:
    """What one micro-batch adds to the metrics (see `batch_delta`)."""

    counters: Mapping[str, int]
    statuses: Mapping[str, int]
    errors: Mapping[str, int]
    latency: tuple[int, ...]  # per bucket of LATENCY_BOUNDS_MS, then above every bound
    latency_sum_s: float
    seconds: float


def batch_delta(last_batch: Mapping[str, Any]) -> BatchDelta:
    """The metric increments of one completed micro-batch, from the shard's `last_batch`
    (pure). Missing counters are 0; keys it does not know are ignored."""
    latency = tuple(int(last_batch.get(f"latency_le_{b}", 0)) for b in (*LATENCY_BOUNDS_MS, "inf"))
    statuses, errors = {}, {}
    for k, v in last_batch.items():
        if m := _STATUS.fullmatch(k):
            statuses[m.group(1)] = int(v)
        elif m := _ERROR.fullmatch(k):
            errors[m.group(1)] = int(v)
    return BatchDelta(
        counters={k: int(last_batch.get(k, 0)) for k in COUNTERS},
        statuses=statuses,
        errors=errors,
        latency=latency,
        latency_sum_s=int(last_batch.get("latency_sum_us", 0)) / 1e6,
        seconds=float(last_batch.get("seconds", 0.0)),
    )


def lag_of(progress: Mapping[str, Any], is_rq: Any) -> dict[str, int] | None:
    """Records readable but not yet read after a query progress (pure): per queue, `main` and
    `rq` (`is_rq(topic)` says which), the sum over the Kafka source's partitions of its
    `latestOffset` minus the batch's `endOffset`. None when the progress has no Kafka source
    offsets (a progress of another kind of query, or Spark not reporting `latestOffset`)."""
    sources = progress.get("sources") or []
    if not sources:
        return None
    latest, end = (_offsets(sources[0].get(k)) for k in ("latestOffset", "endOffset"))
    if latest is None or end is None:
        return None
    lag = {"main": 0, "rq": 0}
    for topic, parts in latest.items():
        read = end.get(topic, {})
        for p, offset in parts.items():
            lag["rq" if is_rq(topic) else "main"] += max(int(offset) - int(read.get(p, 0)), 0)
    return lag


def _offsets(value: Any) -> dict[str, dict[str, int]] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


@dataclass(eq=False)  # hashable by identity: a registry keys its collectors
class ShardMetrics:
    """The metrics of one shard, as counted by this process; thread-safe (the batch hook and
    the listener run on different threads from the HTTP exporter). A prometheus_client
    collector: `registry.register(metrics)`."""

    subscription: str
    shard: int
    batches: int = 0
    counters: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))
    latency_sum_s: float = 0.0
    durations: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS_S) + 1))
    durations_sum_s: float = 0.0
    suspended: int = 0  # the subscription is suspended (endpoint health): 1, else 0
    suspensions: int = 0  # times this shard saw it suspended
    summary: dict[str, Any] = field(default_factory=dict)
    lag: dict[str, int] = field(default_factory=dict)
    spark: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_batch(self, delta: BatchDelta, summary: Mapping[str, Any]) -> None:
        with self._lock:
            self.batches += 1
            self.counters.update(delta.counters)
            self.statuses.update(delta.statuses)
            self.errors.update(delta.errors)
            self.latency = [a + b for a, b in zip(self.latency, delta.latency, strict=True)]
            self.latency_sum_s += delta.latency_sum_s
            i = next(
                (i for i, b in enumerate(BATCH_BUCKETS_S) if delta.seconds <= b),
                len(BATCH_BUCKETS_S),
            )
            self.durations[i] += 1
            self.durations_sum_s += delta.seconds
            self.summary = dict(summary)

    def set_suspended(self, suspended: bool) -> None:
        """The shard's hook for endpoint health (`ShardJob.suspension_hooks`)."""
        with self._lock:
            if suspended and not self.suspended:
                self.suspensions += 1
            self.suspended = int(suspended)

    def set_progress(self, lag: Mapping[str, int] | None, spark: Mapping[str, float]) -> None:
        with self._lock:
            if lag is not None:
                self.lag = dict(lag)
            self.spark = dict(spark)

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so registering does not collect (and hold the lock)."""
        return self._families(snapshot=None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            snapshot = replace(
                self,
                counters=Counter(self.counters),
                statuses=Counter(self.statuses),
                errors=Counter(self.errors),
                latency=list(self.latency),
                durations=list(self.durations),
                summary=dict(self.summary),
                lag=dict(self.lag),
                spark=dict(self.spark),
            )
        return self._families(snapshot)

    def _families(self, snapshot: ShardMetrics | None) -> list[Metric]:
        s = snapshot
        base = ["subscription", "shard"]
        ids = [self.subscription, str(self.shard)]
        out: list[Metric] = []

        def counter(name: str, doc: str, value: float | None) -> None:
            c = CounterMetricFamily(f"varadhi_{name}", doc, labels=base)
            if value is not None:
                c.add_metric(ids, value)
            out.append(c)

        def gauge(name: str, doc: str, extra: str | None, values: Mapping[str, float]) -> None:
            g = GaugeMetricFamily(f"varadhi_{name}", doc, labels=base + ([extra] if extra else []))
            for k, v in values.items():
                g.add_metric(ids + ([k] if extra else []), v)
            out.append(g)

        counter("batches", "micro-batches completed", s.batches if s else None)
        counter(
            "suspensions",
            "times the shard saw its subscription suspended (endpoint health)",
            s.suspensions if s else None,
        )
        gauge(
            "suspended",
            "1 while the subscription is suspended: every attempt to its endpoint failed for "
            "circuit_breaker.suspend_after",
            None,
            {"": s.suspended} if s else {},
        )
        for key, (name, doc) in COUNTERS.items():
            counter(name, doc, s.counters[key] if s else None)
        by_status = CounterMetricFamily(
            "varadhi_endpoint_responses",
            "HTTP responses from the endpoint by status code",
            labels=[*base, "code"],
        )
        by_error = CounterMetricFamily(
            "varadhi_endpoint_errors",
            "requests that got no HTTP response, by kind (timeout, connection_error)",
            labels=[*base, "error"],
        )
        if s:
            for code, n in sorted(s.statuses.items()):
                by_status.add_metric([*ids, code], n)
            for kind, n in sorted(s.errors.items()):
                by_error.add_metric([*ids, kind], n)
        out += [by_status, by_error]
        out.append(
            _histogram(
                "varadhi_delivery_latency_seconds",
                "time from sending a request to its answer (or error), per request",
                base,
                ids,
                LATENCY_BUCKETS_S,
                (s.latency, s.latency_sum_s) if s else None,
            )
        )
        out.append(
            _histogram(
                "varadhi_batch_duration_seconds",
                "time the shard's micro-batch took, from its start to its state commit",
                base,
                ids,
                BATCH_BUCKETS_S,
                (s.durations, s.durations_sum_s) if s else None,
            )
        )
        summary = s.summary if s else {}
        gauge(
            "blocked_groups",
            "groups waiting behind a failed message (retry queue, parked here or DLQ)",
            None,
            {"": summary["blocked_groups"]} if "blocked_groups" in summary else {},
        )
        gauge(
            "pending_messages",
            "messages of blocked groups by where they wait: held = parked in the shard's state",
            "where",
            {
                w: summary[k]
                for w, k in (("held", "held"), ("rq", "rq_pending"), ("dlq", "dlq_pending"))
                if k in summary
            },
        )
        gauge(
            "lag_records",
            "records readable but not yet read by the shard's query, per queue (main, rq)",
            "queue",
            s.lag if s else {},
        )
        gauge(
            "spark_trigger_seconds",
            "Spark's duration of the query's last trigger (batch planning, delivery, commit)",
            None,
            {"": s.spark["trigger_s"]} if s and "trigger_s" in s.spark else {},
        )
        gauge(
            "spark_processed_rows_per_second",
            "Spark's processing rate of the query's last trigger",
            None,
            {"": s.spark["processed_per_s"]} if s and "processed_per_s" in s.spark else {},
        )
        return out


def _histogram(
    name: str,
    doc: str,
    labels: list[str],
    ids: list[str],
    bounds: tuple[float, ...],
    counts: tuple[list[int], float] | None,
) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=labels)
    if counts is not None:
        per_bucket, total = counts
        cumulative, running = [], 0
        for b, n in zip((*bounds, float("inf")), per_bucket, strict=True):
            running += n
            cumulative.append((floatToGoString(b), running))
        h.add_metric(ids, cumulative, total)
    return h


# Spark source: counter -> what it adds up per batch; gauges as of the last batch or progress.
SPARK_COUNTERS = (
    "batches",
    *(name for name, _ in COUNTERS.values()),
    *(f"endpoint_responses_{c}xx" for c in range(1, 6)),
    "endpoint_errors",
    "delivery_latency_us",
)
SPARK_GAUGES = (
    "blocked_groups",
    "pending_held",
    "pending_rq",
    "pending_dlq",
    "lag_main",
    "lag_rq",
    "batch_duration_ms",
)


def spark_values(
    delta: BatchDelta | None, summary: Mapping[str, Any], lag: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """What one batch (`delta`, None for a progress alone) adds to the Spark source's counters
    and the values its gauges take (pure). Status codes are counted by class (1xx..5xx): a
    source's metrics are fixed when it is registered."""
    inc: dict[str, int] = {}
    if delta is not None:
        inc["batches"] = 1
        inc.update({name: delta.counters[key] for key, (name, _) in COUNTERS.items()})
        for code, n in delta.statuses.items():
            key = f"endpoint_responses_{code[0]}xx"
            if key in SPARK_COUNTERS:
                inc[key] = inc.get(key, 0) + n
        inc["endpoint_errors"] = sum(delta.errors.values())
        inc["delivery_latency_us"] = round(delta.latency_sum_s * 1e6)
    gauges = {
        name: int(summary[key])
        for name, key in (
            ("blocked_groups", "blocked_groups"),
            ("pending_held", "held"),
            ("pending_rq", "rq_pending"),
            ("pending_dlq", "dlq_pending"),
        )
        if key in summary
    }
    gauges.update({f"lag_{q}": int(n) for q, n in lag.items()})
    if delta is not None:
        gauges["batch_duration_ms"] = round(delta.seconds * 1000)
    return inc, gauges


class SparkSource:
    """varadhi's metrics in Spark's metrics system: a Dropwizard registry in the driver's JVM,
    registered with `SparkEnv`'s `MetricsSystem` as the source `varadhi.<subscription>.<shard>`
    (a Python object implementing Spark's `Source` interface through Py4J, asked for its name
    and registry only when it is registered and removed). `update` sets the JVM counters and
    gauges; Spark's sinks read those directly.

    Hazard: this reaches into Spark's JVM through Py4J (`SparkEnv.metricsSystem`, Spark-internal
    but stable across 3.5-4.1); where that is refused (a cluster mode without Py4J access), the
    shard logs one warning and goes on without it (`ShardTelemetry.start`)."""

    class Java:
        implements = ["org.apache.spark.metrics.source.Source"]

    def __init__(self, spark: Any, subscription: str, shard: int):
        from pyspark.java_gateway import ensure_callback_server_started

        sc = spark.sparkContext
        ensure_callback_server_started(sc._gateway)
        jvm = sc._jvm
        self.name = f"varadhi.{subscription}.{shard}"
        self.registry = jvm.com.codahale.metrics.MetricRegistry()
        self.counters = {n: self.registry.counter(n) for n in SPARK_COUNTERS}
        self.gauges = {}
        for n in SPARK_GAUGES:
            self.gauges[n] = jvm.com.codahale.metrics.DefaultSettableGauge(0)
            self.registry.register(n, self.gauges[n])
        self._system = sc._jsc.sc().env().metricsSystem()
        self._system.registerSource(self)
        # The JVM's proxy of this object as registered: `removeSource` finds a source by
        # reference (or `equals`), and passing `self` again would make a new proxy.
        self._registered = self._system.getSourcesByName(self.name).head()

    def sourceName(self) -> str:  # noqa: N802 - Spark's Source interface
        return self.name

    def metricRegistry(self) -> Any:  # noqa: N802 - Spark's Source interface
        return self.registry

    # java.lang.Object's methods reach the proxy too (a source list's `-=` compares with them).
    def equals(self, other: Any) -> bool:
        return other is self

    def hashCode(self) -> int:  # noqa: N802
        return id(self) & 0x7FFFFFFF

    def toString(self) -> str:  # noqa: N802
        return self.name

    def update(self, inc: Mapping[str, int], gauges: Mapping[str, int]) -> None:
        for name, n in inc.items():
            if n:
                self.counters[name].inc(n)
        for name, v in gauges.items():
            self.gauges[name].setValue(v)

    def close(self) -> None:
        self._system.removeSource(self._registered)


def json_fields(
    subscription: str,
    shard: int,
    last_batch: Mapping[str, Any],
    summary: Mapping[str, Any],
    lag: Mapping[str, int],
) -> dict[str, Any]:
    """The structured log line of one micro-batch (pure): the same figures the exporter
    serves, as this batch's own counts (not running totals)."""
    delta = batch_delta(last_batch)
    requests = sum(delta.latency)
    return {
        "event": "batch",
        "subscription": subscription,
        "shard": shard,
        "batch_id": last_batch.get("batch_id"),
        "seconds": delta.seconds,
        **{name: delta.counters[key] for key, (name, _) in COUNTERS.items()},
        "endpoint_responses": dict(sorted(delta.statuses.items())),
        "endpoint_errors": dict(sorted(delta.errors.items())),
        "latency_ms": {
            str(b): n for b, n in zip((*LATENCY_BOUNDS_MS, "inf"), delta.latency, strict=True)
        },
        "latency_avg_ms": round(delta.latency_sum_s * 1000 / requests, 3) if requests else None,
        "blocked_groups": summary.get("blocked_groups", 0),
        "pending_messages": {
            "held": summary.get("held", 0),
            "rq": summary.get("rq_pending", 0),
            "dlq": summary.get("dlq_pending", 0),
        },
        "lag_records": dict(lag),
    }


# -- configuration and the I/O around it ------------------------------------------------------


class ShardTelemetry:
    """The running exporter, listener and JSON log line of one shard job (`attach`)."""

    def __init__(self, job: Any, options: MetricsOptions):
        self.metrics = ShardMetrics(job.name, job.shard)
        self.options = options
        self.port: int | None = None
        self._job = job
        self._exporter: Exporter | None = None
        self._listener = None
        self._query_name = re.compile(rf"varadhi-{re.escape(job.name)}-{job.shard}-g\d+-L\d+")
        self._rq_prefix: str | None = None
        self.spark_source: SparkSource | None = None

    def on_batch(self, last_batch: Mapping[str, Any], summary: Mapping[str, Any]) -> None:
        """The shard's batch hook: never raises (a metrics failure must not fail a batch)."""
        try:
            delta = batch_delta(last_batch)
            self.metrics.add_batch(delta, summary)
            if self.spark_source is not None:
                self.spark_source.update(*spark_values(delta, summary, self.metrics.lag))
            if self.options.json_logs:
                fields = json_fields(
                    self.metrics.subscription,
                    self.metrics.shard,
                    last_batch,
                    summary,
                    self.metrics.lag,
                )
                log.info("batch %s", last_batch.get("batch_id"), extra={"fields": fields})
        except Exception:  # noqa: BLE001
            log.exception("metrics of a batch not recorded")

    def on_progress(self, progress: Mapping[str, Any]) -> None:
        """A query progress of the session: the shard's updates the lag and Spark's figures."""
        if not self._query_name.fullmatch(str(progress.get("name") or "")):
            return
        duration = (progress.get("durationMs") or {}).get("triggerExecution")
        spark = {"processed_per_s": float(progress.get("processedRowsPerSecond") or 0.0)}
        if duration is not None:
            spark["trigger_s"] = int(duration) / 1000
        lag = lag_of(progress, self._is_rq)
        self.metrics.set_progress(lag, spark)
        if self.spark_source is not None and lag is not None:
            self.spark_source.update(*spark_values(None, {}, lag))

    def _is_rq(self, topic: str) -> bool:
        if self._rq_prefix is None:
            from varadhi.kafka import subscriptions

            sub = subscriptions.from_snapshot(self._job.catalog.snapshot(), self._job.name)
            self._rq_prefix = f"{sub.spec.rq_topic}."
        return topic.startswith(self._rq_prefix)

    def start(self) -> ShardTelemetry:
        self._job.batch_hooks.append(self.on_batch)
        self._job.suspension_hooks.append(self.metrics.set_suspended)
        info = JobInfo("shard", {"subscription": self._job.name, "shard": str(self._job.shard)})
        self._exporter = serve(
            [info, self.metrics], self.options, f"{self._job.name} shard {self._job.shard}"
        )
        self.port = None if self._exporter is None else self._exporter.port
        spark = self._job.spark
        if spark.conf.get("spark.sql.streaming.metricsEnabled", None) is None:
            spark.conf.set("spark.sql.streaming.metricsEnabled", "true")
        self._listener = _listener(self.on_progress)
        spark.streams.addListener(self._listener)
        try:
            self.spark_source = SparkSource(spark, self._job.name, self._job.shard)
        except Exception as e:  # noqa: BLE001 - the exporter and logs go on without it
            log.warning("varadhi's metrics are not in Spark's metrics system: %s", e)
        return self

    def close(self) -> None:
        if self._listener is not None:
            try:
                self._job.spark.streams.removeListener(self._listener)
            except Exception as e:  # noqa: BLE001 - the session may be stopped already
                log.debug("listener not removed: %s", e)
            self._listener = None
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
        if self.on_batch in self._job.batch_hooks:
            self._job.batch_hooks.remove(self.on_batch)
        if self.metrics.set_suspended in self._job.suspension_hooks:
            self._job.suspension_hooks.remove(self.metrics.set_suspended)
        if self.spark_source is not None:
            try:
                self.spark_source.close()
            except Exception as e:  # noqa: BLE001 - the session may be stopped already
                log.debug("Spark source not removed: %s", e)
            self.spark_source = None


def attach(job: Any, options: MetricsOptions) -> ShardTelemetry | None:
    """Start what `options` ask for around `job` (a `ShardJob`, before `run`): None when they
    ask for nothing. Call `close()` on the result once the job returned. It starts the job's
    Spark session (to add the listener before the query starts). The JSON batch line is a log
    record of `varadhi.spark.metrics` with its figures in `fields`; formatting the process's log as
    JSON is `varadhi.spark.telemetry.use_json_logs`."""
    if options.port is None and not options.json_logs:
        return None
    return ShardTelemetry(job, options).start()


def _listener(on_progress: Any) -> Any:
    """A `StreamingQueryListener` handing each progress, as a dict, to `on_progress`."""
    from pyspark.sql.streaming import StreamingQueryListener

    class ProgressListener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            try:
                on_progress(json.loads(event.progress.json))
            except Exception:  # noqa: BLE001 - a listener must not fail Spark's listener bus
                log.exception("query progress not recorded")

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    return ProgressListener()
