"""Against a secured broker: SASL_SSL only (SCRAM-SHA-512 over TLS with a throw-away CA, ACLs on),
started by `VARADHI_KAFKA_SECURE=1 scripts/kafka start` on its own port and folder for this
module and wiped afterwards; no plaintext listener exists on it. Every client here goes through
`--command-config`, `Settings.kafka` or (a spawned job) `$VARADHI_KAFKA_CONFIG`.

Each component (operator commands, producer, shard, feeder, outbox relay) runs as a user of its
own holding exactly its grants of `varadhi.kafka.acls` (the table docs/kafka-acls.md shows), and
together they run the whole flow: topic create, subscription apply, produce, a grouped shard
with retry and DLQ, change-shards with feeders, re-drive, replay, offset reset of every queue,
status, deletes, both outbox relays. Lacking one ACL, a command or job ends in one line naming
it; a user cannot do what its grants leave out. Bad credentials, an unknown CA, an unreachable cluster and bad
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
from varadhi.kafka import acls
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import config as kafka_config
from varadhi.kafka.settings import Settings
from varadhi.spark.shard.job import ShardJob
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.harness import delivered, read_queue, run_until_idle
from varadhi.testing.secure_kafka import free_port_pair, operation_key, secured_broker

pytestmark = [pytest.mark.kafka]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A SASL_SSL broker started for this module (`SecuredBroker`)."""
    with secured_broker(tmp_path_factory.mktemp("secure-kafka") / "broker") as started:
        yield started


@pytest.fixture(scope="module")
def secure_broker(broker):
    """(bootstrap, data folder) of the module's broker."""
    return broker.bootstrap, broker.folder


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


# The user-visible property is one clear line, and no hang: a client that retried without end
# would run past this. How soon the refusal comes (seconds on a quiet machine) is not a test's
# business: on a loaded one a first SASL handshake can time out and the refusal then comes with
# the client's 30 s timeout (a CI run took 30.1 s where 25 s was asserted).
NO_HANG_S = 120


def _one_clear_line(result, *expected: str, started: float) -> None:
    code, out, err = result
    assert code != 0
    assert time.monotonic() - started < NO_HANG_S
    assert err.count("\n") == 1, err
    for text in expected:
        assert text in err, err


def test_wrong_password(cli, alice, tmp_path, monkeypatch):
    monkeypatch.setenv("NOT_ALICES_PASSWORD", "wrong-password-123")
    secret = "${file:" + str(Path(alice).parent / "secrets" / "alice.password") + "}"
    config = _config(tmp_path, alice, **{secret: "${env:NOT_ALICES_PASSWORD}"})
    started = time.monotonic()
    result = cli("topic", "list", config=config)
    _one_clear_line(result, "authentication failed", "as alice", started=started)
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
    _one_clear_line(result, "certificate is not trusted", started=started)


def test_unreachable_cluster(alice, capsys):
    port = free_port_pair()
    started = time.monotonic()
    code = cli_main(
        ["--bootstrap", f"127.0.0.1:{port}", "--command-config", alice, "topic", "list"]
    )
    _one_clear_line((code, "", capsys.readouterr().err), "nothing answers", started=started)


def test_missing_acl(cli, secure_broker, tmp_path):
    started = time.monotonic()
    result = cli("topic", "create", f"sec-bob-{uuid.uuid4().hex[:6]}", "--partitions", "1",
                 config=str(secure_broker[1] / "bob.properties"))  # fmt: skip
    _one_clear_line(result, "not authorized", started=started)


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
    _one_clear_line(result, "did you mean sasl.mechanism?", started=started)
    assert result[0] == 2


# -- least privilege: one principal per component, holding exactly its varadhi.kafka.acls grants --

USERS = {c: "acl-" + c.replace(" ", "-") for c in acls.COMPONENTS}  # component -> user


@pytest.fixture(scope="module")
def acl_catalog() -> str:
    """The least-privilege tests' own catalog topic: the operator makes it."""
    return f"__varadhi_catalog_acl_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def users(broker) -> dict[str, str]:
    """component -> the properties file of its user (made here, holding no ACL yet)."""
    paths = broker.add_users(USERS.values())
    return {component: paths[user] for component, user in USERS.items()}


