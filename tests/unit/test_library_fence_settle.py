"""The pure parts of the hung-member fence (`varadhi.library.fence`) and of the revoke's wait
for deliveries in flight (`varadhi.library.settle`, its coroutine driven by hand as
kafka-python's event loop would)."""

from __future__ import annotations

from varadhi.library.fence import lapsed
from varadhi.library.settle import settled


def test_a_session_lapses_only_past_the_timeout_since_the_group_was_last_heard():
    assert not lapsed(now=16.0, last_heard=10.0, session_timeout_s=6.0)
    assert lapsed(now=16.1, last_heard=10.0, session_timeout_s=6.0)
    assert lapsed(now=5.0, last_heard=float("-inf"), session_timeout_s=6.0)  # never heard


def drive(coroutine) -> tuple[object, list[float]]:
    """Run `coroutine` to its end, recording each sleep it awaits."""
    sleeps: list[float] = []
    try:
        while True:
            sleeps.append(coroutine.send(None))
    except StopIteration as end:
        return end.value, sleeps


class Sleep:
    """An awaitable that yields its delay to whoever drives the coroutine."""

    def __init__(self, delay: float):
        self.delay = delay

    def __await__(self):
        yield self.delay


def test_settled_does_not_suspend_when_nothing_is_busy():
    assert drive(settled(lambda: False, Sleep, timeout_s=5.0)) == (True, [])


def test_settled_sleeps_until_idle():
    busy = iter([True, True, False])
    done, sleeps = drive(settled(lambda: next(busy), Sleep, timeout_s=60.0, step_s=0.01))
    assert done and sleeps == [0.01, 0.01]


def test_settled_gives_up_at_its_timeout():
    done, sleeps = drive(settled(lambda: True, Sleep, timeout_s=0.0))
    assert not done and sleeps == []
