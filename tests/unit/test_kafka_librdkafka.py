"""librdkafka's (confluent-kafka's) view of the Kafka client configuration, without a broker:
`KafkaConfig.librdkafka_config()` for each protocol and mechanism, the OAUTHBEARER `oauth_cb`
on the same token providers as kafka-python's (a real https token endpoint for client
credentials), the refusals, and which librdkafka errors a fetch consumer treats as permanent."""

from __future__ import annotations

import base64
import json
import time

import confluent_kafka
import pytest

from varadhi.core.errors import KafkaConfigError
from varadhi.kafka import clients
from varadhi.kafka import config as kc
from varadhi.kafka.settings import Settings
from varadhi.testing.oauth_server import OAuthServer
from varadhi.testing.tls import test_pki

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n" + CA
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"
OAUTH = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    "AWS_SESSION_TOKEN": "session-token-for-tests",
}


@pytest.fixture
def ca(tmp_path):
    path = tmp_path / "ca.pem"
    path.write_text(CA)
    return str(path)


def _claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_plaintext_needs_nothing():
    assert kc.PLAINTEXT.librdkafka_config() == {}
    assert kc.from_properties({"bootstrap.servers": "b:9092"}, environ={}).librdkafka_config() == {}


def test_one_way_tls(ca):
    cfg = kc.from_properties({"security.protocol": "SSL", "ssl.truststore.location": ca}, {})
    assert cfg.librdkafka_config() == {
        "security.protocol": "SSL",
        "ssl.ca.location": ca,
        "ssl.endpoint.identification.algorithm": "https",
    }


def test_mutual_tls_takes_the_pem_keystore_as_certificate_and_key(tmp_path, ca):
    key = tmp_path / "client.pem"
    key.write_text(KEY)
    cfg = kc.from_properties(
        {
            "security.protocol": "SSL",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": ca,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(key),
            "ssl.keystore.password": "ignored-for-pem",
            "ssl.key.password": "${env:KEY_PW}",
        },
        environ={"KEY_PW": "kp"},
    )
    assert cfg.librdkafka_config() == {
        "security.protocol": "SSL",
        "ssl.ca.location": ca,
        "ssl.certificate.location": str(key),
        "ssl.key.location": str(key),
        "ssl.key.password": "kp",
        "ssl.endpoint.identification.algorithm": "https",
    }


def test_hostname_verification_off_only_when_asked(ca):
    off = kc.from_properties(
        {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": ""}, environ={}
    )
    assert off.librdkafka_config()["ssl.endpoint.identification.algorithm"] == "none"
    on = kc.from_properties(
        {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "HTTPS"}, environ={}
    )
    assert on.librdkafka_config()["ssl.endpoint.identification.algorithm"] == "https"


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_scram(ca, mechanism):
    cfg = kc.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "ssl.truststore.location": ca,
            "sasl.mechanism": mechanism,
            "sasl.jaas.config": f'{SCRAM} required username="alice" password="${{env:PW}}";',
            "client.dns.lookup": "use_all_dns_ips",
        },
        environ={"PW": "s3cret"},
    )
    assert cfg.librdkafka_config() == {
        "client.dns.lookup": "use_all_dns_ips",
        "security.protocol": "SASL_SSL",
        "ssl.ca.location": ca,
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": mechanism,
        "sasl.username": "alice",
        "sasl.password": "s3cret",
    }


def test_sasl_plaintext_plain():
    cfg = kc.from_properties(
        {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "PLAIN",
            "sasl.jaas.config": f'{PLAIN} required username="bob" password="pw";',
        },
        environ={},
    )
    assert cfg.librdkafka_config() == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "bob",
        "sasl.password": "pw",
    }


def _oauth(jaas: str, **extra: str) -> kc.KafkaConfig:
    return kc.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.jaas.config": f"{OAUTH} required {jaas};",
            **extra,
        },
        environ={},
    )


def _oauth_view(cfg: kc.KafkaConfig) -> tuple[str, float]:
    """The config's librdkafka view, checked for OAUTHBEARER; what its oauth_cb answers."""
    conf = cfg.librdkafka_config()
    oauth_cb = conf.pop("oauth_cb")
    assert conf == {
        "security.protocol": "SASL_SSL",
        "ssl.endpoint.identification.algorithm": "https",
        "sasl.mechanism": "OAUTHBEARER",
    }
    answer = oauth_cb(None)  # librdkafka passes sasl.oauthbearer.config, unset here
    token, expiry = answer
    assert isinstance(token, str) and isinstance(expiry, float)
    assert oauth_cb("ignored") == answer  # the provider's token, reused while fresh
    return token, expiry


def test_oauthbearer_unsecured_answers_the_tokens_exp():
    cfg = _oauth('unsecuredLoginStringClaim_sub="alice" unsecuredLoginLifetimeSeconds="600"')
    before = time.time()
    token, expiry = _oauth_view(cfg)
    claims = _claims(token)
    assert claims["sub"] == "alice" and claims["exp"] == expiry
    assert before + 599 <= expiry <= time.time() + 601  # (exp is rounded to milliseconds)


