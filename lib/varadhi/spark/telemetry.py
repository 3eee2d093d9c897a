"""What every long-running job shares for operations teams: its metrics options, the Prometheus
exporter, an info metric, a collector of plain counters and gauges, and JSON logs, Python's and
the driver JVM's (Spark's own log4j2 lines).

The shard's metrics (`varadhi.spark.metrics`) and those of the feeder, outbox relay and replay
jobs (`varadhi.jobs.*`) are served the same way: `MetricsOptions.from_env` reads the flags and
their environment fallbacks, `serve` starts the exporter on the driver (loopback by default, port
0 picks a free one, logged), and each job registers `job_info` (`varadhi_job_info`,
`varadhi_job_start_time_seconds`) beside its own figures. Jobs whose figures are counters and
gauges (the feeder, relay and replay) declare them as `Spec`s and fill a `JobMetrics`; what a
scrape returns is computed by `families`, pure.

JSON logs: `use_json_logs` formats Python's log records as one JSON object a line
(`JsonFormatter`). The driver JVM's log4j2 lines are JSON too when it is configured with
`LOG4J2_JSON` (a `PatternLayout` whose fields are escaped with `%enc{...}{JSON}`: Spark 3.5 ships
log4j-core without the JSON template layout's jar, so a pattern is what works on every supported
line). `log4j2_json_file` writes it to a file; the JVM reads it from its start where the job
launches it (`./spark-submit.sh`, `get_spark` with `VARADHI_LOG_FORMAT=json`:
`log4j2_java_option`), and `json_spark_logs` reconfigures a JVM that was started before (a
cluster's spark-submit, Databricks), so there only the lines the JVM printed before the job's
Python started are in the cluster's own format.

Hazard: the JVM's JSON lines say `WARN` where Python's say `WARNING` (each keeps its logging
library's level names); both carry `ts`, `level`, `logger` and `message`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from varadhi.core.errors import InvalidArgument
from varadhi.core.version import __version__

if TYPE_CHECKING:
    from prometheus_client.core import Metric

log = logging.getLogger("varadhi.spark.telemetry")

# The exporter binds loopback unless told otherwise: the metrics name subscriptions, groups'
# counts and endpoints' answers, which a driver host's other networks need not see.
DEFAULT_ADDR = "127.0.0.1"
LOG_FORMAT_ENV = "VARADHI_LOG_FORMAT"


@dataclass(frozen=True)
class MetricsOptions:
    """What a job turns on: the exporter (`port`: None off, 0 a free port; `addr` to bind,
    loopback by default) and JSON logs (`json_logs`)."""

    port: int | None = None
    addr: str = DEFAULT_ADDR
    json_logs: bool = False

    @classmethod
    def from_env(
        cls, port: int | None = None, addr: str | None = None, log_format: str | None = None
    ) -> MetricsOptions:
        """Flags win over `VARADHI_METRICS_PORT`, `VARADHI_METRICS_ADDR` and
        `VARADHI_LOG_FORMAT` (`text` or `json`). Raises InvalidArgument for a bad value."""
        raw_port = port if port is not None else os.environ.get("VARADHI_METRICS_PORT") or None
        if raw_port is not None:
            try:
                port = int(raw_port)
            except ValueError:
                raise InvalidArgument(
                    f"metrics port {raw_port!r} is not a number", field="metrics_port"
                ) from None
            if not 0 <= port <= 65535:
                raise InvalidArgument(
                    f"metrics port {port} is outside 0..65535", field="metrics_port"
                )
        fmt = log_format or os.environ.get(LOG_FORMAT_ENV) or "text"
        if fmt not in ("text", "json"):
            raise InvalidArgument(f"log format {fmt!r} is not text or json", field="log_format")
        return cls(
            port=port,
            addr=addr or os.environ.get("VARADHI_METRICS_ADDR") or DEFAULT_ADDR,
            json_logs=fmt == "json",
        )

    def args(self) -> list[str]:
        """These options as a job's flags (pure): what `jobs render` passes to every job."""
        out = [] if self.port is None else ["--metrics-port", str(self.port)]
        if self.port is not None and self.addr != DEFAULT_ADDR:
            out += ["--metrics-addr", self.addr]
        return out + (["--log-format", "json"] if self.json_logs else [])


# -- the exporter and the metrics every job has ------------------------------------------------


class Exporter:
    """A running Prometheus exporter (`serve`): `port` it listens on; `close()` stops it."""

    def __init__(self, server: Any):
        self._server = server
        self.port: int = server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve(collectors: Iterable[Any], options: MetricsOptions, what: str) -> Exporter | None:
    """Serve `collectors` at http://ADDR:PORT/metrics (None when `options.port` is None); logs
    the address as "`what`: metrics at http://...". Raises OSError for a port in use."""
    if options.port is None:
        return None
    # prometheus_client is imported where metrics are made, not at the top: the command line
    # imports this module for `MetricsOptions` and would pay for it at every start
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    server, _ = start_http_server(options.port, addr=options.addr, registry=registry)
    exporter = Exporter(server)
    log.info("%s: metrics at http://%s:%d/metrics", what, options.addr, exporter.port)
    return exporter


