"""The `varadhi` command line. Each command group lives in its own module with a
`register(subparsers)` function; `main` wires them up and turns `VaradhiError`s into one-line
messages on stderr with exit code 2 (refused, nothing changed) or 1 (failed)."""

from __future__ import annotations

import argparse
import logging
import sys

from kafka.errors import AuthorizationError

from varadhi.cli import (
    dlq,
    jobs,
    offsets,
    outbox,
    produce,
    replay,
    status,
    subscription,
    topic,
    trace,
)
from varadhi.core.errors import NotAuthorized, VaradhiError
from varadhi.jobs.runner import refusal_of
from varadhi.kafka.clients import not_authorized

COMMAND_GROUPS = [topic, produce, subscription, status, dlq, trace, offsets, replay, outbox, jobs]


def version() -> str:
    """The installed package's version, or `varadhi.__version__` when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("varadhi-spark")
    except PackageNotFoundError:
        from varadhi.core.version import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="varadhi",
        description="Ordered, retried delivery of Kafka messages to HTTP endpoints on Spark.",
    )
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP)")
    parser.add_argument(
        "--command-config",
        metavar="FILE",
        help="Kafka client properties (security.protocol, sasl.*, ssl.*), as Kafka's tools take "
        "them (default: $VARADHI_KAFKA_CONFIG)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    parser.add_argument("--version", action="version", version=f"varadhi-spark {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if not args.verbose:  # kafka-python logs retried, recovered errors (e.g. fencing) at ERROR
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
    try:
        return int(args.func(args) or 0)
    except VaradhiError as e:
        e = _refusal(args, e) or e
        print(f"varadhi: {e}", file=sys.stderr)
        return e.exit_code
    except AuthorizationError as e:  # a missing ACL, whichever client met it
        print(f"varadhi: {not_authorized(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a Spark query's failure may be a missing ACL
        refused = _refusal(args, e)
        if refused is None:
            raise
        print(f"varadhi: {refused}", file=sys.stderr)
        return refused.exit_code


def _refusal(args: argparse.Namespace, error: Exception) -> NotAuthorized | None:
    """A missing ACL reported by `error` or its cause (a Spark query's error, with Kafka's own
    message in it), as the typed error; None when there is none (`runner.refusal_of`)."""
    return refusal_of(error, args.command_config)


if __name__ == "__main__":
    sys.exit(main())
