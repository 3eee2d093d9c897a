"""The Kafka client configuration: parsing, references, validation, the two views, redaction."""

from __future__ import annotations

import json
import urllib.request

import pytest

from varadhi.core.endpoint_auth import RedirectRefused, TokenError
from varadhi.core.errors import KafkaConfigError
from varadhi.kafka import config as kc
from varadhi.kafka.oauth_tokens import ClientCredentialsTokenProvider

CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n" + CA
SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN = "org.apache.kafka.common.security.plain.PlainLoginModule"


@pytest.fixture
def ca(tmp_path):
    path = tmp_path / "ca.pem"
    path.write_text(CA)
    return str(path)


def scram(tmp_path, ca, password='password="${env:KAFKA_PASSWORD}"', mech="SCRAM-SHA-512"):
    path = tmp_path / "client.properties"
    path.write_text(
        "# a comment\n"
        "bootstrap.servers=broker:9093\n"
        "security.protocol = SASL_SSL\n"
        f"ssl.truststore.type: PEM\nssl.truststore.location={ca}\n"
        f"sasl.mechanism={mech}\n"
        f"sasl.jaas.config={SCRAM} required \\\n"
        f'    username="alice" {password};\n'
    )
    return str(path)


def test_properties_syntax():
    props = kc.parse_properties(
        "# comment\n! also\n  a=1\nb: two words \nc three\nd=x\\\n   y\ne=\\u0041\\t\\=\nf\n"
    )
    assert props == {"a": "1", "b": "two words ", "c": "three", "d": "xy", "e": "A\t=", "f": ""}


def test_scram_both_views(tmp_path, ca):
    cfg = kc.load(scram(tmp_path, ca), environ={"KAFKA_PASSWORD": "s3cret-pw"})
    assert cfg.bootstrap == "broker:9093"
    assert cfg.python_kwargs() == {
        "security_protocol": "SASL_SSL",
        "ssl_cafile": ca,
        "ssl_check_hostname": True,
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice",
        "sasl_plain_password": "s3cret-pw",
    }
    spark = cfg.spark_options()
    assert spark["kafka.security.protocol"] == "SASL_SSL"
    assert spark["kafka.ssl.truststore.type"] == "PEM"
    assert spark["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert 'password="s3cret-pw"' in spark["kafka.sasl.jaas.config"]
    assert "kafka.bootstrap.servers" not in spark
    assert cfg.summary() == "SASL_SSL, SCRAM-SHA-512 as alice"


def test_secrets_never_shown(tmp_path, ca):
    inline = kc.load(scram(tmp_path, ca, password='password="s3cret-pw"'), environ={})
    referenced = kc.load(scram(tmp_path, ca), environ={"KAFKA_PASSWORD": "s3cret-pw"})
    for cfg in (inline, referenced):
        assert "s3cret-pw" not in repr(cfg)
        assert "s3cret-pw" not in str(cfg.describe())
        assert "s3cret-pw" not in cfg.summary()
        assert cfg.redact("login failed for s3cret-pw") == "login failed for [hidden]"
    assert "${env:KAFKA_PASSWORD}" in referenced.describe()["sasl.jaas.config"]
    assert '"[hidden]"' in inline.describe()["sasl.jaas.config"]


def test_file_reference_and_env_override(tmp_path, ca):
    secret = tmp_path / "pw"
    secret.write_text("from-a-file\n")
    path = scram(tmp_path, ca, password=f'password="${{file:{secret}}}"')
    cfg = kc.load(path, environ={"VARADHI_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256"})
    assert cfg.python_kwargs()["sasl_plain_password"] == "from-a-file"
    assert cfg.mechanism == "SCRAM-SHA-256"


def test_config_from_env_var(tmp_path, ca):
    path = scram(tmp_path, ca)
    cfg = kc.load(environ={"VARADHI_KAFKA_CONFIG": path, "KAFKA_PASSWORD": "x"})
    assert cfg.source == path
    assert kc.load(environ={}) == kc.PLAINTEXT
    assert kc.PLAINTEXT.python_kwargs() == {} and kc.PLAINTEXT.spark_options() == {}


@pytest.mark.parametrize(
    ("props", "message"),
    [
        (
            {"sasl.mechanisms": "PLAIN"},
            "unknown Kafka client property 'sasl.mechanisms' (did you mean sasl.mechanism?)",
        ),
        ({"securty.protocol": "SSL"}, "did you mean security.protocol?"),
        ({"linger.ms": "5"}, "unknown Kafka client property 'linger.ms'"),
        ({"security.protocol": "TLS"}, "security.protocol 'TLS' is not one of"),
        ({"security.protocol": "SASL_SSL"}, "needs sasl.mechanism"),
        ({"security.protocol": "SASL_SSL", "sasl.mechanism": "GSSAPI"}, "GSSAPI' is not supported"),
        (
            {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"},
            "PLAIN needs sasl.jaas.config",
        ),
        (
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "PLAIN",
                "sasl.jaas.config": f'{PLAIN} required username="a";',
            },
            'needs password="..." in sasl.jaas.config',
        ),
        (
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.jaas.config": f'{PLAIN} required username="a" password="b";',
            },
            "needs ScramLoginModule in sasl.jaas.config, not PlainLoginModule",
        ),
        (
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "PLAIN",
                "sasl.jaas.config": 'username="a"',
            },
            "sasl.jaas.config is not",
        ),
        (
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "PLAIN",
                "sasl.jaas.config": f'{PLAIN} required username="a" password="${{env:NOPE_PW}}";',
            },
            "sasl.jaas.config names the environment variable NOPE_PW, which is not set",
        ),
        (
            {"ssl.truststore.location": "/x.pem"},
            "ssl.truststore.location is set but security.protocol is PLAINTEXT",
        ),
        ({"sasl.mechanism": "PLAIN"}, "sasl.mechanism is set but security.protocol is PLAINTEXT"),
        (
            {"security.protocol": "SSL", "ssl.truststore.location": "/nowhere/ca.pem"},
            "cannot read /nowhere/ca.pem",
        ),
        (
            {"security.protocol": "SSL", "ssl.truststore.type": "JKS"},
            "JKS cannot be read by the Python clients",
        ),
        (
            {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "none"},
            "must be https or empty",
        ),
        (
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "OAUTHBEARER",
                "sasl.jaas.config": 'org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required clientId="c" clientSecret="s";',
            },
            "needs sasl.oauthbearer.token.endpoint.url",
        ),
    ],
)
def test_refused_with_one_line(props, message):
    with pytest.raises(KafkaConfigError) as e:
        kc.from_properties(props, environ={})
    assert message in str(e.value)
    assert "\n" not in str(e.value)
    assert e.value.exit_code == 2


