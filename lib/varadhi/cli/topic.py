"""`varadhi topic ...`: composite topic commands (placeholder: create only; to be completed)."""

from __future__ import annotations

import argparse

from ..topics import TopicService
from . import common


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topic", help="composite topics")
    tsub = p.add_subparsers(dest="topic_command", metavar="ACTION", required=True)
    c = tsub.add_parser("create", help="create a composite topic")
    c.add_argument("name")
    c.add_argument("--partitions", type=int, required=True)
    c.add_argument("--allow-uneven", action="store_true")
    c.set_defaults(func=_create)


def _create(args: argparse.Namespace) -> int:
    topic = TopicService(common.catalog(args)).create(args.name, args.partitions, args.allow_uneven)
    print(f"created {topic.name}: {topic.produce_topic.name} with {args.partitions} partitions")
    return 0
