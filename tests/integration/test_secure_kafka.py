"""Against a secured broker: SASL_SSL only (SCRAM-SHA-512 over TLS with a throw-away CA, ACLs on),
started by `VARADHI_KAFKA_SECURE=1 scripts/kafka start` on its own port and folder for this
module and wiped afterwards; no plaintext listener exists on it. Every client here goes through
`--command-config`, `Settings.kafka` or (a spawned job) `$VARADHI_KAFKA_CONFIG`.

The user `carol` holds exactly the ACLs of docs/kafka-acls.md and runs the whole flow: subscription
apply, produce, a grouped shard with retry and DLQ, change-shards with feeders, re-drive, replay,
offset reset of every queue, status, both outbox relays. Lacking one ACL, a command or shard ends
in one line naming it. Bad credentials, an unknown CA, an unreachable cluster and bad
configuration each end in one clear line too."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from varadhi.cli import main as cli_main
from varadhi.core.errors import NotAuthorized
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import config as kafka_config
from varadhi.kafka.settings import Settings
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, read_queue, run_until_idle
from varadhi.testing.secure_kafka import free_port_pair, secured_broker

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    """(bootstrap, data folder) of a SASL_SSL broker started for this module."""
    with secured_broker(tmp_path_factory.mktemp("secure-kafka") / "broker") as broker:
        yield broker.bootstrap, broker.folder


@pytest.fixture(scope="module")
def alice(secure_broker) -> str:
    return str(secure_broker[1] / "alice.properties")


@pytest.fixture(scope="module")
def secure_settings(secure_broker, alice, tmp_path_factory) -> Settings:
    return Settings(
        bootstrap=secure_broker[0],
        catalog_topic=f"__varadhi_catalog_secure_{uuid.uuid4().hex[:8]}",
        warehouse=str(tmp_path_factory.mktemp("secure-warehouse")),
        kafka=kafka_config.load(alice),
    )


@pytest.fixture
def cli(secure_settings, capsys, monkeypatch):
    """varadhi --command-config CONFIG ... on the secure broker -> (exit code, stdout, stderr)."""
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", secure_settings.catalog_topic)
    monkeypatch.setenv("VARADHI_WAREHOUSE", secure_settings.warehouse)

    def run(*args: str, config: str | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli_main(
            [
                "--bootstrap",
                secure_settings.bootstrap,
                "--command-config",
                config or secure_settings.kafka.source,
                *args,
            ]
        )
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_the_broker_has_no_plaintext_path(secure_broker):
    server = (secure_broker[1] / "server.properties").read_text()
    assert f"listeners=SASL_SSL://{secure_broker[0]}," in server
    assert "PLAINTEXT://" not in server.replace("CONTROLLER:PLAINTEXT", "")


def _config(tmp_path, alice: str, **replace: str) -> str:
    text = Path(alice).read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / f"client-{uuid.uuid4().hex[:6]}.properties"
    path.write_text(text)
    return str(path)


def _one_clear_line(result, *expected: str, within: float, started: float) -> None:
    code, out, err = result
    assert code != 0
    assert time.monotonic() - started < within
    assert err.count("\n") == 1, err
    for text in expected:
        assert text in err, err


def test_wrong_password(cli, alice, tmp_path, monkeypatch):
    monkeypatch.setenv("NOT_ALICES_PASSWORD", "wrong-password-123")
    secret = "${file:" + str(Path(alice).parent / "secrets" / "alice.password") + "}"
    config = _config(tmp_path, alice, **{secret: "${env:NOT_ALICES_PASSWORD}"})
    started = time.monotonic()
    result = cli("topic", "list", config=config)
    _one_clear_line(result, "authentication failed", "as alice", within=25, started=started)
    assert "wrong-password-123" not in result[2]


def test_unknown_ca(cli, alice, tmp_path):
    other_ca = tmp_path / "other-ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=someone-else", "-keyout", str(tmp_path / "k.pem"), "-out", str(other_ca)],
        check=True, capture_output=True,
    )  # fmt: skip
    ca = str(Path(alice).parent / "tls" / "ca.pem")
    started = time.monotonic()
    result = cli("topic", "list", config=_config(tmp_path, alice, **{ca: str(other_ca)}))
    _one_clear_line(result, "certificate is not trusted", within=25, started=started)


def test_unreachable_cluster(alice, capsys):
    port = free_port_pair()
    started = time.monotonic()
    code = cli_main(
        ["--bootstrap", f"127.0.0.1:{port}", "--command-config", alice, "topic", "list"]
    )
    _one_clear_line(
        (code, "", capsys.readouterr().err), "nothing answers", within=25, started=started
    )


def test_missing_acl(cli, secure_broker, tmp_path):
    started = time.monotonic()
    result = cli("topic", "create", f"sec-bob-{uuid.uuid4().hex[:6]}", "--partitions", "1",
                 config=str(secure_broker[1] / "bob.properties"))  # fmt: skip
    _one_clear_line(result, "not authorized", within=40, started=started)


def test_bad_configuration_is_refused_before_anything_starts(cli, alice, tmp_path, monkeypatch):
    """Refused before any Kafka client or probe is made (each would fail the test), not judged
    by how fast: a loaded machine can take seconds for the command's imports."""

    def nothing_starts(*args, **kwargs):
        raise AssertionError("a Kafka client or probe started")

    monkeypatch.setattr(kafka_clients, "_build", nothing_starts)
    monkeypatch.setattr(kafka_clients, "probe", nothing_starts)
    config = _config(tmp_path, alice, **{"sasl.mechanism=": "sasl.mechanisms="})
    started = time.monotonic()
    result = cli("topic", "list", config=config)
    _one_clear_line(result, "did you mean sasl.mechanism?", within=60, started=started)
    assert result[0] == 2


