"""A real HTTP endpoint on loopback that records what it receives and fails on request.

Used by the HTTP engine's tests, the demo (which checks per-group order from another process
through `GET /received`) and the benchmarks. It is a threaded `http.server` speaking HTTP/1.1
with keep-alive, one thread per connection, so it behaves like a real server for the engine's
connection pooling; it is not fast (a few thousand requests a second).

Every POST/PUT/PATCH, on any path, is a delivery. With `tls` (an `ssl.SSLContext`, e.g.
`varadhi.testing.tls.Pki.server_context`) it speaks https, requiring a client certificate when the
context does. With `authorize` (a function of the `Authorization` header), a delivery it refuses
is answered 401 and recorded with that status, before anything below (it uses no scripted
answer); a batch request it refuses is answered 401 with no record. What it answers, in this
order:

0. during an outage (`outage(seconds)`, or `GET /outage?seconds=S` from another process):
   503 (with `Retry-After: retry_after_s`) to every delivery, scripted or not;
1. `script[message_id]`: the n-th delivery of a message id gets the n-th scripted answer
   (`{"msg-1": [500, 500, 200]}`); once the list is used up, the message gets `ok_status`.
2. with probability `fail_rate`, a failure drawn from `mix` (weights by answer, e.g.
   `{"503": 0.5, "slow": 0.5}`);
3. otherwise `ok_status`.

An answer is an HTTP status (`503` and `429` carry `Retry-After: retry_after_s`) or `"slow"`:
sleep `slow_ms` (set it beyond the client's timeout), then answer `ok_status` if the client is
still there, which is what a slow endpoint does: it may well have processed a request the client
gave up on.

Batch requests (header `X-Varadhi-Batch-Size`, `varadhi.core.batching`) are read entry by entry:
each entry is recorded and answered as a delivery of its own (`Record.batch` numbers the
request). When every entry gets the same status, that is the answer; otherwise a 207 with a
multi-status body (`retry_after` for 429/503). A `"slow"` entry delays the whole answer. The
answer `"malformed"` is for batches: the 207 then lists that entry under an id the request did
not carry (and 200 for every entry), an inconsistent answer a client must not take as success;
in single mode it is `ok_status`. The draw of 2. is a hash of (seed, message id, n), not a shared random stream, so
which deliveries fail does not depend on thread timing: the same seed and the same messages
fail the same way in every run.

`GET /stats` answers JSON counts, `GET /received[?since=N]` the records (from the N-th on),
`GET /outage?seconds=S` starts an outage of S seconds now and answers its `from_ms` and
`until_ms` (epoch ms, the endpoint's clock: the times its records are stamped with).
Run standalone with `python -m varadhi.testing.endpoint --port 18080 --fail-rate 0.1`; it prints
its URL on the first line of stdout. In a process of its own it shares no interpreter lock with
the program under test, so that program's load does not delay when it reads requests; with
`--record FILE` (and `--record-headers`) its records reach the caller through the file, which
`read_records` reads back, complete once the process has ended (SIGTERM: it stops, then exits).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import select
import signal
import socket
import socketserver
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler
from typing import IO, Any, Literal
from urllib.parse import parse_qs, urlsplit

from varadhi.core.batching import BATCH_SIZE_HEADER
from varadhi.core.messages import HTTP_ATTEMPT, HTTP_GROUP_ID, HTTP_MESSAGE_ID

Answer = int | Literal["slow", "malformed"]

# Signing keys of the tests (`endpoint.signing`; never a real secret): the conftest puts them in
# the environment before any Spark starts, so shards and their executors can read them.
TEST_WHSEC_ENV = "VARADHI_ENDPOINT_TEST_WHSEC"
TEST_WHSEC = "whsec_" + base64.b64encode(hashlib.sha256(b"varadhi test v1").digest()).decode()
TEST_WHSK_ENV = "VARADHI_ENDPOINT_TEST_WHSK"
TEST_WHSK = "whsk_" + base64.b64encode(hashlib.sha256(b"varadhi test v1a").digest()).decode()

DEFAULT_MIX: Mapping[str, float] = {"503": 0.4, "500": 0.3, "slow": 0.1, "400": 0.1, "404": 0.1}


@dataclass(frozen=True, slots=True)
class Record:
    """One delivery as the endpoint saw it. `seq` is the arrival order (0-based), `connection`
    the 1-based number of the TCP connection it came on, `status` what the endpoint answered
    (after `delay_ms` of sleeping), `headers` all request headers when `record_headers` is on."""

    seq: int
    connection: int
    method: str
    path: str
    message_id: str | None
    group_id: str | None
    attempt: int | None
    body_bytes: int
    received_ms: float
    status: int
    delay_ms: int
    headers: dict[str, str] | None = None
    # The request body when `record_bodies` is on (a batch's whole body on each of its
    # entries), as text: UTF-8, other bytes as surrogates (`raw_body` gives the bytes back).
    body: str | None = None
    batch: int | None = None  # the batch request it came in (0-based), None: a single request
    # (Single requests.) The client had already closed the connection when the endpoint read
    # the request: it gave up on it (timed out) before it arrived here, so `received_ms` says
    # nothing of when it was sent, and the client saw a timeout, not `status` (a starved
    # endpoint reads late).
    client_gone: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def raw_body(self) -> bytes | None:
        """The request body's bytes as received (`record_bodies`), else None."""
        return None if self.body is None else self.body.encode("utf-8", "surrogateescape")


