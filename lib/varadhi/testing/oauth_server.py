"""A real OAuth 2 authorization server for tests (RFC 6749 client credentials, built with
authlib's `AuthorizationServer` and `ClientCredentialsGrant`), on loopback over https with the
test PKI's server certificate (`varadhi.testing.tls`).

`POST /token` with HTTP Basic client authentication issues random bearer tokens that expire
after `expires_in` seconds; `valid(authorization)` says whether an `Authorization` header
carries a token this server issued that has not expired nor been revoked (`revoke_all`), which
is how `TestEndpoint(authorize=...)` checks requests. `issued` counts the tokens issued.
Threaded; never a real secret.
"""

from __future__ import annotations

import hmac
import json
import secrets
import socketserver
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from authlib.oauth2.rfc6749 import AuthorizationServer, ClientMixin, OAuth2Request
from authlib.oauth2.rfc6749.grants import ClientCredentialsGrant
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from authlib.oauth2.rfc6750 import BearerTokenGenerator

from varadhi.testing.tls import Pki, test_pki

TEST_CLIENT_ID = "varadhi-test"
TEST_CLIENT_SECRET_ENV = "VARADHI_ENDPOINT_TEST_OAUTH_SECRET"
TEST_CLIENT_SECRET = "test client secret: never a real one"


class _Client(ClientMixin):
    def __init__(self, client_id: str, secret: str):
        self.client_id, self.secret = client_id, secret

    def get_client_id(self) -> str:
        return self.client_id

    def check_client_secret(self, client_secret: str) -> bool:
        return hmac.compare_digest(client_secret.encode(), self.secret.encode())

    def check_endpoint_auth_method(self, method: str, endpoint: str) -> bool:
        return method == "client_secret_basic"

    def check_grant_type(self, grant_type: str) -> bool:
        return grant_type == "client_credentials"

    def get_allowed_scope(self, scope: str) -> str:
        return scope or ""


class _Request(OAuth2Request):
    def __init__(self, uri: str, form: dict[str, str], headers: dict[str, str]):
        super().__init__("POST", uri, headers=headers)
        self._form = form
        self.payload = BasicOAuth2Payload(form)

    @property
    def form(self) -> dict[str, str]:
        return self._form


class _Authlib(AuthorizationServer):
    def __init__(self, owner: OAuthServer):
        super().__init__()
        self.owner = owner
        self.register_grant(ClientCredentialsGrant)
        self.register_token_generator(
            "default",
            BearerTokenGenerator(
                access_token_generator=lambda **_: secrets.token_urlsafe(24),
                expires_generator=lambda client, grant_type: owner.expires_in,
            ),
        )

    def query_client(self, client_id: str) -> _Client | None:
        o = self.owner
        return _Client(o.client_id, o.client_secret) if client_id == o.client_id else None

    def save_token(self, token: dict[str, Any], request: Any) -> None:
        self.owner._save(token)

    def send_signal(self, name: str, *args: Any, **kwargs: Any) -> None:
        pass

    def create_oauth2_request(self, request: _Request) -> _Request:
        return request

    def handle_response(self, status: int, body: Any, headers: Any) -> tuple:
        return status, body, headers


class OAuthServer:
    """The authorization server on `https://127.0.0.1:<port>/token` (`start()` returns it)."""

    def __init__(
        self,
        expires_in: int = 3600,
        client_id: str = TEST_CLIENT_ID,
        client_secret: str = TEST_CLIENT_SECRET,
        pki: Pki | None = None,
    ):
        self.expires_in = expires_in
        self.client_id, self.client_secret = client_id, client_secret
        self.pki = pki or test_pki()
        self.issued = 0
        self.requests: list[dict[str, str]] = []  # each token request's form
        self._tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self._lock = threading.Lock()
        self._authlib = _Authlib(self)
        self._server: _Server | None = None
        self.port = 0

    def start(self) -> str:
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._server.socket = self.pki.server_context(False).wrap_socket(
            self._server.socket, server_side=True, do_handshake_on_connect=False
        )
        self.port = self._server.server_address[1]
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self.token_url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> OAuthServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def token_url(self) -> str:
        return f"https://127.0.0.1:{self.port}/token"

    def valid(self, authorization: str | None) -> bool:
        """Whether the header carries an issued, unexpired, unrevoked bearer token."""
        scheme, _, token = (authorization or "").partition(" ")
        with self._lock:
            expires = self._tokens.get(token)
        return scheme.lower() == "bearer" and expires is not None and time.monotonic() < expires

    def revoke_all(self) -> None:
        with self._lock:
            self._tokens.clear()

    def _save(self, token: dict[str, Any]) -> None:
        with self._lock:
            self.issued += 1
            self._tokens[token["access_token"]] = time.monotonic() + token["expires_in"]

    def _token(self, h: _Handler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0)).decode()
        form = dict(urllib.parse.parse_qsl(body))
        with self._lock:
            self.requests.append(form)
        headers = {k: v for k, v in h.headers.items()}
        request = _Request(self.token_url, form, headers)
        status, payload, extra = self._authlib.create_token_response(request)
        data = payload if isinstance(payload, bytes | str) else json.dumps(payload)
        data = data.encode() if isinstance(data, str) else data
        h.send_response(status)
        for name, value in extra:
            if name.lower() != "content-length":
                h.send_header(name, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type, owner: OAuthServer):
        self.owner = owner
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        self.request.do_handshake()
        super().setup()

    def do_POST(self) -> None:
        if urllib.parse.urlsplit(self.path).path != "/token":
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.owner._token(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass
