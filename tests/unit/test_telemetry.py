"""Metrics and JSON logs of every long-running job (`varadhi.spark.telemetry`): the options and
their flags on each job, the collectors' Prometheus text, the relay's, feeder's and replay's
metric values and the driver JVM's log4j2 configuration (`jobs render` passing the options to
every job: tests/unit/test_jobdefs.py). No service starts here: tests/integration/test_outbox_relay.py scrapes a running relay,
tests/integration/test_replay.py a replay run with JSON logs, and test_metrics.py a shard."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from varadhi.cli import main as cli_main
from varadhi.core.errors import InvalidArgument, VaradhiError
from varadhi.jobs import runner
from varadhi.jobs.outbox_relay import RELAY_METRICS, relay_values
from varadhi.outbox.relay import RelayStats
from varadhi.spark import telemetry
from varadhi.spark.telemetry import MetricsOptions

ROOT = Path(__file__).resolve().parents[2]


def samples(*collectors) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


# -- options and logs ------------------------------------------------------------------------


def test_the_json_formatter_writes_one_object_with_the_fields():
    record = logging.LogRecord(
        "varadhi.spark.metrics", logging.INFO, __file__, 1, "batch %s", (7,), None
    )
    record.fields = {"event": "batch", "delivered": 3}
    doc = json.loads(telemetry.JsonFormatter().format(record))
    assert doc["message"] == "batch 7" and doc["level"] == "INFO"
    assert doc["logger"] == "varadhi.spark.metrics" and doc["delivered"] == 3
    assert doc["ts"].endswith("Z") and "\n" not in telemetry.JsonFormatter().format(record)


def test_options_flags_win_over_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("VARADHI_METRICS_PORT", raising=False)
    monkeypatch.delenv("VARADHI_LOG_FORMAT", raising=False)
    assert MetricsOptions.from_env() == MetricsOptions()  # off by default
    monkeypatch.setenv("VARADHI_METRICS_PORT", "9109")
    monkeypatch.setenv("VARADHI_LOG_FORMAT", "json")
    got = MetricsOptions.from_env()
    # loopback unless asked (issue 30: it bound every interface)
    assert (got.port, got.json_logs, got.addr) == (9109, True, "127.0.0.1")
    got = MetricsOptions.from_env(port=0, addr="0.0.0.0", log_format="text")
    assert (got.port, got.json_logs, got.addr) == (0, False, "0.0.0.0")
    monkeypatch.setenv("VARADHI_METRICS_PORT", "nine")
    with pytest.raises(InvalidArgument) as e:
        MetricsOptions.from_env()
    assert e.value.field == "metrics_port"
    with pytest.raises(InvalidArgument):
        MetricsOptions.from_env(port=70000)
    with pytest.raises(InvalidArgument) as e:
        MetricsOptions.from_env(port=1, log_format="xml")
    assert e.value.field == "log_format"


def test_options_as_flags_name_only_what_differs_from_the_defaults():
    assert MetricsOptions().args() == []
    assert MetricsOptions(port=0).args() == ["--metrics-port", "0"]
    assert MetricsOptions(port=9109, addr="0.0.0.0", json_logs=True).args() == [
        "--metrics-port", "9109", "--metrics-addr", "0.0.0.0", "--log-format", "json",
    ]  # fmt: skip
    assert MetricsOptions(addr="0.0.0.0", json_logs=True).args() == ["--log-format", "json"]


def test_the_outbox_relay_command_takes_them_too(capsys):
    with pytest.raises(SystemExit):
        cli_main(["outbox", "relay", "--help"])
    out = capsys.readouterr().out
    assert "--metrics-port" in out and "--log-format" in out


def test_json_logs_are_asked_of_a_jvm_started_later(monkeypatch, caplog):
    """`use_json_logs` (a job's --log-format json) sets VARADHI_LOG_FORMAT=json for this process,
    which `get_spark` reads before it starts a driver JVM."""
    monkeypatch.delenv("VARADHI_LOG_FORMAT", raising=False)
    root = logging.getLogger()
    formatters = [(h, h.formatter) for h in root.handlers]
    try:
        telemetry.use_json_logs()
        assert telemetry.wants_json_logs()
        assert all(isinstance(h.formatter, telemetry.JsonFormatter) for h in root.handlers)
        with caplog.at_level(logging.WARNING):
            warnings.warn("a library's warning", UserWarning, stacklevel=1)
        assert [r.name for r in caplog.records] == ["py.warnings"]  # a log record, JSON too
    finally:
        logging.captureWarnings(False)
        for h, f in formatters:
            h.setFormatter(f)


def test_an_exit_line_is_one_line_whatever_the_error_holds(capsys):
    """A Java error's message holds its stack trace; the line a job exits with stays one line
    of its log (it was many, between the JSON lines)."""
    error = VaradhiError("replay r1 failed: Py4JJavaError: o378.getResult.\n: boom\n\tat x.y(Z)\n")
    assert runner.refuse(error) == 1
    assert (
        capsys.readouterr().err
        == "varadhi: replay r1 failed: Py4JJavaError: o378.getResult. : boom at x.y(Z)\n"
    )


def test_the_jvm_log4j2_configuration_file_is_shared_and_written_whole(tmp_path):
    path = telemetry.log4j2_json_file(str(tmp_path))
    assert path.read_text() == telemetry.LOG4J2_JSON
    assert telemetry.log4j2_json_file(str(tmp_path)) == path  # by content: one per release
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    path.write_text("status = warn\n")  # changed under it: written again, not trusted
    assert telemetry.log4j2_json_file(str(tmp_path)).read_text() == telemetry.LOG4J2_JSON
    assert telemetry.log4j2_java_option(path) == f"-Dlog4j2.configurationFile=file://{path}"
    conf = dict(
        line.split(" = ", 1) for line in telemetry.LOG4J2_JSON.splitlines() if " = " in line
    )
    assert conf["appender.console.target"] == "SYSTEM_ERR"
    assert conf["appender.console.layout.alwaysWriteExceptions"] == "false"
    # every free text field is escaped as JSON
    pattern = conf["appender.console.layout.pattern"]
    assert '"message":"%enc{%m}{JSON}"' in pattern and "%enc{%throwable}{JSON}" in pattern


def test_spark_submit_sh_passes_the_json_configuration_to_the_driver_jvm():
    """./spark-submit.sh gives the driver JVM the JSON log4j2 configuration (so its first line
    is JSON) when VARADHI_LOG_FORMAT=json or the job has --log-format json; not otherwise."""
    script = (ROOT / "spark-submit.sh").read_text()
    assert '--driver-java-options "$LOG4J2_JSON"' in script
    assert "log4j2_java_option(telemetry.log4j2_json_file())" in script
    for needle in ('"${VARADHI_LOG_FORMAT:-}" == json', '*" --log-format json "*'):
        assert needle in script


# -- collectors ------------------------------------------------------------------------------


def test_job_metrics_render_counters_gauges_and_the_info_metric():
    specs = (
        telemetry.Spec("x_records", "counter", "records", ("table",)),
        telemetry.Spec("x_done", "gauge", "done"),
    )
    m = telemetry.JobMetrics(specs, {"subscription": "s"})
    info = telemetry.JobInfo("feeder", {"subscription": "s"}, started_s=1000.0)
    assert samples(m, info) == {
        ("varadhi_job_info", (("job", "feeder"), ("subscription", "s"), ("version", "0.1.0"))): 1,
        ("varadhi_job_start_time_seconds", (("job", "feeder"), ("subscription", "s"))): 1000.0,
    }  # nothing counted yet: no sample
    m.inc("x_records", 3, "t1")
    m.inc("x_records", 2, "t1")
    m.set("x_done", 1)
    got = samples(m)
    assert got[("varadhi_x_records_total", (("subscription", "s"), ("table", "t1")))] == 5
    assert got[("varadhi_x_done", (("subscription", "s"),))] == 1
    with pytest.raises(KeyError):
        m.inc("x_done")  # a gauge
    with pytest.raises(KeyError):
        m.inc("x_records", 1)  # without its table


def test_spark_task_counts_of_the_active_stages():
    stage = SimpleNamespace(numTasks=8, numActiveTasks=2, numCompletedTasks=5, numFailedTasks=1)
    got = telemetry.stage_tasks([stage, None, stage])
    assert got == {("total",): 16, ("active",): 4, ("completed",): 10, ("failed",): 2}
    assert samples(telemetry.SparkTasks({"replay": "r"})) == {}  # no session yet


def test_the_relays_metrics_from_its_stats():
    stats = RelayStats()
    stats.add_relayed("outbox_0_0", 200)
    stats.add_relayed("outbox_0_0", 50)
    stats.add_round()
    stats.add_error("kafka")
    stats.set_head_age("outbox_0_0", 1.5)
    stats.set_head_age("outbox_1_0", 0.0)
    values = relay_values(stats.snapshot(), owned=2, stuck=1)
    assert set(values) == {s.name for s in RELAY_METRICS}
    got = samples(_Collector(telemetry.families(RELAY_METRICS, {}, values)))
    assert got[("varadhi_outbox_relayed_total", (("table", "outbox_0_0"),))] == 250
    assert got[("varadhi_outbox_batches_total", ())] == 1
    assert got[("varadhi_outbox_errors_total", (("error", "kafka"),))] == 1
    assert got[("varadhi_outbox_lag_seconds", (("table", "outbox_0_0"),))] == 1.5
    assert got[("varadhi_outbox_lag_seconds", (("table", "outbox_1_0"),))] == 0
    assert got[("varadhi_outbox_tables", ())] == 2
    assert got[("varadhi_outbox_stuck_tables", ())] == 1


class _Collector:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families
