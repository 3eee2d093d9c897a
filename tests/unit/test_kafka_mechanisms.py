"""The security mechanisms' rendered configuration, without a broker: the unsecured-JWT and MSK
IAM token providers (tokens made offline), both views of every example in conf/kafka/, the
refusals of missing pieces, and no secret in repr, describe or summary."""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import pytest
from kafka.net.sasl.oauth import AbstractTokenProvider

from varadhi.core.errors import KafkaConfigError
from varadhi.kafka import config as kc
from varadhi.spark import lines as spark_lines

EXAMPLES = Path(__file__).resolve().parents[2] / "conf" / "kafka"
CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
OAUTH_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
    "AWS_SESSION_TOKEN": "session-token-for-tests",
}


def _jwt_part(part: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def msk_iam(**extra: str) -> dict[str, str]:
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "OAUTHBEARER",
        "sasl.jaas.config": f"{OAUTH_MODULE} required;",
        "sasl.login.callback.handler.class": kc.MSK_IAM_HANDLER,
        "varadhi.aws.region": "eu-west-1",
        **extra,
    }


def test_unsecured_jwt_is_what_kafkas_unsecured_login_makes():
    cfg = kc.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "sasl.jaas.config": f"{OAUTH_MODULE} required unsecuredLoginStringClaim_sub="
            '"alice" unsecuredLoginListClaim_roles=",admin,ops" '
            'unsecuredLoginLifetimeSeconds="600";',
        },
        environ={},
    )
    assert cfg.oauth_flavor == "unsecured" and cfg.summary() == "SASL_SSL, OAUTHBEARER as alice"
    provider = cfg.python_kwargs()["sasl_oauth_token_provider"]
    assert isinstance(provider, AbstractTokenProvider)
    token = provider.token()
    header, payload, signature = token.split(".")
    assert _jwt_part(header) == {"alg": "none"} and signature == ""
    claims = _jwt_part(payload)
    assert claims["sub"] == "alice" and claims["roles"] == ["admin", "ops"]
    assert claims["exp"] - claims["iat"] == pytest.approx(600)
    assert provider.token() == token  # reused while fresh
    # The Java side needs nothing more: Kafka's default OAUTHBEARER login handler is the
    # unsecured one, reading the same JAAS options.
    spark = cfg.spark_options()
    assert "kafka.sasl.login.callback.handler.class" not in spark
    assert spark["kafka.sasl.jaas.config"] == cfg.get("sasl.jaas.config")


def test_msk_iam_python_provider_signs_offline_and_spark_carries_the_iam_handler(monkeypatch):
    for name, value in AWS_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    cfg = kc.from_properties(msk_iam(), environ={})
    assert cfg.oauth_flavor == "msk-iam"
    kw = cfg.python_kwargs()
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "OAUTHBEARER"
    provider = kw["sasl_oauth_token_provider"]
    assert isinstance(provider, AbstractTokenProvider)
    token = provider.token()
    url = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    assert url.startswith("https://kafka.eu-west-1.amazonaws.com/?Action=kafka-cluster%3AConnect")
    assert "AKIAIOSFODNN7EXAMPLE%2F" in url and "%2Feu-west-1%2Fkafka-cluster%2F" in url
    assert re.search(r"X-Amz-Signature=[0-9a-f]{64}", url)
    assert AWS_SECRET not in url
    assert provider.token() == token  # reused until a minute before it expires

    spark = cfg.spark_options()
    assert spark["kafka.sasl.mechanism"] == "OAUTHBEARER"
    assert spark["kafka.sasl.jaas.config"] == f"{OAUTH_MODULE} required;"
    assert spark["kafka.sasl.login.callback.handler.class"] == kc.MSK_IAM_HANDLER
    assert spark["kafka.sasl.client.callback.handler.class"] == kc.MSK_IAM_HANDLER
    assert not any(k.startswith("kafka.varadhi.") for k in spark)
    assert cfg.spark_extras() == ("msk-iam",)
    line = spark_lines.line_for("4.1.1")
    assert kc.MSK_IAM_PACKAGE in spark_lines.packages(line, cfg.spark_extras())
    assert cfg.summary() == "SASL_SSL, OAUTHBEARER (MSK IAM, eu-west-1)"
    for shown in (repr(cfg), json.dumps(cfg.describe()), cfg.summary(), repr(provider)):
        assert token not in shown and AWS_SECRET not in shown
        assert "session-token-for-tests" not in shown