@dataclass(eq=False)  # hashable by identity: a registry keys its collectors
class JobInfo:
    """`varadhi_job_info{job, version, <labels>}` 1 and `varadhi_job_start_time_seconds`: which
    job and release a driver runs, since when (a collector)."""

    job: str
    labels: Mapping[str, str]
    started_s: float = field(default_factory=time.time)

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.core import GaugeMetricFamily  # see `serve`

        names = ["job", "version", *self.labels]
        values = [self.job, __version__, *self.labels.values()]
        info = GaugeMetricFamily(
            "varadhi_job_info", "the job this driver runs and its varadhi version", labels=names
        )
        info.add_metric(values, 1)
        start = GaugeMetricFamily(
            "varadhi_job_start_time_seconds",
            "when the job's process started its metrics (Unix time)",
            labels=["job", *self.labels],
        )
        start.add_metric([self.job, *self.labels.values()], self.started_s)
        return [info, start]


@dataclass(frozen=True)
class Spec:
    """One metric of a `JobMetrics`: `varadhi_<name>_total` (a counter) or `varadhi_<name>` (a
    gauge), with the job's labels and its own (`labels`: one value each per sample)."""

    name: str
    kind: Literal["counter", "gauge"]
    doc: str
    labels: tuple[str, ...] = ()


