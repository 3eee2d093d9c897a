"""The HTTP engine of delivery: many ordered streams of requests over pooled keep-alive
connections, driven by one libcurl multi handle (pycurl `CurlMulti`).

It runs on Spark executors inside `mapInPandas`, one `HttpDeliverer` per task: it imports
nothing from Spark and keeps no module-level state, so a reused Python worker starts clean.
libcurl was chosen by measurement (docs/benchmarks.md): one Python process posted 46.5k req/s
through a `CurlMulti` where aiohttp managed 10.3k, and the HTTP client is the dominant cost of
delivery. The loop below therefore does as little Python per request as it can: easy handles are
created once and reused, per-request work is two `setopt` calls and one `add_handle`.

Ordering. A `Stream` is a sequence of requests that must reach the endpoint in order (in the
shard job: the messages of one group). The engine never has two requests of one stream in flight:
the next one is asked for only after the previous one's outcome was handed back. Two requests of
a group in flight at once could be processed by the endpoint in either order (two connections,
two server threads), and a failed first request would have a successful second one overtake it.
Concurrency comes from many streams, up to `max_in_flight` at a time, each on its own
connection.

Waiting. A stream may also answer `Wait(seconds)`: it has a request, but not before then (a
retry in place, after its backoff). The engine asks it again once the time has come, without
holding a connection slot meanwhile, and keeps delivering other streams. A due waiting stream
gets the next slot that frees: before any new stream starts, and before the stream whose request
just completed goes on (that one queues behind it), so a retry is sent about on time even when
long streams hold every slot. When nothing completes meanwhile, the engine sleeps until the next
waiting stream's time, but for at least `WAKE_GRANULARITY_S` (10 ms): a stream is asked again up
to that much after its time, never before, and waits that end within it share one wake-up.
Retries in place fall due one by one, a few per millisecond, once a task's other deliveries are
done; a wake-up per retry cost a task with 10% of its attempts failing about a sixth of its CPU
(docs/benchmarks.md, "The failure path's CPU in a task").

`Wait(seconds, while_busy=True)` is bounded: it holds while the engine has other work, and once
nothing is in flight and no stream is left to start, for at most `run`'s `linger_s` more; a wait
that would end later is cut short with the stream's `stop_waiting()`, and the stream is finished
(a shard's group then sends its retry through the RQ). So `run` lasts at most `linger_s` longer
than its streams' requests (and one wake-up's `WAKE_GRANULARITY_S`). It returns only when no
stream waits any more.

Holding. `run`'s `hold`, when given, is asked before every new request: while it answers
true the engine sends nothing new (requests in flight complete, their streams wait) and checks
again every `HOLD_POLL_S`, asking no stream meanwhile. A shard's task holds while its delivery
journal waits too long for the broker (`journal.JournalWriter.behind`); a wait per stream
instead woke every held group twice a second (with 10,000 groups, about a quarter of a core
spent asking for nothing: py-spy, `bench/journal.py --broker-pause`).

Endless sources. With `run`'s `idle`, `streams` may be endless and yield `None`: it has no stream
now, maybe later (the library runtime's streams are its members' messages as they are handed out,
`varadhi.library.runtime`). The engine then starts nothing more this turn and pulls again at its
next: at once after a completion, and, while requests are in flight with a slot free, at least
every `WAKE_GRANULARITY_S` (nothing can wake libcurl's `select` early). Once nothing is in flight
and no waiting stream is due, it calls `idle(seconds)` instead of sleeping: the caller returns
when a stream may be there (woken by its own producer), or after `seconds` (a waiting stream
falls due then; None: none waits). So an idle source costs the engine no polling of its own, and
`run` ends only once the source ended (`StopIteration`), as it does for a finite one.

Batches. With a `delivery` policy in mode `batch`, one request carries the next request of many
streams (`varadhi.core.batching` builds the body and splits the answer into one outcome per stream).
A stream is still asked for its next request only after its previous outcome was handed back, so
a batch holds at most one request per stream and a stream's order is kept exactly as in single
mode; concurrency then comes from the streams of a batch and from `max_in_flight` batches.

What the engine does not do: decide. It does not retry, classify, or skip: a stream receives
every outcome (`on_outcome`) and decides itself what it sends next, typically through
`varadhi.core.retry.decide` (a grouped stream stops at its first failure and parks the rest of its
group behind it: "follow the failure").

Hazards:

- A stuck endpoint (accepts, never answers) costs every request `request_timeout_ms`; with
  `max_in_flight` slots, throughput drops to `max_in_flight / request_timeout` requests a second
  and `run` ends only after each stream's last attempt timed out. Streams should stop asking
  after a failure, which bounds a run to about one timeout per stream wave.
- A timeout after the request was sent does not mean the endpoint did not process it: delivery is
  at-least-once and every request should carry an idempotency key.
- If a stream's `next_request` or `on_outcome` raises, `run` abandons the requests in flight
  (they may or may not have reached the endpoint) and re-raises; the engine stays usable.
- When a reused keep-alive connection turns out to have been closed by the server, libcurl
  sends the request again once on a fresh connection (as every HTTP client does); the first copy
  may have been processed. Another reason for idempotency keys.
- HTTPS endpoints that speak HTTP/2 get their requests multiplexed over few connections; order
  still holds, because it comes from one request per stream at a time, not from connections.
- Proxies: libcurl honours the usual `http_proxy`/`https_proxy`/`no_proxy` environment.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import re
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, get_args
from urllib.parse import urlsplit

import pycurl

from varadhi.core import batching, endpoint_auth, endpoint_guard, signing
from varadhi.core import messages as m
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import DeliveryPolicy, Endpoint, Method, SecretRef
from varadhi.core.rate_limit import THROTTLE_STATUSES, Pacer
from varadhi.core.version import __version__

# How much of a response body an Outcome keeps (dead letters carry it as a header).
RESPONSE_SNIPPET_BYTES = 1024
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field-name
# Header names already matched against `_TOKEN`: a delivery's names repeat (idempotency key,
# attempt, group...), so each is matched once per process instead of once per request. Bounded,
# so that requests with ever new names cannot grow it.
_TOKENS: set[str] = set()
_MAX_TOKENS = 1024
_BAD_VALUE = re.compile("[\r\n\0]")  # a header value with one of these would inject headers
_END = object()  # end of the streams iterable
# Framing headers the engine owns; a per-request header of these names is dropped, a static
# one refused.
_FRAMING = frozenset({"content-length", "transfer-encoding", "host", "connection", "expect"})
# Only these protocols, for requests and for redirects (libcurl speaks many more: file://,
# gopher://, ...). The bitmask options: pycurl builds without PROTOCOLS_STR are common.
_PROTOCOLS = pycurl.PROTO_HTTP | pycurl.PROTO_HTTPS
HOLD_POLL_S = 0.05  # how often a held `run` asks `hold` again
# How late a waiting stream may be asked again (never early): see "Waiting" above.
WAKE_GRANULARITY_S = 0.01
# Upper bounds (ms) of the request latency histogram `DeliveryStats.latency_ms` (`varadhi.spark.metrics`
# exports it); a last bucket counts what took longer.
LATENCY_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request of a stream. `headers` are per-message (idempotency key, group id,
    attempt...); the engine adds the endpoint's static headers and auth, which win over a
    per-message header of the same name. Non-ASCII values are sent as UTF-8.

    Raises InvalidArgument (field `headers`) for a header name that is not an HTTP token or a
    value containing CR, LF or NUL: sent as is, such a value (a group id from a producer, say)
    would inject headers. Build requests inside a try and dead-letter the message on it."""

    body: bytes
    headers: Mapping[str, str]
    # Appended to the endpoint URL's path (`varadhi.core.request_shaping.render_path`: already
    # percent-encoded); None: the URL as configured.
    path: str | None = None

    def __post_init__(self) -> None:
        for name, value in self.headers.items():
            if not _header_ok(name, value):
                raise InvalidArgument(
                    f"header {name!r} has an invalid name or a CR/LF/NUL in its value",
                    field="headers",
                )


