"""Webhook-grade endpoints in the HTTP engine, against a real HTTP server on loopback (issue 29,
parts 1, 2 and 7): signed requests as the Standard Webhooks reference verifier (the
`standardwebhooks` package, not our code) accepts them; mutual TLS with a CA of the test's own,
OAuth2 client credentials from a real authorization server (authlib's) and a JWT bearer as PyJWT
verifies it; and what the engine refuses to do whatever the spec says (other protocols, framing
headers, injected credentials, private addresses)."""

from __future__ import annotations

import base64
import json

import jwt as pyjwt
import pycurl
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from varadhi.core import endpoint_auth
from varadhi.core.delivery import HttpDeliverer, Outcome, Request
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import InvalidArgument
from varadhi.core.messages import HTTP_ATTEMPT, HTTP_GROUP_ID, HTTP_MESSAGE_ID
from varadhi.core.policies import (
    DeliveryPolicy,
    Endpoint,
    EndpointTls,
    JwtBearer,
    OAuth2Credentials,
    SecretRef,
    SigningKey,
)
from varadhi.testing import tls
from varadhi.testing.endpoint import (
    TEST_WHSEC,
    TEST_WHSEC_ENV,
    TEST_WHSK,
    TEST_WHSK_ENV,
    Record,
    TestEndpoint,
)
from varadhi.testing.harness import wait_for
from varadhi.testing.oauth_server import (
    TEST_CLIENT_ID,
    TEST_CLIENT_SECRET,
    TEST_CLIENT_SECRET_ENV,
    OAuthServer,
)

OLD_WHSEC_ENV = "VARADHI_ENDPOINT_OLD_WHSEC"
OLD_WHSEC = "whsec_" + base64.b64encode(b"the key being rotated out, 32 b.").decode()


class Messages:
    """A stream of `n` messages `<name>-1..n`, each sent once; keeps the outcomes."""

    def __init__(self, name: str, n: int, extra: dict[str, str] | None = None):
        self.name, self.n, self.extra = name, n, extra or {}
        self.sent = 0
        self.outcomes: list[Outcome] = []

    def next_request(self) -> Request | None:
        if self.sent == self.n:
            return None
        self.sent += 1
        headers = {
            HTTP_MESSAGE_ID: f"{self.name}-{self.sent}",
            HTTP_GROUP_ID: self.name,
            HTTP_ATTEMPT: "1",
            **self.extra,
        }
        return Request(json.dumps({"n": self.sent, "text": "grüße"}).encode(), headers)

    def on_outcome(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)


@pytest.fixture
def endpoint():
    started: list[TestEndpoint] = []

    def make(**kwargs) -> TestEndpoint:
        ep = TestEndpoint(record_headers=True, record_bodies=True, **kwargs)
        ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        ep.stop()


def key(scheme: str, env: str) -> SigningKey:
    return SigningKey(scheme, SecretRef(env=env))  # type: ignore[arg-type]


def run(url: str, streams, delivery=None, policy=None, **endpoint):
    engine = HttpDeliverer(Endpoint(url=url, **endpoint), 8, delivery, policy)
    with engine:
        return engine.run(streams)


def verify_v1a(record: Record) -> None:
    """Standard Webhooks' v1a: an ed25519 signature over `id.timestamp.body` (the reference
    Python package verifies v1 only, so `cryptography` checks v1a with the public key)."""
    seed = base64.b64decode(TEST_WHSK.removeprefix("whsk_"))
    public = Ed25519PrivateKey.from_private_bytes(seed).public_key()
    h = record.headers
    signed = f"{h['webhook-id']}.{h['webhook-timestamp']}.".encode() + record.raw_body
    v1a = [s.split(",", 1)[1] for s in h["webhook-signature"].split(" ") if s.startswith("v1a,")]
    assert len(v1a) == 1
    public.verify(base64.b64decode(v1a[0]), signed)  # raises InvalidSignature


# -- part 1: signed requests ---------------------------------------------------------------------


