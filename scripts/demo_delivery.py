"""The delivery half of `scripts/demo`: a grouped subscription with two shards delivering to a
local HTTP endpoint that fails a share of requests, run until the backlog is drained.

    .venv/bin/python scripts/demo_delivery.py [--messages 4000] [--groups 200] [--fail-rate 0.1]

It starts the endpoint (varadhi.testing.endpoint: 5xx with and without Retry-After, slow answers
past the request timeout, and a few fatal 4xx), creates a 12-partition topic and a subscription
with two shards (block mode: a dead-lettered message holds its group), produces the messages,
runs both shards with ./spark-submit.sh until they are idle, and prints delivered, retried and
dead-lettered counts, the shards' status and a per-group order check. Exit code 1 if order was
broken or a message is neither delivered nor parked.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import produce

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--fail-rate", type=float, default=0.1)
    args = parser.parse_args()

    run = uuid.uuid4().hex[:6]
    os.environ.setdefault("VARADHI_WAREHOUSE", str(ROOT / ".varadhi" / "warehouse"))
    catalog = Catalog()
    settings = catalog.settings
    mix = {"500": 4, "503": 3, "slow": 1, "404": 0.15}
    endpoint = TestEndpoint(fail_rate=args.fail_rate, seed=7, mix=mix, slow_ms=1500)
    url = endpoint.start()
    print(f"endpoint {url}: fails {args.fail_rate:.0%} of requests ({mix})")

    topic, name = f"demo-orders-{run}", f"demo-orders-http-{run}"
    TopicService(catalog).create(topic, 12)
    spec = parse_spec(
        {
            "name": name,
            "topic": topic,
            "endpoint": {"url": url, "request_timeout": "1s"},
            "shards": 2,
            "retry": {
                "max_attempts": 4,
                "min_backoff": "200ms",
                "max_backoff": "2s",
                "multiplier": 2,
            },
            "consumption": {"trigger_interval": "200ms", "max_in_flight": 64},
            "trace": {"retention": "1h"},  # every attempt, shown below by `varadhi trace`
        }
    )
    SubscriptionService(catalog).create(spec)
    print(f"topic {topic} (12 partitions), subscription {name}: 2 shards, grouped, block mode")

    ids = [(f"g{i % args.groups}", f"{run}-{i}") for i in range(args.messages)]
    produced_from = int(time.time() * 1000)
    produce(settings, topic, ids)
    print(f"produced {len(ids)} messages over {args.groups} groups")

    started = time.monotonic()
    env = dict(
        os.environ,
        VARADHI_BOOTSTRAP=settings.bootstrap,
        VARADHI_CATALOG_TOPIC=settings.catalog_topic,
    )
    shards = [
        subprocess.Popen(
            [str(ROOT / "spark-submit.sh"), name, str(s), "--stop-when-idle", "5"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(ROOT / ".varadhi" / f"demo-shard-{s}.log", "w"),  # noqa: SIM115
        )
        for s in range(2)
    ]
    print("running shards 0 and 1 with ./spark-submit.sh (logs: .varadhi/demo-shard-*.log) ...")
    codes = [p.wait() for p in shards]
    seconds = time.monotonic() - started

    records = endpoint.records()
    first_ok: dict[str, str] = {}
    for r in records:
        if r.status < 300 and r.message_id not in first_ok:
            first_ok[r.message_id] = r.group_id
    parked_rows = dlq.list_parked(catalog, name, limit=0)
    parked = {p["msg_id"] for p in parked_rows}
    blocked = {p["group_id"] for p in parked_rows}  # block mode: later messages wait behind these
    retried = sum(1 for r in records if (r.attempt or 1) > 1)
    order: dict[str, list[int]] = defaultdict(list)
    for r in records:
        seq = int(r.message_id.rsplit("-", 1)[1])
        if r.status < 300 and seq not in order[r.group_id]:
            order[r.group_id].append(seq)
    broken = [g for g, seqs in order.items() if seqs != sorted(seqs)]
    waiting = [m for g, m in ids if m not in first_ok and m not in parked and g in blocked]
    lost = [m for g, m in ids if m not in first_ok and m not in parked and g not in blocked]

    print(f"\nshards exited {codes} after {seconds:.0f} s")
    print(f"requests sent:        {len(records)}")
    print(f"delivered:            {len(first_ok)} of {len(ids)}")
    print(f"retried attempts:     {retried}")
    print(f"dead-lettered:        {len(parked)}")
    print(
        f"waiting behind a DLQ: {len(waiting)} messages in {len(blocked)} blocked groups "
        f"(re-drive them with: varadhi dlq unsideline {name} --group-ids ...)"
    )
    verdict = f"kept in all {len(order)} groups" if not broken else f"BROKEN in {broken[:5]}"
    print(f"per-group order:      {verdict}")
    print(f"lost:                 {len(lost)}")
    print()
    varadhi = str(ROOT / ".venv" / "bin" / "varadhi")
    subprocess.run([varadhi, "status", name], env=env, check=False)
    if parked_rows:
        example = parked_rows[0]["msg_id"]
        print(f"\n== every attempt of dead-lettered message {example} (varadhi trace)")
        trace = [varadhi, "trace", name, "--message-id", example]
        subprocess.run(trace, env=env, check=False)

    print(f"\n== replay: re-deliver the first minute of {topic} out of band (X-Varadhi-Replay)")
    endpoint.fail_rate = 0.0
    before = len(endpoint.records())
    subprocess.run(
        [
            varadhi,
            "replay",
            name,
            "--from",
            str(produced_from),
            "--to",
            str(produced_from + 60_000),
        ],
        env=env,
        check=False,
    )
    replayed = [r for r in endpoint.records()[before:] if r.status < 300]
    print(f"the endpoint received {len(replayed)} replayed messages")
    endpoint.stop()
    return 0 if not broken and not lost and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
