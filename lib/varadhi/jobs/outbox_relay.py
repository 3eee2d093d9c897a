"""Relay transactional outbox tables to Kafka until stopped (no Spark needed).

    varadhi-job outbox_relay --sqlite app.db [--shards 2] [--partitions 1] [--once]
    python -m varadhi.jobs.outbox_relay --dsn postgresql://app@db/app
    spark-submit jobs/outbox_relay.py --dsn ...       (runs on the driver; starts no Spark session)

The options are those of `varadhi outbox relay` (plus --bootstrap); the PostgreSQL DSN may also
come from $VARADHI_OUTBOX_DSN. --metrics-port serves the relay's metrics (`RELAY_METRICS`,
docs/operations.md, "Metrics and logs") and --log-format json writes its log as JSON lines, as
the shard job does. Exit codes: 0 stopped (SIGTERM/SIGINT, or done with --once), 2
refused (bad options), 4 a missing Kafka ACL (one line naming it), 1 failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from varadhi.core.errors import InvalidArgument
from varadhi.jobs import runner
from varadhi.outbox.relay import Relay, RelayStats
from varadhi.outbox.relay import connector as make_connector
from varadhi.outbox.tables import (
    DEFAULT_PARTITIONS,
    DEFAULT_SHARDS,
    DEFAULT_TABLE_PREFIX,
    Outbox,
)
from varadhi.spark.stop_signals import StopSignals
from varadhi.spark.telemetry import JobInfo, Spec, families, serve

log = logging.getLogger(__name__)


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    db = parser.add_mutually_exclusive_group()
    db.add_argument("--dsn", help="PostgreSQL connection string (default: $VARADHI_OUTBOX_DSN)")
    db.add_argument("--sqlite", metavar="PATH", help="SQLite database file")
    parser.add_argument(
        "--shards",
        type=int,
        default=DEFAULT_SHARDS,
        help=f"outbox shards (default {DEFAULT_SHARDS}: shard 1 is a spare)",
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=DEFAULT_PARTITIONS,
        help=f"tables per shard (default {DEFAULT_PARTITIONS})",
    )
    parser.add_argument(
        "--table-prefix",
        default=DEFAULT_TABLE_PREFIX,
        help=f"table names are PREFIX_<shard>_<partition> (default {DEFAULT_TABLE_PREFIX})",
    )


def add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--once", action="store_true", help="relay until the claimed tables are empty, then exit"
    )
    parser.add_argument(
        "--only-shard",
        type=int,
        action="append",
        metavar="SHARD",
        help="relay only this shard (repeatable; default: every shard)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=1000, help="rows read per table per round (1000)"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=0.05,
        help="seconds between polls of an empty table (0.05)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=10.0,
        help="SQLite: seconds after which a dead relay's tables are taken over (10)",
    )
    runner.add_telemetry_options(parser)


RELAY_METRICS = (
    Spec("outbox_relayed", "counter", "outbox rows sent to Kafka and deleted", ("table",)),
    Spec("outbox_batches", "counter", "relay rounds sent (up to --batch-size rows a table)"),
    Spec(
        "outbox_errors",
        "counter",
        "database or Kafka errors the relay retried after a pause",
        ("error",),
    ),
    Spec(
        "outbox_lag_seconds",
        "gauge",
        "age of the table's oldest row not yet relayed, at the last read of its head (0: empty)",
        ("table",),
    ),
    Spec("outbox_tables", "gauge", "outbox tables this relay holds now"),
    Spec("outbox_stuck_tables", "gauge", "held tables waiting at a row that cannot be sent"),
)


def relay_values(stats: dict, owned: int, stuck: int) -> dict[str, dict[tuple[str, ...], float]]:
    """`RELAY_METRICS`' samples from a `RelayStats.snapshot()` and the counts of held and stuck
    tables (pure)."""
    return {
        "outbox_relayed": {(t,): n for t, n in stats["relayed"].items()},
        "outbox_batches": {(): stats["rounds"]},
        "outbox_errors": {(k,): n for k, n in stats["errors"].items()},
        "outbox_lag_seconds": {(t,): age for t, age in stats["head_age_s"].items()},
        "outbox_tables": {(): owned},
        "outbox_stuck_tables": {(): stuck},
    }


class RelayMetrics:
    """A prometheus_client collector of a running relay's `RELAY_METRICS`."""

    def __init__(self, relay: Relay):
        self.relay = relay

    def describe(self):
        return families(RELAY_METRICS, {}, None)

    def collect(self):
        stats: RelayStats = self.relay.stats
        values = relay_values(stats.snapshot(), len(self.relay.owned), len(self.relay.stuck))
        return families(RELAY_METRICS, {}, values)


