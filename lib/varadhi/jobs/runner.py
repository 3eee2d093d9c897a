"""`varadhi-job NAME [job options]`: one console script for every job in `varadhi.jobs`.

    varadhi-job --help                  the jobs and what each does
    varadhi-job shard --help            one job's options
    varadhi-job shard --subscription orders --shard 0

The runner imports the job's module and returns its `main(argv)`'s exit code. Every job's `main`
is an `entry_point`, so however it is started (`varadhi-job`, `python -m`, spark-submit on the
module's file or on a checkout's `jobs/*.py`, or called from Python) errors end the same way
(`run`): a `VaradhiError` that escapes a job is one line on stderr with its exit code (2 refused,
nothing changed; 1 failed), and so is any error that reports a missing Kafka ACL (a Spark job's,
with Kafka's Java message in it): the `NotAuthorized` line, exit code 4. SIGINT that escapes is
130. The jobs also share their parser and common options (`job_parser`, `add_options`), their
settings (`settings`), Spark session and signal handling (`SparkRun`) and logging
(`setup_logging`) from here. No job imports `varadhi.cli` (tests/unit/test_job_runner.py checks
every module a job imports, transitively).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from varadhi.core.errors import NotAuthorized, VaradhiError
from varadhi.kafka.clients import refusal
from varadhi.kafka.settings import Settings
from varadhi.spark.stop_signals import StopSignals
from varadhi.spark.telemetry import MetricsOptions, use_json_logs
from varadhi.spark.telemetry import log as telemetry_log

# name -> what it does (the module is varadhi.jobs.<name>)
JOBS: dict[str, str] = {
    "shard": "run one shard of a subscription until stopped, fenced or failed (Spark)",
    "feeder": "copy an old RQ/DLQ storage topic into the new shards of a shard-count change (Spark)",
    "replay": "re-deliver a time range of a subscription's main topic (Spark, bounded)",
    "outbox_relay": "relay transactional outbox tables to Kafka until stopped (no Spark)",
    "smoke_count": "count a Kafka topic's records per partition (Spark, a set-up check)",
}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Job logging: timestamps on stderr; py4j and kafka-python only from WARNING."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    logging.getLogger("kafka").setLevel(logging.WARNING)


def refuse(error: VaradhiError, prog: str = "varadhi") -> int:
    """Print `error` as one line on stderr and return its exit code; an error raised from a
    missing Kafka ACL is printed as that ACL's `NotAuthorized` line (exit code 4)."""
    error = refusal_of(error) or error
    print(one_line(f"{prog}: {error}"), file=sys.stderr)
    return error.exit_code


def one_line(text: str) -> str:
    """`text` on one line: its lines joined with spaces (a Java error's message holds its stack
    trace), so an exit line stays one line of the job's log, JSON logs or not."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def refusal_of(error: BaseException, command_config: str | None = None) -> NotAuthorized | None:
    """The missing Kafka ACL that `error` or its causes report (`kafka_clients.refusal`), naming
    the principal of the Kafka configuration (`command_config`, else $VARADHI_KAFKA_CONFIG);
    None otherwise. Shared with the `varadhi` command line."""
    try:
        settings = Settings.from_env(command_config=command_config)
    except VaradhiError:  # a bad configuration: the principal is left unnamed
        settings = Settings()
    return refusal(settings, error)


def run(main: Callable[[list[str]], int | None], argv: list[str], prog: str = "varadhi") -> int:
    """A job's exit code: `main(argv)`'s, or, for an error that escapes it, one line on stderr
    and the error's code: a `VaradhiError`'s, 4 for any error reporting a missing Kafka ACL,
    130 for SIGINT. Any other error is raised again (its traceback is the report)."""
    try:
        return int(main(argv) or 0)
    except VaradhiError as e:
        return refuse(e, prog)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        refused = refusal_of(e)
        if refused is None:
            raise
        return refuse(refused, prog)


def entry_point(prog: str = "varadhi") -> Callable[[Callable[[list[str]], int | None]], Callable]:
    """Decorate a job's `main(argv)`: calling it (argv None: the command line's) returns
    `run(main, argv, prog)`'s exit code, so each way of starting a job ends errors alike."""

    def decorate(main: Callable[[list[str]], int | None]) -> Callable[[list[str] | None], int]:
        @functools.wraps(main)
        def job_main(argv: list[str] | None = None) -> int:
            return run(main, list(sys.argv[1:] if argv is None else argv), prog)

        return job_main

    return decorate


