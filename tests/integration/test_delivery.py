"""The HTTP engine against a real HTTP server on loopback (no Kafka, no Spark, no mocks)."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict

import pytest

from varadhi.core import delivery
from varadhi.core.delivery import DeliveryStats, HttpDeliverer, Outcome, Request, Wait
from varadhi.core.errors import InvalidArgument
from varadhi.core.messages import HTTP_ATTEMPT, HTTP_GROUP_ID, HTTP_MESSAGE_ID
from varadhi.core.policies import DeliveryPolicy, Endpoint
from varadhi.core.rate_limit import Pacer
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import wait_for


class Group:
    """A stream of `n` messages `<name>-1..n`; asserts the engine's protocol as it goes."""

    def __init__(self, name: str, n: int, body: bytes = b"{}", extra: dict | None = None):
        self.name, self.n, self.body, self.extra = name, n, body, extra or {}
        self.sent = 0
        self.waiting = False
        self.finished = False
        self.outcomes: list[Outcome] = []

    def next_request(self) -> Request | None:
        assert not self.waiting, f"{self.name}: asked for a request with one in flight"
        assert not self.finished, f"{self.name}: asked again after returning None"
        if self.sent == self.n:
            self.finished = True
            return None
        self.sent += 1
        self.waiting = True
        headers = {
            HTTP_MESSAGE_ID: f"{self.name}-{self.sent}",
            HTTP_GROUP_ID: self.name,
            HTTP_ATTEMPT: "1",
            **self.extra,
        }
        return Request(self.body, headers)

    def on_outcome(self, outcome: Outcome) -> None:
        assert self.waiting, f"{self.name}: outcome without a request in flight"
        self.waiting = False
        self.outcomes.append(outcome)


class Pausing(Group):
    """A Group that answers `Wait(seconds, while_busy)` once, before its message `before`, and
    checks that it is not asked again before that time. `stopped` tells whether the engine
    called `stop_waiting` (the stream then sends nothing more)."""

    def __init__(self, name: str, n: int, before: int, seconds: float, while_busy: bool = False):
        super().__init__(name, n)
        self.before, self.seconds, self.while_busy = before, seconds, while_busy
        self.paused_at: float | None = None
        self.stopped = False

    def next_request(self) -> Request | Wait | None:
        assert not self.stopped, f"{self.name}: asked again after stop_waiting"
        if self.sent + 1 == self.before:
            if self.paused_at is None:
                self.paused_at = time.monotonic()
                return Wait(self.seconds, self.while_busy)
            assert time.monotonic() - self.paused_at >= self.seconds, "asked again too early"
        return super().next_request()

    def stop_waiting(self) -> None:
        assert self.while_busy and not self.stopped
        self.stopped = True


@pytest.fixture
def endpoint():
    """A factory of started TestEndpoints, all stopped at teardown."""
    started: list[TestEndpoint] = []

    def make(**kwargs) -> TestEndpoint:
        ep = TestEndpoint(**kwargs)
        ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        ep.stop()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deliver(url: str, streams, max_in_flight: int = 64, **endpoint) -> DeliveryStats:
    with HttpDeliverer(Endpoint(url=url, **endpoint), max_in_flight=max_in_flight) as engine:
        return engine.run(streams)


# -- ordering and concurrency ---------------------------------------------------------------


def test_order_per_stream_while_streams_run_concurrently(endpoint):
    ep = endpoint(latency_ms=5)
    groups = [Group(f"g{i}", 8) for i in range(30)]
    stats = deliver(ep.url, groups, max_in_flight=10)

    assert stats.requests == 240 and stats.by_status == {200: 240} and stats.streams == 30
    seen: dict[str, list[int]] = defaultdict(list)
    for r in ep.records():
        seen[r.group_id].append(int(r.message_id.rsplit("-", 1)[1]))
    assert seen == {g.name: list(range(1, 9)) for g in groups}
    assert all(g.finished and len(g.outcomes) == 8 for g in groups)
    assert 1 < ep.stats()["max_concurrent"] <= 10


