"""Every security mechanism the product supports, against one secured broker started for this
module (`varadhi.testing.secure_kafka`, i.e. `VARADHI_KAFKA_SECURE=1 scripts/kafka start`) and
wiped afterwards: mutual TLS (SSL listener requiring client certificates), PLAIN, SCRAM-SHA-256,
SCRAM-SHA-512 (SASL_SSL listener) and OAUTHBEARER with unsecured JWTs (SASL_SSL listener with
Kafka's unsecured validator). For each, with the client properties file `scripts/kafka` wrote for
alice: `varadhi --command-config FILE topic create`, three messages through the producer library,
and a Spark batch `kafka` source reading them back with the same file's Spark options, and the
library runtime's librdkafka fetch consumer (`clients.fetch_consumer`, manual assignment) reading
them back too, with two more written by the member's librdkafka producer (`acked_producer`). A
client without a certificate on the mutual-TLS listener is refused in one clear line; so are a
fetch consumer with a wrong password, without a certificate, or with a mechanism the listener
does not offer, and the producer's writes with a wrong password (librdkafka would retry them
without end)."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from varadhi.cli import main as cli_main
from varadhi.core.errors import KafkaUnavailable
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import config as kafka_config
from varadhi.kafka.acked_producer import acked_producer
from varadhi.kafka.producer import Producer
from varadhi.kafka.settings import Settings
from varadhi.testing.secure_kafka import secured_broker

pytestmark = [pytest.mark.kafka]

MECHANISMS = ["mtls", "plain", "scram-sha-256", "scram-sha-512", "oauthbearer"]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with secured_broker(tmp_path_factory.mktemp("mechanisms") / "broker") as b:
        yield b


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """(catalog topic, warehouse) shared by the module's CLI calls and producers."""
    return f"__varadhi_catalog_mech_{uuid.uuid4().hex[:8]}", str(tmp_path_factory.mktemp("wh"))