def test_every_request_is_signed_with_every_key_and_the_reference_verifier_accepts_it(
    endpoint, monkeypatch
):
    monkeypatch.setenv(OLD_WHSEC_ENV, OLD_WHSEC)
    ep = endpoint()
    forged = {"webhook-signature": "v1,Zm9yZ2Vk", "webhook-id": "forged"}
    streams = [Messages("a", 2, extra=forged), Messages("b", 1)]
    keys = (key("v1", OLD_WHSEC_ENV), key("v1", TEST_WHSEC_ENV), key("v1a", TEST_WHSK_ENV))
    stats = run(ep.url, streams, signing=keys)
    assert stats.by_status == {200: 3}
    records = ep.records()
    assert len(records) == 3
    for r in records:
        h = r.headers
        # webhook-id is the message id (stable across retries and replays), never a forgery
        assert h["webhook-id"] == r.message_id
        assert len(h["webhook-signature"].split(" ")) == 3
        # Either v1 key verifies (rotation: the endpoint holds the old or the new one)
        assert Webhook(TEST_WHSEC).verify(r.body, h) == json.loads(r.body)
        assert Webhook(OLD_WHSEC).verify(r.body, h) == json.loads(r.body)
        verify_v1a(r)
        with pytest.raises(WebhookVerificationError):
            Webhook("whsec_" + base64.b64encode(b"some other key").decode()).verify(r.body, h)
        with pytest.raises(WebhookVerificationError):  # the body is what was signed
            Webhook(TEST_WHSEC).verify(r.body.replace('"n"', '"m"'), h)


def test_a_batched_request_is_signed_once_over_its_body_with_an_id_of_its_messages(endpoint):
    ep = endpoint()
    streams = [Messages(f"g{i}", 1) for i in range(5)]
    policy = DeliveryPolicy(mode="batch", max_messages=10)
    run(ep.url, streams, delivery=policy, signing=(key("v1", TEST_WHSEC_ENV),))
    records = ep.records()
    assert len(records) == 5 and {r.batch for r in records} == {0}
    h, body = records[0].headers, records[0].body
    assert h["webhook-id"].startswith("batch_")
    Webhook(TEST_WHSEC).verify(body, h, json_parse=False)
    # The same messages in the same order have the same id; others another
    again = endpoint()
    run(again.url, [Messages(f"g{i}", 1) for i in range(5)], delivery=policy,
        signing=(key("v1", TEST_WHSEC_ENV),))  # fmt: skip
    assert again.records()[0].headers["webhook-id"] == h["webhook-id"]
    other = endpoint()
    run(other.url, [Messages(f"g{i}", 1) for i in range(4)], delivery=policy,
        signing=(key("v1", TEST_WHSEC_ENV),))  # fmt: skip
    assert other.records()[0].headers["webhook-id"] != h["webhook-id"]


def test_unsigned_endpoints_get_no_signature_headers(endpoint):
    ep = endpoint()
    run(ep.url, [Messages("a", 1, extra={"webhook-signature": "v1,Zm9yZ2Vk"})])
    (r,) = ep.records()
    assert not {"webhook-id", "webhook-timestamp", "webhook-signature"} & set(r.headers)


@pytest.mark.parametrize(
    ("value", "why"),
    [("whsec_", "empty"), ("not base64!", "whsec_<base64>"), ("whsk_" + "QUJD", "32-byte")],
)
def test_a_bad_signing_key_is_refused_naming_the_field_never_its_value(monkeypatch, value, why):
    monkeypatch.setenv("VARADHI_ENDPOINT_BAD_KEY", value)
    scheme = "v1a" if value.startswith("whsk_") else "v1"
    keys = (key("v1", TEST_WHSEC_ENV), key(scheme, "VARADHI_ENDPOINT_BAD_KEY"))
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", signing=keys))
    assert e.value.field == "endpoint.signing[1]" and why in str(e.value)
    assert value not in str(e.value).replace("whsec_<base64>", "").replace("whsk_<base64>", "")


# -- part 7: safe by default ---------------------------------------------------------------------


