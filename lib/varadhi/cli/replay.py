"""`varadhi replay NAME --from T [--to T]`: re-deliver a time range of a subscription's main
topic, out of band and in group order, with a bounded Spark job run in this process.

The request is checked (subscription, times, non-empty range) before Spark starts, so a refusal
is quick and changes nothing. Exit codes: 0 every message of the range was delivered, 1 some
failed (listed) or the job failed, 2 refused. See `varadhi.ops.replay` and docs/replay.md.
"""

from __future__ import annotations

import argparse

from varadhi.cli import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-deliver a time range of a subscription's topic (out of band, in group order)",
        description="Re-deliver the messages of a subscription's main topic whose Kafka "
        "timestamp is in [--from, --to), per group in produce order, with the subscription's "
        "endpoint and retry policy and the header X-Varadhi-Replay. The subscription's offsets, "
        "state, RQ and DLQ are not touched; its shards keep delivering live traffic. For a "
        "rewind use `varadhi offsets reset`.",
        epilog="Exit codes: 0 all delivered, 1 some messages failed (listed; each stopped its "
        "group) or the job failed, 2 refused (nothing delivered or recorded).",
    )
    p.add_argument("name", help="subscription name")
    p.add_argument(
        "--from",
        dest="from_",
        required=True,
        metavar="TIME",
        help="inclusive; ISO-8601 (UTC if no zone, e.g. 2026-11-25T10:00:00Z) or epoch ms",
    )
    p.add_argument(
        "--to", metavar="TIME", help="exclusive; same formats (default: now, when it starts)"
    )
    p.add_argument(
        "--parallelism",
        type=int,
        metavar="N",
        help="delivery tasks (default: shards x consumption.concurrency)",
    )
    common.add_output(p)
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    from varadhi.ops import (
        replay,  # pandas, pycurl: only when replaying, not for every `varadhi` command
    )

    with common.client(args) as client:
        plan = client.plan_replay(args.name, args.from_, args.to, parallelism=args.parallelism)
        if args.output == "text":
            print(
                f"replaying {plan.max_messages} offsets of {plan.topic} "
                f"({plan.window.describe()}) as {plan.replay_id} ...",
                flush=True,
            )
        result = client.replay(plan)
    doc = result.to_dict()
    if args.output == "json":
        common.emit_json(doc)
    else:
        print(replay.render_text(doc))
    return 0 if result.ok else 1