@dataclass(frozen=True, slots=True)
class Wait:
    """A stream's answer to `next_request` when its next request may go out only `seconds`
    from now: the engine asks again then (and not before). With `while_busy`, only if by then
    the engine still has other requests to make, or ran out of them less than `run`'s
    `linger_s` before; otherwise it calls `stop_waiting()` instead."""

    seconds: float
    while_busy: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended. Exactly one of `status` (a complete HTTP response was received)
    and `error` is set. `error` is `"timeout"` when the request was sent and no complete answer
    came within `request_timeout_ms` (the endpoint may have processed it), `"connection_error"`
    for everything that got no answer otherwise: refused, reset, DNS, TLS, or a connect that
    timed out (the request was never sent). `detail` is `"HTTP 503"` or curl's error text.
    `body` is the start of the response body, at most `RESPONSE_SNIPPET_BYTES` (the rest is
    read and dropped), so a dead letter can say what the endpoint answered."""

    status: int | None
    error: str | None
    detail: str
    retry_after: str | None
    elapsed_ms: float
    body: bytes = b""


class Stream(Protocol):
    """An ordered sequence of requests, e.g. the pending messages of one group.

    The engine calls `next_request()`; after that request completes it calls `on_outcome()`
    exactly once and only then `next_request()` again. `Wait(s)` means "ask me again in `s`
    seconds"; `None` means the stream is finished: it is never asked again. Both run on the
    engine's thread and should be quick: while they run, no other request makes progress."""

    def next_request(self) -> Request | Wait | None: ...

    def on_outcome(self, outcome: Outcome) -> None: ...

    def stop_waiting(self) -> None:
        """Only for streams that answer `Wait(..., while_busy=True)`: the wait would outlast the
        engine's other work by more than `linger_s`. The stream is finished; it is never asked
        again."""


