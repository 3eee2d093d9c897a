"""How the delivery engine proves who it is to an endpoint, and whom it trusts: the endpoint's
TLS (a CA bundle of its own, a client certificate for mutual TLS), OAuth 2 client credentials,
and a signed JWT bearer of our own (`Endpoint.tls`, `Endpoint.oauth2`, `Endpoint.jwt`).

Secrets are named, never given (`SecretRef`, read through `varadhi.core.endpoint_guard`, so only
references the platform allows are honoured): the TLS material, the OAuth2 client secret, the
JWT signing key. What a secret or a token holds never appears in an error, a `repr` or a log
line (this module logs nothing).

OAuth 2 client credentials (RFC 6749, 4.4; `request_token`): the client authenticates with HTTP
Basic (`client_secret_basic`) to an https token endpoint only, and a redirect of the token
request is refused (`RedirectRefused`): the client secret is never sent to another URL. The
Kafka layer's OAUTHBEARER login (`varadhi.kafka.oauth_tokens`) uses the same request and cache.
A token is reused until a little before it expires (`CachedToken`): the smaller of 30 s and a
fifth of its lifetime before. For an endpoint, one cache per process per (token URL, client,
secret, scope, audience, CA) is shared by every deliverer of the process (`shared_token`): an
executor's tasks fetch one token, not one each. A failed fetch is not tried again for
`FAILURE_BACKOFF_S`: meanwhile every request fails fast with the same reason instead of each
asking the token endpoint.

JWT bearer (`JwtMinter`): RS256 (an RSA key) or ES256 (a P-256 key), header `kid`, claims `iss`,
`sub`, `aud`, `iat`, `exp`; a new token is minted a fifth of its lifetime before it expires.

Addresses. Under the private-address deny-list (`VARADHI_ENDPOINT_DENY_PRIVATE`) the token
endpoint is held to it as the endpoint is: a literal address is refused at `apply`, and the
address a name resolves to is checked on the connected socket, before the TLS handshake and
before any credential is sent (`_GuardedHTTPSConnection`), so a name that resolves to a cloud
metadata address (or is re-pointed there later) gets no client secret.

Hazards: a token is a credential; it goes only into the request's auth header. Through an HTTP
proxy the token endpoint is reached like any https URL (`https_proxy`), and the address checked
is the proxy's (the platform chose it).
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from varadhi.core import endpoint_guard
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import InvalidArgument, VaradhiError
from varadhi.core.policies import Endpoint, EndpointTls, JwtBearer, OAuth2Credentials, SecretRef

TOKEN_TIMEOUT_S = 10.0  # a token request's whole time
FAILURE_BACKOFF_S = 1.0  # a failed token fetch is not tried again before this
MAX_REFRESH_MARGIN_S = 30.0


class TokenError(VaradhiError):
    """No token could be had (the token endpoint refused, failed, redirected or was not
    reached). The message says why, never the secret or a token."""


# -- TLS ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes `Endpoint.tls` names (each None when not configured)."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None


def read_tls(tls: EndpointTls | None, policy: EndpointPolicy) -> TlsMaterial:
    """Read the TLS material through the guard. Raises InvalidArgument naming the field
    (`endpoint.tls.ca`, ...) for a reference the platform refuses, a secret that cannot be
    read, or one that does not hold what it should (never quoting it)."""
    if tls is None:
        return TlsMaterial()

    def pem(ref: SecretRef | None, name: str, marker: str) -> bytes | None:
        if ref is None:
            return None
        field = f"endpoint.tls.{name}"
        text = endpoint_guard.read_secret(ref, field, policy)
        if marker not in text:
            raise InvalidArgument(f"{ref} does not hold a PEM {marker.strip('- ')}", field=field)
        return text.encode() + b"\n"

    return TlsMaterial(
        ca=pem(tls.ca, "ca", "-----BEGIN CERTIFICATE-----"),
        cert=pem(tls.cert, "cert", "-----BEGIN CERTIFICATE-----"),
        key=pem(tls.key, "key", "PRIVATE KEY-----"),
    )


# -- OAuth 2 client credentials -----------------------------------------------------------------


def check_token_url(url: str, field: str) -> None:
    """Refuse a token URL that is not https with a host, or carries credentials: the client
    secret is sent to it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise InvalidArgument(
            f"the OAuth token endpoint {url!r} is not an https URL: the client secret is sent "
            "to it",
            field=field,
        )
    if parts.username or parts.password:
        raise InvalidArgument("must not carry credentials (user:password@)", field=field)


class RedirectRefused(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: urllib would send the request again to wherever the token
    endpoint points, client secret included."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise TokenError(
            f"the OAuth token endpoint {req.full_url} redirected ({code}) to {newurl}; "
            "configure the final URL (credentials are never sent on to another URL)"
        )


