"""`varadhi offsets reset`: flags mirror `kafka-consumer-groups --reset-offsets`."""

from __future__ import annotations

import argparse

from varadhi.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offsets", help="offset reset of a subscription's queues")
    osub = p.add_subparsers(dest="offsets_command", metavar="ACTION", required=True)
    r = osub.add_parser(
        "reset",
        help="move the shards (or library members) of a stopped subscription to other offsets",
        description="Rewind or fast-forward the main queue; fast-forward the RQ or DLQ. The "
        "subscription's shards must be stopped or paused. Starts a new checkpoint generation. "
        "The plan is recorded before anything changes: after a crash, run the same command again "
        "to finish it with the same target positions; once done, running it again changes nothing "
        "until a shard has consumed. A runtime: library subscription's consumer group is moved "
        "instead: its members must be stopped or paused (they then stop and leave the group; "
        "start them again afterwards); a reset into a storage topic moves the group to the end "
        "of every earlier one and removes its commits on every later one.",
    )
    r.add_argument("name", help="subscription name")
    r.add_argument("--queue", choices=["main", "rq", "dlq"], required=True)
    to = r.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true")
    to.add_argument("--to-latest", action="store_true")
    to.add_argument("--to-datetime", metavar="TIME", help="ISO-8601 (UTC if no zone) or epoch ms")
    to.add_argument(
        "--shift-by", type=int, metavar="N", help="move each partition by N (negative: back)"
    )
    to.add_argument(
        "--to-storage-topic", type=int, metavar="I", help="start of storage topic I (main only)"
    )
    how = r.add_mutually_exclusive_group(required=True)
    how.add_argument("--dry-run", action="store_true", help="show the plan, change nothing")
    how.add_argument("--execute", action="store_true", help="carry the reset out")
    common.add_output(r)
    r.set_defaults(func=_reset)


def _reset(args: argparse.Namespace) -> int:
    if args.to_earliest:
        mode, value = "to-earliest", None
    elif args.to_latest:
        mode, value = "to-latest", None
    elif args.to_datetime is not None:
        mode, value = "to-datetime", args.to_datetime
    elif args.shift_by is not None:
        mode, value = "shift-by", args.shift_by
    else:
        mode, value = "to-storage-topic", args.to_storage_topic
    with common.client(args) as client:
        result = client.reset_offsets(args.name, args.queue, mode, value, execute=args.execute)
    summary, outcome = result.summary, result.outcome
    if args.output == "json":
        common.emit_json(result.to_dict())
        return 0
    print(f"{'shard':>5} {'storage topic':<32} {'part':>4} {'current':>9} {'new':>9} {'change':>9}")
    for mv in summary["moves"]:
        current = "-" if mv["current"] is None else mv["current"]
        change = (
            f"skip {mv['delta']}"
            if mv["delta"] > 0
            else (f"replay {-mv['delta']}" if mv["delta"] < 0 else "-")
        )
        print(
            f"{mv['shard']:>5} {mv['topic']:<32} {mv['partition']:>4} {current:>9} {mv['new']:>9} {change:>9}"
        )
    dropped = [f"{mv['topic']}/{mv['partition']}" for mv in summary["moves"] if mv.get("dropped")]
    if dropped:
        print(f"commits removed (read from the log start once reached): {', '.join(dropped)}")
    counts = f"{summary['skipped']} messages skipped, {summary['replayed']} replayed"
    if outcome == "done":
        print(
            "this reset was done already and nothing has been consumed since: nothing changed "
            f"(it {counts})"
        )
        return 0
    resumed = " the interrupted reset recorded earlier" if outcome == "resume" else ""
    if args.execute:
        verb = f"resumed and finished{resumed}" if resumed else "reset"
    else:
        verb = f"would {'resume' + resumed if resumed else 'reset'} (dry run; nothing changed)"
    print(f"{verb}: {counts}")
    return 0