def test_a_stream_never_has_two_requests_in_flight(endpoint):
    """With one stream, requests are strictly sequential at the server: each arrives only after
    the previous one was answered (latency 20 ms each)."""
    ep = endpoint(latency_ms=20)
    stats = deliver(ep.url, [Group("solo", 5)], max_in_flight=64)
    assert stats.requests == 5
    assert ep.stats()["max_concurrent"] == 1
    times = [r.received_ms for r in ep.records()]
    assert all(b - a >= 19 for a, b in zip(times, times[1:], strict=False))


def test_max_in_flight_is_filled_and_respected(endpoint):
    ep = endpoint(latency_ms=30)
    deliver(ep.url, [Group(f"g{i}", 3) for i in range(40)], max_in_flight=7)
    assert ep.stats()["max_concurrent"] == 7


def test_a_waiting_stream_holds_no_slot_and_goes_on_when_due(endpoint):
    """With one slot, the other streams use it while `w` waits; `w` then goes on in order."""
    ep = endpoint(latency_ms=5)
    waiter = Pausing("w", 3, before=2, seconds=0.3)
    others = [Group(f"g{i}", 20) for i in range(3)]
    stats = deliver(ep.url, [waiter, *others], max_in_flight=1)

    assert stats.requests == 63 and all(g.finished for g in [waiter, *others])
    records = ep.records()
    at = {r.message_id: r.received_ms for r in records}
    assert [r.message_id for r in records if r.group_id == "w"] == ["w-1", "w-2", "w-3"]
    assert at["w-2"] - at["w-1"] >= 300
    assert any(at["w-1"] < r.received_ms < at["w-2"] for r in records if r.group_id != "w")


def test_a_due_stream_takes_the_next_slot_even_from_a_long_stream(endpoint):
    """One slot, held by a 200-request stream: `w`'s second request goes out as soon as it is
    due, not after the long stream has finished."""
    ep = endpoint(latency_ms=5)
    waiter = Pausing("w", 2, before=2, seconds=0.2)
    deliver(ep.url, [waiter, Group("long", 200)], max_in_flight=1)
    order = [r.message_id for r in ep.records()]
    assert order.index("w-2") < order.index("long-200")
    assert order.index("w-1") < order.index("long-1")


class CountedMulti:
    """The engine's pycurl multi handle, counting the waits for I/O that return at once and
    those that ended by their timeout, with nothing to read or write (`timed_out`)."""

    def __init__(self, multi):
        self._multi, self.instant_selects, self.timed_out = multi, 0, 0

    def select(self, timeout: float):
        self.instant_selects += timeout == 0
        ready = self._multi.select(timeout)
        self.timed_out += ready == 0
        return ready

    def __getattr__(self, name: str):
        return getattr(self._multi, name)


def test_a_due_stream_with_every_slot_taken_waits_for_io_instead_of_spinning(endpoint):
    """One slot: `w`'s first request, then `g`'s, 300 ms each. `w`, due 100 ms after its first
    answer, waits for `g`'s answer. The engine waits for I/O meanwhile; it used to poll without
    waiting (`select(0)`) for as long as the slot stayed taken, about 100,000 times here,
    burning CPU whenever a retry in place fell due with every slot taken. (`w` waits 100 ms, not
    10: between its `Wait` and the engine's next look for a free slot, a loaded machine can
    stall the process for more than 10 ms, and `w` would take the slot before `g`.)"""
    ep = endpoint(latency_ms=300)
    waiter = Pausing("w", 2, before=2, seconds=0.1)
    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=1) as engine:
        multi = engine._multi = CountedMulti(engine._multi)
        stats = engine.run([waiter, Group("g", 1)])
    assert stats.requests == 3 and waiter.finished
    order = [r.message_id for r in ep.records()]
    assert order == ["w-1", "g-1", "w-2"]
    assert multi.instant_selects <= 3


