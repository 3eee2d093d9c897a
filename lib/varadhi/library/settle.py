"""Awaiting, at a revoke, the end of the revoked slots' deliveries in flight, so that the
revoke's commit covers them and their next owner does not deliver them again.

kafka-python 3.0.x runs the rebalance listener on its I/O thread, before the member's
JoinGroup, and awaits a listener method that is a coroutine function. That thread must not
block (its heartbeats, and the answers to the member's own requests, run on it), so the wait
is `settled`: it polls the member's count of deliveries in flight and, between looks, awaits
the event loop's own `sleep` (`loop_sleep`), which lets the loop run on.

Hazards. The whole group's rebalance waits for the slowest member's revoke (eager protocol),
so the wait is bounded (`timeout_s`); deliveries still in flight at its end are left to the
next owner (at least once). `loop_sleep` reads kafka-python internals and raises
`VaradhiError` before anything starts when the installed kafka-python has not them or would
not await the listener (as `join_guard`): a coroutine listener called without being awaited
would never revoke.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from kafka import KafkaConsumer

from varadhi.core.errors import VaradhiError

#: How often `settled` looks again.
STEP_S = 0.01


async def settled(
    busy: Callable[[], bool],
    sleep: Callable[[float], Awaitable[object]],
    timeout_s: float,
    step_s: float = STEP_S,
) -> bool:
    """Await, by `sleep`, until `busy()` is false or `timeout_s` passed; whether it settled.
    Does not suspend when nothing is busy."""
    deadline = time.monotonic() + timeout_s
    while busy():
        if time.monotonic() >= deadline:
            return False
        await sleep(step_s)
    return True


def loop_sleep(consumer: KafkaConsumer) -> Callable[[float], Awaitable[object]]:
    """The `sleep` of `consumer`'s event loop, for its rebalance listener's coroutines."""
    coordinator = getattr(consumer, "_coordinator", None)
    sleep = getattr(getattr(coordinator, "_net", None), "sleep", None)
    if not callable(sleep) or not hasattr(coordinator, "_invoke_rebalance_listener_async"):
        import kafka

        raise VaradhiError(
            f"kafka-python {kafka.__version__} is not supported by the library runtime: it"
            " does not await a coroutine rebalance listener on its event loop"
            " (varadhi.library.settle); install kafka-python 3.0.x"
        )
    return sleep
