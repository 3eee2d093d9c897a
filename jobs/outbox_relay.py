"""Outbox relay job: relay transactional outbox tables to Kafka until stopped (no Spark needed).

    python jobs/outbox_relay.py --sqlite app.db [--shards 2] [--partitions 1] [--once]
    python jobs/outbox_relay.py --dsn postgresql://app@db/app
    spark-submit jobs/outbox_relay.py --dsn ...       (runs on the driver; starts no Spark session)

The options are those of `varadhi outbox relay` (plus --bootstrap). Exit codes: 0 stopped
(SIGTERM/SIGINT, or done with --once), 2 refused (bad options), 1 failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from varadhi.cli import outbox as outbox_cli
from varadhi.errors import VaradhiError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--bootstrap",
        default=os.environ.get("VARADHI_BOOTSTRAP"),
        help="Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    outbox_cli.add_database_arguments(parser)
    outbox_cli.add_relay_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return outbox_cli.run_relay(args)
    except VaradhiError as e:
        print(f"outbox_relay: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