def test_a_wait_while_busy_is_kept_while_other_streams_run_and_stopped_when_none_do(endpoint):
    """`early` waits 0.1 s while a 100-request stream keeps the engine busy: it goes on. `late`
    waits 30 s: once the long stream is done, the engine stops its wait instead of sleeping."""
    ep = endpoint(latency_ms=5)
    early = Pausing("early", 2, before=2, seconds=0.1, while_busy=True)
    late = Pausing("late", 2, before=2, seconds=30, while_busy=True)
    started = time.monotonic()
    stats = deliver(ep.url, [early, late, Group("long", 100)], max_in_flight=2)
    assert time.monotonic() - started < 30  # it did not sleep through late's wait
    assert stats.requests == 103
    assert early.finished and not early.stopped
    assert late.stopped and late.sent == 1
    order = [r.message_id for r in ep.records()]
    assert order.index("early-2") < order.index("long-100")


def test_after_the_engine_runs_out_of_work_it_lingers_only_for_waits_due_soon_enough(endpoint):
    """With `linger_s=1`, a busy-only wait due 0.2 s after the engine ran out of work is kept
    (its request goes out), one due in 30 s is stopped at once."""
    ep = endpoint()
    soon = Pausing("soon", 2, before=2, seconds=0.2, while_busy=True)
    late = Pausing("late", 2, before=2, seconds=30, while_busy=True)
    with HttpDeliverer(Endpoint(url=ep.url)) as engine:
        started = time.monotonic()
        stats = engine.run([soon, late], linger_s=1.0)
    assert time.monotonic() - started < 30  # it did not sleep through late's wait
    assert stats.requests == 3
    assert soon.finished and not soon.stopped
    assert late.stopped and late.sent == 1


class Until(Group):
    """A Group whose message `before` is not due until `at` (monotonic, not counting from when it
    is asked): it answers `Wait` with the time left once, and checks that it is not asked again
    before then."""

    def __init__(self, name: str, n: int, before: int, at: float):
        super().__init__(name, n)
        self.before, self.at = before, at
        self.waited = False

    def next_request(self) -> Request | Wait | None:
        if self.sent + 1 == self.before:
            if not self.waited:
                self.waited = True
                return Wait(max(self.at - time.monotonic(), 0.0))
            assert time.monotonic() >= self.at, f"{self.name}: asked again too early"
        return super().next_request()


def test_waits_that_end_close_together_share_a_wake_up_and_none_ends_early(endpoint, monkeypatch):
    """Retries in place fall due a few per millisecond once a task's other deliveries are done:
    here 60 streams due 0.5 ms apart. The engine wakes for them at most every
    `WAKE_GRANULARITY_S` (10 ms), each wake-up sending every stream due by then, instead of once
    per stream (a loop pass each, with a libcurl `perform` and a sleep or `select`: about a sixth
    of a failing task's CPU). `Until` checks that none is asked again before its time."""
    sleeps = []

    class Clock:  # the engine's `time`, counting its sleeps (the endpoint's threads keep theirs)
        def __getattr__(self, name: str):
            return getattr(time, name)

        def sleep(self, seconds: float) -> None:
            sleeps.append(seconds)
            time.sleep(seconds)

    monkeypatch.setattr(delivery, "time", Clock())
    ep = endpoint()
    start = time.monotonic() + 1.0  # after every first request was answered, even when slow
    streams = [Until(f"w{i}", 2, before=2, at=start + i * 0.0005) for i in range(60)]
    with HttpDeliverer(Endpoint(url=ep.url)) as engine:
        multi = engine._multi = CountedMulti(engine._multi)
        stats = engine.run(streams)
    assert stats.requests == 120 and all(s.finished for s in streams)
    # Due over 30 ms, the second requests need about four wake-ups by the clock (a sleep, or a
    # wait for I/O that timed out), after one long sleep to the first of them; one per stream
    # took about 60.
    assert len(sleeps) + multi.timed_out <= 10, (sleeps, multi.timed_out)


def test_a_run_with_only_waiting_streams_left_sleeps_until_they_are_due(endpoint):
    ep = endpoint()
    started = time.monotonic()
    stats = deliver(ep.url, [Pausing("w", 2, before=2, seconds=0.25)])
    assert stats.requests == 2 and time.monotonic() - started >= 0.25