def families(
    specs: Sequence[Spec],
    base: Mapping[str, str],
    values: Mapping[str, Mapping[tuple[str, ...], float]] | None,
) -> list[Metric]:
    """The metric families of `specs` (pure): `values` maps a spec's name to its samples, each
    keyed by the values of the spec's own labels; a spec without samples is an empty family
    (None: every family empty, for `describe`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # see `serve`

    out: list[Metric] = []
    for s in specs:
        kind = CounterMetricFamily if s.kind == "counter" else GaugeMetricFamily
        family = kind(f"varadhi_{s.name}", s.doc, labels=[*base, *s.labels])
        for key, v in sorted(((values or {}).get(s.name) or {}).items()):
            family.add_metric([*base.values(), *key], v)
        out.append(family)
    return out


@dataclass(eq=False)  # hashable by identity: a registry keys its collectors
class JobMetrics:
    """A job's counters and gauges (`specs`), every sample labelled with `labels`;
    thread-safe (the job's thread counts, the exporter's collects). A prometheus_client
    collector."""

    specs: tuple[Spec, ...]
    labels: Mapping[str, str]
    _values: dict[str, dict[tuple[str, ...], float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _check(self, name: str, kind: str, key: tuple[str, ...]) -> None:
        spec = next((s for s in self.specs if s.name == name), None)
        if spec is None or spec.kind != kind or len(spec.labels) != len(key):
            raise KeyError(f"no {kind} {name} with labels {key} in this job's metrics")

    def inc(self, name: str, n: float = 1, *key: str) -> None:
        self._check(name, "counter", key)
        with self._lock:
            samples = self._values.setdefault(name, {})
            samples[key] = samples.get(key, 0) + n

    def set(self, name: str, value: float, *key: str) -> None:
        self._check(name, "gauge", key)
        with self._lock:
            self._values.setdefault(name, {})[key] = value

    def value(self, name: str, *key: str) -> float | None:
        with self._lock:
            return (self._values.get(name) or {}).get(key)

    def describe(self) -> Iterable[Metric]:
        return families(self.specs, self.labels, None)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            values = {k: dict(v) for k, v in self._values.items()}
        return families(self.specs, self.labels, values)


# Spark's progress of a bounded job's actions, read from its status tracker at each scrape.
SPARK_TASKS = Spec(
    "spark_tasks",
    "gauge",
    "tasks of the Spark stages running now, by state (total, active, completed, failed)",
    ("state",),
)


def stage_tasks(stages: Iterable[Any]) -> dict[tuple[str, ...], float]:
    """`SPARK_TASKS`' samples from Spark's `SparkStageInfo`s of the active stages (pure)."""
    totals = dict.fromkeys(("total", "active", "completed", "failed"), 0)
    for s in stages:
        if s is None:  # a stage that ended between the two status calls
            continue
        totals["total"] += s.numTasks
        totals["active"] += s.numActiveTasks
        totals["completed"] += s.numCompletedTasks
        totals["failed"] += s.numFailedTasks
    return {(k,): v for k, v in totals.items()}


@dataclass(eq=False)
class SparkTasks:
    """A collector of `SPARK_TASKS` for a session (`spark`; None until the job starts it)."""

    labels: Mapping[str, str]
    spark: Any = None

    def describe(self) -> Iterable[Metric]:
        return families([SPARK_TASKS], self.labels, None)

    def collect(self) -> Iterable[Metric]:
        samples: dict[tuple[str, ...], float] = {}
        if self.spark is not None:
            try:
                tracker = self.spark.sparkContext.statusTracker()
                stages = [tracker.getStageInfo(i) for i in tracker.getActiveStageIds()]
                samples = stage_tasks(stages)
            except Exception as e:  # noqa: BLE001 - a stopping session: no sample, no failure
                log.debug("Spark's task counts not read: %s", e)
        return families([SPARK_TASKS], self.labels, {SPARK_TASKS.name: samples})


# -- JSON logs -------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per log record: `ts` (ISO 8601, UTC), `level`, `logger`, `message`, and
    the fields a record carries in its `fields` attribute (`log.info(..., extra={"fields":
    {...}})`), such as the micro-batch line's."""

    converter = time.gmtime  # `ts` in UTC

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def use_json_logs() -> None:
    """Format every handler of the root logger as JSON lines (`JsonFormatter`), route Python's
    warnings through logging (pyspark warns with `warnings.warn`), and set
    `VARADHI_LOG_FORMAT=json` in this process's environment, so that a driver JVM it starts
    later (`varadhi.spark.session.get_spark`) logs JSON too."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO)
    for handler in root.handlers:
        handler.setFormatter(JsonFormatter())
    logging.captureWarnings(True)  # a library's warnings too (logger `py.warnings`)
    os.environ[LOG_FORMAT_ENV] = "json"


# The driver JVM's log4j2 configuration for JSON lines on stderr: the fields of `JsonFormatter`.
# `%enc{...}{JSON}` escapes quotes, backslashes and control characters (a stack trace's line
# breaks), so each event is one line; `alwaysWriteExceptions` off, because the pattern writes
# the exception itself, inside the object. Levels as Spark's own default configuration has them.
LOG4J2_JSON = """\
status = warn
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.alwaysWriteExceptions = false
appender.console.layout.pattern = {"ts":"%d{yyyy-MM-dd'T'HH:mm:ss.SSS'Z'}{UTC}",\
"level":"%p","logger":"%enc{%c}{JSON}","message":"%enc{%m}{JSON}"\
%notEmpty{,"exception":"%enc{%throwable}{JSON}"}}%n
rootLogger.level = info
rootLogger.appenderRef.console.ref = console
logger.jetty.name = org.sparkproject.jetty
logger.jetty.level = warn
logger.parquet.name = org.apache.parquet
logger.parquet.level = error
logger.hadoop_native.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop_native.level = error
"""


def log4j2_json_file(folder: str | None = None) -> Path:
    """`LOG4J2_JSON` as a file in `folder` (default: the temporary folder), named by its
    content's hash and this user's id, so that a user's jobs of a release share one and a
    changed one gets a new name. Written atomically (a JVM starting meanwhile never reads half
    of it). Hazard: a shared temporary folder: a file of that name is used only if this user
    owns it and it holds exactly `LOG4J2_JSON` (another user could otherwise choose what the
    JVM's log4j2 does); else the file is written again."""
    digest = hashlib.sha256(LOG4J2_JSON.encode()).hexdigest()[:12]
    name = f"varadhi-log4j2-json-{os.getuid()}-{digest}.properties"
    path = Path(folder or tempfile.gettempdir()) / name
    try:
        if path.stat().st_uid == os.getuid() and path.read_text() == LOG4J2_JSON:
            return path
    except OSError:  # none yet, or unreadable: written below
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".varadhi-log4j2-")
    with os.fdopen(fd, "w") as f:
        f.write(LOG4J2_JSON)
    os.replace(tmp, path)  # another user's file of this name is not replaceable: raises
    return path


def log4j2_java_option(path: Path) -> str:
    """The JVM option that makes log4j2 read `path` at the JVM's start."""
    return f"-Dlog4j2.configurationFile={path.as_uri()}"


def wants_json_logs(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(LOG_FORMAT_ENV) == "json"


def json_spark_logs(spark: Any) -> bool:
    """Reconfigure the running driver JVM's log4j2 with `LOG4J2_JSON` unless it already reads
    it; returns True when it changed it (its levels are then the file's: set Spark's again).
    For a JVM started before the job's Python (a cluster's spark-submit, Databricks): the lines
    it printed before stay as they were."""
    jvm = spark.sparkContext._jvm
    path = log4j2_json_file()
    if jvm.java.lang.System.getProperty("log4j2.configurationFile") == path.as_uri():
        return False
    jvm.org.apache.logging.log4j.core.config.Configurator.reconfigure(
        jvm.java.net.URI(path.as_uri())
    )
    # what the check above reads: the next session of this JVM leaves it as it is
    jvm.java.lang.System.setProperty("log4j2.configurationFile", path.as_uri())
    return True