@dataclass(frozen=True)
class DeliveryStats:
    """Totals of one `run`: `by_status` counts responses per HTTP status, `errors` counts
    requests without a response per error kind; `requests` is their sum. `latency_ms` counts
    every request (answered or not) by how long it took: entry i is those within
    `LATENCY_BOUNDS_MS[i]` and above the bound before, the last entry those above every bound;
    `latency_sum_ms` is their total time."""

    requests: int
    streams: int
    by_status: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    latency_ms: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS_MS) + 1)
    latency_sum_ms: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0


class _Transfer:
    """An easy handle, reused across requests, and the state of the request it carries."""

    __slots__ = (
        "curl",
        "stream",
        "batch",
        "retry_after",
        "body",
        "limit",
        "truncated",
        "refused",
        "path",
        "request",
        "webhook_id",
        "resent",
        "auth_line",
    )

    def __init__(self, curl: pycurl.Curl, limit: int = RESPONSE_SNIPPET_BYTES):
        self.curl = curl
        self.stream: Stream | None = None
        self.batch: _Batch | None = None  # batch mode: the streams the request carries
        self.retry_after: str | None = None
        self.body = b""
        self.limit = limit  # how much of the body to keep
        self.truncated = False  # there was more
        self.refused: str | None = None  # why `open_socket` refused an address
        self.path: str | None = None  # the request path the handle's URL has (`Request.path`)
        # With a bearer token (`endpoint.oauth2`, `endpoint.jwt`): the request, to send it
        # again once with a new token after a 401 (`resent`).
        self.request: Request | None = None
        self.webhook_id: str | None = None
        self.resent = False
        self.auth_line = b""  # the auth header line it carried

    def open_socket(self, purpose: int, address: tuple) -> socket.socket | int:
        """libcurl's OPENSOCKETFUNCTION under a deny-list of private ranges: the socket for a
        connection to `address` (family, type, protocol, (host, port, ...)), or SOCKET_BAD
        with the reason kept for the outcome. Every connection passes here, redirects
        included, with the address libcurl resolved and is about to connect to."""
        family, socktype, protocol, addr = address
        if family in (socket.AF_INET, socket.AF_INET6):
            reason = endpoint_guard.address_refusal(addr[0])
            if reason is not None:
                self.refused = reason
                return pycurl.SOCKET_BAD
        return socket.socket(family, socktype, protocol)

    def on_body(self, data: bytes) -> None:
        # Called by libcurl per chunk of the response body: keep its start, drop the rest
        # (returning None tells libcurl the whole chunk was taken).
        room = self.limit - len(self.body)
        if room > 0:
            self.body += data[:room]
        if len(data) > room:
            self.truncated = True

    def on_header(self, line: bytes) -> None:
        # Called by libcurl per response header line; a new status line (e.g. after a
        # `100 Continue`) starts a new header block.
        if line[:5] == b"HTTP/":
            self.retry_after = None
        elif line[:12].lower() == b"retry-after:":
            self.retry_after = line[12:].strip().decode("latin-1")


