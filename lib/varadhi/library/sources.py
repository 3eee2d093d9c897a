"""Where a library member's messages are delivered from: the source it hands the HTTP engine
(`HttpDeliverer.run`, an endless source: `Messages`, one `Message` stream per message handed
out, None when there is none now; it ends once the member stops), and the loop of each of its
handler threads (`run_handler`).

Contract. The member is reached only through a `Desk` (its hand-out and settling, as
callables), and the request shaping, retry policy and random source it delivers with; a source
keeps no state of the member's but the one message it took while idle (`Messages.found`). A
handler thread takes one message at a time (`Desk.await_work`), calls the handler and settles
its result (`handler.decision`: an exception it raises is a retry); it returns once the member
stops.

Why one stream per message. The scheduler keeps a key's order (one message of a key handed
out at a time), so a stream needs to carry only one message; in batch mode a request holds
at most one message per stream (`varadhi.core.delivery`), so to fill `max_in_flight` batches
of `max_messages` the engine needs that many streams at once: made as messages are handed
out, they are exactly the messages in flight, however many batches hold. The engine bounds
what is in flight: `max_in_flight` requests (in batch mode each of up to `max_messages`
messages, as a shard's task), and asks this source only while a request could go out (a
slot free, the pacer letting it).

Idle. When nothing is in flight and there is no message, the engine calls `idle`, which
waits for one (`Desk.await_work`: woken when work comes, not polled) and keeps it for the next
pull. While requests are in flight the engine asks again at every completion and every
`WAKE_GRANULARITY_S` (10 ms). Hazard: a message taken counts as in flight from then on, also
while it waits in the engine (the `idle` one until the next pull, one that did not fit the
batch for the next batch: the engine's `_Batcher.carried`); it goes out even if its slot was
revoked meanwhile, which a revoke's wait for the slot's deliveries covers as it covers the
requests in flight (at least once).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from varadhi.core.delivery import Outcome, Request
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import request_of
from varadhi.core.policies import RequestShaping, RetryPolicy
from varadhi.core.retry import Decision, decide
from varadhi.library import handler as handlers
from varadhi.library.scheduler import Work


@dataclass(frozen=True)
class Desk:
    """What a source needs of its member. `take`: the next message to hand out, None when there
    is none now (or the member is paused or stopping); `await_work(seconds)`: the same, waiting
    up to `seconds` (None: until one comes or the member stops); `stopping`: set once the
    member stops; `settle_invalid`: dead-letter a message that cannot be sent; `settle`: act on
    an attempt's decision (the member's `_settle`)."""

    take: Callable[[], Work | None]
    await_work: Callable[[float | None], Work | None]
    stopping: threading.Event
    settle_invalid: Callable[[Work], None]
    settle: Callable[[Work, Decision, Outcome], None]


class Messages:
    """The engine's streams (see the module docstring). Only the engine's thread uses it."""

    def __init__(self, desk: Desk, shaping: RequestShaping, retry: RetryPolicy, rng: random.Random):
        self.desk = desk
        self.shaping = shaping
        self.retry = retry
        self.rng = rng
        self.found: Work | None = None  # taken while idle, for the next pull

    def __iter__(self) -> Messages:
        return self

    def __next__(self) -> Message | None:
        desk = self.desk
        while True:
            work, self.found = self.found, None
            if work is None:
                work = desk.take()
            if work is None:
                if desk.stopping.is_set():
                    raise StopIteration
                return None
            if not work.entry.invalid:
                try:  # raises for a bad id, or headers the request cannot be shaped from
                    return Message(self, work, request_of(work.entry, self.shaping))
                except InvalidArgument as e:
                    work.entry.invalid = f"malformed: {e}"
            desk.settle_invalid(work)

    def idle(self, seconds: float | None) -> None:
        """(The engine, nothing in flight) Wait for a message, or `seconds` at most."""
        self.found = self.desk.await_work(seconds)

    def settle(self, work: Work, outcome: Outcome) -> None:
        """Decide an attempt's outcome (`retry.decide`) and settle it through the desk."""
        decision = decide(
            self.retry,
            work.entry.attempts + 1,
            outcome.status,
            outcome.error,
            outcome.retry_after,
            int(time.time() * 1000),
            self.rng,
            outcome.detail,
        )
        self.desk.settle(work, decision, outcome)


class Message:
    """One message handed out, as one of the engine's streams: its request, then nothing more
    (the next message of its key is another stream, once the scheduler hands it out). Its
    outcome (a batch's per-message one, in batch mode) is decided and settled as any attempt
    (`Messages.settle`)."""

    __slots__ = ("source", "work", "request")

    def __init__(self, source: Messages, work: Work, request: Request):
        self.source = source
        self.work = work
        self.request: Request | None = request

    def next_request(self) -> Request | None:
        request, self.request = self.request, None
        return request

    def on_outcome(self, outcome: Outcome) -> None:
        self.source.settle(self.work, outcome)

    def stop_waiting(self) -> None:  # never waits
        pass


def run_handler(
    desk: Desk, handler: handlers.Handler, retry: RetryPolicy, rng: random.Random
) -> None:
    """One handler thread's loop (see the module docstring); what the desk raises ends it."""
    while True:
        work = desk.await_work(None)
        if work is None:
            return
        e = work.entry
        if e.invalid:
            desk.settle_invalid(work)
            continue
        message = handlers.Message(
            e.msg_id,
            e.group_id,
            work.key,
            e.value or b"",
            dict(e.headers),
            e.attempts + 1,
            e.source,
        )
        started = time.perf_counter()
        try:
            result = handler(message)
        except Exception as exc:  # noqa: BLE001 - a retry, see `handler`
            result = handlers.Retry(reason=f"handler raised {type(exc).__name__}: {exc}")
        elapsed_ms = (time.perf_counter() - started) * 1000
        now = int(time.time() * 1000)
        decision = handlers.decision(retry, e.attempts + 1, result, now, rng)
        desk.settle(work, decision, Outcome(None, None, decision.reason, None, elapsed_ms))
