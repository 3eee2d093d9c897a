"""Micro-benchmark of the HTTP engine: requests/s of `HttpDeliverer` posting 1 KiB bodies.

Targets, all on 127.0.0.1:

- `test-endpoint`: `python -m varadhi.testing.endpoint` in its own process (a threaded Python
  server: this row measures the server more than the engine);
- `nginx-204`: Debian's nginx (one worker) answering `return 204;`, with a config written to a
  temporary directory: the engine's own ceiling;
- `wrk` against each, one thread, the same connection count: the endpoint's ceiling.

The engine delivers `--groups` streams (pulled lazily, like a shard's groups) with
`--max-in-flight` requests in flight, each request carrying the per-message headers a shard
sends (message id, idempotency key, group id, attempt).

Needs the Debian packages `nginx-light` (or `nginx`) and `wrk`; rows whose tool is missing are
skipped with a message. Installs nothing. Writes bench/results/http_engine.json.

    .venv/bin/python bench/http_engine.py [--requests 200000] [--groups 10000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pycurl

from common import endpoint_process, machine, nginx_binary, stop_process, write_results
from varadhi.core.delivery import DeliveryStats, HttpDeliverer, Outcome, Request
from varadhi.core.messages import HTTP_ATTEMPT, HTTP_GROUP_ID, HTTP_IDEMPOTENCY_KEY, HTTP_MESSAGE_ID
from varadhi.core.policies import Endpoint

BODY = b"x" * 1024
RESULTS = Path(__file__).resolve().parent / "results" / "http_engine.json"


class _Group:
    """A stream of `n` messages of one group, as a shard job would send them."""

    __slots__ = ("group", "n", "sent", "failed")

    def __init__(self, group: str, n: int):
        self.group, self.n, self.sent, self.failed = group, n, 0, 0

    def next_request(self) -> Request | None:
        if self.sent == self.n:
            return None
        self.sent += 1
        msg_id = f"{self.group}-{self.sent}"
        return Request(
            BODY,
            {
                HTTP_MESSAGE_ID: msg_id,
                HTTP_IDEMPOTENCY_KEY: msg_id,
                HTTP_GROUP_ID: self.group,
                HTTP_ATTEMPT: "1",
            },
        )

    def on_outcome(self, outcome: Outcome) -> None:
        if outcome.error is not None or not 200 <= outcome.status < 300:
            self.failed += 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within 10 s")


NGINX_CONF = """\
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 10000000;
    keepalive_timeout 60s;
    server {{
        listen 127.0.0.1:{port};
        location / {{ return 204; }}
    }}
}}
"""


@contextmanager
def nginx(binary: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="varadhi-bench-nginx-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(NGINX_CONF.format(tmp=tmp, port=port))
        proc = subprocess.Popen(
            [binary, "-p", tmp, "-e", f"{tmp}/error.log", "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            _wait_listening(port, proc, "nginx")
            yield f"http://127.0.0.1:{port}/"
        finally:
            stop_process(proc)


def run_engine(url: str, requests: int, groups: int, max_in_flight: int) -> dict:
    per_group, extra = divmod(requests, groups)
    streams = (_Group(f"g{i}", per_group + (1 if i < extra else 0)) for i in range(groups))
    with HttpDeliverer(Endpoint(url=url), max_in_flight=max_in_flight) as engine:
        # Warm up: open the connections, so the row measures the steady state.
        engine.run(_Group(f"warm{i}", 20) for i in range(max_in_flight))
        stats: DeliveryStats = engine.run(streams)
    ok = sum(n for status, n in stats.by_status.items() if 200 <= status < 300)
    if ok != requests:
        raise RuntimeError(f"only {ok} of {requests} requests succeeded: {stats}")
    return {
        "requests": stats.requests,
        "streams": stats.streams,
        "seconds": round(stats.elapsed_s, 3),
        "req_per_s": round(stats.requests_per_s),
    }


WRK_LUA = """\
wrk.method = "POST"
wrk.body = string.rep("x", 1024)
wrk.headers["Content-Type"] = "application/octet-stream"
"""


def run_wrk(binary: str, url: str, connections: int, seconds: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA)
    try:
        out = subprocess.run(
            [binary, "-t1", f"-c{connections}", f"-d{seconds}s", "-s", f.name, url],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    return {"seconds": seconds, "req_per_s": round(float(match.group(1)))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000, help="against nginx")
    parser.add_argument(
        "--endpoint-requests", type=int, default=20_000, help="against the test endpoint"
    )
    parser.add_argument("--groups", type=int, default=10_000)
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--wrk-seconds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    load_at_start = os.getloadavg()
    rows: list[dict] = []
    nginx_bin = nginx_binary()
    wrk_bin = shutil.which("wrk")
    common = {"body_bytes": len(BODY), "max_in_flight": args.max_in_flight}

    with endpoint_process("--port", "0", "--ok-status", "204") as url:
        result = run_engine(url, args.endpoint_requests, args.groups, args.max_in_flight)
        rows.append({"target": "test-endpoint", "client": "HttpDeliverer", **common, **result})
        if wrk_bin:
            result = run_wrk(wrk_bin, url, args.max_in_flight, args.wrk_seconds)
            rows.append({"target": "test-endpoint", "client": "wrk -t1", **common, **result})
    if nginx_bin:
        with nginx(nginx_bin) as url:
            result = run_engine(url, args.requests, args.groups, args.max_in_flight)
            rows.append({"target": "nginx-204", "client": "HttpDeliverer", **common, **result})
            if wrk_bin:
                result = run_wrk(wrk_bin, url, args.max_in_flight, args.wrk_seconds)
                rows.append({"target": "nginx-204", "client": "wrk -t1", **common, **result})
    else:
        print("skipped nginx-204: no nginx (apt-get install nginx-light)", file=sys.stderr)
    if not wrk_bin:
        print("skipped wrk rows: no wrk (apt-get install wrk)", file=sys.stderr)

    print(f"{'target':<15} {'client':<15} {'requests':>9} {'seconds':>8} {'req/s':>9}")
    for row in rows:
        n = row.get("requests", "-")
        print(
            f"{row['target']:<15} {row['client']:<15} {n:>9} {row['seconds']:>8} {row['req_per_s']:>9}"
        )
    doc = {
        "benchmark": "http_engine",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(load_at_start, curl=pycurl.version),
        "groups": args.groups,
        "rows": rows,
    }
    write_results(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
