"""The scaffolding of the benches that produce to a private topic and run a shard in their own
process against the test endpoint (common.py's `endpoint_process`): their shared options, the
topic's set-up and clean-up, the backlog, a shard run to its end, and a backlog bench's
interleaved runs (bench/filter.py, bench/batch_delivery.py; bench/blocked_group.py uses the
parts). Imported by the scripts next to it (`from harness import ...`); each keeps its own
options, runs and results.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common import endpoint_process
from delivery import Env
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka.producer import Producer
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService
from varadhi.spark.shard.job import ShardJob

TYPES = 10  # values of a backlog message's `type` header (bench/filter.py filters on it)


def parser(doc: str, results: Path, *, backlog: int | None = None) -> argparse.ArgumentParser:
    """A bench's parser: its docstring's first paragraph as the description, and the options
    every such bench has (`--groups`, `--partitions`, `--keep`, `--out`, default `results`);
    with `backlog` (the default message count) also `--messages` and `--batch` (the shard's
    `max_messages_per_batch`, large: one micro-batch drains the backlog). The bench adds its own
    options and parses."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if backlog is not None:
        p.add_argument("--messages", type=int, default=backlog)
    p.add_argument("--groups", type=int, default=1_000)
    p.add_argument("--partitions", type=int, default=4)
    if backlog is not None:
        p.add_argument("--batch", type=int, default=100_000, help="max_messages_per_batch")
    p.add_argument("--keep", action="store_true", help="keep the topics and warehouse")
    p.add_argument("--out", type=Path, default=results)
    return p


@contextmanager
def bench_topic(args: argparse.Namespace) -> Iterator[tuple[Env, str]]:
    """A private catalog topic and warehouse (bench/delivery.py's `Env`) and a topic
    `bench-<tag>` of `args.partitions` partitions on it; deleted on the way out unless
    `args.keep`."""
    env = Env(keep=args.keep)
    try:
        topic = f"bench-{env.tag}"
        TopicService(env.catalog).create(topic, args.partitions)
        yield env, topic
    finally:
        env.close()


def produce(env: Env, topic: str, messages: int, groups: int) -> float:
    """A backlog of `messages` 1 KiB messages over `groups` groups (`group-<i % groups>`), each
    with a header `type` cycling over `type-0` .. `type-9`; returns the seconds it took."""
    value = os.urandom(512).hex().encode()  # 1 KiB
    t0 = time.perf_counter()
    with Producer(topic, env.settings, catalog=env.catalog, batch_size=1 << 20, linger_ms=20) as p:
        for i in range(messages):
            p.send(value, group_id=f"group-{i % groups}", headers={"type": f"type-{i % TYPES}"})
        p.flush()
    seconds = time.perf_counter() - t0
    print(f"produced {messages:,} messages in {seconds:.1f} s")
    return seconds


class TimedShard(ShardJob):
    """A shard that notes when each micro-batch started and ended (`batches`, monotonic s),
    from its batch hook (called as the batch ends, with the batch's `seconds`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[float, float]] = []
        self.batch_hooks.append(self._timed)

    def _timed(self, last_batch: dict, _summary: dict) -> None:
        ended = time.monotonic()
        self.batches.append((ended - float(last_batch["seconds"]), ended))

    @property
    def drain_s(self) -> float:
        """First micro-batch start to last micro-batch end (JVM and query start-up excluded)."""
        return self.batches[-1][1] - self.batches[0][0]


def run_shard(job: ShardJob, what: str) -> None:
    """Run `job` in this process to its end; exits naming `what` unless it ended with 0. (The
    shard's SIGINT/SIGTERM handlers are its run's only: `ShardJob.run` puts the bench's back.)"""
    code = job.run()
    if code != 0:
        raise SystemExit(f"{what} ended with exit code {code}")


def drain(env: Env, spark, topic: str, url: str, run: str, batch: int, **spec) -> TimedShard:
    """A fresh subscription `bench-<tag>-<run>` on `topic` to `url` (one shard, micro-batches of
    up to `batch` messages one after the other, `spec`: the rest of its spec document), its shard
    run in this process until idle for 3 s; returns the shard, for its `stats` and `drain_s`."""
    name = f"bench-{env.tag}-{run}"
    doc = {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "consumption": {"max_messages_per_batch": batch, "trigger_interval": 0},
        **spec,
    }
    SubscriptionService(env.catalog).create(parse_spec(doc, "bench"))
    job = TimedShard(name, 0, env.settings, spark=spark, stop_when_idle_s=3)
    run_shard(job, f"run {name}")
    return job


def backlog_settings(args: argparse.Namespace) -> dict:
    """A backlog bench's settings as its results file states them first."""
    return {
        "messages": args.messages,
        "groups": args.groups,
        "partitions": args.partitions,
        "max_messages_per_batch": args.batch,
    }


RunOnce = Callable[..., dict]  # (env, spark, topic, url, kind, repeat, args) -> a results row


def backlog_runs(
    args: argparse.Namespace, app: str, kinds: Iterable[str], run: RunOnce, *endpoint: str
) -> list[dict]:
    """A backlog bench's runs: on a private topic, produce `args.messages` over `args.groups`
    once, start the test endpoint (`endpoint`: its options) and a local Spark session (`app`),
    then `run(env, spark, topic, url, kind, n, args)` for every kind in `kinds`, `args.repeat`
    rounds interleaved; returns their rows in that order."""
    from varadhi.spark.session import get_spark

    with bench_topic(args) as (env, topic):
        produce(env, topic, args.messages, args.groups)
        with endpoint_process(*endpoint) as url:
            spark = get_spark(app)
            return [
                run(env, spark, topic, url, kind, n, args)
                for n in range(args.repeat)
                for kind in kinds
            ]
