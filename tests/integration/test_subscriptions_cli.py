"""`varadhi subscription ...` against the real local Kafka broker and a per-run catalog topic.

Every refusal is checked to leave both the catalog and Kafka exactly as they were.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient

from varadhi import cli
from varadhi.core.subscription_spec import spec_to_dict
from varadhi.kafka.subscriptions import KIND
from varadhi.kafka.topics import TopicService
from varadhi.testing.endpoint import TEST_WHSEC, TEST_WHSEC_ENV
from varadhi.testing.oauth_server import TEST_CLIENT_SECRET, TEST_CLIENT_SECRET_ENV

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def admin(bootstrap):
    client = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="test-subscriptions-cli")
    yield client
    client.close()


@pytest.fixture(scope="module")
def snapshot(catalog, settings):
    """snapshot() -> the catalog once every committed transaction is visible to it.

    A read_committed reader sees a transaction only when its commit marker is written, a moment
    after the writer's commit returned; the CLI under test commits and exits, so wait until the
    last stable offset reaches the log end before reading.
    """
    tp = TopicPartition(settings.catalog_topic, 0)
    raw = KafkaConsumer(bootstrap_servers=settings.bootstrap, isolation_level="read_uncommitted")
    committed = KafkaConsumer(
        bootstrap_servers=settings.bootstrap, isolation_level="read_committed"
    )

    def read():
        deadline = time.monotonic() + 60  # Kafka work on a loaded machine
        while committed.end_offsets([tp])[tp] < raw.end_offsets([tp])[tp]:
            assert time.monotonic() < deadline, "a catalog transaction stayed open"
            time.sleep(0.01)
        return catalog.snapshot()

    yield read
    raw.close()
    committed.close()


@pytest.fixture
def stored(snapshot):
    """stored(name) -> the subscription's catalog document (None if absent)."""
    return lambda name, kind=KIND: snapshot().get(kind, name)


@pytest.fixture
def kafka_partitions(admin):
    """Partition count of a Kafka topic, or None if it does not exist."""

    def count(name: str) -> int | None:
        if name not in admin.list_topics():
            return None
        return len(admin.describe_topics([name])[0]["partitions"])

    return count


@pytest.fixture
def run(bootstrap, capsys):
    """Run the CLI in-process: run(*args) -> (exit code, stdout, stderr)."""

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(["--bootstrap", bootstrap, *args])
        out, err = capsys.readouterr()
        return code, out, err

    return invoke


@pytest.fixture
def make_topic(catalog, snapshot, unique_name):
    """make_topic(partitions) -> the name of a fresh composite topic, visible to the CLI."""

    def make(partitions: int, allow_uneven: bool = False) -> str:
        name = unique_name("mq")
        TopicService(catalog).create(name, partitions, allow_uneven)
        snapshot()
        return name

    return make


@pytest.fixture
def write_yaml(tmp_path):
    def write(doc) -> str:
        path = tmp_path / f"sub-{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    return write


@pytest.fixture
def unchanged(snapshot, kafka_partitions):
    """unchanged(sub_name) -> a context that asserts the catalog and Kafka did not change."""

    class Unchanged:
        def __init__(self, name: str):
            self.name = name

        def state(self):
            snap = snapshot()
            kafka = [kafka_partitions(f"{self.name}.{q}.0") for q in ("rq", "dlq")]
            return snap.items(KIND), snap.items("topic"), kafka

        def __enter__(self):
            self.before = self.state()
            return self

        def __exit__(self, *exc):
            if exc[0] is None:
                assert self.state() == self.before

    return Unchanged


def refused(result: tuple[int, str, str], *fragments: str) -> str:
    code, out, err = result
    assert code == 2, (out, err)
    assert out == ""
    message = err.strip()
    assert "\n" not in message and message.startswith("varadhi: ")
    for fragment in fragments:
        assert fragment in message
    return message


# -- create -------------------------------------------------------------------------------------


