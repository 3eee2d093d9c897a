"""`varadhi-job NAME [job options]`: one console script for every job in `varadhi.jobs`.

    varadhi-job --help                  the jobs and what each does
    varadhi-job shard --help            one job's options
    varadhi-job shard --subscription orders --shard 0

The runner imports the job's module and returns its `main(argv)`'s exit code; a `VaradhiError`
that escapes a job is one line on stderr with its exit code (2 refused, nothing changed; 1
failed), SIGINT that escapes is 130. The jobs share `setup_logging` and `refuse` from here.
"""

from __future__ import annotations

import importlib
import logging
import sys

from ..errors import VaradhiError

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
    """Print `error` as one line on stderr and return its exit code."""
    print(f"{prog}: {error}", file=sys.stderr)
    return error.exit_code


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
    try:
        return int(job.main(rest) or 0)
    except VaradhiError as e:
        return refuse(e)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