def test_missing_file_and_not_pem(tmp_path):
    with pytest.raises(KafkaConfigError, match="cannot read the Kafka client configuration"):
        kc.load(str(tmp_path / "missing.properties"), environ={})
    jks = tmp_path / "store.jks"
    jks.write_bytes(b"\xfe\xed\xfe\xed binary")
    with pytest.raises(KafkaConfigError, match="is not a PEM file"):
        kc.from_properties(
            {"security.protocol": "SSL", "ssl.truststore.location": str(jks)}, environ={}
        )
    with pytest.raises(KafkaConfigError, match="file .* which cannot be read"):
        kc.from_properties({"ssl.key.password": "${file:/nowhere/pw}"}, environ={})


def test_mutual_tls(tmp_path, ca):
    key = tmp_path / "client.pem"
    key.write_text(KEY)
    cfg = kc.from_properties(
        {
            "security.protocol": "SSL",
            "ssl.truststore.location": ca,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(key),
            "ssl.key.password": "${env:KEY_PW}",
        },
        environ={"KEY_PW": "kp"},
    )
    kw = cfg.python_kwargs()
    assert kw["ssl_certfile"] == kw["ssl_keyfile"] == str(key)
    assert kw["ssl_password"] == "kp"
    assert cfg.spark_options()["kafka.ssl.key.password"] == "kp"
    assert cfg.describe()["ssl.key.password"] == "${env:KEY_PW}"
    assert "kp" not in repr(cfg)
    with pytest.raises(KafkaConfigError, match="holds no private key"):
        kc.from_properties({"security.protocol": "SSL", "ssl.keystore.location": ca}, environ={})


def test_hostname_verification_off_only_when_asked(tmp_path, ca):
    cfg = kc.from_properties(
        {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": ""}, environ={}
    )
    assert cfg.python_kwargs()["ssl_check_hostname"] is False
    assert kc.from_properties({"security.protocol": "SSL"}, environ={}).python_kwargs() == {
        "security_protocol": "SSL",
        "ssl_check_hostname": True,
    }


def test_oauthbearer_views():
    cfg = kc.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token",
            "sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
            ' required clientId="app" clientSecret="${env:CS}" scope="kafka";',
        },
        environ={"CS": "oauth-secret"},
    )
    provider = cfg.python_kwargs()["sasl_oauth_token_provider"]
    assert provider.client_id == "app" and provider.scope == "kafka"
    assert "oauth-secret" not in repr(provider) and "oauth-secret" not in repr(cfg)
    assert cfg.spark_options()["kafka.sasl.login.callback.handler.class"] == kc.OAUTH_HANDLER