class HttpDeliverer:
    """Delivers `Stream`s to one `Endpoint`, at most `max_in_flight` requests at a time, each
    from a different stream. Not thread-safe: one deliverer per task. Reusable: connections stay
    pooled across `run` calls until `close()`.

    If `endpoint.auth_env` is set, the environment variable is read once, here, and its value
    sent as `endpoint.auth_header` with every request. It never appears in `repr`, errors or logs
    (the engine logs nothing; libcurl's error texts do not include request headers). Which
    variables (and signing key files) may be read, and which addresses reached, is `policy`'s
    (`varadhi.core.endpoint_guard`; default: the one this process's environment sets). With
    `endpoint.signing`, every request is signed (`varadhi.core.signing`): a single request's
    `webhook-id` is its `X-Varadhi-Message-Id` (else its `Idempotency-Key`).

    TLS and authentication (`varadhi.core.endpoint_auth`): `endpoint.tls` gives the CAs to
    trust and a client certificate; `endpoint.oauth2` or `endpoint.jwt` a bearer token in
    `endpoint.auth_header`, read per request from a cache (an OAuth2 token shared by the
    process's deliverers). A 401 answer to a request with a bearer token drops that token and
    sends the request once more with a new one (the 401 is counted in the stats, not handed
    to the stream); a second 401 is the request's outcome, a failure like any 4xx. When no
    token can be had, the request is not sent: its outcome is a `connection_error` whose
    detail says why (never the secret).

    With a `delivery` policy in mode `batch`, a request carries the messages of up to
    `max_messages` streams (`varadhi.core.batching`: the body, and what the answer means for each);
    `max_in_flight` then bounds such requests. Each stream still has at most one message in
    flight, so a stream's order is kept as in single mode."""

    def __init__(
        self,
        endpoint: Endpoint,
        max_in_flight: int = 64,
        delivery: DeliveryPolicy | None = None,
        policy: EndpointPolicy | None = None,
    ):
        _require_positive_int(max_in_flight, "max_in_flight")
        _validate_endpoint(endpoint)
        policy = EndpointPolicy.from_env() if policy is None else policy
        endpoint_guard.check_endpoint(endpoint, policy)
        self.endpoint = endpoint
        self._pacer: Pacer | None = None  # `run`'s, while it runs
        self.max_in_flight = max_in_flight
        self.delivery = delivery if delivery is not None and delivery.mode == "batch" else None
        self._deny_private = policy.deny_private
        static: dict[str, str] = {}
        for name, value in endpoint.headers:
            static[name] = value
        if endpoint.auth_env:
            field = "endpoint.auth_env"
            secret = endpoint_guard.read_secret(SecretRef(env=endpoint.auth_env), field, policy)
            if _BAD_VALUE.search(secret):
                raise InvalidArgument(
                    f"the value of {endpoint.auth_env} has a CR, LF or NUL, which would inject "
                    "headers",
                    field=field,
                )
            static[endpoint.auth_header] = secret
        keys = []
        for i, key in enumerate(endpoint.signing):
            field = f"endpoint.signing[{i}]"
            keys.append((key.scheme, endpoint_guard.read_secret(key.secret, field, policy), field))
        self._signer = signing.Signer(keys) if keys else None
        tls = endpoint_auth.read_tls(endpoint.tls, policy)
        self._tls_options = [
            (option, pem)
            for option, pem in (
                (pycurl.CAINFO_BLOB, tls.ca),
                (pycurl.SSLCERT_BLOB, tls.cert),
                (pycurl.SSLKEY_BLOB, tls.key),
            )
            if pem is not None
        ]
        self._bearer = endpoint_auth.bearer(endpoint, policy, tls.ca)
        # Requests not sent for want of a token, with the reason: failed in `run`'s loop.
        self._unsent: deque[tuple[_Transfer, str]] = deque()
        if not any(name.lower() == "content-type" for name in static):
            # libcurl would otherwise label a POST body application/x-www-form-urlencoded.
            static["Content-Type"] = (
                "application/octet-stream"
                if self.delivery is None
                else batching.CONTENT_TYPES[self.delivery.format]
            )
        # `Expect:` (empty) stops libcurl from waiting for `100 Continue` before large bodies.
        self._static_lines = [f"{k}: {v}".encode() for k, v in static.items()] + [b"Expect:"]
        self._reserved = _FRAMING | {k.lower() for k in static} | set(signing.HEADERS)
        if self._bearer is not None:
            self._reserved = self._reserved | {endpoint.auth_header.lower()}
        self._multi = pycurl.CurlMulti()
        # Keep every connection we may use open between requests and across runs.
        self._multi.setopt(pycurl.M_MAXCONNECTS, max_in_flight)
        self._idle: list[_Transfer] = []
        self._by_curl: dict[pycurl.Curl, _Transfer] = {}
        self._closed = False

    def __repr__(self) -> str:
        parts = urlsplit(self.endpoint.url)
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        url = parts._replace(netloc=host).geturl()  # without user:password@
        ep = self.endpoint
        auth = f", auth={ep.auth_header}:***" if ep.auth_env or ep.oauth2 or ep.jwt else ""
        return (
            f"HttpDeliverer({self.endpoint.method} {url}, max_in_flight={self.max_in_flight}{auth})"
        )

    def __enter__(self) -> HttpDeliverer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection and handle. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for transfer in self._by_curl.values():
            transfer.curl.close()
        self._by_curl.clear()
        self._idle.clear()
        self._multi.close()

    def run(
        self,
        streams: Iterable[Stream | None],
        linger_s: float = 0.0,
        hold: Callable[[], bool] | None = None,
        pacer: Pacer | None = None,
        idle: Callable[[float | None], None] | None = None,
    ) -> DeliveryStats:
        """Deliver every stream; return when each has returned `None` from `next_request`.

        Streams are pulled from `streams` lazily, one whenever a slot is free, so the iterable
        can be a generator over many thousands of groups. A stream whose request completes gets
        `on_outcome`, then `next_request`, and its next request is issued at once (on the
        handle, and usually the connection, its previous one used). A stream that answers
        `Wait` is asked again when its time has come, before any new stream is started. Once the
        engine first runs out of requests to make, busy-only waits (`Wait.while_busy`) that end
        more than `linger_s` later are stopped (see the module docstring). While `hold()` is
        true, no new request goes out (see "Holding"). With a `pacer` (`varadhi.core.rate_limit`),
        no request goes out before the pacer allows it, each costs one pace per message, and a
        429 or 503 answer slows the pacer down. With `idle`, `streams` may be endless and yield
        None when it has no stream now (see "Endless sources")."""
        if self._closed:
            raise RuntimeError("HttpDeliverer is closed")
        multi = self._multi
        source = _Source(streams, endless=idle is not None)
        batcher = None if self.delivery is None else _Batcher(self.delivery, source)
        waiting = _Waiting()
        idle_until: float | None = None  # set when the engine first runs out of other work
        in_flight = 0
        by_status: Counter[int] = Counter()
        errors: Counter[str] = Counter()
        latency = [0] * (len(LATENCY_BOUNDS_MS) + 1)
        latency_sum = 0.0
        started = time.perf_counter()
        self._pacer = pacer

        def paced() -> bool:  # the pacer holds the next request back
            return pacer is not None and pacer.wait_s() > 0

        try:
            while True:
                held = (hold is not None and hold()) or paced()
                while not held and in_flight < self.max_in_flight:
                    if batcher is not None:  # batch mode: one request for many streams
                        if not self._issue_batch(batcher, waiting):
                            break
                        in_flight += 1
                        held = paced()
                        continue
                    stream = waiting.pop_due()
                    if stream is None:
                        stream = source.pull()
                        if stream is None:
                            break
                    in_flight += self._ask(stream, waiting)
                    held = paced()
                if self._unsent:  # no token: each such request fails without being sent
                    while self._unsent:
                        transfer, reason = self._unsent.popleft()
                        errors["connection_error"] += 1
                        latency[0] += 1
                        outcome = Outcome(None, "connection_error", reason, None, 0.0)
                        # `_complete` takes the handle off the multi handle: put it on first.
                        self._multi.add_handle(transfer.curl)
                        in_flight -= self._complete(transfer, outcome, waiting, held)
                    continue
                if in_flight == 0:  # nothing to send now, and no stream left to start
                    if held and (waiting or not _all_pulled(source, batcher)):
                        pace = pacer.wait_s() if pacer is not None else HOLD_POLL_S
                        time.sleep(min(HOLD_POLL_S, max(pace, 0.001)))
                        continue
                    if source.dry:  # an endless source has nothing now: its caller wakes us
                        assert idle is not None
                        idle(waiting.seconds_to_wake() if waiting else None)
                        continue
                    if not waiting:
                        break
                    if idle_until is None:
                        idle_until = time.monotonic() + linger_s
                    if not waiting.stop_busy_waits(later_than=idle_until):
                        time.sleep(waiting.seconds_to_wake())
                    continue
                multi.perform()
                completed = 0
                blocked = hold is not None and hold()
                while True:
                    queued, ok, failed = multi.info_read()
                    for curl in ok:
                        completed += 1
                        transfer = self._by_curl[curl]
                        status = curl.getinfo(pycurl.RESPONSE_CODE)
                        by_status[status] += 1
                        if pacer is not None and status in THROTTLE_STATUSES:
                            pacer.slow_down()
                        outcome = Outcome(
                            status,
                            None,
                            f"HTTP {status}",
                            transfer.retry_after,
                            curl.getinfo(pycurl.TOTAL_TIME) * 1000.0,
                            transfer.body,
                        )
                        latency[bisect.bisect_left(LATENCY_BOUNDS_MS, outcome.elapsed_ms)] += 1
                        latency_sum += outcome.elapsed_ms
                        if status == 401 and self._bearer is not None and not transfer.resent:
                            self._resend(transfer)  # the same slot; the stream waits on
                            continue
                        held = blocked or paced()
                        in_flight -= self._complete(transfer, outcome, waiting, held)
                    for curl, code, message in failed:
                        completed += 1
                        transfer = self._by_curl[curl]
                        kind = _error_kind(curl, code)
                        errors[kind] += 1
                        outcome = Outcome(
                            None,
                            kind,
                            transfer.refused or f"curl error {code}: {message}",
                            None,
                            curl.getinfo(pycurl.TOTAL_TIME) * 1000.0,
                        )
                        latency[bisect.bisect_left(LATENCY_BOUNDS_MS, outcome.elapsed_ms)] += 1
                        latency_sum += outcome.elapsed_ms
                        held = blocked or paced()
                        in_flight -= self._complete(transfer, outcome, waiting, held)
                    if not queued:
                        break
                held = blocked or paced()
                if not completed:
                    timeout_ms = multi.timeout()
                    if timeout_ms != 0:
                        timeout_s = min(timeout_ms, 1000) / 1000 if timeout_ms > 0 else 1.0
                        # A waiting stream's time matters only if a request could go out then:
                        # with every slot taken (or held), a due one would make this a spin.
                        if waiting and not held and in_flight < self.max_in_flight:
                            timeout_s = min(timeout_s, waiting.seconds_to_wake())
                        # An endless source's new streams: asked again soon (see above).
                        if source.dry and not held and in_flight < self.max_in_flight:
                            timeout_s = min(timeout_s, WAKE_GRANULARITY_S)
                        if pacer is not None and in_flight < self.max_in_flight:
                            timeout_s = min(timeout_s, max(pacer.wait_s(), 0.001))
                        multi.select(timeout_s)
        finally:
            self._pacer = None
            unsent = {id(transfer) for transfer, _ in self._unsent}
            self._unsent.clear()
            for transfer in self._by_curl.values():
                if transfer.stream is not None or transfer.batch is not None:  # a stream raised
                    if id(transfer) not in unsent:
                        multi.remove_handle(transfer.curl)
                    transfer.stream = transfer.batch = None
                    self._idle.append(transfer)
        return DeliveryStats(
            requests=sum(by_status.values()) + sum(errors.values()),
            streams=source.pulled,
            by_status=dict(by_status),
            errors=dict(errors),
            elapsed_s=time.perf_counter() - started,
            latency_ms=tuple(latency),
            latency_sum_ms=latency_sum,
        )

    def _complete(
        self, transfer: _Transfer, outcome: Outcome, waiting: _Waiting, held: bool
    ) -> int:
        """Hand the outcome to its stream and issue the stream's next request, on the same
        handle (`held`: park the stream instead, to be asked once the hold ends). Returns 1 if
        a slot was freed, 0 if it was reused."""
        if transfer.batch is not None:
            return self._complete_batch(transfer, outcome)
        self._multi.remove_handle(transfer.curl)
        stream = transfer.stream
        assert stream is not None
        transfer.stream = None
        self._idle.append(transfer)  # before the callbacks: if they raise, the handle is free
        stream.on_outcome(outcome)
        if held or waiting.has_due():  # held, or a waiting stream's time has come (it goes first)
            waiting.add(stream, Wait(0.0))
            return 1
        return 1 - self._ask(stream, waiting)

    def _ask(self, stream: Stream, waiting: _Waiting) -> int:
        """Ask `stream` for its next request and issue it, or park the stream in `waiting`.
        Returns 1 if a request was issued. The handle is the most recently freed one (the
        stream's own previous one, when called from `_complete`), so its connection is reused."""
        request = stream.next_request()
        if isinstance(request, Wait):
            waiting.add(stream, request)
        elif request is not None:
            transfer = self._idle.pop() if self._idle else self._new_transfer()
            self._issue(transfer, stream, request)
            return 1
        return 0

    def _issue_batch(self, batcher: _Batcher, waiting: _Waiting) -> bool:
        """Gather the next batch (`_Batcher.gather`) and issue it as one request. False when no
        stream has a message to send now."""
        members, entries = batcher.gather(waiting)
        if not members:
            return False
        assert self.delivery is not None
        body = batching.encode_body(entries, self.delivery.format)
        transfer = self._idle.pop() if self._idle else self._new_transfer()
        request = Request(body, {batching.BATCH_SIZE_HEADER: str(len(members))})
        webhook_id = None
        if self._signer is not None:
            webhook_id = signing.batch_id([msg_id for _, msg_id in members])
        self._issue(transfer, None, request, webhook_id, len(members))
        transfer.batch = _Batch(batcher, members)
        return True

    def _complete_batch(self, transfer: _Transfer, outcome: Outcome) -> int:
        """Hand each stream of a batch request its own outcome (`batching.split_answer`); each
        is asked for its next request when a later batch is gathered. Frees the slot."""
        self._multi.remove_handle(transfer.curl)
        batch, transfer.batch = transfer.batch, None
        assert batch is not None
        self._idle.append(transfer)  # before the callbacks: if they raise, the handle is free
        results = batching.split_answer(
            outcome.status,
            outcome.error,
            outcome.detail,
            outcome.retry_after,
            outcome.body,
            transfer.truncated,
            [msg_id for _, msg_id in batch.members],
            RESPONSE_SNIPPET_BYTES,
        )
        elapsed_ms = outcome.elapsed_ms
        for (stream, _), r in zip(batch.members, results, strict=True):
            stream.on_outcome(
                Outcome(r.status, r.error, r.detail, r.retry_after, elapsed_ms, r.body)
            )
            batch.batcher.ready.append(stream)
        return 1

    def _issue(
        self,
        transfer: _Transfer,
        stream: Stream | None,
        request: Request,
        webhook_id: str | None = None,
        messages: int = 1,
    ) -> None:
        """Send `request` (of `messages` messages) on `transfer`'s handle; signed (`webhook_id`:
        a batch's, else the request's message id) when the endpoint has signing keys; paced
        (`run`'s pacer spends `messages` paces)."""
        headers = request.headers
        if headers:
            reserved = self._reserved
            lines = [f"{k}: {v}".encode() for k, v in headers.items() if k.lower() not in reserved]
            lines += self._static_lines
        else:
            lines = self._static_lines
        if self._signer is not None:
            webhook_id = (
                webhook_id or headers.get(m.HTTP_MESSAGE_ID) or headers.get(m.HTTP_IDEMPOTENCY_KEY)
            )
            if not webhook_id:
                raise InvalidArgument(
                    f"a signed request needs an {m.HTTP_MESSAGE_ID} header", field="headers"
                )
            lines = lines + self._signer.header_lines(webhook_id, int(time.time()), request.body)
        if self._bearer is not None:
            transfer.request, transfer.webhook_id, transfer.resent = request, webhook_id, False
            try:
                transfer.auth_line = self._bearer.line()
                lines = lines + [transfer.auth_line]
            except endpoint_auth.TokenError as e:
                transfer.stream, transfer.body, transfer.truncated = stream, b"", False
                self._unsent.append((transfer, str(e)))
                return
        curl = transfer.curl
        if request.path != transfer.path:  # a shaped path (the handle keeps its last URL)
            curl.setopt(pycurl.URL, self._url(request.path))
            transfer.path = request.path
        curl.setopt(pycurl.POSTFIELDS, request.body)
        curl.setopt(pycurl.HTTPHEADER, lines)
        transfer.stream = stream
        transfer.retry_after = None
        transfer.body = b""
        transfer.truncated = False
        transfer.refused = None
        self._multi.add_handle(curl)
        if self._pacer is not None:
            self._pacer.spend(messages)

    def _resend(self, transfer: _Transfer) -> None:
        """Send a request the endpoint answered 401 again, once, with a new token."""
        assert self._bearer is not None and transfer.request is not None
        self._multi.remove_handle(transfer.curl)
        self._bearer.refused(transfer.auth_line)
        self._issue(transfer, transfer.stream, transfer.request, transfer.webhook_id)
        transfer.resent = True

    def _url(self, path: str | None) -> str:
        """The endpoint URL with `path` appended to its path (None: the URL as configured)."""
        if path is None:
            return self.endpoint.url
        parts = urlsplit(self.endpoint.url)
        return parts._replace(path=parts.path.rstrip("/") + path).geturl()

    def _new_transfer(self) -> _Transfer:
        ep = self.endpoint
        curl = pycurl.Curl()
        # A 207 answer is read whole (up to a limit); of any other, a snippet.
        limit = RESPONSE_SNIPPET_BYTES if self.delivery is None else batching.MAX_ANSWER_BYTES
        transfer = _Transfer(curl, limit)
        curl.setopt(pycurl.URL, ep.url)
        curl.setopt(pycurl.PROTOCOLS, _PROTOCOLS)
        curl.setopt(pycurl.REDIR_PROTOCOLS, _PROTOCOLS)
        if self._deny_private:
            curl.setopt(pycurl.OPENSOCKETFUNCTION, transfer.open_socket)
        if ep.method != "POST":
            curl.setopt(
                pycurl.CUSTOMREQUEST, ep.method
            )  # with POSTFIELDS: a body, method PUT/PATCH
        curl.setopt(pycurl.NOSIGNAL, 1)  # no SIGALRM for timeouts: we are not the main thread
        curl.setopt(pycurl.CONNECTTIMEOUT_MS, ep.connect_timeout_ms)
        curl.setopt(pycurl.TIMEOUT_MS, ep.request_timeout_ms)
        curl.setopt(pycurl.TCP_KEEPALIVE, 1)
        curl.setopt(pycurl.USERAGENT, f"varadhi-spark/{__version__}")
        curl.setopt(pycurl.HEADERFUNCTION, transfer.on_header)
        curl.setopt(pycurl.WRITEFUNCTION, transfer.on_body)
        for option, pem in self._tls_options:
            curl.setopt(option, pem)
        self._by_curl[curl] = transfer
        return transfer


