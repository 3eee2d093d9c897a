"""Helpers for tests and demos that drive a real subscription: produce, run a shard until it is
idle, and read what an endpoint received."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ..producer import Producer
from ..settings import Settings
from .endpoint import TestEndpoint


def produce(settings: Settings, topic: str, messages: Iterable[tuple[str | None, str]]) -> None:
    """Send (group id, message id) pairs with body `body-<message id>` and wait for acks."""
    with Producer(topic, settings) as p:
        for group, msg_id in messages:
            p.send(f"body-{msg_id}".encode(), group_id=group, message_id=msg_id)
        p.flush()


def run_until_idle(settings: Settings, spark, name: str, shard: int = 0, idle_s: float = 3.0):
    """Run one shard in this process until everything readable is done; returns the job."""
    from ..shard import ShardJob

    job = ShardJob(name, shard, settings, spark=spark, stop_when_idle_s=idle_s)
    code = job.run()
    if code != 0:
        raise AssertionError(f"shard {shard} of {name} exited with {code}")
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