def test_create_makes_queues_and_records_the_subscription(
    run, stored, make_topic, unique_name, kafka_partitions
):
    topic = make_topic(4)
    name = unique_name("sub")
    code, out, err = run(
        "subscription", "create", name, "--topic", topic, "--endpoint", "http://127.0.0.1:9/in",
        "--shards", "2", "--max-attempts", "3", "--min-backoff", "250ms", "--auth-env", "VARADHI_ENDPOINT_TOKEN",
    )  # fmt: skip
    assert code == 0, err
    assert f"created subscription {name}" in out
    assert kafka_partitions(f"{name}.rq.0") == 4
    assert kafka_partitions(f"{name}.dlq.0") == 2

    doc = stored(name)
    assert set(doc) == {"spec", "state"}
    assert doc["state"]["shard_count"] == 2
    assert doc["state"]["paused"] is False and doc["state"]["generation"] == 0
    assert doc["state"]["created_ms"] > 0
    spec = doc["spec"]
    assert (spec["topic"], spec["shards"], spec["grouped"]) == (topic, 2, True)
    assert (spec["rq_partitions"], spec["dlq_partitions"]) == (4, 2)
    assert spec["retry"]["max_attempts"] == 3 and spec["retry"]["min_backoff"] == 250
    assert spec["endpoint"]["auth_env"] == "VARADHI_ENDPOINT_TOKEN"
    for queue, partitions in (("rq", 4), ("dlq", 2)):
        t = stored(f"{name}.{queue}", "topic")
        assert t["internal"] is True
        assert [st["partitions"] for st in t["storage_topics"]] == [partitions]


def test_create_with_explicit_partitions_ungrouped_and_uneven(
    run, stored, make_topic, unique_name, kafka_partitions
):
    topic = make_topic(4)
    name = unique_name("sub")
    code, _, err = run(
        "subscription", "create", name, "--topic", topic, "--endpoint", "https://h.example/x",
        "--shards", "3", "--allow-uneven", "--ungrouped", "--rq-partitions", "6",
        "--dlq-partitions", "9", "--on-dead-letter", "skip", "--backoff", "fixed",
        "--batch", "20", "--runtime", "library",
    )  # fmt: skip
    assert code == 0, err
    assert (kafka_partitions(f"{name}.rq.0"), kafka_partitions(f"{name}.dlq.0")) == (6, 9)
    spec = stored(name)["spec"]
    assert spec["grouped"] is False and spec["allow_uneven"] is True
    assert spec["on_dead_letter"] == "skip" and spec["retry"]["backoff"] == "fixed"
    assert spec["runtime"] == "library"
    assert spec["delivery"] == {
        "mode": "batch", "max_messages": 20, "max_bytes": 1048576, "format": "ndjson"
    }  # fmt: skip
    code, out, _ = run("subscription", "describe", name)
    assert code == 0
    assert "delivery      batch: up to 20 messages, 1048576 bytes, ndjson" in out
    assert "runtime       library" in out

    code, out, _ = run("subscription", "describe", name, "--output", "json")
    assert code == 0
    shards = json.loads(out)["shards"]
    assert [s["mq"][0]["partitions"] for s in shards] == [[0], [1], [2, 3]]
    assert [s["rq"][0]["partitions"] for s in shards] == [[0, 1], [2, 3], [4, 5]]


def test_create_twice_is_refused(run, make_topic, unique_name, unchanged):
    topic = make_topic(2)
    name = unique_name("sub")
    args = ("subscription", "create", name, "--topic", topic, "--endpoint", "http://h/x")
    assert run(*args, "--shards", "1")[0] == 0
    with unchanged(name):
        refused(run(*args, "--shards", "1"), "already exists")


def test_create_finishes_after_a_crash_between_queues_and_record(
    run, catalog, stored, make_topic, unique_name, kafka_partitions
):
    topic = make_topic(4)
    name = unique_name("sub")
    # What a create that died after making its internal queues leaves behind.
    TopicService(catalog).create(f"{name}.rq", 4, internal=True)
    TopicService(catalog).create(f"{name}.dlq", 2, internal=True)
    stored(f"{name}.dlq", "topic")
    code, _, err = run(
        "subscription", "create", name, "--topic", topic, "--endpoint", "http://h/x",
        "--shards", "2",
    )  # fmt: skip
    assert code == 0, err
    assert stored(name)["state"]["shard_count"] == 2
    assert kafka_partitions(f"{name}.rq.0") == 4


