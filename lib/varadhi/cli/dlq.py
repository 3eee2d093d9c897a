"""`varadhi dlq list|unsideline`: browse parked messages and re-drive them."""

from __future__ import annotations

import argparse

from varadhi.cli import common
from varadhi.kafka.dlq import parse_rate


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dlq", help="dead-letter queue: list and unsideline (re-drive)")
    dsub = p.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)

    ls = dsub.add_parser(
        "list",
        help="list parked messages with reason, status, attempts, times",
        description="List parked messages, oldest first, with their re-drive state (parked, "
        "redrive requested, redriven) and, for a message parked again after a re-drive, the "
        "re-drive that put it back (re-driven by).",
    )
    ls.add_argument("name", help="subscription name")
    ls.add_argument("--group-id", help="only this group's messages")
    ls.add_argument(
        "--limit", type=int, default=100, help="show the newest N (default 100; 0: all)"
    )
    common.add_output(ls)
    ls.set_defaults(func=_list)

    un = dsub.add_parser(
        "unsideline",
        help="re-drive parked messages in their original group order, attempts reset",
        description="Record a re-drive; each running shard applies it at its next micro-batch "
        "(runtime: library: the member holding each slot, within 5 s, through the RQ). "
        "A group blocked on its DLQ unblocks once its re-driven messages are delivered. Every "
        "request of a re-driven message carries X-Varadhi-Redriven: <re-drive id>.",
    )
    un.add_argument("name", help="subscription name")
    un.add_argument("--group-ids", nargs="+", default=[], metavar="G")
    un.add_argument("--message-ids", nargs="+", default=[], metavar="ID")
    un.add_argument("--failed-since", metavar="TIME", help="ISO-8601 (UTC if no zone) or epoch ms")
    un.add_argument("--failed-until", metavar="TIME")
    un.add_argument(
        "--rate",
        metavar="N/s",
        help="put the messages back at no more than N a second for the whole subscription "
        "(`50/s` or `50`; split among its shards): each shard takes its share in portions, one "
        "a micro-batch, each group in order and ahead of its newer traffic; a library member "
        "its slot's share, one portion a second (default: all at once)",
    )
    un.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="wait until every shard applied it (with --rate: put everything back)",
    )
    un.set_defaults(func=_unsideline)


def _list(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        rows = client.dlq_messages(args.name, args.group_id, args.limit)
    if args.output == "json":
        common.emit_json(rows)
        return 0
    if not rows:
        print("no parked messages")
        return 0
    print(
        f"{'message id':<24} {'group':<16} {'attempts':>8} {'status':>6} {'state':<18} "
        f"{'re-driven by':<26} reason"
    )
    for r in rows:
        msg_id, group = common.printable(r["msg_id"]), common.printable(r["group_id"])
        by = common.printable(r["redriven_by"] or "-")
        print(
            f"{msg_id[:24]:<24} {group[:16]:<16} {r['attempts']:>8} "
            f"{str(r['status'] or '-'):>6} {r['state']:<18} {by[:26]:<26} "
            f"{common.printable(r['reason'] or '')}"
        )
    return 0


def _unsideline(args: argparse.Namespace) -> int:
    rate = None if args.rate is None else parse_rate(args.rate)
    with common.client(args) as client:
        op_id = client.redrive(
            args.name,
            args.group_ids,
            args.message_ids,
            args.failed_since,
            args.failed_until,
            rate=rate,
        )
        if client.subscription(args.name).spec.runtime == "library":
            who, when, each = "running library members", "within 5 s", "slot"
        else:
            who, when, each = "running shards", "at their next micro-batch", "shard"
        if rate is not None:
            when += f", at most {rate:g} messages a second in all"
        print(f"re-drive {op_id} recorded; {who} apply it {when}")
        if args.wait:
            client.wait_for_redrive(args.name, op_id, args.wait)
            print(f"re-drive {op_id} applied for every {each}")
    return 0
