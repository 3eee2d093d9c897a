"""`varadhi outbox ...`: create the transactional outbox tables, relay them to Kafka, show them.

    varadhi outbox init  --sqlite app.db [--shards 2] [--partitions 1]
    varadhi outbox relay --dsn postgresql://app@db/app [--once]
    varadhi outbox status --sqlite app.db [--output json]

The PostgreSQL DSN may also come from $VARADHI_OUTBOX_DSN, which keeps a password out of the
process list. `relay` runs until SIGINT or SIGTERM (then releases its tables, so another relay
takes them at once); with `--once` it relays what it can claim until those tables are empty, and
exits. See docs/outbox.md for the guarantees.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from ..errors import InvalidArgument
from ..outbox import DEFAULT_PARTITIONS, DEFAULT_SHARDS, DEFAULT_TABLE_PREFIX, Outbox, Relay
from ..outbox import connector as make_connector
from . import common

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "outbox",
        help="transactional outbox: tables in your database, relayed to Kafka",
        description=__doc__.split("\n\n")[0],
    )
    osub = p.add_subparsers(dest="outbox_command", metavar="ACTION", required=True)

    init = osub.add_parser("init", help="create the outbox tables (idempotent)")
    add_database_arguments(init)
    init.set_defaults(func=_init)

    relay = osub.add_parser(
        "relay",
        help="send committed outbox rows to Kafka, then delete them",
        description="Poll every outbox table this relay can claim, send its rows in id order "
        "to their composite topics, wait for Kafka's acknowledgement and delete them. "
        "At-least-once; one relay per table at a time; run several for availability.",
    )
    add_database_arguments(relay)
    add_relay_arguments(relay)
    relay.set_defaults(func=run_relay)

    status = osub.add_parser("status", help="rows waiting in each outbox table")
    add_database_arguments(status)
    common.add_output(status)
    status.set_defaults(func=_status)


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


def _init(args: argparse.Namespace) -> int:
    outbox = outbox_from(args)
    connect = connector_from(args)
    if args.sqlite:
        import sqlite3

        conn = sqlite3.connect(args.sqlite)  # creates the file
    else:
        conn = connect()
    try:
        outbox.create_tables(conn)
    finally:
        conn.close()
    print(f"outbox tables ready: {', '.join(outbox.tables())}")
    return 0


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
    """Run a relay from parsed arguments (shared with jobs/outbox_relay.py)."""
    outbox = outbox_from(args)
    require_tables(outbox, connector_from(args))
    if args.batch_size < 1:
        raise InvalidArgument(f"must be positive, got {args.batch_size}", field="--batch-size")
    relay = Relay(
        connector_from(args),
        outbox,
        settings=common.settings(args),
        shards=args.only_shard,
        batch_size=args.batch_size,
        poll_interval_s=args.poll_interval,
        lease_ttl_s=args.lease_ttl,
    )
    try:
        if args.once:
            relay.claim()
            n = relay.run_once()
            print(f"relayed {n} messages from {', '.join(relay.owned) or 'no table'}")
            return 0
        stop = threading.Event()

        def on_signal(signum, _frame):
            log.info("outbox relay: signal %d, stopping", signum)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info("outbox relay %s: polling %s", relay.owner, ", ".join(relay.tables))
        relay.run_forever(stop)
        return 0
    finally:
        relay.close()


def _status(args: argparse.Namespace) -> int:
    outbox = outbox_from(args)
    require_tables(outbox, connector_from(args))
    conn = connector_from(args)()
    try:
        pending = outbox.pending(conn)
    finally:
        conn.close()
    if args.output == "json":
        common.emit_json({"pending": pending})
    else:
        for table, n in pending.items():
            print(f"{table}\t{n}")
    return 0