@pytest.mark.parametrize(
    "props, message",
    [
        ({"varadhi.aws.region": ""}, "LoginCallbackHandler) needs varadhi.aws.region"),
        ({"varadhi.aws.region": "mars"}, "'mars' is not an AWS region"),
        ({"security.protocol": "SASL_PLAINTEXT"}, "MSK IAM needs security.protocol SASL_SSL"),
        ({"varadhi.aws.regoin": "eu-west-1"}, "did you mean varadhi.aws.region?"),
    ],
)
def test_msk_iam_refusals(props, message):
    base = msk_iam(**props)
    if "varadhi.aws.regoin" in props:
        del base["varadhi.aws.region"]
    with pytest.raises(KafkaConfigError) as e:
        kc.from_properties(base, environ={})
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "props, message",
    [
        (
            {"sasl.mechanism": "OAUTHBEARER", "sasl.jaas.config": f"{OAUTH_MODULE} required;"},
            'needs clientId="..." in sasl.jaas.config (or unsecuredLoginStringClaim_sub',
        ),
        (
            {
                "sasl.mechanism": "OAUTHBEARER",
                "sasl.jaas.config": f'{OAUTH_MODULE} required unsecuredLoginStringClaim_sub="";',
            },
            'needs unsecuredLoginStringClaim_sub="<principal>"',
        ),
        (
            {
                "sasl.mechanism": "OAUTHBEARER",
                "sasl.jaas.config": f"{OAUTH_MODULE} required unsecuredLoginStringClaim_sub=a "
                "unsecuredLoginLifetimeSeconds=soon;",
            },
            "unsecuredLoginLifetimeSeconds must be a number, not 'soon'",
        ),
        (
            {
                "sasl.mechanism": "PLAIN",
                "sasl.jaas.config": "org.apache.kafka.common.security.plain.PlainLoginModule "
                'required username="key";',
            },
            'sasl.mechanism PLAIN needs password="..."',
        ),
        (
            {
                "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
                'required password="p";',
            },
            'sasl.mechanism SCRAM-SHA-256 needs username="..."',
        ),
    ],
)
def test_a_mechanism_without_its_credentials_is_refused(props, message):
    with pytest.raises(KafkaConfigError) as e:
        kc.from_properties({"security.protocol": "SASL_SSL", **props}, environ={})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_client_certificate_without_its_key_or_a_key_without_its_certificate(tmp_path):
    for text, missing in ((CA, "holds no private key"), (KEY, "holds no certificate")):
        pem = tmp_path / "client.pem"
        pem.write_text(text)
        with pytest.raises(KafkaConfigError, match=missing):
            kc.from_properties(
                {"security.protocol": "SSL", "ssl.keystore.location": str(pem)}, environ={}
            )


