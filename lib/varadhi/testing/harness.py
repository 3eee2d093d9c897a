"""Helpers for tests and demos that drive a real subscription: produce, run a shard until it is
idle, read what an endpoint received, and read a queue (RQ/DLQ storage topic) back."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kafka import TopicPartition

from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.testing.endpoint import TestEndpoint


def produce(settings: Settings, topic: str, messages: Iterable[tuple[str | None, str]]) -> None:
    """Send (group id, message id) pairs with body `body-<message id>` and wait for acks."""
    with Producer(topic, settings) as p:
        for group, msg_id in messages:
            p.send(f"body-{msg_id}".encode(), group_id=group, message_id=msg_id)
        p.flush()


# The quiet period of a run that is to go to its end (`stop_when_idle_s`, `--stop-when-idle`).
# The end itself is an event, the shard's idle check: everything read up to the end offsets (the
# RQ's included), no parked retry or re-drive waiting for a tick, no batch running. The quiet
# period only has to outlast a trigger interval (100-200 ms in the tests) and a look of the
# control loop (0.5 s): each second more is a second of waiting at the end of every such run
# (it was 3 s).
END_IDLE_S = 1.0


def run_until_idle(
    settings: Settings, spark, name: str, shard: int = 0, idle_s: float = END_IDLE_S
):
    """Run one shard in this process until everything readable is done; returns the job."""
    from varadhi.spark.shard.job import ShardJob

    job = ShardJob(name, shard, settings, spark=spark, stop_when_idle_s=idle_s)
    code = job.run()
    if code != 0:
        raise AssertionError(f"shard {shard} of {name} exited with {code}")
    return job


def run_until(
    settings: Settings,
    spark,
    name: str,
    condition: Callable[[], bool],
    what: str,
    seconds: float = 120.0,
    shard: int = 0,
):
    """Run one shard in this process until `condition()` holds (within `seconds`, else
    AssertionError naming `what`), then stop it between batches; returns the job. For runs that
    never go idle: a retry parked until far ahead keeps `run_until_idle` waiting for its tick."""
    import threading

    from varadhi.spark.shard.job import ShardJob

    job = ShardJob(name, shard, settings, spark=spark)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(job.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: condition() or not thread.is_alive(), seconds, what)
    finally:
        job.request_stop()
        thread.join(150)
    if thread.is_alive() or codes != [0]:
        raise AssertionError(f"shard {shard} of {name} ended with {codes or 'no exit'}")
    if not condition():
        raise AssertionError(f"{what}: not met when shard {shard} of {name} ended")
    return job


def delivered(endpoint: TestEndpoint, group: str | None = None) -> list[str]:
    """Message ids the endpoint accepted (2xx), in arrival order, optionally of one group."""
    return [
        r.message_id
        for r in endpoint.records()
        if r.status < 300 and (group is None or r.group_id == group)
    ]


def wait_for(condition: Callable[[], bool], seconds: float, what: str = "condition") -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"{what} not met within {seconds} s")


def read_queue(
    bootstrap: str | Settings, storage_topic: str, timeout_s: float = 120.0
) -> list[dict]:
    """Every committed record of a Kafka topic: key, value, headers (dict), partition, offset.
    `bootstrap`: the servers of a plaintext cluster, or `Settings` (with their Kafka config).
    Raises `AssertionError` when the records up to the end offsets read at the start are not
    all read within `timeout_s` (a broker gone, a transaction that stays open)."""
    settings = Settings(bootstrap=bootstrap) if isinstance(bootstrap, str) else bootstrap
    consumer = kafka_clients.consumer(
        settings, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [
            TopicPartition(storage_topic, p) for p in consumer.partitions_for_topic(storage_topic)
        ]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out = []
        deadline = time.monotonic() + timeout_s
        while behind := {
            tp.partition: f"{at} of {ends[tp]}"
            for tp in tps
            if (at := consumer.position(tp)) < ends[tp]
        }:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{storage_topic} not read to its end within {timeout_s:g} s "
                    f"(partition: position of end offset): {behind}"
                )
            for batch in consumer.poll(timeout_ms=500).values():
                for r in batch:
                    headers = {k: (v or b"").decode("utf-8", "replace") for k, v in r.headers}
                    out.append(
                        {
                            "key": r.key,
                            "value": r.value,
                            "headers": headers,
                            "partition": r.partition,
                            "offset": r.offset,
                        }
                    )
        return out
    finally:
        consumer.close()
