"""The test endpoint tells a request read after its client had given up on it (`Record.
client_gone`): what bench/chaos.py's judge needs on a starved machine, where the endpoint reads
requests late. A real endpoint on loopback and raw sockets; no other service."""

from __future__ import annotations

import socket

import pytest

from varadhi.testing.endpoint import TestEndpoint

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