def test_a_held_engine_sends_nothing_new_and_asks_no_stream_until_the_hold_ends(endpoint):
    """`run(hold=...)`: a shard's task holds while its delivery journal waits for Kafka. Held,
    the engine lets requests in flight complete but sends nothing new and asks no stream (before,
    each held group was woken twice a second to answer `Wait` again, for nothing);
    then it goes on, every stream in order."""
    ep = endpoint(latency_ms=20)
    state = {"on": False, "from": None, "to": None}
    asked_while_held: list[str] = []
    asked_before_hold: set[str] = set()

    class Counted(Group):
        def next_request(self):
            if state["on"]:
                asked_while_held.append(self.name)
            request = super().next_request()
            if state["from"] is None and request is not None:
                asked_before_hold.add(request.headers[HTTP_MESSAGE_ID])
            return request

    def hold() -> bool:
        if state["from"] is None and len(ep.records()) >= 10:
            state["on"], state["from"] = True, time.time()
        elif state["on"] and time.time() - state["from"] >= 0.5:
            state["on"], state["to"] = False, time.time()
        return state["on"]

    groups = [Counted(f"g{i}", 5) for i in range(20)]
    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=4) as engine:
        stats = engine.run(groups, hold=hold)

    assert state["from"] and state["to"], "the hold never began and ended"
    assert not asked_while_held
    # What arrived while held was in flight when the hold began (at most one request a slot):
    # asked for before it, however late the endpoint got to it on a loaded machine.
    during = [
        r.message_id for r in ep.records() if state["from"] <= r.received_ms / 1000 < state["to"]
    ]
    assert set(during) <= asked_before_hold and len(during) <= 4, during
    assert stats.requests == 100 and all(g.finished for g in groups)
    seen: dict[str, list[int]] = defaultdict(list)
    for r in ep.records():
        seen[r.group_id].append(int(r.message_id.rsplit("-", 1)[1]))
    assert seen == {g.name: [1, 2, 3, 4, 5] for g in groups}


def test_streams_are_pulled_lazily(endpoint):
    ep = endpoint()
    pulled = 0
    pulled_at_first_outcome: list[int] = []

    class Counting(Group):
        def on_outcome(self, outcome):
            pulled_at_first_outcome.append(pulled)
            super().on_outcome(outcome)

    def streams():
        nonlocal pulled
        for i in range(1_000):
            pulled += 1
            yield Counting(f"g{i}", 1)

    deliver(ep.url, streams(), max_in_flight=4)
    assert pulled == 1_000
    assert pulled_at_first_outcome[0] == 4


def test_ten_thousand_streams_complete(endpoint):
    ep = endpoint()
    groups = [Group(f"g{i}", 1) for i in range(10_000)]
    stats = deliver(ep.url, iter(groups))
    assert stats.streams == 10_000
    assert stats.by_status == {200: 10_000}
    assert ep.stats()["requests"] == 10_000
    assert all(g.finished and g.outcomes[0].status == 200 for g in groups)


def test_streams_without_requests_and_no_streams(endpoint):
    ep = endpoint()
    stats = deliver(ep.url, [Group("empty", 0), Group("one", 1), Group("empty2", 0)])
    assert (stats.requests, stats.streams) == (1, 3)
    assert deliver(ep.url, []).requests == 0


# -- what reaches the server ----------------------------------------------------------------


def test_headers_auth_and_body_reach_the_server(endpoint, monkeypatch):
    monkeypatch.setenv("VARADHI_ENDPOINT_TEST_TOKEN", "Bearer s3cr3t-value")
    ep = endpoint(record_headers=True)
    group = Group(
        "grüße",
        2,
        body=b"\x00binary\x00" * 100,
        extra={"X-Custom": "per-message", "Authorization": "forged", "X-Static": "overridden"},
    )
    deliver(
        ep.url,
        [group],
        headers=(("X-Static", "static"), ("Content-Type", "application/json")),
        auth_env="VARADHI_ENDPOINT_TEST_TOKEN",
    )
    first, second = ep.records()
    assert (first.method, first.body_bytes, first.group_id) == ("POST", 800, "grüße")
    assert first.message_id == "grüße-1" and second.message_id == "grüße-2"
    h = first.headers
    assert h["Authorization"] == "Bearer s3cr3t-value"  # auth wins over a per-message header
    assert h["X-Static"] == "static"  # so does the endpoint's configuration
    assert h["X-Custom"] == "per-message"
    assert h["Content-Type"] == "application/json"