@pytest.fixture
def cli(places, capsys, monkeypatch):
    """cli(config, *args) -> (exit code, stdout, stderr): varadhi --bootstrap <the file's>
    --command-config config ARGS, in this process."""
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", places[0])
    monkeypatch.setenv("VARADHI_WAREHOUSE", places[1])

    def run(config: str, *args: str) -> tuple[int, str, str]:
        bootstrap = kafka_config.load(config, environ={}).bootstrap
        capsys.readouterr()
        code = cli_main(["--bootstrap", bootstrap, "--command-config", config, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _produced(broker, places, cli, mechanism: str, prefix: str) -> tuple[Settings, str, list]:
    """A topic made with the CLI over `mechanism`'s listener and three messages written to it
    by the project's producer: the settings, its storage topic and the bodies."""
    config = broker.client_config("alice", mechanism)
    cfg = kafka_config.load(config, environ={})
    topic = f"{prefix}-{mechanism}-{uuid.uuid4().hex[:6]}"
    code, out, err = cli(config, "topic", "create", topic, "--partitions", "1")
    assert code == 0, err
    settings = Settings(
        bootstrap=cfg.bootstrap, catalog_topic=places[0], warehouse=places[1], kafka=cfg
    )
    bodies = [f"{prefix} {mechanism} {i}" for i in range(3)]
    with Producer(topic, settings) as producer:
        for body in bodies:
            producer.send(body, group_id="g").get(timeout=60)
        return settings, producer.topic.produce_topic.name, bodies


def test_the_script_records_one_listener_per_kind(broker):
    assert set(broker.listeners) == {"SASL_SSL", "MTLS", "OAUTH"}
    assert broker.listeners["SASL_SSL"] == broker.bootstrap
    assert len(set(broker.listeners.values())) == 3
    assert all(a.startswith("127.0.0.1:") for a in broker.listeners.values())
    mtls = kafka_config.load(broker.client_config("alice", "mtls"), environ={})
    oauth = kafka_config.load(broker.client_config("alice", "oauthbearer"), environ={})
    assert (mtls.bootstrap, mtls.protocol) == (broker.listeners["MTLS"], "SSL")
    assert (oauth.bootstrap, oauth.oauth_flavor) == (broker.listeners["OAUTH"], "unsecured")


@pytest.mark.spark
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_topic_create_produce_and_spark_read(broker, places, cli, spark, mechanism):
    cfg = kafka_config.load(broker.client_config("alice", mechanism), environ={})
    assert cfg.summary() == {
        "mtls": "SSL, client certificate",
        "oauthbearer": "SASL_SSL, OAUTHBEARER as alice",
    }.get(mechanism, f"SASL_SSL, {mechanism.upper()} as alice")
    settings, storage, bodies = _produced(broker, places, cli, mechanism, "mech")

    options = kafka_clients.spark_options(settings)
    assert options["kafka.bootstrap.servers"] == cfg.bootstrap
    assert options.get("kafka.security.protocol") == cfg.protocol
    rows = (
        spark.read.format("kafka")
        .options(**options)
        .option("subscribe", storage)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .load()
        .selectExpr("CAST(value AS STRING) AS v")
        .collect()
    )
    assert sorted(r.v for r in rows) == bodies


def test_mutual_tls_without_a_client_certificate_is_refused(broker, cli, tmp_path):
    with_cert = Path(broker.client_config("alice", "mtls")).read_text()
    without = tmp_path / "no-cert.properties"
    without.write_text(re.sub(r"(?m)^ssl\.keystore\..*\n", "", with_cert))
    code, out, err = cli(str(without), "topic", "list")
    assert code != 0
    assert err.count("\n") == 1, err
    assert f"cannot connect to Kafka at {broker.listeners['MTLS']} (SSL)" in err
    assert "requires a client certificate (mutual TLS)" in err and "ssl.keystore.location" in err


def test_a_certificate_the_broker_does_not_trust_is_refused(broker, cli, tmp_path):
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=alice", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True,
    )  # fmt: skip
    own = tmp_path / "self-signed.pem"
    own.write_text(key.read_text() + crt.read_text())
    text = Path(broker.client_config("alice", "mtls")).read_text()
    config = tmp_path / "self-signed.properties"
    config.write_text(
        re.sub(r"(?m)^ssl\.keystore\.location=.*$", f"ssl.keystore.location={own}", text)
    )
    code, out, err = cli(str(config), "topic", "list")
    assert code != 0 and err.count("\n") == 1, err
    assert "did not accept the client certificate" in err


def test_a_mechanism_the_listener_does_not_offer_is_named(broker, cli, tmp_path):
    text = Path(broker.client_config("alice", "oauthbearer")).read_text()
    config = tmp_path / "oauth-at-the-scram-port.properties"
    config.write_text(text.replace(broker.listeners["OAUTH"], broker.bootstrap))
    code, out, err = cli(str(config), "topic", "list")
    assert code != 0 and err.count("\n") == 1, err
    assert "the listener does not offer sasl.mechanism OAUTHBEARER" in err


def test_a_mechanism_not_offered_is_named_even_when_the_client_saw_only_the_close(broker, tmp_path):
    """The broker answers a mechanism its listener does not offer, then closes; kafka-python
    sometimes reads the close first and reports only "socket disconnected" (CI, four tries in a
    row). The one line must still name the mechanism, from the broker's own answer, and what
    the listener offers instead."""
    text = Path(broker.client_config("alice", "oauthbearer")).read_text()
    config = tmp_path / "oauth-at-the-scram-port.properties"
    config.write_text(text.replace(broker.listeners["OAUTH"], broker.bootstrap))
    cfg = kafka_config.load(str(config), environ={})
    settings = Settings(bootstrap=cfg.bootstrap, catalog_topic="c", warehouse="w", kafka=cfg)
    line = kafka_clients.explain(settings, "KafkaConnectionError: socket disconnected")
    assert "the listener does not offer sasl.mechanism OAUTHBEARER" in line, line
    offered = kafka_clients.offered_mechanisms(settings)
    assert offered is not None and "OAUTHBEARER" not in offered and "PLAIN" in offered, offered
    assert f"(it offers {', '.join(offered)})" in line, line
    # the same listener with a mechanism it offers: no such claim
    scram = kafka_config.load(broker.client_config("alice", "scram-sha-512"), environ={})
    ok = Settings(bootstrap=scram.bootstrap, catalog_topic="c", warehouse="w", kafka=scram)
    assert "SCRAM-SHA-512" in kafka_clients.offered_mechanisms(ok)
    assert "does not offer" not in kafka_clients.explain(ok, "socket disconnected")


# -- the library runtime's fetching: librdkafka (confluent-kafka) with the same properties -------

#: One generous deadline for a bounded consume loop: a loaded machine's TLS and SASL exchanges
#: take seconds; librdkafka itself retries a refused login without end.
FETCH_DEADLINE_S = 120


def _fetch(settings: Settings, topic: str, until) -> tuple[list[str], KafkaUnavailable | None]:
    """Consume partition 0 of `topic` from its beginning with a fetch consumer of `settings`
    (manual assignment, no commits) until `until(values)` or the consumer's first permanent
    failure: (the values read, that failure or None)."""
    consumer = kafka_clients.fetch_consumer(
        settings, **{"group.id": f"fetch-{uuid.uuid4().hex[:6]}", "enable.auto.commit": False}
    )
    values: list[str] = []
    deadline = time.monotonic() + FETCH_DEADLINE_S
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        while not until(values) and consumer.failure() is None:
            assert time.monotonic() < deadline, f"neither the records nor a failure: {values}"
            for message in consumer.consume(num_messages=100, timeout=0.2):
                assert message.error() is None, message.error()
                values.append(message.value().decode())
        return values, consumer.failure()
    finally:
        consumer.close()


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_librdkafkas_fetch_consumer_and_producer_over_each_mechanism(
    broker, places, cli, mechanism
):
    """librdkafka with `KafkaConfig.librdkafka_config()` reads back, over each listener and
    mechanism, what the project's producer wrote with the same client properties file, and
    what the library member's producer (`acked_producer`) wrote after it (via `fetch_consumer`
    and a manual assignment)."""
    settings, storage, bodies = _produced(broker, places, cli, mechanism, "fetch")
    more = [f"acked {mechanism} {i}" for i in range(2)]
    producer = acked_producer(settings)
    try:
        for body in more:
            producer.send(storage, value=body.encode(), partition=0).get(FETCH_DEADLINE_S)
    finally:
        producer.close(FETCH_DEADLINE_S)
    values, failure = _fetch(settings, storage, lambda got: len(got) >= len(bodies) + 2)
    assert failure is None and values == bodies + more


def _with_password(broker, tmp_path, password: str) -> Settings:
    """alice's SCRAM-SHA-512 settings with `password` instead of hers."""
    text = Path(broker.client_config("alice", "scram-sha-512")).read_text()
    config = tmp_path / "wrong-password.properties"
    config.write_text(re.sub(r'password="[^"]*"', f'password="{password}"', text))
    cfg = kafka_config.load(str(config), environ={})
    return Settings(bootstrap=cfg.bootstrap, kafka=cfg)


def test_the_members_producer_with_a_wrong_password_fails_its_writes_with_the_line(
    broker, tmp_path
):
    """librdkafka retries a refused login without end, reporting it only to the error
    callback: `acked_producer` fails every write not acknowledged with `explain`'s line."""
    password = "not-alices-password-456"
    producer = acked_producer(_with_password(broker, tmp_path, password))
    try:
        ack = producer.send("any-topic", value=b"x", partition=0)
        with pytest.raises(KafkaUnavailable) as refused:
            ack.get(FETCH_DEADLINE_S)
    finally:
        producer.close(5)
    line = str(refused.value)
    assert line.startswith(
        f"cannot connect to Kafka at {broker.bootstrap} (SASL_SSL, SCRAM-SHA-512 as alice): "
        f"authentication failed (wrong user name, password or mechanism): "
    ), line
    assert password not in line and "\n" not in line


def _refused(settings: Settings) -> str:
    """The line of the failure a fetch consumer of `settings` ends with (assigned a topic that
    need not exist: the client fails before it asks)."""
    values, failure = _fetch(settings, "no-such-topic", lambda got: False)
    assert values == [] and failure is not None
    line = str(failure)
    assert "\n" not in line
    return line


def test_a_fetch_consumer_with_a_wrong_password_ends_with_the_explained_line(broker, tmp_path):
    """librdkafka retries a refused login without end; the fetch consumer's `failure()` ends
    the loop with `explain`'s line, as kafka-python's clients give it."""
    password = "not-alices-password-123"
    line = _refused(_with_password(broker, tmp_path, password))
    assert line.startswith(
        f"cannot connect to Kafka at {broker.bootstrap} (SASL_SSL, SCRAM-SHA-512 as alice): "
        f"authentication failed (wrong user name, password or mechanism): "
    ), line
    assert password not in line


def test_a_fetch_consumer_without_a_client_certificate_ends_with_the_explained_line(
    broker, tmp_path
):
    with_cert = Path(broker.client_config("alice", "mtls")).read_text()
    config = tmp_path / "no-cert.properties"
    config.write_text(re.sub(r"(?m)^ssl\.keystore\..*\n", "", with_cert))
    cfg = kafka_config.load(str(config), environ={})
    line = _refused(Settings(bootstrap=cfg.bootstrap, kafka=cfg))
    assert f"cannot connect to Kafka at {broker.listeners['MTLS']} (SSL)" in line, line
    assert "requires a client certificate (mutual TLS)" in line, line


def test_a_fetch_consumer_with_a_mechanism_the_listener_does_not_offer(broker, tmp_path):
    text = Path(broker.client_config("alice", "oauthbearer")).read_text()
    config = tmp_path / "oauth-at-the-scram-port.properties"
    config.write_text(text.replace(broker.listeners["OAUTH"], broker.bootstrap))
    cfg = kafka_config.load(str(config), environ={})
    line = _refused(Settings(bootstrap=cfg.bootstrap, kafka=cfg))
    assert "the listener does not offer sasl.mechanism OAUTHBEARER" in line, line