def test_create_refuses_leftover_queues_of_other_settings(
    run, catalog, make_topic, unique_name, unchanged
):
    topic = make_topic(4)
    name = unique_name("sub")
    TopicService(catalog).create(f"{name}.rq", 8, internal=True)
    with unchanged(name):  # (its snapshot waits until the queue is visible)
        refused(
            run(
                "subscription", "create", name, "--topic", topic, "--endpoint", "http://h/x",
                "--shards", "2",
            ),
            "rq_partitions",
            "rq_partitions: 8",
        )  # fmt: skip


# -- refusals leave everything unchanged --------------------------------------------------------


@pytest.mark.parametrize(
    "extra,fragments",
    [
        (("--shards", "3"), ("shards:", "does not divide the 4 partitions", "--allow-uneven")),
        (("--shards", "8", "--allow-uneven"), ("shards:", "exceed")),
        (("--shards", "2", "--rq-partitions", "3"), ("rq_partitions:", "multiple of shards")),
        (("--shards", "2", "--max-attempts", "0"), ("retry.max_attempts:",)),
        (("--shards", "2", "--min-backoff", "soon"), ("retry.min_backoff:",)),
        (("--shards", "2", "--min-backoff", "2m"), ("retry.max_backoff:",)),
        (("--shards", "0"), ("shards:",)),
        (("--shards", "2", "--auth-env", "not-a-var"), ("endpoint.auth_env:",)),
        # A platform secret (issue 29, part 7): only names under VARADHI_ENDPOINT_ by default
        (
            ("--shards", "2", "--auth-env", "AWS_SECRET_ACCESS_KEY"),
            ("endpoint.auth_env:", "VARADHI_ENDPOINT_"),
        ),
        (
            ("--shards", "2", "--auth-env", "VARADHI_KAFKA_SASL_PASSWORD"),
            ("endpoint.auth_env:", "Kafka"),
        ),
        (("--shards", "2", "--batch", "0"), ("delivery.max_messages:", "at least 1")),
    ],
)
def test_create_refusals_change_nothing(run, make_topic, unique_name, unchanged, extra, fragments):
    topic = make_topic(4)
    name = unique_name("sub")
    with unchanged(name):
        refused(
            run(
                "subscription", "create", name, "--topic", topic, "--endpoint", "http://h/x", *extra
            ),
            *fragments,
        )


def test_create_refuses_unknown_topic(run, unique_name, unchanged):
    name = unique_name("sub")
    missing = unique_name("nope")
    with unchanged(name):
        refused(
            run(
                "subscription", "create", name, "--topic", missing, "--endpoint", "http://h/x",
                "--shards", "1",
            ),
            "topic:",
            missing,
            "does not exist",
        )  # fmt: skip


def test_create_refuses_a_bad_endpoint(run, make_topic, unique_name, unchanged):
    topic = make_topic(1)
    name = unique_name("sub")
    with unchanged(name):
        refused(
            run(
                "subscription", "create", name, "--topic", topic, "--endpoint", "ftp://h/x",
                "--shards", "1",
            ),
            "endpoint.url:",
        )  # fmt: skip


# -- describe, list -----------------------------------------------------------------------------


