"""Outbox relay throughput: pre-insert N rows of 1 KiB, then time one relay draining them to Kafka.

    scripts/kafka start; eval "$(scripts/postgres start)"
    .venv/bin/python bench/outbox_relay.py [--rows 200000] [--dialect postgres sqlite]

Each run creates a fresh composite topic (12 partitions) and fresh outbox tables, inserts the rows
(10,000 groups; PostgreSQL with binary COPY, SQLite with executemany), then runs
`Relay.run_once()`, which sends every row, waits for Kafka's acknowledgements (acks=all,
idempotent producer) and deletes the rows. Reported: insert and relay rates (wall clock, and per CPU-second
of the relay process, which a busy machine changes less), and whether Kafka's end offsets add up to
the row count. The relay runs in this process, with the broker on the same
machine. Results go to bench/results/outbox_relay.json.

kafka-python computes each record batch's CRC-32C in pure Python unless the `crc32c` package is
installed; the report says which one ran, since it changes the figure several times over. The
results file keeps the latest run of each kind (`PYTHONPATH=<dir with crc32c> ...` for the other).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kafka.record import util as record_util

from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Message
from varadhi.kafka.settings import Settings
from varadhi.kafka.topics import TopicService, end_offsets
from varadhi.outbox.relay import Relay, connector
from varadhi.outbox.tables import Outbox

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "outbox_relay.json"


def insert(outbox: Outbox, conn, topic: str, rows: int, groups: int, chunk: int = 20_000) -> float:
    value = os.urandom(512).hex().encode()  # 1 KiB
    t0 = time.perf_counter()
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        messages = [Message(value, f"group-{(start + i) % groups}") for i in range(n)]
        outbox.add_many(conn, topic, messages)
        conn.commit()
    return time.perf_counter() - t0


def run(dialect: str, rows: int, groups: int, args, catalog: Catalog) -> dict:
    name = f"bench-outbox-{uuid.uuid4().hex[:8]}"
    topic = TopicService(catalog).create(name, args.topic_partitions)
    prefix = f"bench_{uuid.uuid4().hex[:8]}"
    outbox = Outbox(shards=1, partitions=args.partitions, table_prefix=prefix)
    tmp = None
    if dialect == "postgres":
        import psycopg

        dsn = os.environ.get("VARADHI_TEST_POSTGRES_DSN")
        if not dsn:
            raise SystemExit('set VARADHI_TEST_POSTGRES_DSN: eval "$(scripts/postgres start)"')
        conn = psycopg.connect(dsn)
        connect = connector(dsn=dsn)
    else:
        tmp = tempfile.mkdtemp(prefix="varadhi-bench-outbox-")
        path = os.path.join(tmp, "outbox.db")
        conn = sqlite3.connect(path)
        connect = connector(sqlite=path)
    outbox.create_tables(conn)
    insert_s = insert(outbox, conn, name, rows, groups)
    conn.commit()
    if dialect == "postgres":
        conn.autocommit = True
        for table in outbox.tables():
            conn.execute(f"VACUUM ANALYZE {table}")  # what autovacuum does after a bulk load
    relay = Relay(connect, outbox, catalog=catalog, batch_size=args.batch_size)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        relayed = relay.run_once()
        relay_s, relay_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    finally:
        relay.close()
    left = sum(outbox.pending(conn).values())
    in_kafka = sum(end_offsets(catalog, topic.storage_topics)[topic.produce_topic.name])
    if dialect == "postgres":
        for table in outbox.tables():
            conn.execute(f"DROP TABLE {table}")
    conn.close()
    return {
        "dialect": dialect,
        "rows": rows,
        "groups": groups,
        "value_bytes": 1024,
        "outbox_partitions": args.partitions,
        "topic_partitions": args.topic_partitions,
        "batch_size": args.batch_size,
        "insert_s": round(insert_s, 3),
        "insert_msgs_per_s": round(rows / insert_s),
        "relay_s": round(relay_s, 3),
        "relay_msgs_per_s": round(relayed / relay_s),
        "relay_cpu_s": round(relay_cpu_s, 3),
        "relay_msgs_per_cpu_s": round(relayed / relay_cpu_s),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
        "relayed": relayed,
        "left_in_outbox": left,
        "in_kafka": in_kafka,
        "complete": relayed == rows and left == 0 and in_kafka == rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--dialect", nargs="+", default=["postgres", "sqlite"])
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--partitions", type=int, default=1, help="outbox partitions (tables)")
    parser.add_argument("--topic-partitions", type=int, default=12)
    parser.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = parser.parse_args(argv)

    settings = Settings.from_env(catalog_topic=f"__varadhi_catalog_bench_{uuid.uuid4().hex[:8]}")
    catalog = Catalog(settings)
    results = []
    try:
        for dialect in args.dialect:
            result = run(dialect, args.rows, args.groups, args, catalog)
            print(
                f"{dialect:8s} insert {result['insert_msgs_per_s']:>8,} msg/s   relay "
                f"{result['relay_msgs_per_s']:>8,} msg/s ({result['relayed']:,} rows in "
                f"{result['relay_s']:.1f} s; {result['relay_msgs_per_cpu_s']:,} msg per relay "
                f"CPU-second)   complete={result['complete']}   "
                f"load {result['load_average_1m_after']}",
                flush=True,
            )
            results.append(result)
    finally:
        catalog.close()
    doc = {
        "benchmark": "outbox_relay",
        "command": "python bench/outbox_relay.py " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "kafka_crc32c": "C (crc32c package)"
        if record_util.crc32c_c is not None
        else "pure Python (crc32c package not installed)",
        "reference": "tw-tkms: 50,000 msg/s on a laptop (its documentation)",
        "results": results,
    }
    print(f"kafka-python CRC-32C: {doc['kafka_crc32c']}")
    if not args.no_write:
        # One entry per CRC-32C implementation: a run replaces the earlier one of its kind.
        runs = []
        if RESULTS.exists():
            runs = [
                r
                for r in json.loads(RESULTS.read_text()).get("runs", [])
                if r.get("kafka_crc32c") != doc["kafka_crc32c"]
            ]
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({"runs": [*runs, doc]}, indent=2) + "\n")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0 if all(r["complete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