class _GuardedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection that, once its TCP connection stands and before the TLS handshake,
    refuses a peer address the deny-list names (`endpoint_guard.address_refusal`). Through a
    proxy (a tunnel) the peer is the proxy, which is not checked."""

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP, and a proxy's CONNECT if any
        if not self._tunnel_host:
            reason = endpoint_guard.address_refusal(self.sock.getpeername()[0])
            if reason is not None:
                self.sock.close()
                raise OSError(reason)
        server_hostname = self._tunnel_host or self.host
        self.sock = self._context.wrap_socket(self.sock, server_hostname=server_hostname)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):  # noqa: ANN001, ANN201 - urllib's handler protocol
        return self.do_open(_GuardedHTTPSConnection, req, context=self._context)


def request_token(
    url: str,
    client_id: str,
    secret: str,
    scope: str | None = None,
    audience: str | None = None,
    cadata: str | None = None,
    deny_private: bool = False,
) -> tuple[str, float]:
    """One client-credentials grant: (access token, seconds it lives; 3600 when the answer
    says not). `cadata`: PEM CAs to trust instead of the system's. `deny_private`: refuse a
    token endpoint whose address the deny-list names (module docstring). Raises
    InvalidArgument for a URL `check_token_url` refuses, TokenError for any failure to get a
    token."""
    check_token_url(url, "token_url")
    form = {"grant_type": "client_credentials"}
    if scope:
        form["scope"] = scope
    if audience:
        form["audience"] = audience
    request = urllib.request.Request(
        url,
        data=urllib.parse.urlencode(form).encode(),
        headers={"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"},
    )
    basic = f"{urllib.parse.quote(client_id)}:{urllib.parse.quote(secret)}"
    request.add_header("Authorization", "Basic " + base64.b64encode(basic.encode()).decode())
    context = ssl.create_default_context(cadata=cadata)
    handler = _GuardedHTTPSHandler if deny_private else urllib.request.HTTPSHandler
    opener = urllib.request.build_opener(RedirectRefused, handler(context=context))
    try:
        with opener.open(request, timeout=TOKEN_TIMEOUT_S) as response:
            body = json.loads(response.read(65_536))
    except urllib.error.HTTPError as e:
        raise TokenError(
            f"the OAuth token endpoint {url} answered HTTP {e.code}{_oauth_error(e)}"
        ) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or type(e).__name__
        raise TokenError(f"the OAuth token endpoint {url} could not be used ({why})") from None
    token = body.get("access_token") if isinstance(body, Mapping) else None
    if not isinstance(token, str) or not token or any(c in token for c in "\r\n\0 "):
        raise TokenError(f"the OAuth token endpoint {url} answered without a usable access_token")
    token_type = body.get("token_type", "Bearer")
    if not isinstance(token_type, str) or token_type.lower() != "bearer":
        raise TokenError(
            f"the OAuth token endpoint {url} issued a {token_type!r} token, not Bearer"
        )
    expires_in = body.get("expires_in", 3600)
    if isinstance(expires_in, str) and expires_in.isdigit():
        expires_in = int(expires_in)
    if isinstance(expires_in, bool) or not isinstance(expires_in, int | float) or expires_in <= 0:
        raise TokenError(f"the OAuth token endpoint {url} answered an invalid expires_in")
    return token, float(expires_in)


def _oauth_error(e: urllib.error.HTTPError) -> str:
    """`: <error>` from an RFC 6749 error answer (its `error` code only), else nothing."""
    try:
        code = json.loads(e.read(4096)).get("error")
    except (ValueError, AttributeError, OSError):
        return ""
    return f": {code}" if isinstance(code, str) and code.isprintable() and len(code) < 64 else ""


class CachedToken:
    """A token from `fetch` (-> token, lifetime in seconds), reused until the smaller of
    `MAX_REFRESH_MARGIN_S` and a fifth of its lifetime is left. Thread-safe. `invalidate`
    drops a token the endpoint refused (only if it is still the current one, so that many
    requests refused at once cause one fetch)."""

    def __init__(
        self, fetch: Callable[[], tuple[str, float]], clock: Callable[[], float] = time.monotonic
    ):
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._renew_at = 0.0
        self._failure: TokenError | None = None
        self._retry_at = 0.0

    def get(self) -> str:
        """The current token, fetched when there is none or it is about to expire. Raises
        TokenError (the fetch's, or again the last one's within `FAILURE_BACKOFF_S`)."""
        with self._lock:
            now = self._clock()
            if self._token is not None and now < self._renew_at:
                return self._token
            if self._failure is not None and now < self._retry_at:
                raise self._failure
            try:
                token, lifetime = self._fetch()
            except TokenError as e:
                self._token, self._failure, self._retry_at = None, e, now + FAILURE_BACKOFF_S
                raise
            self._failure = None
            self._token = token
            self._renew_at = now + lifetime - min(MAX_REFRESH_MARGIN_S, lifetime / 5)
            return token

    def invalidate(self, token: str) -> None:
        with self._lock:
            if token == self._token:
                self._token = None

    def __repr__(self) -> str:
        return "CachedToken(***)"


_shared: dict[tuple, CachedToken] = {}
_shared_lock = threading.Lock()


def shared_token(
    url: str,
    client_id: str,
    secret: str,
    scope: str | None = None,
    audience: str | None = None,
    cadata: str | None = None,
    deny_private: bool = False,
) -> CachedToken:
    """The process's one cache for these credentials (see the module docstring)."""
    check_token_url(url, "token_url")
    key = (url, client_id, secret, scope, audience, cadata, deny_private)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = CachedToken(
                lambda: request_token(url, client_id, secret, scope, audience, cadata, deny_private)
            )
        return _shared[key]


