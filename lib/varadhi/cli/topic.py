"""`varadhi topic ...`: create, grow, switch, describe and list composite topics.

Every command validates its input before it changes anything; a refusal is one line on stderr and
exit code 2. Partition counts must be 1, 2, 3 or a multiple of 4 or 6 (they shard evenly) unless
`--allow-uneven` is given.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from varadhi.cli import common

UNEVEN_HELP = "accept a partition count that cannot be sharded evenly (not 1, 2, 3, 4k or 6k)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topic",
        help="composite topics",
        description="A composite topic is an ordered list of Kafka storage topics "
        "(<name>.0, <name>.1, ...) and a produce pointer; producers write to the storage topic "
        "it points at.",
    )
    tsub = p.add_subparsers(dest="topic_command", metavar="ACTION", required=True)

    c = tsub.add_parser(
        "create",
        help="create a composite topic",
        description="Create a composite topic with one storage topic (<name>.0) of P partitions.",
    )
    c.add_argument("name", metavar="NAME", help="letters, digits, '_' or '-' (no dots)")
    c.add_argument("--partitions", type=int, required=True, metavar="P", help="partition count")
    c.add_argument("--allow-uneven", action="store_true", help=UNEVEN_HELP)
    common.add_output(c)
    c.set_defaults(func=_create)

    a = tsub.add_parser(
        "add-storage",
        help="append a storage topic",
        description="Append a storage topic with P partitions. Its scale factor K keeps every "
        "group on the same shard when P is a multiple of the previous base count "
        "(P_prev / K_prev); otherwise K=1 and this is a partition change: subscriptions may "
        "need resharding. Producers keep writing to the current storage topic until "
        "`topic switch-produce`.",
    )
    a.add_argument("name", metavar="NAME")
    a.add_argument("--partitions", type=int, required=True, metavar="P", help="partition count")
    a.add_argument("--allow-uneven", action="store_true", help=UNEVEN_HELP)
    common.add_output(a)
    a.set_defaults(func=_add_storage)

    s = tsub.add_parser(
        "switch-produce",
        help="move the produce pointer to the next storage topic",
        description="Move the produce pointer one storage topic on. Running producers follow "
        "within about a second. Refused when it already points at the last storage topic.",
    )
    s.add_argument("name", metavar="NAME")
    common.add_output(s)
    s.set_defaults(func=_switch_produce)

    d = tsub.add_parser(
        "describe",
        help="show storage topics, K, end offsets and the produce pointer",
        description="Show a composite topic: its storage topics with partitions, K and "
        "log-end offsets per partition, and the produce pointer.",
    )
    d.add_argument("name", metavar="NAME")
    common.add_output(d)
    d.set_defaults(func=_describe)

    dl = tsub.add_parser(
        "delete",
        help="delete a composite topic no subscription uses",
        description="Delete a composite topic: refused while a subscription uses it (they are "
        "named). Removes its catalog record and, unless --keep-data, its Kafka storage topics. "
        "After a crash, run it again to finish.",
    )
    dl.add_argument("name", metavar="NAME")
    dl.add_argument(
        "--dry-run", action="store_true", help="print what would be removed; change nothing"
    )
    dl.add_argument(
        "--keep-data",
        action="store_true",
        help="keep the Kafka storage topics (only the record goes)",
    )
    common.add_output(dl)
    dl.set_defaults(func=_delete)

    ls = tsub.add_parser(
        "list",
        help="list composite topics",
        description="List every composite topic (internal queues included) with its storage "
        "topics and produce pointer.",
    )
    common.add_output(ls)
    ls.set_defaults(func=_list)


def _create(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        topic = client.create_topic(args.name, args.partitions, args.allow_uneven)
    if args.output == "json":
        common.emit_json(topic.to_dict())
    else:
        st = topic.produce_topic
        print(f"created {topic.name}: storage topic {st.name} with {st.partitions} partitions")
    return 0


def _add_storage(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        report = client.add_storage(args.name, args.partitions, args.allow_uneven)
    if args.output == "json":
        common.emit_json({**report.storage.to_dict(), "partition_change": not report.compatible})
    else:
        print(
            f"added {report.storage.name}: {report.storage.partitions} partitions, K={report.storage.k}"
        )
    if not report.compatible:
        print(f"warning: {report.describe()}", file=sys.stderr)
    return 0


def _switch_produce(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        topic = client.switch_produce(args.name)
    if args.output == "json":
        common.emit_json(topic.to_dict())
    else:
        print(
            f"{topic.name} now produces to {topic.produce_topic.name} "
            f"(storage topic {topic.produce_pointer})"
        )
    return 0


def _describe(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        doc = client.describe_topic(args.name)
    if args.output == "json":
        common.emit_json(doc)
    else:
        print("\n".join(describe_lines(doc)))
    return 0


def _list(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        docs = client.describe_topics([t.name for t in client.topics()])
    if args.output == "json":
        common.emit_json(docs)
        return 0
    if not docs:
        print("no topics")
    for i, doc in enumerate(docs):
        if i:
            print()
        print("\n".join(describe_lines(doc)))
    return 0


def _delete(args: argparse.Namespace) -> int:
    from varadhi.ops.lifecycle import text_topic_plan

    text = args.output == "text"
    with common.client(args) as client:
        plan = client.delete_topic(
            args.name,
            args.keep_data,
            dry_run=args.dry_run,
            log=print if text and not args.dry_run else common.silent,
        )
    if text:
        print("\n".join(text_topic_plan(plan, done=not args.dry_run)))
    else:
        common.emit_json({**plan.to_dict(), "dry_run": args.dry_run})
    return 0


def describe_lines(doc: dict[str, Any]) -> list[str]:
    """A `TopicService.describe` document as a small table, the produce topic marked `*`."""
    kind = " (internal)" if doc.get("internal") else ""
    lines = [
        f"topic {doc['name']}{kind}: produces to {doc['produce_topic']} "
        f"(produce pointer {doc['produce_pointer']})",
        f"  {'':1} {'#':>2}  {'storage topic':<24} {'partitions':>10} {'K':>4} {'messages':>10}"
        "  end offsets",
    ]
    for i, st in enumerate(doc["storage_topics"]):
        mark = "*" if i == doc["produce_pointer"] else ""
        offsets = ",".join(str(o) for o in st["end_offsets"])
        lines.append(
            f"  {mark:1} {i:>2}  {st['name']:<24} {st['partitions']:>10} {st['k']:>4} "
            f"{st['messages']:>10}  {offsets}"
        )
    stats = doc.get("statistics")
    if stats:
        lines.append(f"  inserted: {stats['inserted']}")
        for name, c in stats["subscriptions"].items():
            lines.append(
                f"  subscription {name}: routed {c['routed']}, emitted {c['emitted']}, "
                f"acknowledged {c['acknowledged']}"
            )
    return lines