# -- least privilege: carol holds exactly the ACLs of docs/kafka-acls.md ----------------------


@pytest.fixture(scope="module")
def carol_settings(secure_broker, tmp_path_factory) -> Settings:
    """carol's deployment: the default catalog topic, names starting with `carol-`."""
    return Settings(
        bootstrap=secure_broker[0],
        catalog_topic="__varadhi_catalog",
        warehouse=str(tmp_path_factory.mktemp("carol-warehouse")),
        kafka=kafka_config.load(str(secure_broker[1] / "carol.properties")),
    )


@pytest.fixture
def as_user(carol_settings, secure_broker, capsys, monkeypatch):
    """as_user(user, *args) -> (exit code, stdout, stderr) of `varadhi --command-config
    <user>.properties ARGS` in carol's deployment (admin's properties for admin)."""
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", carol_settings.catalog_topic)
    monkeypatch.setenv("VARADHI_WAREHOUSE", carol_settings.warehouse)

    def run(user: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        config = str(secure_broker[1] / f"{user}.properties")
        code = cli_main(
            ["--bootstrap", carol_settings.bootstrap, "--command-config", config, *args]
        )
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="module")
def denied(secure_broker, carol_settings):
    """with denied(operation, resource type, name): carol lacks exactly that ACL (a DENY ACL,
    which wins over her prefixed ALLOWs, added by admin and removed on exit)."""
    import contextlib

    from kafka.admin import (
        ACL,
        ACLFilter,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePattern,
        ResourceType,
    )

    from varadhi.kafka import clients as kafka_clients

    admin_settings = Settings(
        bootstrap=carol_settings.bootstrap,
        kafka=kafka_config.load(str(secure_broker[1] / "admin.properties")),
    )
    admin = kafka_clients.admin(admin_settings)
    kinds = {"Topic": ResourceType.TOPIC, "TransactionalId": ResourceType.TRANSACTIONAL_ID}

    @contextlib.contextmanager
    def deny(operation: str, kind: str, name: str):
        pattern = ResourcePattern(kinds[kind], name, ACLResourcePatternType.LITERAL)
        acl = ACL("User:carol", "*", ACLOperation[operation.upper()], ACLPermissionType.DENY,
                  pattern)  # fmt: skip
        assert not admin.create_acls([acl])["failed"]
        try:
            yield
        finally:
            admin.delete_acls(
                [ACLFilter(acl.principal, acl.host, acl.operation, acl.permission_type, pattern)]
            )

    try:
        yield deny
    finally:
        admin.close()