def test_large_bodies_go_without_expect_100_continue(endpoint):
    """libcurl would send `Expect: 100-continue` and wait a round trip before a large body."""
    ep = endpoint(record_headers=True)
    deliver(ep.url, [Group("g", 1, body=b"x" * (2 << 20))])
    (r,) = ep.records()
    assert r.body_bytes == 2 << 20
    assert "Expect" not in r.headers


def test_default_content_type_and_custom_auth_header(endpoint, monkeypatch):
    monkeypatch.setenv("VARADHI_ENDPOINT_TEST_KEY", "k-123")
    ep = endpoint(record_headers=True)
    deliver(ep.url, [Group("g", 1)], auth_env="VARADHI_ENDPOINT_TEST_KEY", auth_header="X-Api-Key")
    (r,) = ep.records()
    assert r.headers["Content-Type"] == "application/octet-stream"
    assert r.headers["X-Api-Key"] == "k-123"
    assert "Authorization" not in r.headers


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
def test_put_and_patch_carry_the_body(endpoint, method):
    ep = endpoint()
    deliver(ep.url, [Group("g", 2, body=b"x" * 1024)], method=method)
    assert [(r.method, r.body_bytes) for r in ep.records()] == [(method, 1024)] * 2


def test_auth_value_never_shows(endpoint, monkeypatch, caplog, capfd):
    secret = "Bearer do-not-print-me"
    monkeypatch.setenv("VARADHI_ENDPOINT_TEST_TOKEN", secret)
    caplog.set_level(logging.DEBUG)
    ep = endpoint(script={"g-1": [500], "g-2": ["slow"]}, slow_ms=2_000)
    group = Group("g", 3)
    engine = HttpDeliverer(
        Endpoint(url=ep.url, auth_env="VARADHI_ENDPOINT_TEST_TOKEN", request_timeout_ms=300)
    )
    with engine:
        stats = engine.run([group])
        refused = Group("r", 1)
        deliver(
            f"http://127.0.0.1:{closed_port()}/", [refused], auth_env="VARADHI_ENDPOINT_TEST_TOKEN"
        )
        shown = [repr(engine), str(engine), repr(stats), caplog.text]
        shown += [repr(o) for o in group.outcomes + refused.outcomes]
    out, err = capfd.readouterr()
    assert "Authorization:***" in repr(engine)
    for text in [*shown, out, err]:
        assert "do-not-print-me" not in text


def test_missing_auth_env_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("VARADHI_ENDPOINT_NO_SUCH_VAR", raising=False)
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", auth_env="VARADHI_ENDPOINT_NO_SUCH_VAR"))
    assert e.value.field == "endpoint.auth_env"
    assert "VARADHI_ENDPOINT_NO_SUCH_VAR" in str(e.value)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"url": "ftp://127.0.0.1/"}, "endpoint.url"),
        ({"url": "not a url"}, "endpoint.url"),
        ({"method": "GET"}, "endpoint.method"),
        ({"request_timeout_ms": 0}, "endpoint.request_timeout_ms"),
        ({"headers": (("Bad Name", "v"),)}, "endpoint.headers"),
        ({"headers": (("X-A", "v\r\nX-B: injected"),)}, "endpoint.headers"),
    ],
)
def test_bad_endpoint_is_rejected(changes, field):
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(**{"url": "http://127.0.0.1:1/", **changes}))
    assert e.value.field == field


def test_bad_max_in_flight_is_rejected():
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/"), max_in_flight=0)
    assert e.value.field == "max_in_flight"


@pytest.mark.parametrize(
    "headers",
    [
        {"X-Group": "a\r\nX-Evil: 1"},
        {"X-Group": "a\nb"},
        {"X-Group": "a\0"},
        {"Bad:Name": "v"},
        {"": "v"},
    ],
)
def test_request_rejects_header_injection(headers):
    with pytest.raises(InvalidArgument) as e:
        Request(b"", headers)
    assert e.value.field == "headers"


# -- outcomes -------------------------------------------------------------------------------