def test_settings_carry_the_config(tmp_path, ca, monkeypatch):
    from varadhi.kafka.settings import Settings

    monkeypatch.delenv("VARADHI_BOOTSTRAP", raising=False)
    monkeypatch.setenv("KAFKA_PASSWORD", "pw")
    settings = Settings.from_env(command_config=scram(tmp_path, ca))
    assert settings.bootstrap == "broker:9093"  # from the file when $VARADHI_BOOTSTRAP is unset
    assert settings.kafka.mechanism == "SCRAM-SHA-512"
    assert 'pw"' not in repr(settings)
    monkeypatch.setenv("VARADHI_BOOTSTRAP", "other:9092")
    assert Settings.from_env(command_config=scram(tmp_path, ca)).bootstrap == "other:9092"


def test_cli_refuses_bad_config_in_one_line(tmp_path, capsys):
    from varadhi import cli

    bad = tmp_path / "bad.properties"
    bad.write_text("security.protocol=SASL_SSL\nsasl.mechanisms=PLAIN\n")
    assert cli.main(["--command-config", str(bad), "topic", "list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "did you mean sasl.mechanism?" in err


def test_the_spark_source_answers_an_empty_fetch_soon_and_the_sink_gets_no_consumer_property(
    tmp_path, ca
):
    # Spark's consumer asks for the offset range behind its own pipelined fetch, which the
    # broker holds up to fetch.max.wait.ms: Kafka's 500 ms default cost a task up to 500 ms per
    # partition whenever no new record came in (the last batch before traffic stops).
    from types import SimpleNamespace

    from varadhi.kafka import clients as kafka_clients

    cfg = kc.load(scram(tmp_path, ca), environ={"KAFKA_PASSWORD": "s3cret-pw"})
    settings = SimpleNamespace(bootstrap="broker:9093", kafka=cfg)
    source = kafka_clients.spark_source_options(settings)
    sink = kafka_clients.spark_options(settings)
    assert source["kafka.fetch.max.wait.ms"] == "0"  # even with traffic it waits for a record
    assert {k: v for k, v in source.items() if k != "kafka.fetch.max.wait.ms"} == sink
    assert sink["kafka.sasl.mechanism"] == "SCRAM-SHA-512"
    assert not any("fetch" in key for key in sink)


# -- issue 30, item 11: secrets by name, the token endpoint https only, no redirects ----------


def test_every_option_or_key_named_secret_token_or_password_is_hidden():
    """MSK IAM's `awsRoleSecretAccessKey` and `awsRoleSessionToken` were shown and left in
    error texts: only a fixed list of names was secret."""
    cfg = kc.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.oauthbearer.token.endpoint.url": "https://idp.example/token",
            "sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
            ' required clientId="app" clientSecret="cs-123" awsRoleSecretAccessKey="sak-456"'
            ' awsRoleSessionToken="tok-789";',
        },
        environ={},
    )
    shown = json.dumps(cfg.describe())
    for secret in ("cs-123", "sak-456", "tok-789"):
        assert secret not in shown
        assert secret not in cfg.redact(f"failed with {secret}")
    assert "https://idp.example/token" in shown  # a URL named token...url is not secret
    assert kc.is_secret_key("ssl.key.password") and not kc.is_secret_key("sasl.mechanism")


def test_the_token_endpoint_must_be_https():
    """The client credentials went to a plain http:// token endpoint."""
    with pytest.raises(KafkaConfigError, match="https"):
        kc.from_properties(
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "OAUTHBEARER",
                "sasl.oauthbearer.token.endpoint.url": "http://idp.example/token",
                "sasl.jaas.config": "org.apache.kafka.common.security.oauthbearer"
                '.OAuthBearerLoginModule required clientId="app" clientSecret="s";',
            },
            environ={},
        )
    with pytest.raises(KafkaConfigError, match="https"):
        ClientCredentialsTokenProvider("http://idp.example/token", "app", "s")


def test_a_redirect_of_the_token_request_is_refused():
    """urllib followed a redirect of the token request, Authorization header and all."""
    request = urllib.request.Request("https://idp.example/token", data=b"grant_type=x")
    with pytest.raises(TokenError, match="redirected"):
        RedirectRefused().redirect_request(request, None, 302, "Found", {}, "https://x.test/")