@pytest.fixture(scope="module")
def settings_of(broker, users, acl_catalog, tmp_path_factory):
    """settings_of(component) -> Settings of the component's user in the tests' deployment
    (`"verify"`: alice's, for the tests' own reads)."""
    warehouse = str(tmp_path_factory.mktemp("acl-warehouse"))

    def settings(component: str) -> Settings:
        source = users.get(component) or str(broker.folder / "alice.properties")
        return Settings(bootstrap=broker.bootstrap, catalog_topic=acl_catalog,
                        warehouse=warehouse, kafka=kafka_config.load(source))  # fmt: skip

    return settings


def deployment(broker, acl_catalog: str, tag: str) -> acls.Names:
    """New names (`acl-t-<tag>`, `acl-s-<tag>`, `acl-dox-<tag>`) and every component's user
    holding exactly the table's grants for them."""
    names = acls.Names(acl_catalog, f"acl-t-{tag}", f"acl-s-{tag}", f"acl-dox-{tag}")
    broker.allow({user: acls.grants(component, names) for component, user in USERS.items()})
    return names


@pytest.fixture
def as_user(settings_of, broker, capsys, monkeypatch):
    """as_user(component, *args) -> (exit code, stdout, stderr) of `varadhi --command-config
    <its user's properties> ARGS` in the tests' deployment."""
    settings = settings_of("operator")
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", settings.catalog_topic)
    monkeypatch.setenv("VARADHI_WAREHOUSE", settings.warehouse)

    def run(component: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        config = settings_of(component).kafka.source
        code = cli_main(["--bootstrap", broker.bootstrap, "--command-config", config, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="module")
def denied(broker):
    """with denied(component, operation, resource type, name): the component's user lacks
    exactly that ACL (a DENY ACL, which wins over its ALLOWs, added by admin and removed on
    exit)."""
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

    kinds = {
        "Topic": ResourceType.TOPIC,
        "TransactionalId": ResourceType.TRANSACTIONAL_ID,
        "Group": ResourceType.GROUP,
    }

    with broker.admin() as admin:

        @contextlib.contextmanager
        def deny(component: str, operation: str, kind: str, name: str):
            pattern = ResourcePattern(kinds[kind], name, ACLResourcePatternType.LITERAL)
            acl = ACL(f"User:{USERS[component]}", "*", ACLOperation[operation_key(operation)],
                      ACLPermissionType.DENY, pattern)  # fmt: skip
            assert not admin.create_acls([acl])["failed"]
            try:
                yield
            finally:
                admin.delete_acls(
                    [ACLFilter(acl.principal, acl.host, acl.operation, acl.permission_type,
                               pattern)]
                )  # fmt: skip

        yield deny


def assert_refused_write(settings: Settings, topic: str) -> None:
    """A plain send to `topic` as `settings`' user is refused by the cluster's ACLs."""
    from kafka.errors import TopicAuthorizationFailedError

    producer = kafka_clients.producer(settings, max_block_ms=30_000)
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            producer.send(topic, key=b"k", value=b"v").get(timeout=30)
    finally:
        producer.close(timeout=5)


def test_a_missing_acl_is_named_in_one_line(as_user, broker, acl_catalog, denied, tmp_path):
    """CLI commands, each lacking one ACL of its component: exit code 4 and one line naming
    it."""
    names, other = (deployment(broker, acl_catalog, uuid.uuid4().hex[:6]) for _ in range(2))
    assert as_user("operator", "topic", "create", names.topic, "--partitions", "1")[0] == 0
    lines = tmp_path / "m.jsonl"
    lines.write_text(json.dumps({"value": "v", "group_id": "g", "message_id": "m"}) + "\n")
    for component, (operation, kind, resource), args in (
        ("operator", ("Describe", "Topic", acl_catalog), ("topic", "list")),
        ("operator", ("Write", "TransactionalId", f"varadhi-catalog-writer.{acl_catalog}"),
         ("topic", "create", other.topic, "--partitions", "1")),
        ("producer", ("Write", "Topic", f"{names.topic}.0"),
         ("produce", names.topic, "--file", str(lines))),
    ):  # fmt: skip
        with denied(component, operation, kind, resource):
            code, _, err = as_user(component, *args)
        assert code == 4, err
        user = USERS[component]
        assert err == (
            f"varadhi: not authorized: User:{user} lacks {operation} on {kind} {resource} "
            f"(kafka-acls.sh --add --allow-principal User:{user} --operation {operation} "
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
def feeder_job(settings_of, capsys, monkeypatch):
    """feeder_job(subscription, source) -> (exit code, stdout, stderr) of `varadhi-job feeder`
    as the feeder's user, configured by the environment alone ($VARADHI_KAFKA_CONFIG), in this
    process (and its Spark session)."""
    from varadhi.jobs import runner

    settings = settings_of("feeder")
    monkeypatch.setenv("VARADHI_KAFKA_CONFIG", settings.kafka.source)
    monkeypatch.setenv("VARADHI_BOOTSTRAP", settings.bootstrap)
    monkeypatch.setenv("VARADHI_CATALOG_TOPIC", settings.catalog_topic)
    monkeypatch.setenv("VARADHI_WAREHOUSE", settings.warehouse)

    def run(name: str, source: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = runner.main(["feeder", "--subscription", name, "--source", source])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.mark.spark
def test_each_component_with_least_privilege_runs_the_whole_flow(
    as_user, broker, acl_catalog, settings_of, denied, feeder_job, spark, tmp_path
):
    """The operator's commands, the producer, the shards and the feeders, each as its own user
    holding exactly its grants of `varadhi.kafka.acls` (docs/kafka-acls.md), run the whole flow:
    topic create, subscription apply, a transactional produce, a grouped shard with retry and
    DLQ, change-shards with feeder jobs, re-drive, replay, offset reset of every queue, status
    and the deletes; a user lacks what the table does not give it."""
    names = deployment(broker, acl_catalog, uuid.uuid4().hex[:6])
    topic, name = names.topic, names.sub
    shard = settings_of("shard")
    assert as_user("operator", "topic", "create", topic, "--partitions", "2")[0] == 0
    code, out, _ = as_user("operator", "topic", "describe", topic, "--output", "json")
    assert code == 0 and json.loads(out)["storage_topics"][0]["partitions"] == 2
    with TestEndpoint(script={"g1-1": [503], "g2-1": [503, 404]}) as endpoint:
        spec = tmp_path / "sub.yaml"
        spec.write_text(json.dumps(_spec(name, topic, endpoint.url)))
        code, _, err = as_user("operator", "subscription", "apply", "-f", str(spec))
        assert code == 0, err
        lines = tmp_path / "messages.jsonl"
        lines.write_text("".join(json.dumps(m) + "\n" for m in _messages()))
        code, _, err = as_user("producer", "produce", topic, "--file", str(lines),
                               "--transactional")  # fmt: skip
        assert code == 0, err
        started_ms = int(time.time() * 1000) - 60_000

        # what the table does not give: the producer cannot write the catalog, the shard
        # cannot write the topic it reads
        assert_refused_write(settings_of("producer"), acl_catalog)
        assert_refused_write(shard, f"{topic}.0")

        # Without one ACL a shard stops with one line naming it (exit code 4 in a job): the
        # transactional id of its RQ/DLQ writer, then Write on its DLQ (from inside the query).
        for operation, kind, resource in (
            ("Write", "TransactionalId", f"varadhi.{name}.s1.shard-0"),
            ("Write", "Topic", f"{name}.dlq.0"),
        ):
            with (
                denied("shard", operation, kind, resource),
                pytest.raises(NotAuthorized) as refused,
            ):
                ShardJob(name, 0, shard, spark=spark, stop_when_idle_s=3).run()
            assert str(refused.value).startswith(
                f"not authorized: User:acl-shard lacks {operation} on {kind} {resource} ("
            ), refused.value
            assert "\n" not in str(refused.value) and refused.value.exit_code == 4
        assert delivered(endpoint, "g2") == ["g2-0"]  # g2-1's dead letter was never written

        # with the ACL back, the same batch runs again and completes: g1-1 failed once (503),
        # went through the RQ and was delivered, in order; g2-1 was retried (503) then
        # dead-lettered (404), and g2's later messages wait behind it.
        run_until_idle(shard, spark, name)
        assert delivered(endpoint, "g1") == ["g1-0", "g1-1", "g1-2"]
        assert delivered(endpoint, "g2") == ["g2-0"]
        rq = read_queue(settings_of("verify"), f"{name}.rq.0")
        assert [r["headers"].get("varadhi-msg-id") for r in rq if r["value"]].count("g1-1") >= 1
        code, out, err = as_user("operator", "dlq", "list", name, "--output", "json")
        assert code == 0, err
        assert [(p["msg_id"], p["status"]) for p in json.loads(out)] == [("g2-1", 404)]
        code, out, err = as_user("operator", "status", name, "--output", "json")
        assert code == 0, err
        assert json.loads(out)["shards"][0]["blocked_groups"] == 1

        # change-shards 1 -> 2 with feeder jobs: the feeders carry the dead letter (and g2's
        # block) to the new DLQ; the re-drive then finds it there. Lacking Write on the new RQ,
        # the RQ's feeder (refused by Spark's Kafka sink, whose error names only the topic) ends
        # with exit code 4 and one line naming Write; once granted it copies.
        code, out, err = as_user("operator", "subscription", "change-shards", name, "--to", "2",
                                 "--feeders", "external", "--output", "json")  # fmt: skip
        assert code == 0, err
        op = json.loads(out)
        sources = {f["queue"]: f["source"] for f in op["feeders"]}
        new_rq = op["rq_target"]
        with denied("feeder", "Write", "Topic", new_rq):
            code, out, err = feeder_job(name, sources["rq"])
        assert code == 4, (code, out, err)
        assert (code, err.splitlines()[-1]) == (4, (
            f"varadhi: not authorized: User:acl-feeder lacks Write on Topic {new_rq} "
            f"(kafka-acls.sh --add --allow-principal User:acl-feeder --operation Write "
            f"--topic {new_rq})"
        ))  # fmt: skip
        assert err.count("varadhi:") == 1
        for queue, records in (("rq", None), ("dlq", 1)):
            code, out, err = feeder_job(name, sources[queue])
            assert code == 0, err
            assert records is None or out == f"fed {records} records from {sources[queue]}\n"
        code, _, err = as_user("operator", "dlq", "unsideline", name, "--group-ids", "g2")
        assert code == 0, err
        run_shards(shard, spark, name, 2)
        assert delivered(endpoint, "g2") == ["g2-0", "g2-1", "g2-2"]

        # replay lacking Read on the topic: refused inside its Spark job by Kafka's Java
        # client, which names the topic but not the operation
        replay = ("replay", name, "--from", str(started_ms), "--output", "json")
        with denied("operator", "Read", "Topic", f"{topic}.0"):
            code, _, err = as_user("operator", *replay)
        # (pyspark may print its own UserWarning about Arrow before it, unless pytest captures
        # warnings)
        assert (code, err.splitlines()[-1]) == (4, (
            f"varadhi: not authorized: User:acl-operator lacks Describe or Read on Topic "
            f"{topic}.0 (kafka-acls.sh --add --allow-principal User:acl-operator --operation "
            f"Describe --operation Read --topic {topic}.0)"
        ))  # fmt: skip
        assert err.count("varadhi:") == 1
        code, out, err = as_user("operator", *replay)
        assert code == 0, err
        for g in ("g1", "g2"):
            assert delivered(endpoint, g) == [f"{g}-{i}" for i in range(3)] * 2

        # offset reset of each queue (what a reset then re-delivers is test_offset_reset's):
        # the plan reads every queue's offsets, the execution changes the catalog
        for queue, to in (("rq", "--to-latest"), ("dlq", "--to-latest"), ("main", "--to-earliest")):
            code, out, err = as_user("operator", "offsets", "reset", name, "--queue", queue, to,
                                     "--execute", "--output", "json")  # fmt: skip
            assert code == 0, (queue, err)
            assert json.loads(out)["executed"] is True
        assert json.loads(out)["replayed"] == 7  # six messages and the produce's commit marker

        code, out, err = as_user("operator", "status", name, "--output", "json")
        assert code == 0, err
        assert [s["shard"] for s in json.loads(out)["shards"]] == [0, 1]
        code, out, _ = as_user("operator", "subscription", "describe", name, "--output", "json")
        assert code == 0
        password = Path(settings_of("operator").kafka.source).parent / "secrets"
        assert (password / "acl-operator.password").read_text().strip() not in out

    # the deletes; lacking Write on the progress topic, the subscription's delete ends naming
    # it (its shards' progress would outlive it), and once granted finishes
    progress_topic = f"{acl_catalog}_progress"
    with denied("operator", "Write", "Topic", progress_topic):
        code, _, err = as_user("operator", "subscription", "delete", name)
    assert (code, err.splitlines()[-1]) == (4, (
        f"varadhi: not authorized: User:acl-operator lacks Write on Topic {progress_topic} "
        f"(kafka-acls.sh --add --allow-principal User:acl-operator --operation Write "
        f"--topic {progress_topic})"
    ))  # fmt: skip
    for args in (("subscription", "delete", name), ("topic", "delete", topic)):
        code, _, err = as_user("operator", *args)
        assert code == 0, (args, err)
    with broker.admin() as admin:
        left = [t for t in admin.list_topics() if t.startswith((f"{name}.", f"{topic}."))]
    assert left == []


def test_the_operator_with_least_privilege_runs_a_library_subscriptions_operations(
    as_user, broker, acl_catalog, settings_of, denied, tmp_path, monkeypatch
):
    """The operator's group row (`varadhi-library.<sub>`: Describe, Read, Delete) is what its
    commands need of a `runtime: library` subscription's consumer group: `status` reads the
    group's commits, `offsets reset` waits for it to be empty, commits, and removes the commits
    on the main topic's second storage topic, `subscription delete` checks that it is empty and
    deletes it. Without Describe on the group, the delete ends in
    one line naming it (exit 4) before anything changes. The member runs as the member's user."""
    from varadhi.kafka import topics as composite_topics
    from varadhi.library import Consumer
    from varadhi.library.runtime import group_id
    from varadhi.ops import status

    names = deployment(broker, acl_catalog, uuid.uuid4().hex[:6])
    topic, name, group = names.topic, names.sub, group_id(names.sub)
    assert as_user("operator", "topic", "create", topic, "--partitions", "2")[0] == 0
    with TestEndpoint() as endpoint:
        _library_flow(as_user, tmp_path, name, topic, endpoint.url, on_dead_letter="skip")
        assert as_user("operator", "topic", "add-storage", topic, "--partitions", "2")[0] == 0
        assert as_user("operator", "topic", "switch-produce", topic)[0] == 0
        lines = str(tmp_path / "messages.jsonl")
        assert as_user("producer", "produce", topic, "--file", lines)[0] == 0  # to T_1
        monkeypatch.setattr(composite_topics, "SEAL_GRACE_MS", 1_000)  # the member crosses soon
        member = Consumer(name, settings_of("member")).start()
        try:
            deadline = time.monotonic() + 120
            while member.counters()["delivered"] < 2 * len(_messages()):
                assert time.monotonic() < deadline, (member.health(), member.counters())
                time.sleep(0.1)
        finally:
            member.stop()
        verify = settings_of("verify")
        deadline = time.monotonic() + 120  # a stopped member leaves the group at once
        while status.group_members(verify, group):
            assert time.monotonic() < deadline, status.group_members(verify, group)
            time.sleep(0.2)

        code, out, err = as_user("operator", "status", name, "--output", "json")
        assert code == 0, err
        assert json.loads(out)["library"]["main_lag"] == 0  # the group's commits, read
        code, out, err = as_user("operator", "offsets", "reset", name, "--queue", "main",
                                 "--to-earliest", "--execute", "--output", "json")  # fmt: skip
        assert code == 0, err
        assert [mv["topic"] for mv in json.loads(out)["moves"] if mv.get("dropped")]  # T_1's
        code, out, err = as_user("operator", "status", name, "--output", "json")
        assert code == 0 and json.loads(out)["library"]["main_lag"] == 2 * len(_messages()), err

        with denied("operator", "Describe", "Group", group):
            code, _, err = as_user("operator", "subscription", "delete", name)
        assert code == 4, err
        assert err.strip().endswith(
            f"not authorized: User:acl-operator lacks Describe on Group {group} (kafka-acls.sh "
            f"--add --allow-principal User:acl-operator --operation Describe --group {group})"
        ), err
        assert as_user("operator", "subscription", "describe", name)[0] == 0  # still there
        code, out, err = as_user("operator", "subscription", "delete", name)
        assert code == 0 and f"consumer group: {group}" in out, err
        assert status.group_members(verify, group) is None


def test_a_library_member_with_least_privilege_delivers_retries_dead_letters_and_a_redrive(
    as_user, broker, acl_catalog, settings_of, denied, tmp_path
):
    """A library member as the member's user, holding exactly its grants of the table: it joins
    the group and commits, reads the main topic and its RQ, writes a retry, a dead letter and
    its delivery trace (made on first use), blocks the dead letter's key in its GroupState topic
    (made on first use, block mode) and sidelines the key's next message, writes and reads the
    ids it delivered (its dedup topic, made on first use), publishes its progress
    and circuit reports and reads the others' (its circuit on), and applies the operator's
    re-drive (reading the DLQ, marking its slot done in the catalog). Lacking Read on the group,
    `varadhi-consumer` ends in one line naming it, exit 4."""
    import sys

    from varadhi.library import Consumer
    from varadhi.library.runtime import group_id

    names = deployment(broker, acl_catalog, uuid.uuid4().hex[:6])
    topic, name, group = names.topic, names.sub, group_id(names.sub)
    assert as_user("operator", "topic", "create", topic, "--partitions", "2")[0] == 0
    # g2-1 is answered 404 until its re-drive: a rebalance of the member's group with it in
    # flight (the group may rebalance on a metadata change, `library.join_guard`) takes it back
    # (at least once) and the member attempts it again, dead-lettered again, not delivered.
    with TestEndpoint(script={"g1-1": [503], "g2-1": [404] * 20}) as endpoint:
        _library_flow(
            as_user, tmp_path, name, topic, endpoint.url, on_dead_letter="block",
            trace={"retention": "1h"}, circuit_breaker={"enabled": True}, dedup_window="10m",
        )  # fmt: skip

        def until(what: str, done) -> None:
            deadline = time.monotonic() + 120  # one generous deadline for a loaded machine
            while not done():
                health = member.health()
                assert health["state"] == "running", health
                assert time.monotonic() < deadline, (
                    f"waiting for {what}: counters {member.counters()}, health {health}, "
                    f"accepted {delivered(endpoint)}"
                )
                time.sleep(0.1)

        member = Consumer(name, settings_of("member")).start()
        try:
            counts = member.counters
            before = {"g1-0", "g1-1", "g1-2", "g2-0"}
            until("all but g2's last two", lambda: set(delivered(endpoint)) == before)
            until(
                "the dead letter and g2-2",
                lambda: counts()["sidelined"] >= 1 and counts()["blocked"] == 1,
            )
            assert counts()["retried"] >= 1, counts()
            assert set(delivered(endpoint)) == before, delivered(endpoint)  # g2 blocked
            endpoint.set_script("g2-1", [])  # answered 2xx from now on
            code, _, err = as_user("operator", "dlq", "unsideline", name, "--group-ids", "g2")
            assert code == 0, err
            until("the re-driven messages", lambda: {"g2-1", "g2-2"} <= set(delivered(endpoint)))
            assert delivered(endpoint, "g2")[-2:] == ["g2-1", "g2-2"], delivered(endpoint)
            until("g2 unblocked", lambda: counts()["blocked"] == 0)
            code, out, err = as_user("operator", "status", name, "--output", "json")
            assert code == 0, err
            [shown] = json.loads(out)["library"]["members"]
            assert shown["member"] == member.health()["member"], shown  # its progress
            assert shown["circuit"]["enabled"] and shown["circuit"]["state"] == "closed", shown
        finally:
            member.stop()
        assert member.health()["state"] == "stopped", member.health()
        code, out, err = as_user("operator", "trace", name, "--message-id", "g1-1",
                                 "--output", "json")  # fmt: skip
        assert code == 0, err
        assert "503" in out and "delivered" in out, out

        env = {**os.environ, "VARADHI_BOOTSTRAP": broker.bootstrap,
               "VARADHI_CATALOG_TOPIC": acl_catalog,
               "VARADHI_KAFKA_CONFIG": settings_of("member").kafka.source}  # fmt: skip
        with denied("member", "Read", "Group", group):
            done = subprocess.run(
                [sys.executable, "-m", "varadhi.library.console", name],
                env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        assert done.returncode == 4, done.stderr
        [line] = [x for x in done.stderr.splitlines() if x.startswith("varadhi-consumer: not")]
        assert f"Read on Group {group}" in line, done.stderr


def _library_flow(as_user, tmp_path: Path, name: str, topic: str, url: str, **fields) -> None:
    """A `runtime: library` subscription of `_spec` with `fields`, applied by the operator, and
    `_messages()` produced by the producer, each as its user."""
    spec = dict(_spec(name, topic, url), runtime="library", **fields)
    (tmp_path / "sub.yaml").write_text(json.dumps(spec))
    code, _, err = as_user("operator", "subscription", "apply", "-f", str(tmp_path / "sub.yaml"))
    assert code == 0, err
    lines = tmp_path / "messages.jsonl"
    lines.write_text("".join(json.dumps(m) + "\n" for m in _messages()))
    assert as_user("producer", "produce", topic, "--file", str(lines))[0] == 0


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
def test_both_outbox_relays_with_least_privilege(
    as_user, broker, acl_catalog, settings_of, denied, spark, tmp_path
):
    """The SQL relay as a job of its own, configured by $VARADHI_KAFKA_CONFIG alone (shared
    PostgreSQL), and the Delta outbox's query in this process, both as the outbox relay's user
    holding exactly its grants (first lacking Write on the topic: the query's failure names
    it); that user cannot write the catalog."""
    import sys

    import psycopg

    from varadhi.outbox.delta import SCHEMA, DeltaOutbox
    from varadhi.outbox.tables import Outbox

    dsn = os.environ.get("VARADHI_TEST_POSTGRES_DSN")
    if not dsn:
        pytest.skip("VARADHI_TEST_POSTGRES_DSN is not set (scripts/test sets it)")
    suffix = uuid.uuid4().hex[:6]
    names = deployment(broker, acl_catalog, suffix)
    topic = names.topic
    relay_settings = settings_of("outbox relay")
    assert as_user("operator", "topic", "create", topic, "--partitions", "1")[0] == 0
    assert_refused_write(relay_settings, acl_catalog)

    outbox = Outbox(table_prefix=f"obx_{suffix}")
    with psycopg.connect(dsn) as conn:
        outbox.create_tables(conn)
        for i in range(3):
            outbox.add(conn, topic, f"sql-{i}".encode(), group_id="g")
        conn.commit()
    try:
        env = {
            **os.environ,
            "VARADHI_KAFKA_CONFIG": relay_settings.kafka.source,
            "VARADHI_BOOTSTRAP": relay_settings.bootstrap,
            "VARADHI_CATALOG_TOPIC": relay_settings.catalog_topic,
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

    delta = DeltaOutbox(spark, str(tmp_path / "outbox"), name=names.outbox,
                        settings=relay_settings)  # fmt: skip
    try:
        delta.create_table()
        rows = [(topic, "g", f"delta-{i}", None, f"delta-{i}".encode()) for i in range(3)]
        delta.append(spark.createDataFrame(rows, SCHEMA).coalesce(1))
        # lacking Write on the topic, the query fails and the wait names it; granted, the same
        # batch is sent
        with (
            denied("outbox relay", "Write", "Topic", f"{topic}.0"),
            pytest.raises(NotAuthorized) as refused,
        ):
            delta.await_termination(delta.start(available_now=True), 300)
        assert str(refused.value) == str(
            NotAuthorized("Write", "Topic", f"{topic}.0", "User:acl-outbox-relay")
        )
        query = delta.start(available_now=True)
        assert delta.await_termination(query, 300), "the outbox query did not finish"
        assert query.exception() is None, query.exception()
    finally:
        delta.close()
    assert [r["value"] for r in read_queue(settings_of("verify"), f"{topic}.0")] == [
        f"{source}-{i}".encode() for source in ("sql", "delta") for i in range(3)
    ]