def test_a_missing_acl_is_named_in_one_line(as_user, denied, tmp_path):
    """CLI commands as carol, each lacking one ACL: exit code 4 and one line naming it."""
    suffix = uuid.uuid4().hex[:6]
    topic = f"carol-t-{suffix}"
    assert as_user("admin", "topic", "create", topic, "--partitions", "1")[0] == 0
    lines = tmp_path / "m.jsonl"
    lines.write_text(json.dumps({"value": "v", "group_id": "g", "message_id": "m"}) + "\n")
    for (operation, kind, resource), args in (
        (("Describe", "Topic", "__varadhi_catalog"), ("topic", "list")),
        (("Write", "TransactionalId", "varadhi-catalog-writer.__varadhi_catalog"),
         ("topic", "create", f"carol-u-{suffix}", "--partitions", "1")),
        (("Write", "Topic", f"{topic}.0"), ("produce", topic, "--file", str(lines))),
    ):  # fmt: skip
        with denied(operation, kind, resource):
            code, _, err = as_user("carol", *args)
        assert code == 4, err
        assert err == (
            f"varadhi: not authorized: User:carol lacks {operation} on {kind} {resource} "
            f"(kafka-acls.sh --add --allow-principal User:carol --operation {operation} "
            f"--{'topic' if kind == 'Topic' else 'transactional-id'} {resource})\n"
        )