def test_describe_and_list(run, make_topic, unique_name, bootstrap):
    topic = make_topic(4)
    name = unique_name("sub")
    assert run(
        "subscription", "create", name, "--topic", topic, "--endpoint", "http://h/x",
        "--shards", "2",
    )[0] == 0  # fmt: skip
    # One failed message in RQ partition 3 (shard 1's range) shows in the end offsets.
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    producer.send(f"{name}.rq.0", b"m", key=b"g", partition=3).get(timeout=30)
    producer.close()

    code, out, err = run("subscription", "describe", name, "--output", "json")
    assert code == 0, err
    info = json.loads(out)
    assert info["name"] == name
    assert info["spec"]["topic"] == topic
    assert info["state"]["paused"] is False and info["state"]["shard_count"] == 2
    assert info["topic"]["name"] == topic
    (rq,) = info["rq"]["storage_topics"]
    assert (rq["name"], rq["partitions"], rq["end_offsets"]) == (f"{name}.rq.0", 4, [0, 0, 0, 1])
    assert rq["messages"] == 1
    (dlq,) = info["dlq"]["storage_topics"]
    assert dlq["end_offsets"] == [0, 0]
    assert info["shards"] == [
        {
            "shard": s,
            "mq": [{"storage_topic_idx": 0, "storage_topic": f"{topic}.0", "partitions": mq}],
            "rq": [{"storage_topic_idx": 0, "storage_topic": f"{name}.rq.0", "partitions": rq}],
            "dlq": [{"storage_topic_idx": 0, "storage_topic": f"{name}.dlq.0", "partitions": d}],
        }
        for s, mq, rq, d in ((0, [0, 1], [0, 1], [0]), (1, [2, 3], [2, 3], [1]))
    ]

    code, out, _ = run("subscription", "describe", name)
    assert code == 0
    assert f"subscription  {name}" in out and "1 messages written" in out
    assert "delivery      single" in out and "trace         off" in out
    assert f"{topic}.0[2, 3]" in out

    code, out, _ = run("subscription", "list", "--output", "json")
    assert code == 0
    listed = {d["spec"]["name"]: d for d in json.loads(out)}
    assert listed[name]["state"]["shard_count"] == 2
    code, out, _ = run("subscription", "list")
    assert code == 0 and name in out and out.startswith("NAME")


def test_describe_unknown(run, unique_name):
    refused(run("subscription", "describe", unique_name("nope")), "does not exist")


# -- apply --------------------------------------------------------------------------------------


def test_apply_creates_then_updates_allowed_fields(
    run, stored, make_topic, unique_name, write_yaml, kafka_partitions
):
    topic = make_topic(4)
    name = unique_name("sub")
    doc = {"name": name, "topic": topic, "endpoint": {"url": "http://h/v1"}, "shards": 2}
    path = write_yaml(doc)
    code, out, err = run("subscription", "apply", "-f", path)
    assert code == 0, err
    assert out.startswith(f"created subscription {name}")
    assert kafka_partitions(f"{name}.rq.0") == 4
    created = stored(name)

    signing = [{"scheme": "v1", "env": TEST_WHSEC_ENV}]
    doc.update(
        endpoint={
            "url": "http://h/v2",
            "headers": {"Content-Type": "application/json"},
            "signing": signing,
            "forward_headers": {"tenant": "X-Tenant"},
            "path": "/t/{header:tenant}",
            "key_header": "X-Record-Key",
            "oauth2": {
                "token_url": "https://idp.example/token",
                "client_id": "orders",
                "client_secret": {"env": TEST_CLIENT_SECRET_ENV},
            },
        },
        retry={"max_attempts": 9, "min_backoff": "2s"},
        consumption={"concurrency": 4},
        circuit_breaker={"open_for": "1m", "probes": 2},
        on_dead_letter="skip",
        dedup_window="30m",
    )
    code, out, err = run("subscription", "apply", "-f", write_yaml(doc))
    assert code == 0, err
    assert out.startswith(f"updated subscription {name}")
    updated = stored(name)
    assert updated["state"] == created["state"]
    spec = updated["spec"]
    assert spec["endpoint"]["url"] == "http://h/v2"
    assert spec["endpoint"]["headers"] == {"Content-Type": "application/json"}
    assert spec["endpoint"]["signing"] == [{"scheme": "v1", "env": TEST_WHSEC_ENV, "file": None}]
    assert spec["endpoint"]["forward_headers"] == {"tenant": "X-Tenant"}
    assert spec["endpoint"]["path"] == "/t/{header:tenant}"
    assert spec["endpoint"]["key_header"] == "X-Record-Key"
    assert spec["endpoint"]["oauth2"]["client_secret"] == {
        "env": TEST_CLIENT_SECRET_ENV,
        "file": None,
    }
    # describe shows where the keys and the client secret are, never them
    code, out, _ = run("subscription", "describe", name, "--output", "json")
    assert code == 0 and TEST_WHSEC_ENV in out and TEST_WHSEC.removeprefix("whsec_") not in out
    assert TEST_CLIENT_SECRET_ENV in out and TEST_CLIENT_SECRET not in out
    assert '"key_header": "X-Record-Key"' in out
    assert (spec["retry"]["max_attempts"], spec["retry"]["min_backoff"]) == (9, 2000)
    assert spec["consumption"]["concurrency"] == 4
    assert (spec["circuit_breaker"]["open_for"], spec["circuit_breaker"]["probes"]) == (60_000, 2)
    assert spec["circuit_breaker"]["max_open_for"] == 60_000
    assert (spec["on_dead_letter"], spec["dedup_window"]) == ("skip", 1_800_000)

    code, out, _ = run("subscription", "apply", "-f", write_yaml(doc))
    assert code == 0 and out.startswith(f"unchanged subscription {name}")
    assert stored(name) == updated


