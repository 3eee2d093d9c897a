"""The test endpoint tells a request read after its client had given up on it (`Record.
client_gone`): what bench/chaos.py's judge needs on a starved machine, where the endpoint reads
requests late. Real endpoints on loopback (one in a process of its own, to stop it), raw sockets
and the delivery engine; no other service."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from varadhi.core import messages as m
from varadhi.core.delivery import HttpDeliverer
from varadhi.core.group_state import Entry, GroupRun, RunCounts
from varadhi.core.policies import Endpoint as HttpEndpoint
from varadhi.core.policies import RetryPolicy
from varadhi.testing.endpoint import Record, TestEndpoint

REQUEST = (
    b"POST / HTTP/1.1\r\nHost: x\r\nX-Varadhi-Message-Id: m\r\nX-Varadhi-Attempt: 1\r\n"
    b"Content-Length: 4\r\n\r\nbody"
)


@pytest.fixture
def endpoint():
    with TestEndpoint() as ep:
        yield ep


def _send(url: str, leave: bool) -> bytes:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        # Corked, the request leaves with the end of stream in one segment, as if the client
        # had left before the endpoint read it: the endpoint never sees one without the other.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        sock.sendall(REQUEST)
        if leave:  # as a client that timed out: nothing more will come
            sock.shutdown(socket.SHUT_WR)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
        return sock.recv(1024)


def test_a_request_whose_client_left_is_marked(endpoint):
    _send(endpoint.url, leave=True)
    _send(endpoint.url, leave=False)
    first, second = endpoint.records()
    assert (first.client_gone, second.client_gone) == (True, False)
    assert first.to_json()["client_gone"] is True


def test_a_stalled_endpoint_is_not_taken_for_early_retries():
    """The real engine and group runs (in-place retries, 200 ms backoff, 1 s timeout) against
    an endpoint process stopped for 3 s: the requests it reads late were given up by their
    clients, and bench/chaos.py's judge counts no early retry (before `client_gone`, the same
    records gave early retries: attempt n+1 read right after a late-read attempt n)."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("chaos_judge", bench / "chaos.py")
        chaos = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(chaos)
    finally:
        sys.path.remove(str(bench))

    args = ["--fail-rate", "0.5", "--mix", "500=0.5,503=0.5"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "varadhi.testing.endpoint", *args], stdout=subprocess.PIPE, text=True
    )
    try:
        url = proc.stdout.readline().strip()
        policy = RetryPolicy(max_attempts=12, min_backoff_ms=200, max_backoff_ms=2000, jitter=0)
        counts = RunCounts()
        runs = [
            GroupRun(
                [Entry(m.Origin(0, 0, i), f"m-{i}", f"g{i}", "new", value=b"x", source=f"t/0/{i}")],
                policy,
                "skip",
                lambda: int(time.time() * 1000),
                random.Random(1),
                counts,
            )
            for i in range(200)
        ]

        def stall():
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(3)
            os.kill(proc.pid, signal.SIGCONT)

        stopper = threading.Thread(target=stall)
        stopper.start()
        with HttpDeliverer(HttpEndpoint(url=url, request_timeout_ms=1000), 64) as http:
            http.run(iter(runs), linger_s=2.0)
        stopper.join()
        with urllib.request.urlopen(url + "received", timeout=30) as answer:
            records = [Record(**r) for r in json.load(answer)]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(30)
    verdict = chaos.judge(records, {}, set(), [], 0)
    assert verdict["read_after_client_left"] > 0
    assert verdict["early_retries"] == 0, verdict["early_retry_pairs"]