# -- JWT bearer ---------------------------------------------------------------------------------


class JwtMinter:
    """Mints the JWTs of `Endpoint.jwt` with the PEM private key `key_pem` (`mint`: a token
    and its lifetime in seconds). Raises InvalidArgument naming `field` for a key that is not a
    PEM private key of the algorithm's kind (never quoting it)."""

    def __init__(
        self,
        jwt: JwtBearer,
        key_pem: str,
        audience: str,
        field: str = "endpoint.jwt.key",
        clock: Callable[[], float] = time.time,
    ):
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils

        try:
            key: Any = serialization.load_pem_private_key(key_pem.encode(), password=None)
        except (ValueError, TypeError):
            raise InvalidArgument(
                f"{jwt.key} does not hold an unencrypted PEM private key", field=field
            ) from None
        if jwt.algorithm == "RS256":
            if not isinstance(key, rsa.RSAPrivateKey) or key.key_size < 2048:
                raise InvalidArgument("RS256 needs an RSA key of 2048 bits or more", field=field)

            def sign(data: bytes) -> bytes:
                return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
        else:
            if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
                raise InvalidArgument("ES256 needs an EC key on the P-256 curve", field=field)

            def sign(data: bytes) -> bytes:  # JWS wants r || s, 32 bytes each, not DER
                r, s = utils.decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
                return r.to_bytes(32, "big") + s.to_bytes(32, "big")

        self._sign = sign
        self._clock = clock
        self.lifetime_s = jwt.lifetime_ms // 1000
        self._header = _b64url_json({"alg": jwt.algorithm, "typ": "JWT", "kid": jwt.key_id})
        self._claims = {"iss": jwt.issuer, "sub": jwt.subject or jwt.issuer, "aud": audience}

    def mint(self) -> tuple[str, float]:
        now = int(self._clock())
        claims = {**self._claims, "iat": now, "exp": now + self.lifetime_s}
        signing_input = f"{self._header}.{_b64url_json(claims)}".encode()
        signature = base64.urlsafe_b64encode(self._sign(signing_input)).rstrip(b"=")
        return (signing_input + b"." + signature).decode(), float(self.lifetime_s)

    def __repr__(self) -> str:
        return f"JwtMinter({self._claims['iss']}, {self._claims['aud']})"


def _b64url_json(doc: Mapping[str, Any]) -> str:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


# -- the engine's bearer header -----------------------------------------------------------------


class BearerHeader:
    """The auth header line of every request: `<header>: Bearer <token>` from `source`; the
    line is rebuilt only when the token changes. Not thread-safe (one per deliverer; the
    source may be shared)."""

    __slots__ = ("_header", "_source", "_token", "_line")

    def __init__(self, header: str, source: CachedToken):
        self._header = header
        self._source = source
        self._token: str | None = None
        self._line = b""

    def line(self) -> bytes:
        """Raises TokenError when no token can be had."""
        token = self._source.get()
        if token is not self._token:
            self._token = token
            self._line = f"{self._header}: Bearer {token}".encode()
        return self._line

    def refused(self, line: bytes) -> None:
        """The endpoint refused the request that carried `line` (401): if that is still the
        current token, the next `line` has a new one (a request that carried an older token
        is simply sent with the current one: many refused at once cause one fetch)."""
        if line is self._line and self._token is not None:
            self._source.invalidate(self._token)

    def __repr__(self) -> str:
        return f"BearerHeader({self._header}: Bearer ***)"


def bearer(endpoint: Endpoint, policy: EndpointPolicy, ca: bytes | None) -> BearerHeader | None:
    """The bearer header of `endpoint.oauth2` or `endpoint.jwt` (None without either), its
    secret read through the guard now. Raises InvalidArgument naming the field."""
    if endpoint.oauth2 is not None:
        o: OAuth2Credentials = endpoint.oauth2
        check_token_url(o.token_url, "endpoint.oauth2.token_url")
        secret = endpoint_guard.read_secret(
            o.client_secret, "endpoint.oauth2.client_secret", policy
        )
        source = shared_token(
            o.token_url,
            o.client_id,
            secret,
            o.scope,
            o.audience,
            None if ca is None else ca.decode(),
            policy.deny_private,
        )
        return BearerHeader(endpoint.auth_header, source)
    if endpoint.jwt is not None:
        j = endpoint.jwt
        key = endpoint_guard.read_secret(j.key, "endpoint.jwt.key", policy)
        minter = JwtMinter(j, key, j.audience or endpoint.url)
        return BearerHeader(endpoint.auth_header, CachedToken(minter.mint))
    return None