def test_statuses_and_retry_after_are_captured(endpoint):
    ep = endpoint(script={"g-1": [503], "g-2": [429], "g-3": [500], "g-4": [404]}, retry_after_s=7)
    group = Group("g", 5)
    stats = deliver(ep.url, [group])
    got = [(o.status, o.error, o.detail, o.retry_after) for o in group.outcomes]
    assert got == [
        (503, None, "HTTP 503", "7"),
        (429, None, "HTTP 429", "7"),
        (500, None, "HTTP 500", None),
        (404, None, "HTTP 404", None),
        (200, None, "HTTP 200", None),
    ]
    assert stats.by_status == {503: 1, 429: 1, 500: 1, 404: 1, 200: 1}
    assert all(o.elapsed_ms > 0 for o in group.outcomes)


def test_a_request_that_takes_too_long_is_a_timeout(endpoint):
    """A request answered only after 60 s times out after its 250 ms. The upper bounds say the
    engine did not wait for the answer; they leave a loaded machine 10 s and more of slack (the
    endpoint's teardown wakes its sleeping handler)."""
    ep = endpoint(script={"g-1": ["slow"]}, slow_ms=60_000)
    group = Group("g", 2)
    started = time.monotonic()
    stats = deliver(ep.url, [group], request_timeout_ms=250)
    first, second = group.outcomes
    assert (first.status, first.error) == (None, "timeout")
    assert first.detail.startswith("curl error 28:")
    assert 200 <= first.elapsed_ms < 15_000
    assert second.status == 200  # the stream goes on, on a fresh connection
    assert stats.errors == {"timeout": 1}
    assert time.monotonic() - started < 30


def test_a_closed_port_is_a_connection_error():
    group = Group("g", 2)
    stats = deliver(f"http://127.0.0.1:{closed_port()}/", [group])
    assert [(o.status, o.error) for o in group.outcomes] == [(None, "connection_error")] * 2
    assert group.outcomes[0].detail.startswith("curl error 7:")
    assert stats.errors == {"connection_error": 2} and stats.by_status == {}


