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

from varadhi.cli import common
from varadhi.jobs.outbox_relay import (
    add_database_arguments,
    add_relay_arguments,
    connector_from,
    outbox_from,
    require_tables,
    run_relay,
)


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