def read_records(path: str) -> list[Record]:
    """The records a `record_file` (`--record`) holds, in the order written (arrival order for
    single requests). Read it after the endpoint stopped: a record is written as it arrives."""
    with open(path, encoding="utf-8") as f:
        return [Record(**json.loads(line)) for line in f if line.strip()]


class TestEndpoint:
    """A recording, failure-injecting HTTP endpoint on `host:port` (port 0: any free port).

    `start()` returns the base URL; `stop()` closes the listener and every open connection (so
    a client sees a dead endpoint, not a half-alive one). Also a context manager. Thread-safe.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        fail_rate: float = 0.0,
        seed: int = 1,
        mix: Mapping[str, float] | None = None,
        script: Mapping[str, Sequence[Answer]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ok_status: int = 200,
        retry_after_s: int = 1,
        slow_ms: int = 3_000,
        latency_ms: int = 0,
        record_headers: bool = False,
        record_bodies: bool = False,
        record_file: str | None = None,
        tls: ssl.SSLContext | None = None,
        authorize: Callable[[str | None], bool] | None = None,
    ):
        if not 0.0 <= fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be in [0, 1], got {fail_rate}")
        mix = dict(DEFAULT_MIX if mix is None else mix)
        if not mix or any(w <= 0 for w in mix.values()):
            raise ValueError(f"mix needs positive weights, got {mix}")
        self._mix = [(_parse_answer(k), w) for k, w in mix.items()]
        self._mix_total = sum(w for _, w in self._mix)
        self._script = {
            m: [_parse_answer(a) for a in answers] for m, answers in (script or {}).items()
        }
        _check_status(ok_status)
        self.fail_rate = fail_rate
        self.seed = seed
        self.host = host
        self.port = port
        self.ok_status = ok_status
        self.retry_after_s = retry_after_s
        self.slow_ms = slow_ms
        self.latency_ms = latency_ms
        self.record_headers = record_headers
        self.record_bodies = record_bodies
        self._record_path = record_file
        self.tls = tls
        self.authorize = authorize
        self._record_out: IO[str] | None = None
        self._lock = threading.Lock()
        self._records: list[Record] = []
        self._seen: Counter[str] = Counter()
        self._by_status: Counter[int] = Counter()
        self._connections = 0
        self._batches = 0
        self._open: set[socket.socket] = set()
        self._concurrent = 0
        self._max_concurrent = 0
        self._stopping = threading.Event()
        self._down_until_ms = 0.0  # answer 503 to every delivery until then (`outage`)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> str:
        if self._server is not None:
            raise RuntimeError("already started")
        if self._record_path:
            self._record_out = open(self._record_path, "a", encoding="utf-8")  # noqa: SIM115
        self._stopping.clear()
        self._server = _Server((self.host, self.port), _Handler, self)
        if self.tls is not None:  # the handshake is made in the connection's thread
            self._server.socket = self.tls.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"test-endpoint-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop accepting, wake sleeping handlers, and close every open connection."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join()
        if self._record_out is not None:
            with self._lock:
                self._record_out.close()
                self._record_out = None

    def __enter__(self) -> TestEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://{self.host}:{self.port}/"

    # -- inspection ------------------------------------------------------------------------

    def records(self, since: int = 0) -> list[Record]:
        with self._lock:
            return self._records[since:]

    def stats(self) -> dict[str, Any]:
        """`requests` (deliveries: a batch request counts one per message), `batch_requests`,
        `connections` (accepted so far), `max_concurrent` (most deliveries being handled at one
        time), `by_status` (answers sent, keys as strings, JSON-ready)."""
        with self._lock:
            return {
                "requests": len(self._records),
                "batch_requests": self._batches,
                "connections": self._connections,
                "max_concurrent": self._max_concurrent,
                "by_status": {str(k): v for k, v in sorted(self._by_status.items())},
            }

    def outage(self, seconds: float) -> tuple[float, float]:
        """Answer 503 (with Retry-After) to every delivery for `seconds` from now, whatever the
        script or `fail_rate` say; returns the outage's (from, until) in epoch ms. A delivery
        read at or after `until` is answered as usual again."""
        if not seconds >= 0:
            raise ValueError(f"an outage lasts 0 seconds or more, got {seconds!r}")
        start = time.time() * 1000
        with self._lock:
            self._down_until_ms = start + seconds * 1000
            return start, self._down_until_ms

    def set_script(self, message_id: str, answers: Sequence[Answer]) -> None:
        """Script the next answers for `message_id` (counting from its next delivery)."""
        parsed = [_parse_answer(a) for a in answers]
        with self._lock:
            self._script[message_id] = [self.ok_status] * self._seen[message_id] + parsed

    # -- request handling (handler threads) ---------------------------------------------------

    def _connected(self, sock: socket.socket) -> int:
        with self._lock:
            self._connections += 1
            self._open.add(sock)
            return self._connections

    def _disconnected(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.discard(sock)

    def _answer(self, message_id: str | None, seq: int, n: int) -> Answer:
        if time.time() * 1000 < self._down_until_ms:
            return 503
        scripted = self._script.get(message_id) if message_id is not None else None
        if scripted is not None and n < len(scripted):
            return scripted[n]
        if self.fail_rate and scripted is None:
            key = message_id if message_id is not None else f"#seq{seq}"
            digest = hashlib.blake2b(f"{self.seed}\0{key}\0{n}".encode(), digest_size=16).digest()
            u1 = int.from_bytes(digest[:8]) / 2**64
            if u1 < self.fail_rate:
                u2 = int.from_bytes(digest[8:]) / 2**64 * self._mix_total
                for answer, weight in self._mix:
                    u2 -= weight
                    if u2 < 0:
                        return answer
                return self._mix[-1][0]
        return self.ok_status

    def _recorded_headers(self, h: _Handler) -> dict[str, str] | None:
        """The request's headers as a record keeps them (`record_headers`), else None."""
        if not self.record_headers:
            return None
        return {k: _utf8(v) for k, v in h.headers.items()}

    def _recorded_body(self, body: bytes) -> str | None:
        return body.decode("utf-8", "surrogateescape") if self.record_bodies else None

    def _deliver(self, h: _Handler) -> None:
        if "chunked" in (h.headers.get("Transfer-Encoding") or "").lower():
            h.close_connection = True
            _reply(h, 411, None)
            return
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        refused = self.authorize is not None and not self.authorize(h.headers.get("Authorization"))
        if h.headers.get(BATCH_SIZE_HEADER) is not None:
            if refused:
                _reply(h, 401, None)
                return
            self._deliver_batch(h, body)
            return
        received_ms = time.time() * 1000
        gone = _client_gone(h.connection)
        message_id = _utf8(h.headers.get(HTTP_MESSAGE_ID))
        group_id = _utf8(h.headers.get(HTTP_GROUP_ID))
        attempt = h.headers.get(HTTP_ATTEMPT)
        with self._lock:
            seq = len(self._records)
            n = self._seen[message_id] if message_id is not None else 0
            if refused:
                answer: Answer = 401
            else:
                if message_id is not None:
                    self._seen[message_id] += 1
                answer = self._answer(message_id, seq, n)
            status = self.ok_status if answer == "slow" else answer
            delay_ms = self.latency_ms + (self.slow_ms if answer == "slow" else 0)
            record = Record(
                seq=seq,
                connection=h.connection_id,
                method=h.command,
                path=h.path,
                message_id=message_id,
                group_id=group_id,
                attempt=int(attempt) if attempt is not None and attempt.isdigit() else None,
                body_bytes=len(body),
                received_ms=received_ms,
                status=status,
                delay_ms=delay_ms,
                headers=self._recorded_headers(h),
                body=self._recorded_body(body),
                client_gone=gone,
            )
            self._records.append(record)
            self._by_status[status] += 1
            self._concurrent += 1
            self._max_concurrent = max(self._max_concurrent, self._concurrent)
            if self._record_out is not None:
                self._record_out.write(json.dumps(record.to_json()) + "\n")
                self._record_out.flush()
        try:
            if delay_ms and self._stopping.wait(delay_ms / 1000):
                h.close_connection = True
                return
            retry_after = str(self.retry_after_s) if status in (429, 503) else None
            _reply(h, status, retry_after)
        finally:
            with self._lock:
                self._concurrent -= 1

    def _deliver_batch(self, h: _Handler, body: bytes) -> None:
        """A batch request: one record and one answer per entry, then one reply (see the module
        docstring)."""
        text = body.decode("utf-8")
        if text.startswith("["):
            entries = json.loads(text)
        else:
            entries = [json.loads(line) for line in text.splitlines() if line]
        received_ms = time.time() * 1000
        headers = self._recorded_headers(h)  # one request: the same for each of its entries
        recorded_body = self._recorded_body(body)
        results: list[dict[str, Any]] = []
        delay_ms = self.latency_ms
        with self._lock:
            batch = self._batches
            self._batches += 1
            for entry in entries:
                message_id = entry["id"]
                seq = len(self._records)
                n = self._seen[message_id]
                self._seen[message_id] += 1
                answer = self._answer(message_id, seq, n)
                status = self.ok_status if answer in ("slow", "malformed") else answer
                if answer == "slow":
                    delay_ms = self.latency_ms + self.slow_ms
                result: dict[str, Any] = {"id": message_id, "status": status}
                if answer == "malformed":
                    result["id"] = f"not-sent-{message_id}"
                if status in (429, 503):
                    result["retry_after"] = self.retry_after_s
                results.append(result)
                record = Record(
                    seq=seq,
                    connection=h.connection_id,
                    method=h.command,
                    path=h.path,
                    message_id=message_id,
                    group_id=entry.get("group"),
                    attempt=entry.get("attempt"),
                    body_bytes=len(json.dumps(entry, separators=(",", ":"))),
                    received_ms=received_ms,
                    status=status,
                    delay_ms=delay_ms,
                    headers=headers,
                    body=recorded_body,
                    batch=batch,
                )
                self._records.append(record)
                self._by_status[status] += 1
                if self._record_out is not None:
                    self._record_out.write(json.dumps(record.to_json()) + "\n")
            if self._record_out is not None:
                self._record_out.flush()
        if delay_ms and self._stopping.wait(delay_ms / 1000):
            h.close_connection = True
            return
        statuses = {r["status"] for r in results}
        malformed = any(r["id"] != e["id"] for r, e in zip(results, entries, strict=True))
        if len(statuses) == 1 and not malformed:
            status = statuses.pop()
            _reply(h, status, str(self.retry_after_s) if status in (429, 503) else None)
            return
        payload = json.dumps(results).encode()
        h.send_response(207)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)

    def _get(self, h: _Handler) -> None:
        url = urlsplit(h.path)
        if url.path == "/stats":
            payload: Any = self.stats()
        elif url.path == "/received":
            since = int(parse_qs(url.query).get("since", ["0"])[0])
            payload = [r.to_json() for r in self.records(since)]
        elif url.path == "/outage":
            try:
                start, until = self.outage(float(parse_qs(url.query)["seconds"][0]))
            except (KeyError, ValueError):
                _reply(h, 400, None)
                return
            payload = {"from_ms": start, "until_ms": until}
        else:
            _reply(h, 404, None)
            return
        body = json.dumps(payload).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    # socketserver, not http.server.HTTPServer: the latter resolves its host name on bind,
    # which can hang for seconds on a machine without DNS.
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], handler: type, owner: TestEndpoint):
        self.owner = owner
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client going away is not news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    disable_nagle_algorithm = True  # else small replies wait for the client's delayed ACK
    server: _Server
    connection_id = 0

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()  # a failed one (no client certificate): OSError
        super().setup()
        self.connection_id = self.server.owner._connected(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._disconnected(self.connection)

    def do_POST(self) -> None:
        self.server.owner._deliver(self)

    do_PUT = do_PATCH = do_POST

    def do_GET(self) -> None:
        self.server.owner._get(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _reply(h: BaseHTTPRequestHandler, status: int, retry_after: str | None) -> None:
    """Answer `status`; an error (4xx/5xx) comes with a short JSON body saying so, as real
    endpoints answer (dead letters carry the start of it)."""
    body = (
        json.dumps({"error": f"test endpoint answered {status}"}).encode() if status >= 400 else b""
    )
    h.send_response(status)
    if retry_after is not None:
        h.send_header("Retry-After", retry_after)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def _client_gone(sock: socket.socket) -> bool:
    """Whether the peer has closed (or reset) the connection, with the request just read: no
    request follows on it (the engine does not pipeline), so readable means end of stream.
    Over TLS: False (unknown: readable bytes may be a TLS record, not the end)."""
    if isinstance(sock, ssl.SSLSocket):
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _utf8(value: str | None) -> str | None:
    """http.server decodes header bytes as latin-1; senders (the engine) send UTF-8."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _check_status(status: int) -> None:
    if not isinstance(status, int) or not 100 <= status <= 599:
        raise ValueError(f"not an HTTP status: {status!r}")


def _parse_answer(answer: Answer | str) -> Answer:
    if answer in ("slow", "malformed"):
        return answer  # type: ignore[return-value]
    try:
        status = int(answer)
    except (TypeError, ValueError):
        raise ValueError(
            f"an answer is an HTTP status, 'slow' or 'malformed', got {answer!r}"
        ) from None
    _check_status(status)
    return status


def _parse_mix(text: str) -> dict[str, float]:
    try:
        return {k.strip(): float(w) for k, w in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ANSWER=WEIGHT,... (e.g. 503=0.5,slow=0.5), got {text!r}"
        ) from None


def _read_script(path: str) -> dict[str, list[Answer]]:
    try:
        with open(path, encoding="utf-8") as f:
            script = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read the script {path}: {e}") from None
    if not isinstance(script, dict) or not all(isinstance(a, list) for a in script.values()):
        raise argparse.ArgumentTypeError(
            f'a script is a JSON object of answer lists ({{"msg-1": [500, 200]}}), in {path}'
        )
    return script


def from_command_line(argv: Sequence[str] | None = None) -> TestEndpoint:
    """The endpoint `python -m varadhi.testing.endpoint ARGV` runs (not started); a bad option
    exits 2 with argparse's message."""
    parser = argparse.ArgumentParser(
        prog="python -m varadhi.testing.endpoint",
        description="A recording, failure-injecting HTTP endpoint on loopback.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (default)")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--mix", type=_parse_mix, default=None, help="e.g. 503=0.5,500=0.3,slow=0.2"
    )
    parser.add_argument("--ok-status", type=int, default=200)
    parser.add_argument("--retry-after", type=int, default=1, help="seconds, on 503 and 429")
    parser.add_argument("--slow-ms", type=int, default=3_000)
    parser.add_argument("--latency-ms", type=int, default=0)
    parser.add_argument("--record", metavar="FILE.jsonl", help="append every record to FILE")
    parser.add_argument(
        "--record-headers", action="store_true", help="keep every request's headers in its record"
    )
    parser.add_argument(
        "--record-bodies", action="store_true", help="keep every request's body in its record"
    )
    parser.add_argument(
        "--script",
        type=_read_script,
        default=None,
        metavar="FILE.json",
        help='scripted answers by message id, e.g. {"msg-1": [500, 503, 200]}',
    )
    args = parser.parse_args(argv)
    try:
        return TestEndpoint(
            fail_rate=args.fail_rate,
            seed=args.seed,
            mix=args.mix,
            script=args.script,
            host=args.host,
            port=args.port,
            ok_status=args.ok_status,
            retry_after_s=args.retry_after,
            slow_ms=args.slow_ms,
            latency_ms=args.latency_ms,
            record_headers=args.record_headers,
            record_bodies=args.record_bodies,
            record_file=args.record,
        )
    except ValueError as e:
        parser.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    endpoint = from_command_line(argv)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(endpoint.start(), flush=True)
    done.wait()
    endpoint.stop()
    print(json.dumps(endpoint.stats()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