def test_msk_iam_without_the_signer_package_is_refused_in_one_line(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without_signer(name, *args, **kwargs):
        if name.startswith("aws_msk_iam_sasl_signer"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_signer)
    cfg = kc.from_properties(msk_iam(), environ={})
    with pytest.raises(KafkaConfigError, match=r"pip install aws-msk-iam-sasl-signer-python"):
        cfg.python_kwargs()


# What each example must render to (with the dummy secrets below): its flavor and what each side
# receives. The files are in conf/kafka/ and documented in docs/kafka.md.
EXPECTED = {
    "confluent-cloud.properties": ("SASL_SSL", "PLAIN", None),
    "msk-iam.properties": ("SASL_SSL", "OAUTHBEARER", "msk-iam"),
    "msk-scram.properties": ("SASL_SSL", "SCRAM-SHA-512", None),
    "aiven.properties": ("SASL_SSL", "SCRAM-SHA-256", None),
    "mutual-tls.properties": ("SSL", None, None),
    "scram-sasl-ssl.properties": ("SASL_SSL", "SCRAM-SHA-512", None),
    "oauth-client-credentials.properties": ("SASL_SSL", "OAUTHBEARER", "client-credentials"),
    "unsecured-jwt.properties": ("SASL_SSL", "OAUTHBEARER", "unsecured"),
}
SECRETS = {
    "KAFKA_PASSWORD": "dummy-kafka-password",
    "MSK_PASSWORD": "dummy-msk-password",
    "CONFLUENT_API_KEY": "DUMMYKEY",
    "CONFLUENT_API_SECRET": "dummy-confluent-secret",
    "KAFKA_KEY_PASSWORD": "dummy-key-password",
    "OAUTH_CLIENT_SECRET": "dummy-oauth-secret",
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_example_loads_and_renders_both_sides(name, tmp_path, monkeypatch):
    for var, value in AWS_ENV.items():
        monkeypatch.setenv(var, value)
    assert sorted(p.name for p in EXAMPLES.glob("*.properties")) == sorted(EXPECTED)
    ca, client, aiven = tmp_path / "ca.pem", tmp_path / "client.pem", tmp_path / "aiven-pw"
    ca.write_text(CA)
    client.write_text(KEY + CA)
    aiven.write_text("dummy-aiven-password\n")
    text = re.sub(r"/etc/varadhi/\S*ca\.pem", str(ca), (EXAMPLES / name).read_text())
    text = text.replace("/etc/varadhi/client.pem", str(client))
    text = text.replace("/run/secrets/aiven-password", str(aiven))
    path = tmp_path / name
    path.write_text(text)

    cfg = kc.load(str(path), environ=SECRETS)
    protocol, mechanism, flavor = EXPECTED[name]
    assert (cfg.protocol, cfg.mechanism, cfg.oauth_flavor) == (protocol, mechanism, flavor)
    kw, spark = cfg.python_kwargs(), cfg.spark_options()
    assert kw["security_protocol"] == spark["kafka.security.protocol"] == protocol
    assert kw["ssl_check_hostname"] is True  # hostname verification stays on
    assert "kafka.bootstrap.servers" not in spark and cfg.bootstrap
    if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        assert kw["sasl_plain_password"].startswith("dummy-")
        assert kw["sasl_plain_password"] in spark["kafka.sasl.jaas.config"]
    if mechanism == "OAUTHBEARER":
        assert isinstance(kw["sasl_oauth_token_provider"], AbstractTokenProvider)
    if protocol == "SSL":
        assert kw["ssl_certfile"] == kw["ssl_keyfile"] == spark["kafka.ssl.keystore.location"]
        assert spark["kafka.ssl.keystore.type"] == "PEM"
    shown = " ".join([repr(cfg), json.dumps(cfg.describe()), cfg.summary()])
    # (the Confluent API key is the user name, shown as such; its secret is not)
    for secret in [v for v in SECRETS.values() if v != "DUMMYKEY"] + ["dummy-aiven-password"]:
        assert secret not in shown
        assert cfg.redact(f"failed with {secret}") in (
            f"failed with {secret}",  # not this file's secret
            "failed with [hidden]",
        )
    assert cfg.spark_extras() == (("msk-iam",) if flavor == "msk-iam" else ())


def test_a_private_key_the_java_clients_cannot_read_is_refused(tmp_path):
    pem = tmp_path / "client.pem"
    pem.write_text(KEY.replace("PRIVATE KEY", "RSA PRIVATE KEY") + CA)
    with pytest.raises(KafkaConfigError, match=r"RSA private key in the old format.*pkcs8 -topk8"):
        kc.from_properties(
            {"security.protocol": "SSL", "ssl.keystore.location": str(pem)}, environ={}
        )


def test_a_sasl_handshake_answer_is_read_or_refused():
    from varadhi.kafka.clients import _parse_handshake_answer

    def answer(error: int, names: list[bytes]) -> bytes:
        items = b"".join(len(n).to_bytes(2, "big") + n for n in names)
        return (
            (7).to_bytes(4, "big")
            + error.to_bytes(2, "big")
            + len(names).to_bytes(4, "big")
            + items
        )

    assert _parse_handshake_answer(answer(33, [b"PLAIN", b"SCRAM-SHA-512"])) == (
        "PLAIN",
        "SCRAM-SHA-512",
    )
    assert _parse_handshake_answer(answer(0, [])) == ()
    with pytest.raises(ValueError):  # bytes left over: not the answer this reader knows
        _parse_handshake_answer(answer(0, [b"PLAIN"]) + b"x")
    with pytest.raises(struct.error):  # cut short in its header
        _parse_handshake_answer(answer(0, [b"PLAIN"])[:9])
    with pytest.raises(ValueError):  # cut short in a name
        _parse_handshake_answer(answer(0, [b"PLAIN"])[:-2])
