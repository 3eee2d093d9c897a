"""Endpoint TLS and authentication as configuration and pure logic (issue 29, part 2;
`varadhi.core.endpoint_auth`): the spec's `tls`, `oauth2` and `jwt` sections, validated naming
the field and stored as references; what the platform allows them to name; when a token is
fetched again; the JWTs we mint. The engine against real servers:
tests/integration/test_endpoint_security.py."""

import jwt as pyjwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from varadhi.core import endpoint_auth
from varadhi.core.endpoint_auth import CachedToken, JwtMinter, TokenError
from varadhi.core.endpoint_guard import EndpointPolicy, check_endpoint
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import JwtBearer, SecretRef
from varadhi.core.subscription_spec import parse_spec, spec_from_dict, spec_to_dict

TOKEN_URL = "https://idp.example/oauth/token"
OAUTH2 = {
    "token_url": TOKEN_URL,
    "client_id": "varadhi",
    "client_secret": {"env": "VARADHI_ENDPOINT_ORDERS_CLIENT_SECRET"},
    "scope": "orders.write",
    "audience": "https://hooks.example.com",
}
JWT = {
    "algorithm": "ES256",
    "key": {"file": "/run/secrets/varadhi/jwt.pem"},
    "key_id": "k1",
    "issuer": "varadhi",
    "lifetime": "2m",
}
TLS = {
    "ca": {"file": "/run/secrets/varadhi/ca.pem"},
    "cert": {"file": "/run/secrets/varadhi/client.pem"},
    "key": {"env": "VARADHI_ENDPOINT_ORDERS_CLIENT_KEY"},
}


def spec(**endpoint):
    doc = {
        "name": "s",
        "topic": "t",
        "endpoint": {"url": "https://hooks.example.com/x", **endpoint},
    }
    return parse_spec(doc, "test.yaml")


def error(**endpoint) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        spec(**endpoint)
    return e.value


def test_the_sections_parse_and_round_trip_as_references():
    for endpoint in ({"tls": TLS, "oauth2": OAUTH2}, {"tls": {"ca": TLS["ca"]}, "jwt": JWT}):
        parsed = spec(**endpoint)
        assert spec_from_dict(spec_to_dict(parsed)) == parsed
    e = spec(tls=TLS, oauth2=OAUTH2).endpoint
    assert e.tls.key == SecretRef(env="VARADHI_ENDPOINT_ORDERS_CLIENT_KEY")
    assert e.oauth2.client_secret == SecretRef(env="VARADHI_ENDPOINT_ORDERS_CLIENT_SECRET")
    j = spec(jwt=JWT).endpoint.jwt
    assert (j.algorithm, j.lifetime_ms, j.subject, j.audience) == ("ES256", 120_000, None, None)


@pytest.mark.parametrize(
    ("endpoint", "field", "words"),
    [
        ({"oauth2": {**OAUTH2, "token_url": "http://idp.example/t"}}, "oauth2.token_url", "https"),
        ({"oauth2": {**OAUTH2, "client_secret": "s3cret"}}, "oauth2.client_secret", "mapping"),
        (
            {"oauth2": {k: v for k, v in OAUTH2.items() if k != "client_id"}},
            "oauth2.client_id",
            "required",
        ),  # fmt: skip
        ({"jwt": {**JWT, "algorithm": "HS256"}}, "jwt.algorithm", "RS256, ES256"),
        ({"jwt": {**JWT, "lifetime": "2h"}}, "jwt.lifetime", "at most 3600s"),
        ({"jwt": {**JWT, "lifetime": "5s"}}, "jwt.lifetime", "at least 10000ms"),
        ({"jwt": {**JWT, "key": {"env": "X", "file": "/k"}}}, "jwt.key", "exactly one"),
        ({"tls": {"cert": TLS["cert"]}}, "tls.key", "needs its key"),
        ({"tls": {"ca": {"file": "ca.pem"}}}, "tls.ca.file", "absolute path"),
        ({"tls": {"crl": "x"}}, "tls.crl", "unknown"),
        ({"auth_env": "VARADHI_ENDPOINT_T", "oauth2": OAUTH2}, "oauth2", "at most one"),
        ({"oauth2": OAUTH2, "jwt": JWT}, "jwt", "at most one"),
    ],
)
def test_invalid_sections_are_refused_naming_the_field(endpoint, field, words):
    e = error(**endpoint)
    assert e.field == f"endpoint.{field}" and words in str(e), str(e)


