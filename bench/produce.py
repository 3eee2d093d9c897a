"""Producer throughput: the varadhi library vs plain kafka-python vs Kafka's Java producer.

    scripts/kafka start
    .venv/bin/python bench/produce.py [--messages 200000] [--groups 10000] [--repeat 3]

Every run sends `--messages` values of `--value-bytes` (1 KiB) random bytes, grouped over
`--groups` group ids, to a fresh topic of `--partitions` partitions, and is timed from the first
send until `flush()` returns (every record acknowledged): wall clock, and the CPU time of the
sending process (all its threads). All clients use the same settings: acks=all with the
idempotent producer, linger 5 ms, 64 KiB batches, no compression.

| run                     | what it sends                                                       |
|-------------------------|---------------------------------------------------------------------|
| varadhi                 | `Producer.send(value, group_id)`: validation, routing, headers      |
| kafka-python, same shape| `KafkaProducer.send` of the same records (key, the three varadhi     |
|                         | headers, ids from `new_message_id`), Kafka's default partitioner    |
| kafka-python, bare      | `KafkaProducer.send(topic, value, key=group)`: no headers           |
| Java ProducerPerformance| Kafka's own tool from the broker's jars (.jars/kafka): no key, no   |
|                         | headers, random payload                                              |

The target ("routing adds at most 10% over plain kafka-python") compares varadhi with
"kafka-python, same shape": the same bytes reach the broker, so the difference is what the
library does per message. It is judged on CPU time per message, because the wall-clock rate
swings with whatever else runs on the machine (the broker shares its cores) while the CPU a
process spends per message hardly does; both are reported. The Python runs are interleaved and
repeated (`--repeat`); the table shows medians. kafka-python computes
record batch CRCs in pure Python unless the `crc32c` package is installed; the report says which.

Results: a table on stdout, JSON in bench/results/produce.json. Topics are deleted afterwards;
the composite topics live in their own catalog topic (`__varadhi_catalog_bench`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.record import util as record_util

from varadhi.core.messages import H_GROUP_ID, H_MSG_ID, H_PRODUCED_MS
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Producer, new_message_id
from varadhi.kafka.settings import Settings
from varadhi.kafka.topics import TopicService

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "produce.json"
JAVA_LINE = re.compile(
    r"(\d+) records sent, ([\d.]+) records/sec \(([\d.]+) MB/sec\), ([\d.]+) ms avg latency"
)


def kafka_settings(args: argparse.Namespace) -> dict:
    """The same producer settings for every Python run (the Java run gets the same below)."""
    return {"acks": "all", "linger_ms": args.linger_ms, "batch_size": args.batch_size}


def java_settings(args: argparse.Namespace) -> list[str]:
    return [
        "acks=all",
        "enable.idempotence=true",
        f"linger.ms={args.linger_ms}",
        f"batch.size={args.batch_size}",
        "compression.type=none",
    ]


def result(name: str, messages: int, value_bytes: int, seconds: float, **extra) -> dict:
    return {
        "run": name,
        "messages": messages,
        "seconds": round(seconds, 3),
        "msg_per_s": round(messages / seconds),
        "mb_per_s": round(messages * value_bytes / seconds / 2**20, 2),
        **extra,
    }


def timed(send_all: Callable[[], None], flush: Callable[[], None]) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process, all threads) of sending and flushing."""
    t0, c0 = time.perf_counter(), time.process_time()
    send_all()
    flush()
    return time.perf_counter() - t0, time.process_time() - c0


def run_varadhi(args, settings: Settings, catalog: Catalog, value: bytes, groups: list[str]):
    name = f"bench-produce-{uuid.uuid4().hex[:8]}"
    TopicService(catalog).create(name, args.partitions)
    n = args.messages
    with Producer(name, settings, catalog=catalog, **kafka_settings(args)) as producer:
        producer.send(value, "warm-up").get(30)
        send = producer.send

        def send_all() -> None:
            for i in range(n):
                send(value, groups[i % len(groups)])

        seconds, cpu = timed(send_all, producer.flush)
    return f"{name}.0", seconds, cpu


def run_plain(args, settings: Settings, value: bytes, groups: list[str], headers: bool):
    topic = f"bench-produce-plain-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
    admin.create_topics([NewTopic(topic, args.partitions, 1)])
    admin.close()
    keys = [g.encode() for g in groups]
    n = args.messages
    producer = KafkaProducer(bootstrap_servers=settings.bootstrap, **kafka_settings(args))
    producer.send(topic, value, key=b"warm-up").get(30)
    send = producer.send

    def send_all() -> None:
        for i in range(n):
            key = keys[i % len(keys)]
            if headers:
                h = [
                    (H_MSG_ID, new_message_id().encode()),
                    (H_PRODUCED_MS, str(int(time.time() * 1000)).encode()),
                    (H_GROUP_ID, key),
                ]
                send(topic, value, key=key, headers=h)
            else:
                send(topic, value, key=key)

    seconds, cpu = timed(send_all, producer.flush)
    producer.close()
    return topic, seconds, cpu