def test_a_connect_timeout_is_a_connection_error():
    """A listener whose accept queue is full drops new SYNs: the connect times out and the
    request was never sent, so it is a connection error, not a timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        try:
            group = Group("g", 1)
            deliver(f"http://127.0.0.1:{port}/", [group], connect_timeout_ms=200)
        finally:
            for s in fillers:
                s.close()
    (outcome,) = group.outcomes
    assert (outcome.status, outcome.error) == (None, "connection_error")
    assert outcome.detail.startswith("curl error 28:")


def test_an_endpoint_going_away_between_runs(endpoint):
    ep = endpoint()
    with HttpDeliverer(Endpoint(url=ep.url)) as engine:
        assert engine.run([Group("a", 3)]).by_status == {200: 3}
        ep.stop()
        gone = Group("b", 1)
        engine.run([gone])
    assert gone.outcomes[0].error == "connection_error"


# -- connections ----------------------------------------------------------------------------


def test_connections_are_kept_alive_and_reused_across_runs(endpoint):
    ep = endpoint()
    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=8) as engine:
        engine.run([Group(f"a{i}", 50) for i in range(40)])
        after_first = ep.stats()["connections"]
        engine.run([Group(f"b{i}", 50) for i in range(40)])
    stats = ep.stats()
    assert stats["requests"] == 4_000
    assert after_first <= 8
    assert stats["connections"] == after_first


def test_a_failing_stream_aborts_the_run_and_leaves_the_engine_usable(endpoint):
    ep = endpoint(latency_ms=20)

    class Boom(Group):
        def on_outcome(self, outcome):
            raise RuntimeError("stream bug")

    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=4) as engine:
        with pytest.raises(RuntimeError, match="stream bug"):
            engine.run([Group("slow1", 5), Boom("boom", 1), Group("slow2", 5)])
        after = [Group(f"c{i}", 2) for i in range(6)]
        assert engine.run(after).by_status == {200: 12}
        assert all(len(g.outcomes) == 2 for g in after)
    with pytest.raises(RuntimeError, match="closed"):
        engine.run([])


# -- the test endpoint itself ---------------------------------------------------------------


def test_endpoint_failures_are_seeded_and_independent_of_timing(endpoint):
    def statuses(seed: int, max_in_flight: int) -> dict[str, int]:
        ep = endpoint(fail_rate=0.3, seed=seed, mix={"500": 1, "503": 1, "404": 1})
        deliver(ep.url, [Group(f"g{i}", 5) for i in range(40)], max_in_flight=max_in_flight)
        return {r.message_id: r.status for r in ep.records()}

    a = statuses(seed=5, max_in_flight=1)
    assert a == statuses(seed=5, max_in_flight=32)
    assert a != statuses(seed=6, max_in_flight=32)
    failed = [s for s in a.values() if s != 200]
    assert 30 <= len(failed) <= 90  # about 30% of 200
    assert set(failed) == {500, 503, 404}


def test_endpoint_script_then_ok_and_set_script(endpoint):
    ep = endpoint(script={"g-1": [500, 503]})
    group = Group("g", 1)
    deliver(ep.url, [group])
    ep.set_script("g-1", [404])
    deliver(ep.url, [Group("g", 1), Group("g", 1)])
    assert [r.status for r in ep.records()] == [500, 404, 200]


def test_endpoint_stats_and_received_over_http(endpoint):
    ep = endpoint(script={"g-2": [503]})
    deliver(ep.url, [Group("g", 3)])
    with urllib.request.urlopen(ep.url + "stats", timeout=5) as resp:
        stats = json.load(resp)
    assert stats["requests"] == 3 and stats["by_status"] == {"200": 2, "503": 1}
    with urllib.request.urlopen(ep.url + "received?since=1", timeout=5) as resp:
        received = json.load(resp)
    assert [(r["seq"], r["message_id"], r["status"]) for r in received] == [
        (1, "g-2", 503),
        (2, "g-3", 200),
    ]


def test_endpoint_runs_standalone_and_records_to_a_file(tmp_path):
    record = tmp_path / "received.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "varadhi.testing.endpoint", "--record", str(record)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        deliver(url, [Group("g", 2)])
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["message_id"] for r in lines] == ["g-1", "g-2"]
    assert json.loads(err.strip().splitlines()[-1])["requests"] == 2


# -- pacing (`endpoint.max_rate`) ------------------------------------------------------------


class Paces:
    """A pacer (`varadhi.core.rate_limit.Pacer`) that records when it let each message go."""

    def __init__(self, rate: float):
        self.pacer = Pacer(rate)
        self.spent: list[float] = []
        self.slowed = 0

    def wait_s(self) -> float:
        return self.pacer.wait_s()

    def spend(self, messages: int = 1) -> None:
        self.spent.extend([time.monotonic()] * messages)
        self.pacer.spend(messages)

    def slow_down(self) -> None:
        self.slowed += 1
        self.pacer.slow_down()


def test_a_paced_engine_spaces_its_requests_and_loses_none(endpoint):
    """200 messages over 40 streams at 100 a second: every message delivered in order, and
    none of them sent sooner than its pace allows (a bound a slower machine only keeps better:
    pacing never catches up with a burst)."""
    ep = endpoint()
    groups = [Group(f"g{i}", 5) for i in range(40)]
    paces = Paces(100.0)
    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=16) as engine:
        stats = engine.run(groups, pacer=paces)
    assert stats.requests == 200 and stats.by_status == {200: 200}
    assert all(g.finished for g in groups)
    gaps = [b - a for a, b in zip(paces.spent, paces.spent[1:], strict=False)]
    assert len(paces.spent) == 200 and min(gaps) >= 0.0099, min(gaps)


def test_a_paced_engine_slows_down_on_429_and_503(endpoint):
    ep = endpoint(fail_rate=0.5, mix={"429": 1, "503": 1}, retry_after_s=0)
    groups = [Group(f"g{i}", 2) for i in range(10)]
    paces = Paces(1000.0)
    with HttpDeliverer(Endpoint(url=ep.url), max_in_flight=4) as engine:
        stats = engine.run(groups, pacer=paces)
    throttled = stats.by_status.get(429, 0) + stats.by_status.get(503, 0)
    assert throttled > 0 and paces.slowed == throttled
    assert paces.pacer.rate < 1000.0


# -- an endless source (`run`'s `idle`) ------------------------------------------------------


class Feed:
    """An endless source of one-message `Group`s, fed from another thread (`put`, `end`): None
    while it has none, `idle` blocks until it has one (or `seconds`). Counts its dry pulls and
    keeps the `seconds` of each `idle` call."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queued: list[Group] = []
        self.ended = False
        self.dry_pulls = 0
        self.idles: list[float | None] = []  # each idle call's `seconds`
        self.idling = False

    def put(self, *groups: Group) -> None:
        with self.cond:
            self.queued.extend(groups)
            self.cond.notify_all()

    def end(self) -> None:
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self) -> Group | None:
        with self.cond:
            if self.queued:
                return self.queued.pop(0)
            if self.ended:
                raise StopIteration
            self.dry_pulls += 1
            return None

    def idle(self, seconds: float | None) -> None:
        with self.cond:
            self.idles.append(seconds)
            self.idling = True
            self.cond.wait_for(lambda: self.queued or self.ended, seconds)
            self.idling = False