def run_shards(settings: Settings, spark, name: str, count: int) -> None:
    """Every shard of `name` in threads of this process until idle; each must exit 0."""
    import threading

    codes: dict[int, int] = {}
    jobs = [ShardJob(name, i, settings, spark=spark, stop_when_idle_s=3) for i in range(count)]
    threads = [
        threading.Thread(target=lambda i=i, j=j: codes.__setitem__(i, j.run()), daemon=True)
        for i, j in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert codes == {i: 0 for i in range(count)}


@pytest.fixture
def feeder_job(carol_settings, secure_broker, capsys, monkeypatch):
    """feeder_job(subscription, source) -> (exit code, stdout, stderr) of `varadhi-job feeder`
    as carol, configured by the environment alone ($VARADHI_KAFKA_CONFIG), in this process (and
    its Spark session)."""
    from varadhi.jobs import runner

    monkeypatch.setenv("VARADHI_KAFKA_CONFIG", str(secure_broker[1] / "carol.properties"))
    monkeypatch.setenv("VARADHI_BOOTSTRAP", carol_settings.bootstrap)
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", carol_settings.catalog_topic)
    monkeypatch.setenv("VARADHI_WAREHOUSE", carol_settings.warehouse)

    def run(name: str, source: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = runner.main(["feeder", "--subscription", name, "--source", source])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.spark
def test_carol_with_least_privilege_runs_the_whole_flow(
    as_user, carol_settings, denied, feeder_job, spark, tmp_path
):
    suffix = uuid.uuid4().hex[:6]
    topic, name = f"carol-t-{suffix}", f"carol-s-{suffix}"
    assert as_user("admin", "topic", "create", topic, "--partitions", "2")[0] == 0
    code, out, _ = as_user("carol", "topic", "describe", topic, "--output", "json")
    assert code == 0 and json.loads(out)["storage_topics"][0]["partitions"] == 2
    with TestEndpoint(script={"g1-1": [503], "g2-1": [503, 404]}) as endpoint:
        spec = tmp_path / "sub.yaml"
        spec.write_text(json.dumps(_spec(name, topic, endpoint.url)))
        code, _, err = as_user("carol", "subscription", "apply", "-f", str(spec))
        assert code == 0, err
        lines = tmp_path / "messages.jsonl"
        lines.write_text("".join(json.dumps(m) + "\n" for m in _messages()))
        code, _, err = as_user("carol", "produce", topic, "--file", str(lines))
        assert code == 0, err
        started_ms = int(time.time() * 1000) - 60_000

        # Without one ACL a shard stops with one line naming it (exit code 4 in a job): the
        # transactional id of its RQ/DLQ writer, then Write on its DLQ (from inside the query).
        for operation, kind, resource in (
            ("Write", "TransactionalId", f"varadhi.{name}.s1.shard-0"),
            ("Write", "Topic", f"{name}.dlq.0"),
        ):
            with denied(operation, kind, resource), pytest.raises(NotAuthorized) as refused:
                ShardJob(name, 0, carol_settings, spark=spark, stop_when_idle_s=3).run()
            assert str(refused.value).startswith(
                f"not authorized: User:carol lacks {operation} on {kind} {resource} ("
            ), refused.value
            assert "\n" not in str(refused.value) and refused.value.exit_code == 4
        assert delivered(endpoint, "g2") == ["g2-0"]  # g2-1's dead letter was never written

        # with the ACL back, the same batch runs again and completes: g1-1 failed once (503),
        # went through the RQ and was delivered, in order; g2-1 was retried (503) then
        # dead-lettered (404), and g2's later messages wait behind it.
        run_until_idle(carol_settings, spark, name)
        assert delivered(endpoint, "g1") == ["g1-0", "g1-1", "g1-2"]
        assert delivered(endpoint, "g2") == ["g2-0"]
        rq = read_queue(carol_settings, f"{name}.rq.0")
        assert [r["headers"].get("varadhi-msg-id") for r in rq if r["value"]].count("g1-1") >= 1
        code, out, err = as_user("carol", "dlq", "list", name, "--output", "json")
        assert code == 0, err
        assert [(p["msg_id"], p["status"]) for p in json.loads(out)] == [("g2-1", 404)]
        code, out, err = as_user("carol", "status", name, "--output", "json")
        assert code == 0, err
        assert json.loads(out)["shards"][0]["blocked_groups"] == 1

        # change-shards 1 -> 2 with feeder jobs: the feeders carry the dead letter (and g2's
        # block) to the new DLQ; the re-drive then finds it there. Lacking Write on the new RQ,
        # the RQ's feeder (refused by Spark's Kafka sink, whose error names only the topic) ends
        # with exit code 4 and one line naming Write; once granted it copies.
        code, out, err = as_user("carol", "subscription", "change-shards", name, "--to", "2",
                                 "--feeders", "external", "--output", "json")  # fmt: skip
        assert code == 0, err
        op = json.loads(out)
        sources = {f["queue"]: f["source"] for f in op["feeders"]}
        new_rq = op["rq_target"]
        with denied("Write", "Topic", new_rq):
            code, out, err = feeder_job(name, sources["rq"])
        assert code == 4, (code, out, err)
        assert (code, err.splitlines()[-1]) == (4, (
            f"varadhi: not authorized: User:carol lacks Write on Topic {new_rq} (kafka-acls.sh "
            f"--add --allow-principal User:carol --operation Write --topic {new_rq})"
        ))  # fmt: skip
        assert err.count("varadhi:") == 1
        for queue, records in (("rq", None), ("dlq", 1)):
            code, out, err = feeder_job(name, sources[queue])
            assert code == 0, err
            assert records is None or out == f"fed {records} records from {sources[queue]}\n"
        code, _, err = as_user("carol", "dlq", "unsideline", name, "--group-ids", "g2")
        assert code == 0, err
        run_shards(carol_settings, spark, name, 2)
        assert delivered(endpoint, "g2") == ["g2-0", "g2-1", "g2-2"]

        # replay lacking Read on the topic: refused inside its Spark job by Kafka's Java
        # client, which names the topic but not the operation
        replay = ("replay", name, "--from", str(started_ms), "--output", "json")
        with denied("Read", "Topic", f"{topic}.0"):
            code, _, err = as_user("carol", *replay)
        # (pyspark may print its own UserWarning about Arrow before it, unless pytest captures
        # warnings)
        assert (code, err.splitlines()[-1]) == (4, (
            f"varadhi: not authorized: User:carol lacks Describe or Read on Topic {topic}.0 "
            f"(kafka-acls.sh --add --allow-principal User:carol --operation Describe "
            f"--operation Read --topic {topic}.0)"
        ))  # fmt: skip
        assert err.count("varadhi:") == 1
        code, out, err = as_user("carol", *replay)
        assert code == 0, err
        for g in ("g1", "g2"):
            assert delivered(endpoint, g) == [f"{g}-{i}" for i in range(3)] * 2

        # offset reset of each queue (what a reset then re-delivers is test_offset_reset's):
        # the plan reads every queue's offsets, the execution changes the catalog
        for queue, to in (("rq", "--to-latest"), ("dlq", "--to-latest"), ("main", "--to-earliest")):
            code, out, err = as_user("carol", "offsets", "reset", name, "--queue", queue, to,
                                     "--execute", "--output", "json")  # fmt: skip
            assert code == 0, (queue, err)
            assert json.loads(out)["executed"] is True
        assert json.loads(out)["replayed"] == 6

        code, out, err = as_user("carol", "status", name, "--output", "json")
        assert code == 0, err
        assert [s["shard"] for s in json.loads(out)["shards"]] == [0, 1]
        code, out, _ = as_user("carol", "subscription", "describe", name, "--output", "json")
        assert code == 0
        password = Path(carol_settings.kafka.source).parent / "secrets/carol.password"
        assert password.read_text().strip() not in out


def _spec(name: str, topic: str, url: str, shards: int = 1) -> dict:
    return {
        "name": name,
        "topic": topic,
        "endpoint": {"url": url},
        "shards": shards,
        "retry": {
            "max_attempts": 3,
            "min_backoff": "100ms",
            "max_backoff": "200ms",
            "jitter": 0,
            "in_place_window": 0,
        },  # fmt: skip
        "consumption": {"trigger_interval": "100ms", "journal_interval": "250ms"},
        "circuit_breaker": {"enabled": False},
    }


def _messages() -> list[dict]:
    return [
        {"value": f"body {g}-{i}", "group_id": g, "message_id": f"{g}-{i}"}
        for i in range(3)
        for g in ("g1", "g2")
    ]


@pytest.mark.spark
def test_both_outbox_relays_as_carol(
    as_user, carol_settings, denied, secure_broker, spark, tmp_path
):
    """The SQL relay as a job of its own, configured by $VARADHI_KAFKA_CONFIG alone (shared
    PostgreSQL), and the Delta outbox's query in this process, both as carol (first lacking Write
    on the topic: the query's failure names it)."""
    import sys

    import psycopg

    from varadhi.outbox.delta import SCHEMA, DeltaOutbox
    from varadhi.outbox.tables import Outbox

    dsn = os.environ.get("VARADHI_TEST_POSTGRES_DSN")
    if not dsn:
        pytest.skip("VARADHI_TEST_POSTGRES_DSN is not set (scripts/test sets it)")
    suffix = uuid.uuid4().hex[:6]
    topic = f"carol-o-{suffix}"
    assert as_user("admin", "topic", "create", topic, "--partitions", "1")[0] == 0

    outbox = Outbox(table_prefix=f"obx_{suffix}")
    with psycopg.connect(dsn) as conn:
        outbox.create_tables(conn)
        for i in range(3):
            outbox.add(conn, topic, f"sql-{i}".encode(), group_id="g")
        conn.commit()
    try:
        env = {
            **os.environ,
            "VARADHI_KAFKA_CONFIG": str(secure_broker[1] / "carol.properties"),
            "VARADHI_BOOTSTRAP": carol_settings.bootstrap,
            "VARADHI_CATALOG_TOPIC": carol_settings.catalog_topic,
        }
        relay = subprocess.run(
            [sys.executable, "-m", "varadhi.jobs.outbox_relay", "--dsn", dsn,
             "--table-prefix", f"obx_{suffix}", "--once"],
            env=env, capture_output=True, text=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        assert relay.returncode == 0, relay.stderr
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for table in outbox.tables():
                conn.execute(f"DROP TABLE IF EXISTS {table}")

    delta = DeltaOutbox(spark, str(tmp_path / "outbox"), name=f"carol-dox-{suffix}",
                        settings=carol_settings)  # fmt: skip
    try:
        delta.create_table()
        rows = [(topic, "g", f"delta-{i}", None, f"delta-{i}".encode()) for i in range(3)]
        delta.append(spark.createDataFrame(rows, SCHEMA).coalesce(1))
        # lacking Write on the topic, the query fails and the wait names it; granted, the same
        # batch is sent
        with denied("Write", "Topic", f"{topic}.0"), pytest.raises(NotAuthorized) as refused:
            delta.await_termination(delta.start(available_now=True), 300)
        assert str(refused.value) == str(NotAuthorized("Write", "Topic", f"{topic}.0",
                                                       "User:carol"))  # fmt: skip
        query = delta.start(available_now=True)
        assert delta.await_termination(query, 300), "the outbox query did not finish"
        assert query.exception() is None, query.exception()
    finally:
        delta.close()
    assert [r["value"] for r in read_queue(carol_settings, f"{topic}.0")] == [
        f"{source}-{i}".encode() for source in ("sql", "delta") for i in range(3)
    ]
