"""`varadhi-job NAME [job options]`: one console script for every job in `varadhi.jobs`.

    varadhi-job --help                  the jobs and what each does
    varadhi-job shard --help            one job's options
    varadhi-job shard --subscription orders --shard 0

The runner imports the job's module and returns its `main(argv)`'s exit code (`run`, which each
job's `__main__` uses too, so `python -m`/`spark-submit` behave the same): a `VaradhiError` that
escapes a job is one line on stderr with its exit code (2 refused, nothing changed; 1 failed), and
so is any error that reports a missing Kafka ACL (a Spark job's, with Kafka's Java message in it):
the `NotAuthorized` line, exit code 4. SIGINT that escapes is 130. The jobs share
`setup_logging`, `refuse` and `refusal_of` from here.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable

from ..errors import NotAuthorized, VaradhiError
from ..kafka_clients import refusal
from ..settings import Settings

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
    print(f"{prog}: {error}", file=sys.stderr)
    return error.exit_code


def refusal_of(error: BaseException) -> NotAuthorized | None:
    """The missing Kafka ACL that `error` or its causes report (`kafka_clients.refusal`), naming
    the principal of the job's Kafka configuration ($VARADHI_KAFKA_CONFIG); None otherwise."""
    try:
        settings = Settings.from_env()
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
