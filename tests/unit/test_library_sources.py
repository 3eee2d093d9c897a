"""Where a library member's messages are delivered from (`varadhi.library.sources`): a handler
thread's loop and the HTTP engine's source, against a desk of plain callables (no services)."""

from __future__ import annotations

import random
import threading

from varadhi.core.group_state import Entry
from varadhi.core.messages import Origin
from varadhi.core.policies import RequestShaping, RetryPolicy
from varadhi.library.handler import Success
from varadhi.library.scheduler import Work
from varadhi.library.sources import Desk, Messages, run_handler


def _work(msg_id: str, invalid: str | None = None) -> Work:
    entry = Entry(Origin(0, 0, 1), msg_id, "g", "new", b"{}", {}, source="t/0/1", invalid=invalid)
    return Work(entry, "t", 0, 1, 0, "g")


class _Member:
    """A desk's side: hands out `works` in order, then none (and, for a handler, stops)."""

    def __init__(self, *works: Work):
        self.works = list(works)
        self.stopping = threading.Event()
        self.invalid: list[str] = []
        self.settled: list[tuple[str, str, str]] = []

    def take(self):
        return self.works.pop(0) if self.works else None

    def await_work(self, _seconds):
        return self.take()

    def settle_invalid(self, work):
        self.invalid.append(work.entry.msg_id)

    def settle(self, work, decision, outcome):
        self.settled.append((work.entry.msg_id, decision.action, outcome.detail))

    def desk(self) -> Desk:
        return Desk(self.take, self.await_work, self.stopping, self.settle_invalid, self.settle)


def test_a_handler_thread_settles_each_result_and_a_raised_exception_is_a_retry():
    def handler(message):
        if message.msg_id == "boom":
            raise ValueError("no")
        return Success()

    member = _Member(_work("ok"), _work("bad", invalid="malformed: no value"), _work("boom"))
    run_handler(member.desk(), handler, RetryPolicy(), random.Random(1))
    assert member.invalid == ["bad"]  # dead-lettered unsent: the handler never sees it
    assert [(msg_id, action) for msg_id, action, _ in member.settled] == [
        ("ok", "success"),
        ("boom", "retry"),
    ]
    assert member.settled[1][2].startswith("handler raised ValueError: no; retry in ")


def test_the_engines_source_gives_none_while_idle_and_ends_once_the_member_stops():
    member = _Member(_work("a"), _work("bad", invalid="malformed: no value"))
    source = Messages(member.desk(), RequestShaping(), RetryPolicy(), random.Random(1))
    stream = next(source)
    assert stream is not None and stream.work.entry.msg_id == "a"
    assert stream.next_request() is not None and stream.next_request() is None
    assert next(source) is None and member.invalid == ["bad"]  # settled, then nothing now
    member.works.append(_work("later"))
    source.idle(0.1)  # taken while idle, kept for the next pull
    assert next(source).work.entry.msg_id == "later"
    member.stopping.set()
    assert list(source) == []