def test_auth_env_may_not_name_a_platform_secret(monkeypatch):
    """Any variable's value went to any URL: a spec could send the executors' cloud keys."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "platform-secret")
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", auth_env="AWS_SECRET_ACCESS_KEY"))
    assert e.value.field == "endpoint.auth_env" and "VARADHI_ENDPOINT_" in str(e.value)
    assert "platform-secret" not in str(e.value)
    policy = EndpointPolicy.from_env({"VARADHI_ENDPOINT_SECRET_NAMES": "AWS_SECRET_ACCESS_KEY"})
    HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", auth_env="AWS_SECRET_ACCESS_KEY"),
                  policy=policy).close()  # fmt: skip


def test_a_credential_with_a_line_break_is_refused_not_sent(monkeypatch):
    monkeypatch.setenv("VARADHI_ENDPOINT_TOKEN", "Bearer t\r\nX-Injected: 1")
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", auth_env="VARADHI_ENDPOINT_TOKEN"))
    assert e.value.field == "endpoint.auth_env" and "CR, LF or NUL" in str(e.value)
    assert "Injected" not in str(e.value)


@pytest.mark.parametrize("name", ["Host", "content-length", "Transfer-Encoding", "webhook-id"])
def test_framing_and_signature_headers_are_refused_among_static_headers(name):
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="http://127.0.0.1:1/", headers=((name, "x"),)))
    assert e.value.field == "endpoint.headers" and name in str(e.value)


def test_the_engine_speaks_only_http_and_https(tmp_path):
    """libcurl reads file://, gopher://, dict://... : the engine's handles refuse them, for
    requests and redirects."""
    secret = tmp_path / "secret"
    secret.write_text("do not read")
    with HttpDeliverer(Endpoint(url="http://127.0.0.1:1/")) as engine:
        curl = engine._new_transfer().curl  # a handle as the engine configures it
        for url in (f"file://{secret}", "dict://127.0.0.1:1/x", "gopher://127.0.0.1:1/x"):
            curl.setopt(pycurl.URL, url)
            with pytest.raises(pycurl.error) as e:
                curl.perform()
            assert e.value.args[0] == pycurl.E_UNSUPPORTED_PROTOCOL, url


def test_a_denied_private_address_is_refused_at_start_and_at_connect_with_the_reason(endpoint):
    ep = endpoint()
    deny = EndpointPolicy.from_env({"VARADHI_ENDPOINT_DENY_PRIVATE": "true"})
    # A literal address: at start
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url=ep.url), policy=deny)
    assert e.value.field == "endpoint.url" and "loopback" in str(e.value)
    metadata = Endpoint(url="http://169.254.169.254/latest/meta-data/")
    with pytest.raises(InvalidArgument, match="cloud metadata"):
        HttpDeliverer(metadata, policy=deny)
    # A name: where it resolves, at connect time; nothing reaches the endpoint
    by_name = ep.url.replace("127.0.0.1", "localhost")
    stream = Messages("a", 1)
    stats = run(by_name, [stream], policy=deny)
    assert stats.errors == {"connection_error": 1} and ep.records() == []
    (outcome,) = stream.outcomes
    assert "loopback" in outcome.detail and "VARADHI_ENDPOINT_DENY_PRIVATE" in outcome.detail
    # Off (the default locally): the same name is delivered to
    run(by_name, [Messages("b", 1)], policy=EndpointPolicy.from_env({}))
    assert len(ep.records()) == 1


# -- part 6: request shaping ---------------------------------------------------------------------


class Paths:
    """One stream sending a request to each of `paths` in turn (None: the URL as configured)."""

    def __init__(self, paths):
        self.paths = list(paths)
        self.sent = 0

    def next_request(self) -> Request | None:
        if self.sent == len(self.paths):
            return None
        self.sent += 1
        headers = {HTTP_MESSAGE_ID: f"p-{self.sent}", HTTP_ATTEMPT: "1"}
        return Request(b"{}", headers, path=self.paths[self.sent - 1])

    def on_outcome(self, outcome: Outcome) -> None:
        assert outcome.status == 200


def test_a_request_goes_to_its_shaped_path_on_the_reused_connection(endpoint):
    ep = endpoint()
    paths = ["/t/acme%2Feu", None, "/t/other", "/t/other"]
    run(ep.url + "base/?v=1", [Paths(paths)], signing=(key("v1", TEST_WHSEC_ENV),))
    records = ep.records()
    assert [r.path for r in records] == [
        "/base/t/acme%2Feu?v=1",
        "/base/?v=1",
        "/base/t/other?v=1",
        "/base/t/other?v=1",
    ]
    assert len({r.connection for r in records}) == 1  # one keep-alive connection throughout
    for r in records:  # the signature covers the body, whatever the path
        Webhook(TEST_WHSEC).verify(r.body, r.headers)


# -- part 2: endpoint TLS and authentication -----------------------------------------------------

TLS_REFS = EndpointTls(
    ca=SecretRef(env=tls.CA_ENV),
    cert=SecretRef(env=tls.CLIENT_CERT_ENV),
    key=SecretRef(env=tls.CLIENT_KEY_ENV),
)
CA_ONLY = EndpointTls(ca=SecretRef(env=tls.CA_ENV))


def delivered(streams) -> list[int | None]:
    return [o.status for s in streams for o in s.outcomes]


def test_mutual_tls_with_a_custom_ca_and_a_client_certificate(endpoint):
    """A TLS endpoint that requires a client certificate its CA signed: reached only with the
    CA bundle (else the server is not trusted) and the client certificate (else the server
    ends the handshake)."""
    ep = endpoint(tls=tls.test_pki().server_context(require_client_cert=True))
    assert ep.url.startswith("https://")
    for config in (None, CA_ONLY):  # untrusted server; no client certificate
        stream = Messages("a", 1)
        stats = run(ep.url, [stream], tls=config)
        assert stats.errors == {"connection_error": 1} and ep.records() == []
    streams = [Messages("m", 3), Messages("n", 2)]
    stats = run(ep.url, streams, tls=TLS_REFS)
    assert stats.by_status == {200: 5} and len(ep.records()) == 5


def test_a_bad_tls_reference_or_material_is_refused_naming_the_field(monkeypatch):
    monkeypatch.setenv("VARADHI_ENDPOINT_NOT_PEM", "secret text")
    url = "https://127.0.0.1:1/"
    bad = EndpointTls(ca=SecretRef(env=tls.CA_ENV), cert=SecretRef(env=tls.CLIENT_CERT_ENV),
                      key=SecretRef(env="VARADHI_ENDPOINT_NOT_PEM"))  # fmt: skip
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url=url, tls=bad))
    assert e.value.field == "endpoint.tls.key" and "secret text" not in str(e.value)
    platform = EndpointTls(ca=SecretRef(env="SSL_CERT_FILE"))
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url=url, tls=platform))
    assert e.value.field == "endpoint.tls.ca" and "VARADHI_ENDPOINT_" in str(e.value)


@pytest.fixture
def oauth():
    started: list[OAuthServer] = []

    def make(**kwargs) -> OAuthServer:
        server = OAuthServer(**kwargs)
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def oauth2(server: OAuthServer, secret_env: str = TEST_CLIENT_SECRET_ENV) -> OAuth2Credentials:
    return OAuth2Credentials(
        token_url=server.token_url,
        client_id=TEST_CLIENT_ID,
        client_secret=SecretRef(env=secret_env),
        scope="deliver",
    )


def test_oauth2_client_credentials_one_token_shared_then_refreshed_on_401_and_on_expiry(
    endpoint, oauth
):
    """A real authorization server (authlib) on https with the test CA, an mTLS endpoint that
    accepts only its unexpired tokens."""
    server = oauth(expires_in=2)
    ep = endpoint(tls=tls.test_pki().server_context(True), authorize=server.valid)
    auth = {"tls": TLS_REFS, "oauth2": oauth2(server)}
    # Two deliverers of the process: one token, fetched once, on every request
    for name in ("a", "b"):
        streams = [Messages(f"{name}{i}", 2) for i in range(4)]
        run(ep.url, streams, **auth)
        assert delivered(streams) == [200] * 8
    assert server.issued == 1 and server.requests[0]["scope"] == "deliver"
    first = {r.headers["Authorization"] for r in ep.records()}
    assert len(first) == 1 and server.valid(first.pop())
    # Revoked at the server: each request answered 401 is sent once more with a new token;
    # the streams see only the 200s
    server.revoke_all()
    streams = [Messages(f"c{i}", 2) for i in range(4)]
    stats = run(ep.url, streams, **auth)
    assert delivered(streams) == [200] * 8 and server.issued == 2
    refused = [r for r in ep.records() if r.status == 401]
    assert 1 <= len(refused) <= 8 and stats.by_status == {401: len(refused), 200: 8}
    assert sum(stats.latency_ms) == stats.requests == 8 + len(refused)  # each answer counted
    # Expired (2 s tokens, renewed when less than a fifth is left): a new one before any 401
    token = ep.records()[-1].headers["Authorization"]
    wait_for(lambda: not server.valid(token), 30, "the token to expire")
    before = len(ep.records())
    stats = run(ep.url, [Messages("d", 2)], **auth)
    assert stats.by_status == {200: 2} and server.issued == 3
    assert all(r.status == 200 for r in ep.records()[before:])


def test_a_second_401_is_the_outcome_and_a_refused_token_request_sends_nothing(
    endpoint, oauth, monkeypatch
):
    server = oauth()
    ep = endpoint(tls=tls.test_pki().server_context(False), authorize=lambda _: False)
    stream = Messages("a", 1)
    stats = run(ep.url, [stream], tls=CA_ONLY, oauth2=oauth2(server))
    # sent twice (a new token the second time), then the 401 is the stream's outcome
    assert [o.status for o in stream.outcomes] == [401] and stats.by_status == {401: 2}
    assert server.issued == 2 and len(ep.records()) == 2
    # A wrong client secret: no token, nothing sent, the reason without the secret
    monkeypatch.setenv("VARADHI_ENDPOINT_WRONG_SECRET", "not the client secret")
    stream = Messages("b", 2)
    stats = run(ep.url, [stream], tls=CA_ONLY,
                oauth2=oauth2(server, "VARADHI_ENDPOINT_WRONG_SECRET"))  # fmt: skip
    assert stats.errors == {"connection_error": 2} and len(ep.records()) == 2
    for outcome in stream.outcomes:
        assert "answered HTTP 401: invalid_client" in outcome.detail
        assert "not the client secret" not in outcome.detail
    # The token endpoint's own certificate is checked (the CA bundle serves it too)
    stream = Messages("c", 1)
    run(ep.url, [stream], tls=None, oauth2=oauth2(server))
    assert "CERTIFICATE_VERIFY_FAILED" in stream.outcomes[0].detail


def test_a_token_endpoint_whose_name_resolves_to_a_denied_address_gets_no_credentials(oauth):
    """Under the deny-list, a token URL given as a host name that resolves to a denied address
    (here localhost: loopback) is refused on the connected socket, before the TLS handshake:
    the authorization server sees no request, so no client secret leaves. Before, the check
    read only a literal address and urllib connected wherever the name pointed."""
    server = oauth()
    named = OAuth2Credentials(
        token_url=server.token_url.replace("127.0.0.1", "localhost"),
        client_id=TEST_CLIENT_ID,
        client_secret=SecretRef(env=TEST_CLIENT_SECRET_ENV),
    )
    stream = Messages("a", 1)
    url = "https://localhost:1/"  # never reached: no token, no request
    run(url, [stream], tls=CA_ONLY, oauth2=named, policy=EndpointPolicy(deny_private=True))
    [outcome] = stream.outcomes
    assert outcome.error == "connection_error"
    assert "address 127.0.0.1 is loopback" in outcome.detail, outcome.detail
    assert server.issued == 0 and server.requests == []
    # Without the deny-list the same name is used as before.
    assert endpoint_auth.request_token(
        named.token_url, TEST_CLIENT_ID, TEST_CLIENT_SECRET,
        cadata=tls.test_pki().ca,
    )[0]  # fmt: skip
    assert server.issued == 1


def test_an_oauth2_token_url_must_be_https():
    bad = OAuth2Credentials("http://127.0.0.1:1/token", "c", SecretRef(env=TEST_CLIENT_SECRET_ENV))
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url="https://127.0.0.1:1/", oauth2=bad))
    assert e.value.field == "endpoint.oauth2.token_url" and "https" in str(e.value)


def private_pem(algorithm: str) -> tuple[str, object]:
    key = (
        rsa.generate_private_key(65537, 2048)
        if algorithm == "RS256"
        else ec.generate_private_key(ec.SECP256R1())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()  # fmt: skip
    return pem, key.public_key()


@pytest.mark.parametrize("algorithm", ["RS256", "ES256"])
def test_a_signed_jwt_bearer_verified_by_pyjwt(endpoint, monkeypatch, algorithm):
    pem, public = private_pem(algorithm)
    monkeypatch.setenv("VARADHI_ENDPOINT_TEST_JWT_KEY", pem)
    seen: list[dict] = []

    def verify(header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        claims = pyjwt.decode(token, public, algorithms=[algorithm], audience="https://hooks.test",
                              issuer="varadhi", options={"require": ["iat", "exp", "sub"]})  # fmt: skip
        seen.append({**claims, "kid": pyjwt.get_unverified_header(token)["kid"]})
        return scheme == "Bearer"

    ep = endpoint(authorize=verify)
    spec = JwtBearer(algorithm, SecretRef(env="VARADHI_ENDPOINT_TEST_JWT_KEY"), "k-2026",
                     "varadhi", audience="https://hooks.test", lifetime_ms=60_000)  # fmt: skip
    stats = run(ep.url, [Messages("a", 2)], jwt=spec)
    assert stats.by_status == {200: 2}
    assert all(c["kid"] == "k-2026" and c["sub"] == "varadhi" for c in seen) and len(seen) == 2
    assert seen[0]["exp"] - seen[0]["iat"] == 60
    # A key of the other kind is refused naming the field, never quoting the key
    other, _ = private_pem("ES256" if algorithm == "RS256" else "RS256")
    monkeypatch.setenv("VARADHI_ENDPOINT_TEST_JWT_KEY", other)
    with pytest.raises(InvalidArgument) as e:
        HttpDeliverer(Endpoint(url=ep.url, jwt=spec))
    assert e.value.field == "endpoint.jwt.key" and "PRIVATE" not in str(e.value)