def run_java(args, settings: Settings) -> dict:
    topic = f"bench-produce-java-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
    admin.create_topics([NewTopic(topic, args.partitions, 1)])
    admin.close()
    cmd = [
        "java",
        "-Xmx512m",
        "-cp",
        str(ROOT / ".jars" / "kafka" / "*"),
        "org.apache.kafka.tools.ProducerPerformance",
        "--topic",
        topic,
        "--num-records",
        str(args.messages),
        "--record-size",
        str(args.value_bytes),
        "--throughput",
        "-1",
        "--producer-props",
        f"bootstrap.servers={settings.bootstrap}",
        *java_settings(args),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    match = [m for m in JAVA_LINE.finditer(out)][-1]
    sent, rate = int(match.group(1)), float(match.group(2))
    row = result(
        "Java ProducerPerformance",
        sent,
        args.value_bytes,
        sent / rate,
        avg_latency_ms=float(match.group(4)),
    )
    return {**row, "topic": topic, "command": " ".join(cmd[:3] + ["'.jars/kafka/*'"] + cmd[4:])}


def count_records(settings: Settings, topic: str) -> int:
    consumer = KafkaConsumer(bootstrap_servers=settings.bootstrap, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
        return sum(consumer.end_offsets(tps).values())
    finally:
        consumer.close()


def delete_topics(settings: Settings, topics: list[str]) -> None:
    admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
    try:
        admin.delete_topics(topics)
    finally:
        admin.close()


def summarise(runs: list[dict]) -> list[dict]:
    """Per kind of run, in first-seen order: the run with the median msg/s, plus the median CPU
    time per message over all its repeats (CPU time barely moves with other load on the machine;
    wall-clock throughput does)."""
    names = list(dict.fromkeys(r["run"] for r in runs))
    rows = []
    for name in names:
        mine = sorted((r for r in runs if r["run"] == name), key=lambda r: r["msg_per_s"])
        row = {**mine[len(mine) // 2], "repeats": len(mine)}
        row["all_msg_per_s"] = [r["msg_per_s"] for r in mine]
        cpu = [r["cpu_us_per_msg"] for r in mine if r.get("cpu_us_per_msg") is not None]
        row["cpu_us_per_msg"] = statistics.median(cpu) if cpu else None
        row.pop("repeat", None)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--linger-ms", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=65_536)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-java", action="store_true", help="skip Kafka's Java tool")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()

    load_before = os.getloadavg()
    settings = Settings.from_env(
        catalog_topic=os.environ.get("VARADHI_CATALOG_TOPIC", "__varadhi_catalog_bench")
    )
    catalog = Catalog(settings)
    value = os.urandom(args.value_bytes)
    groups = [f"group-{i}" for i in range(args.groups)]
    python_runs = {
        "varadhi Producer": lambda: run_varadhi(args, settings, catalog, value, groups),
        "kafka-python, same shape": lambda: run_plain(args, settings, value, groups, True),
        "kafka-python, bare": lambda: run_plain(args, settings, value, groups, False),
    }
    runs, topics = [], []
    try:
        for rep in range(args.repeat):
            for name, run in python_runs.items():
                topic, seconds, cpu = run()
                topics.append(topic)
                count = count_records(settings, topic)
                assert count == args.messages + 1, (
                    f"{name}: {count} records, expected {args.messages + 1}"
                )
                cpu_us = round(cpu / args.messages * 1e6, 2)
                runs.append(
                    result(
                        name,
                        args.messages,
                        args.value_bytes,
                        seconds,
                        cpu_us_per_msg=cpu_us,
                        repeat=rep,
                    )
                )
                print(f"  {name:<26} run {rep + 1}: {runs[-1]['msg_per_s']:>8} msg/s", flush=True)
        if not args.no_java:
            java = run_java(args, settings)
            topics.append(java.pop("topic"))
            runs.append(java)
    finally:
        if topics:
            delete_topics(settings, topics)
        catalog.close()

    rows = summarise(runs)
    library = next(r for r in rows if r["run"] == "varadhi Producer")
    same = next(r for r in rows if r["run"] == "kafka-python, same shape")
    wall_overhead = same["msg_per_s"] / library["msg_per_s"] - 1
    cpu_overhead = library["cpu_us_per_msg"] / same["cpu_us_per_msg"] - 1
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "crc32c": "C (crc32c package)" if record_util.crc32c_c else "pure Python",
            # the machine is shared (broker, other jobs): 1-minute load before and after
            "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        },
        "parameters": {k: v for k, v in vars(args).items() if k not in ("output",)},
        "java_command": next((r.get("command") for r in runs if "command" in r), None),
        "results": rows,
        "runs": runs,
        "library_overhead_vs_same_shape": {
            "cpu_per_message": round(cpu_overhead, 4),
            "wall_clock": round(wall_overhead, 4),
        },
        "target_met": cpu_overhead <= 0.10,
    }
    print()
    print(f"{'run':<26} {'msg/s':>9} {'MB/s':>7} {'s':>7} {'CPU us/msg':>11}  all runs (msg/s)")
    for r in rows:
        cpu = "" if r["cpu_us_per_msg"] is None else f"{r['cpu_us_per_msg']:.1f}"
        print(
            f"{r['run']:<26} {r['msg_per_s']:>9} {r['mb_per_s']:>7} {r['seconds']:>7} "
            f"{cpu:>11}  {r['all_msg_per_s']}"
        )
    machine = report["machine"]
    print(
        f"\nvaradhi over kafka-python (same shape): CPU per message {cpu_overhead:+.1%}, "
        f"wall clock {wall_overhead:+.1%} (target <= +10%: "
        f"{'met' if report['target_met'] else 'NOT met'}, judged on CPU time)\n"
        f"CRC-32C: {machine['crc32c']}; medians of {args.repeat}; "
        f"load average {machine['load_average'][0]} -> {machine['load_average'][1]}"
    )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
