"""`varadhi trace`: every attempt of one message, and where it went next."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from varadhi.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="show every attempt of a message and where it went next",
        description="Read the subscription's delivery trace (its spec's trace section) for one "
        "message: each attempt with its time, shard, status, latency and the start of the "
        "answer, and where the message went next (delivered, retry, rq, dlq, filtered, "
        "deduplicated).",
    )
    p.add_argument("name", help="subscription name")
    p.add_argument("--message-id", required=True, metavar="ID", help="the message's id")
    p.add_argument(
        "--since",
        metavar="TIME",
        help="only steps from this time on, ISO-8601 (UTC if no zone) or epoch ms (default: the "
        "whole retention; reading from a recent time is faster)",
    )
    common.add_output(p)
    p.set_defaults(func=_trace)


def _trace(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        events = client.trace(args.name, args.message_id, args.since)
    if args.output == "json":
        common.emit_json(events)
        return 0
    if not events:
        print(f"no trace of message {common.printable(args.message_id)} in {args.name}")
        return 0
    print(
        f"{'time (UTC)':<23} {'shard':>5} {'attempt':>7} {'status':>8} {'latency':>9} "
        f"{'next':<12} detail"
    )
    for e in events:
        at = datetime.fromtimestamp(e["at_ms"] / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:23]
        status = e.get("status") or e.get("error") or "-"
        latency = f"{e['latency_ms']:.1f} ms" if "latency_ms" in e else "-"
        detail = [e.get("answer"), e.get("reason")]
        if "redriven" in e:
            detail.append(f"re-driven by {e['redriven']}")
        print(
            f"{at:<23} {e.get('shard', '-')!s:>5} {e.get('attempt', '-')!s:>7} {status!s:>8} "
            f"{latency:>9} {e['next']:<12} {common.printable('; '.join(d for d in detail if d))}"
        )
    return 0
