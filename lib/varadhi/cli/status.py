"""`varadhi status NAME`: per shard and queue, lag, rates, blocked groups and DLQ depth."""

from __future__ import annotations

import argparse
import time

from varadhi.cli import common
from varadhi.kafka.subscriptions import Suspension
from varadhi.ops import status

TEXT_BLOCKED = 10  # blocked groups named per shard in text; --output json has up to 100


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="lag, rates, blocked groups and DLQ depth of a subscription",
        description="Status of a subscription from the shards' latest progress and Kafka's "
        "current offsets. Works without Spark and while shards are stopped. Blocked groups are "
        "named with their head message (up to 10 per shard; 100 with --output json).",
    )
    p.add_argument("name", help="subscription name")
    common.add_output(p)
    p.set_defaults(func=_status)


def standby_text(sb: dict) -> str:
    """One line about a standby instance of a shard (pure)."""
    w = sb.get("watching") or {}
    if w.get("holder"):
        how = f"lease of {w['holder']} unchanged for {w.get('unchanged_s', 0):.0f}s"
        if w.get("ttl_ms"):
            how += f" of {w['ttl_ms'] / 1000:.0f}s"
    else:
        how = w.get("why") or "waiting"
    return f"standby {sb.get('instance')}: {how}"


def suspended_text(suspended: dict, now_ms: int) -> str:
    """The status line's note on a suspension (endpoint health), escaped for a terminal."""
    since_s = max(0, now_ms - int(suspended["since_ms"])) / 1000
    s = Suspension.from_dict(suspended)
    assert s is not None
    prober = "a member" if s.member is not None else f"shard {s.shard}"
    ends = (
        f"a probe by {prober} finds the endpoint healthy, or a resume"
        if s.resume == "probe"
        else "`varadhi subscription resume`"
    )
    reason = common.printable(s.reason)
    return f" (suspended {since_s:.0f}s ago by {common.printable(s.by)}: {reason}; until {ends})"


def library_lines(doc: dict, flags: str, now_ms: int) -> list[str]:
    """`varadhi status` of a `runtime: library` subscription as text (pure): the consumer
    group's lag and DLQ depth, then one row per member that reported lately, with its circuit
    (`circuit_text`: an open one's seconds left as of `now_ms`)."""
    lib = doc["library"]
    lines = [
        f"subscription {doc['subscription']}{flags}: runtime library, {doc['shard_count']} slots,"
        f" consumer group {lib['group']}",
        f"main lag {lib['main_lag']}, rq lag {lib['rq_lag']} (past the group's committed offsets),"
        f" dlq depth {lib['dlq_depth']}",
    ]
    if not lib["members"]:
        lines.append("no member reported in the last 10 minutes (start `varadhi-consumer`)")
    else:
        lines.append(
            f"{'member':<28} {'state':<9} {'circuit':<12} {'slots':<7} {'seen':>6} {'pending':>7} "
            f"{'in flight':>9} {'delivered':>9} {'retried':>7} {'dead':>5}"
        )
    for m in lib["members"]:
        c = m["counters"]
        slots = ",".join(str(s) for s in m["slots"]) or "-"
        lines.append(
            f"{common.printable(m['member']):<28} {m['state']:<9} "
            f"{status.circuit_text(m.get('circuit'), now_ms):<12} {slots:<7} "
            f"{m['age_ms'] / 1000:>5.0f}s {c.get('pending', 0):>7} {c.get('in_flight', 0):>9} "
            f"{c.get('delivered', 0):>9} {c.get('retried', 0):>7} {c.get('dead_lettered', 0):>5}"
        )
        if m.get("error"):
            lines.append(f"  {common.printable(str(m['error']))}")
        if m.get("waiting"):
            lines.append(f"  {common.printable(str(m['waiting']))}")
    st = doc["stats"]
    lines.append(
        f"messages: inserted {st['inserted']}; of the members shown, since each started: read"
        f" {st['routed']}, emitted {st['emitted']}, acknowledged {st['acknowledged']}"
    )
    lines += [
        f"operation {key}: {op.get('kind', '?')} {op.get('step', '')}".rstrip()
        for key, op in doc["operations"].items()
    ]
    return lines


def _status(args: argparse.Namespace) -> int:
    with common.client(args) as client:
        doc = client.status(args.name)
    if args.output == "json":
        common.emit_json(doc)
        return 0
    flags = " (paused)" if doc["paused"] else ""
    if doc.get("suspended"):
        flags += suspended_text(doc["suspended"], int(time.time() * 1000))
    if doc.get("runtime") == "library":
        print("\n".join(library_lines(doc, flags, int(time.time() * 1000))))
        return 0
    print(
        f"subscription {doc['subscription']}{flags}: {doc['shard_count']} shards, generation {doc['generation']}"
    )
    print(
        f"{'shard':>5}  {'state':<14} {'circuit':<12} {'main lag':>9} {'rq lag':>7} {'rq pend':>7} "
        f"{'dlq parked':>10} {'dlq depth':>9} {'blocked':>7} {'deliv/s':>8} {'fail/s':>7}"
    )
    now = int(time.time() * 1000)
    for s in doc["shards"]:
        q = s["queues"]
        r = s["rates"]
        circuit = status.circuit_text(s.get("circuit"), now)
        state = s["state"]
        if state == "dead" and s.get("dead_for_ms") is not None:
            state = f"dead {s['dead_for_ms'] / 1000:.0f}s"
        print(
            f"{s['shard']:>5}  {state:<14} {circuit:<12} {q['main']['lag']:>9} {q['rq']['lag']:>7} "
            f"{q['rq']['pending']:>7} {q['dlq']['parked']:>10} {q['dlq']['depth']:>9} "
            f"{s['blocked_groups']:>7} {r.get('delivered_per_s', 0):>8} {r.get('failures_per_s', 0):>7}"
        )
    for s in doc["shards"]:
        for sb in s.get("standbys") or []:
            print(f"shard {s['shard']} {standby_text(sb)}")
    for s in doc["shards"]:
        if s.get("waiting"):
            print(f"shard {s['shard']} {s['waiting']['text']}")
    for s in doc["shards"]:
        blocked = s.get("blocked") or []
        if blocked:
            print(f"shard {s['shard']} blocked groups ({s['blocked_groups']}):")
        for b in blocked[:TEXT_BLOCKED]:
            why = f": {common.printable(b['reason'])}" if b.get("reason") else ""
            group, head = common.printable(b["group"]), common.printable(b["head"])
            print(f"  {group}  head {head} in {b['where']}{why} ({b['waiting']} waiting)")
        if s["blocked_groups"] > min(len(blocked), TEXT_BLOCKED):
            print(f"  ... {s['blocked_groups'] - min(len(blocked), TEXT_BLOCKED)} more")
    st = doc["stats"]
    print(
        f"messages: inserted {st['inserted']}, routed {st['routed']}, emitted {st['emitted']}, "
        f"acknowledged {st['acknowledged']}, filtered {doc.get('filtered', 0)}"
    )
    for key, op in doc["operations"].items():
        print(f"operation {key}: {op.get('kind', '?')} {op.get('step', '')}".rstrip())
    return 0