#: The options jobs share: name -> (flag, argparse keywords).
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "subscription": ("--subscription", {"required": True}),
    "bootstrap": (
        "--bootstrap",
        {
            "help": "Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP, else the Kafka client "
            "configuration's bootstrap.servers)"
        },  # fmt: skip
    ),
    "warehouse": (
        "--warehouse",
        {"help": "Delta tables and checkpoints (default: $VARADHI_WAREHOUSE)"},
    ),
    "cluster": (
        "--cluster",
        {"action": "store_true", "help": "use the cluster's Spark (no local jars)"},
    ),
}


def job_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of job `name` (`varadhi-job NAME`), its module docstring `doc` as the help."""
    return argparse.ArgumentParser(
        prog=f"varadhi-job {name}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_options(parser: argparse.ArgumentParser, *names: str) -> None:
    """Add the shared `OPTIONS` named, in the order given."""
    for name in names:
        flag, keywords = OPTIONS[name]
        parser.add_argument(flag, **keywords)


def add_telemetry_options(parser: argparse.ArgumentParser, adds: str = "") -> None:
    """--metrics-port, --metrics-addr and --log-format, which every long-running job takes
    (`telemetry`); `adds` says what the job's JSON log adds (the shard: a line per batch)."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port of the driver, /metrics (0: a free port, "
        "logged; default: $VARADHI_METRICS_PORT, else no exporter)",
    )
    parser.add_argument(
        "--metrics-addr",
        metavar="ADDR",
        help="address the metrics port binds (default: $VARADHI_METRICS_ADDR or 127.0.0.1; "
        "0.0.0.0 for a Prometheus on another host)",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        help=f"json: one JSON object per log line, Spark's driver lines too{adds} (default: "
        "$VARADHI_LOG_FORMAT or text)",
    )


def telemetry(args: argparse.Namespace) -> MetricsOptions:
    """The job's `MetricsOptions` from `add_telemetry_options`' flags and their environment
    fallbacks; with JSON logs, formats the process's log as JSON (`use_json_logs`, which also
    makes a driver JVM started later log JSON). The exporter's address is logged whatever the
    job's log level (the relay's is WARNING without -v): with port 0 it is the only way to
    learn it. Raises InvalidArgument (exit 2) for a bad value, before any side effect."""
    options = MetricsOptions.from_env(args.metrics_port, args.metrics_addr, args.log_format)
    if options.json_logs:
        use_json_logs()
    telemetry_log.setLevel(logging.INFO)
    return options


def settings(args: argparse.Namespace) -> Settings:
    """The job's settings: the environment's (`Settings.from_env`) with the shared options given
    (--bootstrap, --warehouse, and --command-config where a command shares the job's code).
    Raises `KafkaConfigError` (one line, exit code 2 through `run`) for a bad Kafka client
    configuration ($VARADHI_KAFKA_CONFIG), before any side effect."""
    return Settings.from_env(
        command_config=getattr(args, "command_config", None),
        bootstrap=getattr(args, "bootstrap", None),
        warehouse=getattr(args, "warehouse", None),
    )


class SparkRun:
    """A bounded job's Spark session (`start`: local, or the cluster's with --cluster) whose
    Spark jobs SIGINT and SIGTERM cancel (`StopSignals.cancelling`) until `restore` (or the end
    of a `with` block). `received` names the signal that cancelled them, None if none did: a
    job that failed after one reports the interruption, not the failure."""

    def __init__(self, args: argparse.Namespace, app_name: str):
        self.args = args
        self.app_name = app_name
        self._signals: StopSignals | None = None

    def start(self) -> Any:
        from varadhi.spark.session import get_spark

        spark = get_spark(self.app_name, local=not self.args.cluster)
        self._signals = StopSignals.cancelling(spark)
        self._signals.install()
        return spark

    @property
    def received(self) -> str | None:
        return None if self._signals is None else self._signals.received

    def restore(self) -> None:
        if self._signals is not None:
            self._signals.restore()

    def __enter__(self) -> SparkRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def usage() -> str:
    width = max(len(name) for name in JOBS)
    lines = [f"  {name.ljust(width)}  {what}" for name, what in JOBS.items()]
    return (
        "usage: varadhi-job NAME [job options]\n\n"
        "Run one of varadhi's jobs (also `python -m varadhi.jobs.NAME`). Jobs:\n"
        + "\n".join(lines)
        + "\n\n`varadhi-job NAME --help` shows a job's options.\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0
    name, rest = args[0], args[1:]
    if name not in JOBS:
        print(f"varadhi-job: unknown job {name!r} (jobs: {', '.join(JOBS)})", file=sys.stderr)
        return 2
    job = importlib.import_module(f"{__package__}.{name}")
    return run(job.main, rest)


if __name__ == "__main__":
    sys.exit(main())