class _Source:
    """`run`'s streams, pulled one at a time (`pull`): `exhausted` once the iterable ended, `dry`
    while its last pull found no stream now (an endless source's None: see "Endless sources")."""

    def __init__(self, streams: Iterable[Stream | None], endless: bool):
        self._pending = iter(streams)
        self._endless = endless
        self.exhausted = False
        self.dry = False
        self.pulled = 0

    def pull(self) -> Stream | None:
        """The next stream, or None: the source ended, or has none now (`dry`)."""
        if self.exhausted:
            return None
        pulled = next(self._pending, _END)
        if pulled is _END:
            self.exhausted = True
            self.dry = False
            return None
        if pulled is None:
            if not self._endless:
                raise TypeError("a stream source yielded None: only one run with `idle` may")
            self.dry = True
            return None
        self.dry = False
        self.pulled += 1
        return pulled  # type: ignore[return-value]


class _Batcher:
    """Batch mode of one `run`: puts the next request of many streams into one.

    A stream is asked for its next request only after the outcome of its previous one was handed
    back, as in single mode, so a batch holds at most one request per stream. Streams whose
    outcome came back wait in `ready` for the next batch. Where a batch takes its streams from,
    in this order: a request left over from the batch before (it did not fit), streams whose
    `Wait` is over, `ready`, then new streams."""

    def __init__(self, policy: DeliveryPolicy, source: _Source):
        self.policy = policy
        self.source = source
        self.ready: deque[Stream] = deque()
        self.carried: tuple[Stream, batching.Entry] | None = None

    def gather(self, waiting: _Waiting) -> tuple[list[tuple[Stream, str]], list[bytes]]:
        """The next batch: its streams with their message ids, and its entries (same order).
        At most `max_messages` entries and `max_bytes` of body (a first entry larger than that
        goes alone), no id twice. Empty when no stream has a request now."""
        members: list[tuple[Stream, str]] = []
        entries: list[bytes] = []
        ids: set[str] = set()
        size = 0
        while len(members) < self.policy.max_messages:
            if self.carried is not None:
                stream, entry = self.carried
                self.carried = None
            else:
                found = self._next(waiting)
                if found is None:
                    break
                stream = found
                request = stream.next_request()
                if isinstance(request, Wait):
                    waiting.add(stream, request)
                    continue
                if request is None:
                    continue
                entry = batching.encode_entry(request.body, request.headers)
            if members and (
                entry.id in ids
                or batching.body_size(len(members) + 1, size + len(entry.data))
                > self.policy.max_bytes
            ):
                self.carried = (stream, entry)  # first in the next batch
                break
            members.append((stream, entry.id))
            entries.append(entry.data)
            ids.add(entry.id)
            size += len(entry.data)
        return members, entries

    def _next(self, waiting: _Waiting) -> Stream | None:
        stream = waiting.pop_due()
        if stream is not None:
            return stream
        if self.ready:
            return self.ready.popleft()
        return self.source.pull()


