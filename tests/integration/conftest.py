"""Fixtures for tests against the real local Kafka broker (see tests/conftest.py for the basics).

Each fixture here is a self-contained factory; add new ones below the existing ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord


@pytest.fixture
def topic_service(catalog):
    """A `TopicService` on the test run's catalog."""
    from varadhi.kafka.topics import TopicService

    return TopicService(catalog)


@pytest.fixture
def make_topic(topic_service, unique_name):
    """make_topic(2, 12, switches=1) -> name of a fresh composite topic whose storage topics have
    those partition counts, with the produce pointer moved `switches` times."""

    def make(*partitions: int, switches: int = 0, prefix: str = "t") -> str:
        name = unique_name(prefix)
        topic_service.create(name, partitions[0], allow_uneven=True)
        for p in partitions[1:]:
            topic_service.add_storage(name, p, allow_uneven=True)
        for _ in range(switches):
            topic_service.switch_produce(name)
        return name

    return make


@pytest.fixture
def read_records(bootstrap):
    """read_records(storage_topic, isolation="read_committed") -> every record of the Kafka topic
    up to its current end, sorted by (partition, offset)."""
    consumers: list[KafkaConsumer] = []

    def read(topic: str, isolation: str = "read_committed") -> list[ConsumerRecord]:
        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            isolation_level=isolation,
            enable_auto_commit=False,
            client_id="test-read-records",
        )
        consumers.append(consumer)
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + 120  # Kafka work on a loaded machine
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"timed out reading {topic}"
            for batch in consumer.poll(timeout_ms=200).values():
                records.extend(batch)
        return sorted(records, key=lambda r: (r.partition, r.offset))

    yield read
    for consumer in consumers:
        consumer.close()


@pytest.fixture
def varadhi_cli(bootstrap, capsys):
    """Run the CLI in this process: varadhi_cli(*args) -> (exit code, stdout, stderr)."""
    from varadhi import cli

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(["--bootstrap", bootstrap, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


@pytest.fixture
def varadhi_processes(bootstrap):
    """varadhi_processes([args, args, ...]) -> CompletedProcess per argument list, all started at
    once as separate `varadhi` processes (same catalog topic, through the environment)."""

    def run(arg_lists: list[list[str]], timeout: float = 60) -> list[subprocess.CompletedProcess]:
        env = {**os.environ, "VARADHI_BOOTSTRAP": bootstrap}
        cmd = [sys.executable, "-c", "import sys; from varadhi.cli import main; sys.exit(main())"]
        procs = [
            subprocess.Popen(
                cmd + args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for args in arg_lists
        ]
        done = []
        for args, proc in zip(arg_lists, procs, strict=True):
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(cmd + args, proc.returncode, out, err))
        return done

    return run


@pytest.fixture
def make_subscription(catalog, unique_name):
    """Factory: a 2-partition topic and a one-shard grouped subscription delivering to `url`."""

    from varadhi.core.subscription_spec import parse_spec
    from varadhi.kafka.subscriptions import SubscriptionService
    from varadhi.kafka.topics import TopicService

    def make(url: str, **overrides):
        topic = unique_name("ops")
        TopicService(catalog).create(topic, 2)
        doc = {
            "name": unique_name("ops-sub"),
            "topic": topic,
            "endpoint": {"url": url},
            "shards": 1,
            "retry": {
                "max_attempts": 2,
                "min_backoff": "100ms",
                "max_backoff": "200ms",
                "jitter": 0,
                "in_place_window": 0,  # failures go through the RQ, as operations expect
            },
            "consumption": {"trigger_interval": "100ms"},
        }
        doc.update(overrides)
        spec = parse_spec(doc)
        SubscriptionService(catalog).create(spec)
        return spec

    return make


@pytest.fixture
def varadhi_killed_at():
    """varadhi_killed_at(point, *args) -> output: runs `varadhi args` as a process of its own
    (the catalog, broker and warehouse of this run, through the environment) that ends abruptly
    at crash point `point` (`VARADHI_CRASH_AT`, `varadhi.core.faults`: no `finally`, no exit
    handler, nothing flushed); asserts that it did (exit 137). A Spark JVM it started goes
    with it: the whole process group is SIGKILLed once it has ended."""
    import signal
    import tempfile

    def run(point: str, *args: str, timeout: float = 300) -> str:
        env = {**os.environ, "VARADHI_CRASH_AT": point}
        cmd = [sys.executable, "-c", "import sys; from varadhi.cli import main; sys.exit(main())"]
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                [*cmd, *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code = proc.wait(timeout)
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            out.seek(0)
            text = out.read().decode("utf-8", "replace")
        assert code == 137 and f"crashing at {point.partition('@')[0]}" in text, (
            f"exit {code}, not killed at {point}:\n{text[-4000:]}"
        )
        return text

    return run