def test_apply_a_list(run, stored, make_topic, unique_name, write_yaml):
    topic = make_topic(2)
    a, b = unique_name("sub"), unique_name("sub")
    docs = [{"name": n, "topic": topic, "endpoint": {"url": "http://h/x"}} for n in (a, b)]
    code, out, err = run("subscription", "apply", "-f", write_yaml({"subscriptions": docs}))
    assert code == 0, err
    assert out.splitlines()[0].startswith(f"created subscription {a}")
    assert out.splitlines()[1].startswith(f"created subscription {b}")
    assert stored(a) and stored(b)


def test_apply_the_example_file(run, stored, make_topic, unique_name, write_yaml):
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "conf" / "subscriptions" / "example.yaml"
    doc = yaml.safe_load(example.read_text())
    doc.update(name=unique_name("sub"), topic=make_topic(4))
    code, out, err = run("subscription", "apply", "-f", write_yaml(doc))
    assert code == 0, err
    assert stored(doc["name"])["spec"]["circuit_breaker"]["open_for"] == 5000


@pytest.fixture
def existing(run, make_topic, unique_name, write_yaml):
    """An applied subscription: (its document, its YAML path)."""
    doc = {
        "name": unique_name("sub"),
        "topic": make_topic(4),
        "endpoint": {"url": "http://h/x"},
        "shards": 2,
    }
    assert run("subscription", "apply", "-f", write_yaml(doc))[0] == 0
    return doc


@pytest.mark.parametrize(
    "change,fragments",
    [
        ({"shards": 4, "rq_partitions": 8}, ("shards:", "subscription change-shards", "--to 4")),
        ({"grouped": False}, ("grouped:", "cannot change")),
        ({"rq_partitions": 8}, ("rq_partitions:", "cannot change")),
        ({"dlq_partitions": 4}, ("dlq_partitions:", "cannot change")),
        ({"retry": {"jitter": 2}}, ("retry.jitter:",)),
        ({"retry": {"responses": [{"codes": "5xx", "action": "retry"}]}}, ("retry.responses:",)),
        ({"consumption": {"error_rate_threshold": 0}}, ("consumption.error_rate_threshold:",)),
        ({"circuit_breaker": {"probes": 0}}, ("circuit_breaker.probes:",)),
        ({"endpoint": {"url": "http://h/x", "headers": {"Authorization": "Bearer x"}}},
         ("endpoint.headers.Authorization:", "auth_env")),
        ({"endpoint": {"url": "http://h/x",
                       "signing": [{"scheme": "v1", "env": "AWS_SECRET_ACCESS_KEY"}]}},
         ("endpoint.signing[0]:", "VARADHI_ENDPOINT_")),
        ({"endpoint": {"url": "http://h/x", "path": "/t/{tenant}"}},
         ("endpoint.path:", "unknown placeholder")),
        ({"endpoint": {"url": "https://h/x", "oauth2": {"token_url": "http://idp/t",
          "client_id": "c", "client_secret": {"env": "VARADHI_ENDPOINT_S"}}}},
         ("endpoint.oauth2.token_url:", "https")),
        ({"endpoint": {"url": "https://h/x", "tls": {"ca": {"env": "SSL_CERT_FILE"}}}},
         ("endpoint.tls.ca:", "VARADHI_ENDPOINT_")),
        ({"endpoint": {"url": "https://h/x", "jwt": {"algorithm": "ES256", "key_id": "k",
          "issuer": "i", "key": {"file": "/etc/ssl/private/k.pem"}}}},
         ("endpoint.jwt.key:", "VARADHI_ENDPOINT_SECRET_DIR")),
        ({"retries": 3}, ("unknown key(s) retries",)),
    ],
)  # fmt: skip
def test_apply_refusals_change_nothing(run, existing, write_yaml, unchanged, change, fragments):
    with unchanged(existing["name"]):
        refused(run("subscription", "apply", "-f", write_yaml({**existing, **change})), *fragments)