def outbox_from(args: argparse.Namespace) -> Outbox:
    return Outbox(args.shards, args.partitions, table_prefix=args.table_prefix)


def connector_from(args: argparse.Namespace):
    dsn = args.dsn or (None if args.sqlite else os.environ.get("VARADHI_OUTBOX_DSN"))
    if not dsn and not args.sqlite:
        raise InvalidArgument(
            "give --dsn (or set $VARADHI_OUTBOX_DSN) for PostgreSQL, or --sqlite PATH",
            field="database",
        )
    if args.sqlite:
        return make_connector(sqlite=args.sqlite)
    return make_connector(dsn=dsn)


def require_tables(outbox: Outbox, connect) -> None:
    """Refuse, with the remedy, a database without the outbox tables (before any relay work)."""
    conn = connect()
    try:
        missing = outbox.missing_tables(conn)
    finally:
        conn.close()
    if missing:
        raise InvalidArgument(
            f"outbox tables {', '.join(missing)} do not exist: run `varadhi outbox init` with the "
            "same --shards/--partitions/--table-prefix first",
            field="tables",
        )


def run_relay(args: argparse.Namespace) -> int:
    """Run a relay from parsed arguments (shared with `varadhi outbox relay`)."""
    options = runner.telemetry(args)
    outbox = outbox_from(args)
    require_tables(outbox, connector_from(args))
    if args.batch_size < 1:
        raise InvalidArgument(f"must be positive, got {args.batch_size}", field="--batch-size")
    relay = Relay(
        connector_from(args),
        outbox,
        settings=runner.settings(args),
        shards=args.only_shard,
        batch_size=args.batch_size,
        poll_interval_s=args.poll_interval,
        lease_ttl_s=args.lease_ttl,
    )
    exporter = None
    try:
        info = JobInfo("outbox_relay", {"relay": relay.owner})
        exporter = serve([info, RelayMetrics(relay)], options, f"outbox relay {relay.owner}")
        if args.once:
            relay.claim()
            n = relay.run_once()
            print(f"relayed {n} messages from {', '.join(relay.owned) or 'no table'}")
            return 0
        stop = threading.Event()
        # SIGINT and SIGTERM stop the relay between polls (`varadhi.spark.stop_signals`, no JVM).
        with StopSignals(None, lambda _signum: stop.set()):
            log.info("outbox relay %s: polling %s", relay.owner, ", ".join(relay.tables))
            relay.run_forever(stop)
        return 0
    finally:
        if exporter is not None:
            exporter.close()
        relay.close()


def build_parser() -> argparse.ArgumentParser:
    parser = runner.job_parser("outbox_relay", __doc__.split("\n\n")[0])
    parser.epilog = __doc__.split("\n\n", 1)[1]
    runner.add_options(parser, "bootstrap")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    add_database_arguments(parser)
    add_relay_arguments(parser)
    return parser


@runner.entry_point(prog="outbox_relay")
def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    runner.setup_logging(logging.INFO if args.verbose else logging.WARNING)
    return run_relay(args)


if __name__ == "__main__":
    sys.exit(main())