def test_oauthbearer_client_credentials_from_a_real_token_endpoint(tmp_path, monkeypatch):
    trusted = tmp_path / "test-ca.pem"
    trusted.write_text(test_pki().ca)
    monkeypatch.setenv("SSL_CERT_FILE", str(trusted))  # the token request's default CAs
    with OAuthServer(expires_in=600) as server:
        cfg = _oauth(
            f'clientId="{server.client_id}" clientSecret="{server.client_secret}" scope="kafka"',
            **{"sasl.oauthbearer.token.endpoint.url": server.token_url},
        )
        before = time.time()
        token, expiry = _oauth_view(cfg)
        assert server.valid(f"Bearer {token}") and server.issued == 1
        assert before + 600 <= expiry <= time.time() + 600
        assert server.requests[0]["scope"] == "kafka"


def test_oauthbearer_msk_iam_signs_offline(monkeypatch):
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    cfg = _oauth(
        "",
        **{"sasl.login.callback.handler.class": kc.MSK_IAM_HANDLER},
        **{"varadhi.aws.region": "eu-west-1"},
    )
    before = time.time()
    token, expiry = _oauth_view(cfg)
    url = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    assert url.startswith("https://kafka.eu-west-1.amazonaws.com/?Action=kafka-cluster%3AConnect")
    assert before < expiry <= time.time() + 3600  # the signer's (15 minutes)


def test_every_known_property_has_a_librdkafka_mapping():
    assert set(kc.KNOWN) == set(kc.RDKAFKA_HANDLED)


@pytest.mark.parametrize(
    "resolved, message",
    [
        # a property this product might come to know without a mapping here
        ({"security.protocol": "SSL", "ssl.cipher.suites": "X"}, "ssl.cipher.suites has no lib"),
        # a mechanism the validation would refuse (Kerberos), built around it
        (
            {"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI"},
            "sasl.mechanism GSSAPI has no librdkafka mapping",
        ),
    ],
)
def test_what_has_no_mapping_is_refused_not_dropped(resolved, message):
    cfg = kc.KafkaConfig(resolved=tuple(sorted(resolved.items())))
    with pytest.raises(KafkaConfigError, match=message):
        cfg.librdkafka_config()


def test_a_fetch_consumer_keeps_its_own_error_callback():
    settings = Settings(bootstrap="127.0.0.1:9", catalog_topic="c", warehouse="w")
    with pytest.raises(TypeError, match="error_cb is its own"):
        clients.fetch_consumer(settings, **{"error_cb": print})


E = confluent_kafka.KafkaError
REFUSED_CERT = (
    "ssl://127.0.0.1:1/bootstrap: Receive failed: error:0A000412:SSL routines::ssl/tls alert "
    "bad certificate: SSL alert number 42 (after 0ms in state APIVERSION_QUERY)"
)
UNTRUSTED = (
    "ssl://127.0.0.1:1/bootstrap: SSL handshake failed: error:0A000086:SSL routines::"
    "certificate verify failed: broker certificate could not be verified"
)


@pytest.mark.parametrize(
    "error, permanent",
    [
        (E(E._AUTHENTICATION, "SASL authentication error: Authentication failed"), True),
        (E(E.SASL_AUTHENTICATION_FAILED, "OAuth token not set"), True),
        (E(E._TRANSPORT, REFUSED_CERT), True),
        (E(E._SSL, UNTRUSTED), True),
        (E(E._FATAL, "fatal", fatal=True), True),
        (E(E._TRANSPORT, "Connect to ipv4#127.0.0.1:1 failed: Connection refused"), False),
        (E(E._ALL_BROKERS_DOWN, "1/1 brokers are down"), False),
        (E(E._TRANSPORT, "Disconnected (after 5ms in state UP)"), False),
        # the oauth_cb raised (the token endpoint down): librdkafka asks it again later
        (
            E(
                E._AUTHENTICATION,
                "Failed to acquire SASL OAUTHBEARER token: OAuth callback raised exception",
            ),
            False,
        ),
    ],
)
def test_which_librdkafka_errors_are_permanent(error, permanent):
    assert clients.permanent(error) is permanent


def test_a_token_the_provider_cannot_get_raises_its_own_error_before_any_consumer(caplog):
    """confluent-kafka turns an exception of `oauth_cb` during its construction into a
    SystemError or a 10 s wait: fetch_consumer asks for the first token before, and the
    provider's typed error is raised (and logged by the callback)."""
    from varadhi.core.endpoint_auth import TokenError
    from varadhi.testing.secure_kafka import free_port_pair

    closed = f"https://127.0.0.1:{free_port_pair(1)}/token"  # nothing listens there
    cfg = _oauth(
        'clientId="app" clientSecret="cs-not-shown"',
        **{"sasl.oauthbearer.token.endpoint.url": closed},
    )
    settings = Settings(bootstrap="127.0.0.1:9", catalog_topic="c", warehouse="w", kafka=cfg)
    with pytest.raises(TokenError, match="could not be used"):
        clients.fetch_consumer(settings, **{"group.id": "g"})
    assert "no OAUTHBEARER token for librdkafka: TokenError" in caplog.text
    assert "cs-not-shown" not in caplog.text