def test_apply_refuses_a_changed_topic(run, existing, make_topic, write_yaml, unchanged):
    other = make_topic(4)
    with unchanged(existing["name"]):
        refused(
            run("subscription", "apply", "-f", write_yaml({**existing, "topic": other})),
            "topic:",
            "cannot change",
        )


def test_apply_checks_every_subscription_before_applying_any(
    run, make_topic, unique_name, write_yaml, unchanged
):
    topic = make_topic(4)
    good, bad = unique_name("sub"), unique_name("sub")
    docs = [
        {"name": good, "topic": topic, "endpoint": {"url": "http://h/x"}},
        {"name": bad, "topic": unique_name("nope"), "endpoint": {"url": "http://h/x"}},
    ]
    with unchanged(good), unchanged(bad):
        refused(
            run("subscription", "apply", "-f", write_yaml({"subscriptions": docs})),
            "does not exist",
        )


def test_apply_refuses_a_name_given_twice(run, make_topic, unique_name, write_yaml, unchanged):
    topic = make_topic(4)
    name = unique_name("sub")
    doc = {"name": name, "topic": topic, "endpoint": {"url": "http://h/x"}}
    with unchanged(name):
        refused(
            run("subscription", "apply", "-f", write_yaml({"subscriptions": [doc, doc]})),
            "more than once",
        )


# -- pause / resume -----------------------------------------------------------------------------


def test_pause_and_resume_flip_the_flag(run, stored, existing):
    name = existing["name"]
    before = stored(name)
    code, out, _ = run("subscription", "pause", name)
    assert code == 0 and out.strip() == f"paused subscription {name}"
    paused = stored(name)
    assert paused["state"] == {**before["state"], "paused": True}
    assert paused["spec"] == before["spec"]
    assert run("subscription", "pause", name)[0] == 0  # idempotent
    assert stored(name)["state"]["paused"] is True

    code, out, _ = run("subscription", "resume", name)
    assert code == 0 and out.strip() == f"resumed subscription {name}"
    assert stored(name) == before


def test_pause_keeps_state_written_by_other_components(run, catalog, stored, existing):
    name = existing["name"]
    doc = stored(name)
    extended = {**doc, "state": {**doc["state"], "operation": {"kind": "offset-reset"}}}
    catalog.mutate(lambda snap: {f"{KIND}/{name}": extended})
    assert stored(name) == extended
    assert run("subscription", "pause", name)[0] == 0
    assert stored(name)["state"]["operation"] == {"kind": "offset-reset"}


def test_pause_unknown(run, unique_name):
    refused(run("subscription", "pause", unique_name("nope")), "does not exist")


def test_spec_document_in_catalog_is_spec_to_dict(stored, existing):
    from varadhi.core.subscription_spec import spec_from_dict

    stored = stored(existing["name"])["spec"]
    assert spec_to_dict(spec_from_dict(stored)) == stored


def test_help_everywhere(capsys):
    for args in (
        ["subscription"],
        ["subscription", "create"],
        ["subscription", "apply"],
        ["subscription", "describe"],
        ["subscription", "list"],
        ["subscription", "pause"],
        ["subscription", "resume"],
    ):
        with pytest.raises(SystemExit) as e:
            cli.main([*args, "--help"])
        assert e.value.code == 0
        assert "usage: varadhi subscription" in capsys.readouterr().out
