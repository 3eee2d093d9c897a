"""A broker refusing SASL credentials answers, then closes the connection 100 ms later; a client
held up that long sees only "socket disconnected". `kafka_clients._build` tries such a failure on
a SASL connection again (up to `SASL_CLOSE_TRIES` times), so that a wrong password or a mechanism
the listener lacks is named as such (CI saw the bare disconnect; a quiet machine saw two in a
row). Fake client classes log what kafka-python's connection manager logs; the probe
of the broker's TCP/TLS (an I/O edge) is replaced."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from kafka.errors import KafkaConnectionError, KafkaTimeoutError, SaslAuthenticationFailedError

from varadhi.core.errors import KafkaUnavailable
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import config as kc

SCRAM = "org.apache.kafka.common.security.scram.ScramLoginModule"
MANAGER = logging.getLogger("kafka.net.manager")
DISCONNECTED = KafkaConnectionError("socket disconnected")
SASL_TIMED_OUT = KafkaTimeoutError("SASL Authentication timed out")
REFUSED = SaslAuthenticationFailedError(
    "SaslAuthenticationFailedError: Authentication failed during authentication due to invalid "
    "credentials with SASL mechanism SCRAM-SHA-512"
)


@dataclass
class Settings:
    bootstrap: str
    kafka: kc.KafkaConfig


def client_failing_with(*failures: BaseException):
    """A client class whose n-th construction logs the n-th failure, as kafka-python's manager
    does for a failed bootstrap connection, and then raises."""

    class Client:
        made = 0

        def __init__(self, **_kwargs):
            failure = failures[min(Client.made, len(failures) - 1)]
            Client.made += 1
            MANAGER.warning(
                "Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", failure, 0.05
            )
            raise KafkaTimeoutError("Bootstrap timed out")

    return Client


@pytest.fixture
def sasl(tmp_path, monkeypatch):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    props = tmp_path / "client.properties"
    props.write_text(
        f"security.protocol=SASL_SSL\nssl.truststore.type=PEM\nssl.truststore.location={ca}\n"
        f'sasl.mechanism=SCRAM-SHA-512\nsasl.jaas.config={SCRAM} required username="alice" '
        'password="wrong";\n'
    )
    monkeypatch.setattr(kafka_clients, "probe", lambda _settings: None)  # TCP and TLS work
    return Settings("127.0.0.1:9093", kc.load(str(props)))


def test_a_close_that_overtook_the_sasl_answer_is_tried_once_more(sasl):
    client = client_failing_with(DISCONNECTED, REFUSED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == 2
    assert "authentication failed" in str(refused.value), refused.value
    assert "as alice" in str(refused.value)


def test_two_closes_in_a_row_are_tried_again(sasl):
    client = client_failing_with(DISCONNECTED, DISCONNECTED, REFUSED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == 3
    assert "authentication failed" in str(refused.value), refused.value


def test_a_sasl_exchange_that_outlasted_the_bootstrap_is_tried_again(sasl):
    """A CI run on an overloaded machine: TLS and SCRAM took longer than the bootstrap's time,
    and a wrong password was reported as "SASL Authentication timed out"."""
    client = client_failing_with(SASL_TIMED_OUT, REFUSED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == 2
    assert "authentication failed" in str(refused.value), refused.value


def test_a_sasl_timeout_that_repeats_is_reported_as_such(sasl):
    client = client_failing_with(SASL_TIMED_OUT)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == kafka_clients.SASL_CLOSE_TRIES
    assert "SASL Authentication timed out" in str(refused.value), refused.value


def test_a_close_that_repeats_is_reported_after_the_last_try(sasl):
    client = client_failing_with(DISCONNECTED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == kafka_clients.SASL_CLOSE_TRIES
    assert "socket disconnected" in str(refused.value)


def test_a_refusal_seen_at_once_is_not_tried_again(sasl):
    client = client_failing_with(REFUSED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, sasl, {})
    assert client.made == 1
    assert "authentication failed" in str(refused.value)


def test_without_sasl_a_close_is_reported_at_once(monkeypatch):
    monkeypatch.setattr(kafka_clients, "probe", lambda _settings: None)
    client = client_failing_with(DISCONNECTED)
    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(client, Settings("127.0.0.1:9092", kc.PLAINTEXT), {})
    assert client.made == 1
    assert "socket disconnected" in str(refused.value)


def test_a_certificate_refusal_seen_in_a_bootstrap_outranks_a_later_connection_error(
    monkeypatch, tmp_path
):
    """CI, twice: an mTLS client without a certificate the broker accepts got the broker's
    "bad certificate" alert on every bootstrap try but the last, which got ECONNREFUSED (the
    broker answered the probe right after); the one line then named the refused connection,
    not the certificate."""
    monkeypatch.setattr(kafka_clients, "probe", lambda _settings: None)  # TCP and TLS work
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    props = tmp_path / "client.properties"
    props.write_text(
        f"security.protocol=SSL\nssl.truststore.type=PEM\nssl.truststore.location={ca}\n"
    )
    alert = KafkaConnectionError(
        "[SSL: SSLV3_ALERT_BAD_CERTIFICATE] sslv3 alert bad certificate (_ssl.c:2580)"
    )

    class Client:
        def __init__(self, **_kwargs):
            for failure in (alert, alert, KafkaConnectionError("111 ECONNREFUSED")):
                MANAGER.warning(
                    "Bootstrap connection to %s failed: %s (backoff %.2f secs)", "b-0", failure, 0.1
                )
            raise KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:9094")

    with pytest.raises(KafkaUnavailable) as refused:
        kafka_clients._build(Client, Settings("127.0.0.1:9094", kc.load(str(props))), {})
    assert "requires a client certificate (mutual TLS)" in str(refused.value)
