"""The jobs' one entry-point runner (`varadhi.jobs.runner`): however a job is started, its errors
end alike; the jobs share their options and settings; and no job imports the CLI, directly or
through any module it imports."""

from __future__ import annotations

import ast
import functools
import importlib
import runpy
import sys
from pathlib import Path

import pytest

from varadhi.jobs import runner

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(importlib.import_module("varadhi").__file__).parent
# the checkout's spark-submit entry point of each job (jobs/*.py)
CHECKOUT = {name: ROOT / "jobs" / f"{name}.py" for name in runner.JOBS}
CHECKOUT["shard"] = ROOT / "jobs" / "subscription_shard.py"

SOURCE_READ = (
    "An error occurred while calling o77.load.\n: org.apache.spark.SparkException: Job aborted\n"
    "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to "
    "access topics: [orders.0]\n"
)


@functools.cache
def imports_of(module: str) -> frozenset[str]:
    """The varadhi modules `module` imports (absolute and relative), with their packages."""
    path = PACKAGE.parent.joinpath(*module.split("."))
    is_package = path.is_dir()
    path = path / "__init__.py" if is_package else path.with_suffix(".py")
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a module's packages run first
                found.add(".".join(parts[:i]))
    return frozenset(m for m in found if m.split(".")[0] == "varadhi" and _exists(m))


def _exists(module: str) -> bool:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imports_of(module) - seen)
    return seen


@pytest.mark.parametrize("job", ["runner", *runner.JOBS])
def test_no_job_imports_the_cli_even_through_another_module(job):
    modules = reachable(f"varadhi.jobs.{job}")
    assert "varadhi.kafka.settings" in modules  # the walk follows imports
    assert not {m for m in modules if m == "varadhi.cli" or m.startswith("varadhi.cli.")}


#: What only the runner does for a job: its logging, its settings and signal handlers that are
#: put back (`varadhi.spark.stop_signals`), not a job's own copy of them.
RUNNER_ONLY = {"logging.basicConfig", "Settings.from_env", "signal.signal"}


def calls(module: str) -> set[str]:
    """The dotted names `module` calls (`a.b(...)` as "a.b")."""
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            found.add(f"{func.value.id}.{func.attr}")
    return found


@pytest.mark.parametrize("job", list(runner.JOBS))
def test_jobs_log_read_settings_and_take_signals_through_the_runner(job):
    assert not calls(f"varadhi.jobs.{job}") & RUNNER_ONLY
    assert RUNNER_ONLY & calls("varadhi.jobs.runner")  # the walk sees calls


def test_the_import_walk_sees_relative_and_nested_imports():
    assert "varadhi.jobs.outbox_relay" in reachable("varadhi.cli")
    assert {"varadhi.kafka.clients", "varadhi.kafka.jvm_errors"} <= reachable("varadhi.jobs.runner")


@pytest.mark.parametrize("job", list(runner.JOBS))
def test_each_way_of_starting_a_job_runs_its_main_through_the_runner(job):
    """`python -m varadhi.jobs.X`, spark-submit on the module's file and `varadhi-job X` call
    the module's `main`; a checkout's jobs/*.py imports it too."""
    module = importlib.import_module(f"varadhi.jobs.{job}")
    assert module.main.__wrapped__ is not None  # an `entry_point`
    tree = ast.parse(CHECKOUT[job].read_text())
    imported = [(n.module, [a.name for a in n.names]) for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom)]  # fmt: skip
    assert imported == [(f"varadhi.jobs.{job}", ["main"])]


@pytest.mark.parametrize(
    "job,argv",
    [
        ("shard", ["--subscription", "s", "--shard", "0"]),
        ("feeder", ["--subscription", "s", "--source", "s.rq.0"]),
        ("replay", ["--subscription", "s", "--from", "0"]),
        ("smoke_count", ["--topic", "t.0"]),
    ],
)
def test_a_bad_kafka_configuration_is_one_line_and_exit_code_2(job, argv, tmp_path, monkeypatch,
                                                                capsys):  # fmt: skip
    bad = tmp_path / "bad.properties"
    bad.write_text("security.protocol=NOPE\n")
    monkeypatch.setenv("VARADHI_KAFKA_CONFIG", str(bad))
    assert importlib.import_module(f"varadhi.jobs.{job}").main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"varadhi: {bad}: security.protocol 'NOPE' is not one of PLAINTEXT, SSL, " \
        "SASL_PLAINTEXT, SASL_SSL\n"  # fmt: skip


class _Py4JError(Exception):
    """Stands for py4j's Py4JJavaError: its text is the Java exception's, with its causes."""


class RefusedRead:
    """A Spark session whose Kafka read the cluster refuses (Py4J's error, as a job meets it);
    it keeps the options the job gave the Kafka source."""

    def __init__(self):
        self.kafka_options: dict[str, str] = {}

    @property
    def read(self):
        return self

    def format(self, _name):
        return self

    def options(self, **options):
        self.kafka_options.update(options)
        return self

    def option(self, key, value):
        return self.options(**{key: value})

    def load(self):
        raise _Py4JError(SOURCE_READ)


def test_a_checkout_s_entry_point_ends_a_spark_job_s_missing_acl_in_one_line(
    tmp_path, monkeypatch, capsys
):
    """spark-submit on jobs/smoke_count.py, a missing ACL met by Spark's Kafka source. Before
    the shared runner the checkout's entry points called `main` directly: the Py4J error was a
    traceback and exit code 1, where `varadhi-job` printed one line and exit code 4; and
    smoke_count read from 127.0.0.1:19092 rather than the Kafka configuration's
    bootstrap.servers when $VARADHI_BOOTSTRAP was not set."""
    config = tmp_path / "carol.properties"
    config.write_text(
        "bootstrap.servers=kafka.example:9093\nsecurity.protocol=SASL_PLAINTEXT\n"
        "sasl.mechanism=SCRAM-SHA-512\nsasl.jaas.config=org.apache.kafka.common.security.scram."
        'ScramLoginModule required username="carol" password="not-shown";\n'
    )
    monkeypatch.setenv("VARADHI_KAFKA_CONFIG", str(config))
    monkeypatch.delenv("VARADHI_BOOTSTRAP", raising=False)
    spark = RefusedRead()
    monkeypatch.setattr("varadhi.spark.session.get_spark", lambda *a, **k: spark)
    monkeypatch.setattr(sys, "argv", [str(CHECKOUT["smoke_count"]), "--topic", "orders.0"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(CHECKOUT["smoke_count"]), run_name="__main__")
    assert exited.value.code == 4
    assert capsys.readouterr().err == (
        "varadhi: not authorized: User:carol lacks Describe or Read on Topic orders.0 "
        "(kafka-acls.sh --add --allow-principal User:carol --operation Describe --operation Read"
        " --topic orders.0)\n"
    )
    assert spark.kafka_options["kafka.bootstrap.servers"] == "kafka.example:9093"