def run_in_thread(engine: HttpDeliverer, feed: Feed) -> threading.Thread:
    thread = threading.Thread(target=engine.run, args=(feed,), kwargs={"idle": feed.idle})
    thread.start()
    return thread


@pytest.mark.parametrize("mode", ["single", "batch"])
def test_an_endless_source_is_woken_not_polled_and_the_run_ends_with_it(endpoint, mode):
    """Idle, the engine waits in the source's `idle` (no pull meanwhile); what is fed later is
    delivered (in batch mode, what was queued together shares requests); `run` returns once
    the source ends."""
    ep = endpoint()
    policy = DeliveryPolicy(mode="batch", max_messages=10) if mode == "batch" else None
    feed = Feed()
    first = [Group(f"a{i}", 1) for i in range(30)]
    feed.put(*first)
    with HttpDeliverer(Endpoint(url=ep.url), 4, policy) as engine:
        thread = run_in_thread(engine, feed)
        try:
            wait_for(lambda: all(g.outcomes for g in first) and feed.idling, 30, "the first feed")
            pulls = feed.dry_pulls
            # Idle, the engine waits to be woken, with no time of its own to wake at (None: no
            # stream waits), so it pulls nothing meanwhile; a polling engine would pass a time.
            assert feed.idles == [None] and feed.idling
            assert feed.dry_pulls == pulls
            later = [Group(f"b{i}", 1) for i in range(30)]
            feed.put(*later)
            wait_for(lambda: all(g.outcomes for g in later), 30, "the second feed")
        finally:
            feed.end()
            thread.join(30)
        assert not thread.is_alive()
    assert all(g.outcomes[0].status == 200 for g in first + later)
    if mode == "batch":
        sizes = defaultdict(int)
        for r in ep.records():
            sizes[r.batch] += 1
        assert max(sizes.values()) == 10 and len(sizes) < 60


def test_an_endless_source_is_asked_again_while_requests_are_in_flight(endpoint):
    """A stream fed while the only request in flight hangs goes out meanwhile (the engine asks
    the dry source again while it waits for the network), not once the hung one ended."""
    ep = endpoint(slow_ms=60_000)
    ep.set_script("hung-1", ["slow"])
    feed = Feed()
    hung, later = Group("hung", 1), Group("later", 1)
    feed.put(hung)
    with HttpDeliverer(Endpoint(url=ep.url, request_timeout_ms=120_000), 4) as engine:
        thread = run_in_thread(engine, feed)
        try:
            wait_for(lambda: ep.stats()["requests"] == 1, 30, "the hung request")
            feed.put(later)
            wait_for(lambda: bool(later.outcomes), 30, "the later stream's outcome")
            assert not hung.outcomes
        finally:
            ep.stop()  # the hung request ends (its connection closed)
            feed.end()
            thread.join(30)
        assert not thread.is_alive()
    assert later.outcomes[0].status == 200 and hung.outcomes[0].error == "connection_error"


def test_a_source_may_yield_none_only_with_idle(endpoint):
    ep = endpoint()
    with pytest.raises(TypeError, match="only one run with `idle`"):
        deliver(ep.url, [Group("a", 1), None])