def test_tls_is_for_https_endpoints():
    with pytest.raises(InvalidArgument) as e:
        parse_spec({"name": "s", "topic": "t", "endpoint": {"url": "http://h/x", "tls": TLS}})
    assert e.value.field == "endpoint.tls" and "https" in str(e.value)


def test_every_new_reference_is_checked_by_the_platforms_policy():
    policy = EndpointPolicy.from_env({"VARADHI_ENDPOINT_SECRET_DIR": "/run/secrets/varadhi"})
    check_endpoint(spec(tls=TLS, oauth2=OAUTH2).endpoint, policy)
    check_endpoint(spec(jwt=JWT).endpoint, policy)
    for endpoint, field in [
        ({"tls": {**TLS, "key": {"env": "AWS_SECRET_ACCESS_KEY"}}}, "tls.key"),
        ({"tls": {"ca": {"file": "/etc/ssl/private/x.pem"}}}, "tls.ca"),
        (
            {"oauth2": {**OAUTH2, "client_secret": {"env": "VARADHI_KAFKA_SASL_PASSWORD"}}},
            "oauth2.client_secret",
        ),  # fmt: skip
        ({"jwt": {**JWT, "key": {"file": "/home/me/.ssh/id_ecdsa"}}}, "jwt.key"),
    ]:
        with pytest.raises(InvalidArgument) as e:
            check_endpoint(spec(**endpoint).endpoint, policy)
        assert e.value.field == f"endpoint.{field}"
    deny = EndpointPolicy.from_env({"VARADHI_ENDPOINT_DENY_PRIVATE": "true"})
    metadata = {**OAUTH2, "token_url": "https://169.254.169.254/token"}
    with pytest.raises(InvalidArgument) as e:
        check_endpoint(spec(oauth2=metadata).endpoint, deny)
    assert e.value.field == "endpoint.oauth2.token_url"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_is_reused_until_a_little_before_it_expires_and_dropped_when_refused():
    clock, fetched = Clock(), []

    def fetch():
        fetched.append(clock.now)
        return f"t{len(fetched)}", 100.0  # renewed 20 s before (a fifth; at most 30 s)

    cache = CachedToken(fetch, clock)
    assert cache.get() == "t1"
    clock.now += 79.9
    assert cache.get() == "t1"
    clock.now += 0.2
    assert cache.get() == "t2"
    cache.invalidate("t1")  # an older token refused: the current one stays
    assert cache.get() == "t2" and len(fetched) == 2
    cache.invalidate("t2")
    assert cache.get() == "t3"


def test_a_failed_fetch_is_not_tried_again_for_a_second():
    clock, calls = Clock(), []

    def fetch():
        calls.append(clock.now)
        if len(calls) < 3:
            raise TokenError("the OAuth token endpoint https://idp/t answered HTTP 503")
        return "t", 3600.0

    cache = CachedToken(fetch, clock)
    for _ in range(2):
        with pytest.raises(TokenError, match="503"):
            cache.get()
    assert len(calls) == 1
    clock.now += endpoint_auth.FAILURE_BACKOFF_S
    with pytest.raises(TokenError):
        cache.get()
    clock.now += endpoint_auth.FAILURE_BACKOFF_S
    assert cache.get() == "t" and len(calls) == 3


def test_minted_jwts_carry_the_claims_and_are_minted_again_before_expiry():
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()  # fmt: skip
    clock = Clock()
    spec_ = JwtBearer("ES256", SecretRef(env="K"), "k1", "varadhi", subject="orders",
                      lifetime_ms=300_000)  # fmt: skip
    minter = JwtMinter(spec_, pem, "https://hooks.example.com/x", clock=clock)
    cache = CachedToken(minter.mint, clock)
    token = cache.get()
    claims = pyjwt.decode(token, key.public_key(), algorithms=["ES256"],
                          audience="https://hooks.example.com/x",
                          options={"verify_exp": False, "verify_iat": False})  # fmt: skip
    assert claims == {"iss": "varadhi", "sub": "orders", "aud": "https://hooks.example.com/x",
                      "iat": 1000, "exp": 1300}  # fmt: skip
    assert pyjwt.get_unverified_header(token) == {"alg": "ES256", "typ": "JWT", "kid": "k1"}
    clock.now += 269
    assert cache.get() == token
    clock.now += 2  # less than 30 s left: a new one
    assert cache.get() != token
    assert "varadhi" in repr(minter) and "BEGIN" not in repr(minter) + repr(cache)
