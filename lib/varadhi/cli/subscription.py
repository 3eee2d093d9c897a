"""`varadhi subscription ...`: create, apply, describe, list, pause, resume and change-shards.

Options and files are parsed into a `SubscriptionSpec` (`varadhi.kafka.subscription_spec.parse_spec`)
before the catalog or Kafka is touched, so a refused command changes nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from varadhi.cli import common
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import SubscriptionSpec
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.subscriptions import Subscription, Suspension


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "subscription",
        help="subscriptions: deliver a topic to an HTTP endpoint",
        description="Subscriptions deliver a composite topic to an HTTP endpoint in shards, "
        "with a retry queue (<name>.rq) and a dead-letter queue (<name>.dlq).",
    )
    ssub = p.add_subparsers(dest="subscription_command", metavar="ACTION", required=True)

    c = ssub.add_parser(
        "create",
        help="create a subscription from options",
        description="Create a subscription and its RQ/DLQ topics. Options not given take the "
        "defaults shown in conf/subscriptions/example.yaml; use `apply -f` for the rest.",
    )
    c.add_argument("name", help="subscription name (letters, digits, '_', '-')")
    c.add_argument("--topic", required=True, help="the composite topic to consume")
    c.add_argument("--endpoint", required=True, metavar="URL", help="http(s) URL to deliver to")
    c.add_argument("--shards", type=int, required=True, help="shard count; divides partitions")
    c.add_argument("--ungrouped", action="store_true", help="no per-group order (max parallelism)")
    c.add_argument("--rq-partitions", type=int, metavar="N", help="default: 2 x shards")
    c.add_argument("--dlq-partitions", type=int, metavar="N", help="default: shards")
    c.add_argument("--max-attempts", type=int, metavar="N", help="attempts, first included")
    c.add_argument("--backoff", choices=["fixed", "exponential"])
    c.add_argument("--min-backoff", metavar="DURATION", help="e.g. 500ms, 1s (default 1s)")
    c.add_argument("--max-backoff", metavar="DURATION", help="e.g. 60s, 5m (default 60s)")
    c.add_argument(
        "--on-dead-letter",
        choices=["block", "skip"],
        help="block: a group waits behind its dead-lettered message (default); skip: it moves on",
    )
    c.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="deliver up to N messages per request (delivery.mode batch; docs/delivery.md); "
        "default: one message per request",
    )
    c.add_argument(
        "--auth-env",
        metavar="VAR",
        help="environment variable holding the Authorization header value (never stored)",
    )
    c.add_argument(
        "--allow-uneven",
        action="store_true",
        help="accept shards that do not divide the topic's partition count",
    )
    c.add_argument(
        "--runtime",
        choices=["spark", "library"],
        help="who delivers it: spark shards (`varadhi-job shard`, the default) or library "
        "members (`varadhi-consumer`, docs/library.md); each refuses the other's subscriptions",
    )
    c.set_defaults(func=_create)

    a = ssub.add_parser(
        "apply",
        help="create or update subscriptions from YAML",
        description="Create or update the subscriptions of a YAML file: one subscription, or a "
        "list under `subscriptions:`. All are checked before any is applied. Updates may change "
        "endpoint, retry, consumption, circuit_breaker, on_dead_letter, max_message_bytes, "
        "dedup_window, filter and delivery (a changed filter applies from the next micro-batch); "
        "runtime only while the subscription is paused and its shards or members report paused "
        "or stopped (docs/library.md#moving-between-runtimes).",
    )
    a.add_argument("-f", "--file", required=True, metavar="FILE", help="YAML file")
    a.set_defaults(func=_apply)

    d = ssub.add_parser("describe", help="spec, state, queues and shard assignment")
    d.add_argument("name")
    common.add_output(d)
    d.set_defaults(func=_describe)

    ls = ssub.add_parser("list", help="list subscriptions")
    common.add_output(ls)
    ls.set_defaults(func=_list)

    for action, paused, text in (
        ("pause", True, "stop consuming (shards finish their current batch)"),
        ("resume", False, "resume consuming"),
    ):
        pr = ssub.add_parser(action, help=text)
        pr.add_argument("name")
        pr.set_defaults(func=_set_paused, paused=paused)

    cs = ssub.add_parser(
        "change-shards",
        help="change the shard count (shards stopped or paused)",
        description="Change the shard count of a subscription whose shards are stopped (or "
        "paused): new RQ/DLQ storage topics, GroupState resharded, new shards' positions carried "
        "over, then feeders copy the old RQ/DLQ into the new ones. Each step is recorded in the "
        "catalog; after a crash, run the same command again to resume. Start the new shards "
        "once it has finished (they may run while external feeders still copy). A `runtime: "
        "library` subscription is changed in place instead (paused, members stopped; the same "
        "queues): docs/library.md.",
    )
    cs.add_argument("name", help="subscription name")
    cs.add_argument("--to", type=int, required=True, metavar="S", help="the new shard count")
    cs.add_argument("--dry-run", action="store_true", help="print the plan; change nothing")
    cs.add_argument(
        "--allow-uneven",
        action="store_true",
        help="accept a count that does not divide the partitions the shards still read",
    )
    cs.add_argument(
        "--feeders",
        choices=["in-process", "external"],
        default="in-process",
        help="run the feeders in this process (default), or leave them to "
        "`spark-submit.sh --job feeder` runs",
    )
    common.add_output(cs)
    cs.set_defaults(func=_change_shards)

    dl = ssub.add_parser(
        "delete",
        help="delete a subscription (shards stopped)",
        description="Delete a subscription whose shards are stopped (or paused and reported "
        "paused) and which has no operation in progress: every catalog record of it (the "
        "subscription, its RQ/DLQ composite topics, leases, reader layouts, operations) in one "
        "catalog transaction, and unless --keep-data its RQ/DLQ Kafka topics and its warehouse "
        "folder (GroupState, checkpoints, dedup). After a crash, run it again to finish.",
    )
    dl.add_argument("name", help="subscription name")
    dl.add_argument(
        "--dry-run", action="store_true", help="print what would be removed; change nothing"
    )
    dl.add_argument(
        "--keep-data",
        action="store_true",
        help="keep the RQ/DLQ Kafka topics and the warehouse folder (only the catalog records go)",
    )
    common.add_output(dl)
    dl.set_defaults(func=_delete)


def _create(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {
        "name": args.name,
        "topic": args.topic,
        "endpoint": {"url": args.endpoint, "auth_env": args.auth_env},
        "shards": args.shards,
        "grouped": not args.ungrouped,
        "rq_partitions": args.rq_partitions,
        "dlq_partitions": args.dlq_partitions,
        "retry": {
            "max_attempts": args.max_attempts,
            "backoff": args.backoff,
            "min_backoff": args.min_backoff,
            "max_backoff": args.max_backoff,
        },
        "on_dead_letter": args.on_dead_letter,
        "allow_uneven": args.allow_uneven,
        "delivery": None if args.batch is None else {"mode": "batch", "max_messages": args.batch},
        "runtime": args.runtime,
    }
    spec = parse_spec(doc, source="command line")
    with common.client(args) as client:
        sub = client.create_subscription(spec)
    print(_summary("created", sub))
    return 0


def load_specs(path: str) -> list[SubscriptionSpec]:
    """The subscriptions of a YAML file: one document, or a list under `subscriptions:`."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}", field="file") from None
    except yaml.YAMLError as e:
        raise InvalidArgument(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if isinstance(doc, dict) and "subscriptions" in doc:
        if len(doc) != 1:
            others = ", ".join(sorted(str(k) for k in doc if k != "subscriptions"))
            raise InvalidArgument(
                f"{path}: a file with `subscriptions:` holds nothing else (found {others})"
            )
        items = doc["subscriptions"]
        if not isinstance(items, list) or not items:
            raise InvalidArgument(f"{path}: `subscriptions:` must be a non-empty list")
        return [parse_spec(d, source=f"{path} subscriptions[{i}]") for i, d in enumerate(items)]
    if doc is None:
        raise InvalidArgument(f"{path} is empty")
    return [parse_spec(doc, source=path)]


def _apply(args: argparse.Namespace) -> int:
    specs = load_specs(args.file)
    with common.client(args) as client:
        results = client.apply(specs)
    for action, sub in results:
        print(_summary(action, sub))
    return 0


def _summary(action: str, sub: Subscription) -> str:
    s = sub.spec
    return (
        f"{action} subscription {s.name}: topic {s.topic}, {sub.shard_count} shard(s), "
        f"RQ {s.rq_topic} ({s.rq_partitions} partitions), "
        f"DLQ {s.dlq_topic} ({s.dlq_partitions} partitions)"
    )


def _describe(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        info = client.describe_subscription(args.name)
    if args.output == "json":
        common.emit_json(info)
        return 0
    spec, state = info["spec"], info["state"]
    endpoint = spec["endpoint"]
    print(f"subscription  {info['name']}")
    print(f"topic         {spec['topic']}")
    print(f"endpoint      {endpoint['method']} {endpoint['url']}")
    print(f"grouped       {'yes' if spec['grouped'] else 'no'}")
    print(f"runtime       {spec.get('runtime', 'spark')}")
    print(f"shards        {state['shard_count']}")
    print(f"paused        {'yes' if state['paused'] else 'no'}")
    if state.get("suspended"):
        sus = Suspension.from_dict(state["suspended"])
        assert sus is not None
        print(
            f"suspended     by {common.printable(sus.by)} since {sus.since_ms} ms: "
            f"{common.printable(sus.reason)} (resume: {sus.resume})"
        )
    print(f"generation    {state['generation']}")
    print(f"dead letters  {spec['on_dead_letter']}")
    print(f"delivery      {_delivery(spec['delivery'])}")
    print(f"trace         {_trace(info['name'], spec.get('trace'))}")
    for label in ("rq", "dlq"):
        for st in info[label]["storage_topics"]:
            print(
                f"{label:<13} {st['name']}: {st['partitions']} partitions, "
                f"{st['messages']} messages written"
            )
    for shard in info["shards"]:
        parts = [
            f"{queue} {a['storage_topic']}{a['partitions']}"
            for queue in ("mq", "rq", "dlq")
            for a in shard[queue]
        ]
        print(f"shard {shard['shard']:<7} {'  '.join(parts)}")
    return 0


def _delivery(d: dict[str, Any]) -> str:
    """`single`, or `batch: up to 100 messages, 1048576 bytes, ndjson`."""
    if d["mode"] != "batch":
        return d["mode"]
    return f"batch: up to {d['max_messages']} messages, {d['max_bytes']} bytes, {d['format']}"


def _trace(name: str, trace: dict[str, Any] | None) -> str:
    """`off`, or `kept 7d in orders-http.trace (varadhi trace)`."""
    if trace is None:
        return "off"
    ms = trace["retention"]
    kept = f"{ms // 86_400_000}d" if ms % 86_400_000 == 0 else f"{ms / 3_600_000:g}h"
    return f"kept {kept} in {name}.trace (varadhi trace)"


def _list(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        subs = client.subscriptions()
    if args.output == "json":
        common.emit_json([sub.to_dict() for sub in subs])
        return 0
    rows = [("NAME", "TOPIC", "SHARDS", "GROUPED", "PAUSED", "ENDPOINT")]
    rows += [
        (
            sub.name,
            sub.spec.topic,
            str(sub.shard_count),
            "yes" if sub.spec.grouped else "no",
            "yes" if sub.paused else "no",
            sub.spec.endpoint.url,
        )
        for sub in subs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _set_paused(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        sub = client.pause(args.name) if args.paused else client.resume(args.name)
    print(f"{'paused' if sub.paused else 'resumed'} subscription {sub.name}")
    return 0


def _change_shards(args: argparse.Namespace) -> int:
    from varadhi.ops import library_shards
    from varadhi.ops.change_shards_plan import text_plan

    text = args.output == "text"
    with common.client(args) as client:
        if args.dry_run:
            plan = client.plan_change_shards(args.name, args.to, args.allow_uneven)
            if not text:
                common.emit_json(plan.to_dict())
            elif isinstance(plan, library_shards.Plan):
                print(library_shards.text_plan(plan))
            else:
                print(text_plan(plan))
            return 0
        op = client.change_shards(
            args.name,
            args.to,
            args.allow_uneven,
            args.feeders,
            log=print if text else common.silent,
        )
        paused = client.subscription(args.name).paused
    if not text:
        common.emit_json(op)
    elif op.get("runtime") == "library":
        print(
            f"subscription {args.name} now has {op['to']} slots; start its members "
            f"(`varadhi-consumer {args.name}`): they read the new count"
        )
    elif op["step"] == "done":
        print(f"subscription {args.name} now has {op['to']} shards; start shards 0..{op['to'] - 1}")
    else:
        print(
            f"subscription {args.name} now has {op['to']} shards; start shards 0..{op['to'] - 1}. "
            "Feeders still to run:"
        )
        for f in op["feeders"]:
            if not f["done"]:
                print(
                    f"  ./spark-submit.sh --job feeder --subscription {args.name} --source {f['source']}"
                )
    if text and paused:
        who = "members" if op.get("runtime") == "library" else "new shards"
        print(
            f"subscription {args.name} is paused: its {who} wait until "
            f"`varadhi subscription resume {args.name}`"
        )
    return 0


def _delete(args: argparse.Namespace) -> int:
    from varadhi.ops.lifecycle import text_subscription_plan

    text = args.output == "text"
    with common.client(args) as client:
        plan = client.delete_subscription(
            args.name,
            args.keep_data,
            dry_run=args.dry_run,
            log=print if text and not args.dry_run else common.silent,
        )
    if text:
        print("\n".join(text_subscription_plan(plan, done=not args.dry_run)))
    else:
        common.emit_json({**plan.to_dict(), "dry_run": args.dry_run})
    return 0