@dataclass(slots=True)
class _Batch:
    """A batch request in flight: its streams and their message ids, in body order."""

    batcher: _Batcher
    members: list[tuple[Stream, str]]


class _Waiting:
    """Streams that answered `Wait`, by the monotonic time they asked to be woken at."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Stream, bool]] = []
        self._seq = itertools.count()  # ties: first come, first served (streams don't compare)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, stream: Stream, wait: Wait) -> None:
        at = time.monotonic() + max(wait.seconds, 0.0)
        heapq.heappush(self._heap, (at, next(self._seq), stream, wait.while_busy))

    def has_due(self) -> bool:
        return bool(self._heap) and self._heap[0][0] <= time.monotonic()

    def pop_due(self) -> Stream | None:
        """The stream whose time came first, if it has come."""
        return heapq.heappop(self._heap)[2] if self.has_due() else None

    def seconds_to_wake(self) -> float:
        """How long the engine may sleep for the waiting streams: until the first one's time,
        but at least `WAKE_GRANULARITY_S`, so that waits ending within it share a wake-up."""
        left = self._heap[0][0] - time.monotonic() if self._heap else 0.0
        return max(left, WAKE_GRANULARITY_S)

    def stop_busy_waits(self, later_than: float) -> bool:
        """Call `stop_waiting()` on every stream waiting only while the engine is busy that would
        wake after `later_than` (monotonic), and drop them (in the order they would have been
        woken). Returns whether there were any."""

        def stops(entry: tuple[float, int, Stream, bool]) -> bool:
            return entry[3] and entry[0] > later_than

        busy = sorted(entry for entry in self._heap if stops(entry))
        if busy:
            self._heap = [entry for entry in self._heap if not stops(entry)]
            heapq.heapify(self._heap)
            for _, _, stream, _ in busy:
                stream.stop_waiting()
        return bool(busy)


def _all_pulled(source: _Source, batcher: _Batcher | None) -> bool:
    """Whether no stream is left to start or to ask again (besides those waiting)."""
    if batcher is None:
        return source.exhausted
    return source.exhausted and not batcher.ready and batcher.carried is None


def _error_kind(curl: pycurl.Curl, code: int) -> str:
    """`timeout` only if the request went out (some bytes sent) before time ran out: a connect
    that timed out never reached the endpoint and is a connection error like a refusal."""
    if code == pycurl.E_OPERATION_TIMEDOUT and curl.getinfo(pycurl.REQUEST_SIZE) > 0:
        return "timeout"
    return "connection_error"


def _validate_endpoint(endpoint: Endpoint) -> None:
    parts = urlsplit(endpoint.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"must be an http(s) URL, got {endpoint.url!r}", field="endpoint.url")
    if endpoint.method not in get_args(Method):
        raise InvalidArgument(
            f"must be one of {', '.join(get_args(Method))}, got {endpoint.method!r}",
            field="endpoint.method",
        )
    for name in ("connect_timeout_ms", "request_timeout_ms"):
        _require_positive_int(getattr(endpoint, name), f"endpoint.{name}")
    credentials = [
        name for name in ("auth_env", "oauth2", "jwt") if getattr(endpoint, name) is not None
    ]
    if len(credentials) > 1:
        raise InvalidArgument(
            f"set at most one of auth_env, oauth2 and jwt, got {' and '.join(credentials)}",
            field=f"endpoint.{credentials[-1]}",
        )
    for name, value in [*endpoint.headers, (endpoint.auth_header, "")]:
        if not _header_ok(name, value):
            raise InvalidArgument(
                f"header {name!r} has an invalid name or a CR/LF/NUL in its value",
                field="endpoint.headers",
            )
        if name.lower() in _FRAMING or name.lower() in signing.HEADERS:
            raise InvalidArgument(
                f"header {name!r} is set by the engine and cannot be configured",
                field="endpoint.headers",
            )


def _header_ok(name: str, value: str) -> bool:
    """Whether `name` is an HTTP token and `value` has no CR, LF or NUL (which would inject
    headers if sent as is)."""
    if name not in _TOKENS:
        if not _TOKEN.fullmatch(name):
            return False
        if len(_TOKENS) < _MAX_TOKENS:
            _TOKENS.add(name)
    return not _BAD_VALUE.search(value)


def _require_positive_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"must be an integer >= 1, got {value!r}", field=field)
