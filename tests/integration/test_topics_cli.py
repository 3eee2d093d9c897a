"""`varadhi topic ...` and `varadhi produce ...` against the real broker and the run's catalog."""

from __future__ import annotations

import json

import pytest
from kafka import KafkaConsumer

from varadhi.core import messages, routing
from varadhi.kafka import clients as kafka_clients

pytestmark = pytest.mark.kafka


def describe(varadhi_cli, name: str) -> dict:
    code, out, err = varadhi_cli("topic", "describe", name, "--output", "json")
    assert code == 0, err
    return json.loads(out)


def test_create_add_storage_switch_describe(varadhi_cli, unique_name):
    name = unique_name("cli")
    code, out, _ = varadhi_cli("topic", "create", name, "--partitions", "2")
    assert code == 0
    assert f"{name}.0 with 2 partitions" in out

    doc = describe(varadhi_cli, name)
    assert doc["produce_pointer"] == 0
    assert doc["produce_topic"] == f"{name}.0"
    assert [
        (s["name"], s["partitions"], s["k"], s["end_offsets"]) for s in doc["storage_topics"]
    ] == [(f"{name}.0", 2, 1, [0, 0])]

    code, out, err = varadhi_cli("topic", "add-storage", name, "--partitions", "12")
    assert code == 0
    assert "K=6" in out
    assert err == ""  # a compatible K: no partition-change warning

    code, out, _ = varadhi_cli("topic", "switch-produce", name)
    assert code == 0
    assert f"now produces to {name}.1" in out

    doc = describe(varadhi_cli, name)
    assert doc["produce_pointer"] == 1
    assert [(s["partitions"], s["k"]) for s in doc["storage_topics"]] == [(2, 1), (12, 6)]
    assert doc["storage_topics"][1]["end_offsets"] == [0] * 12

    code, out, _ = varadhi_cli("topic", "describe", name)
    assert code == 0
    assert f"produces to {name}.1 (produce pointer 1)" in out

    code, out, _ = varadhi_cli("topic", "list", "--output", "json")
    assert code == 0
    listed = {d["name"]: d for d in json.loads(out)}
    assert listed[name] == doc


def test_topic_list_asks_kafka_a_few_times_whatever_the_number_of_topics(
    varadhi_cli, unique_name, monkeypatch
):
    """`topic list` describes every topic of the catalog (a CI run's holds hundreds): one
    end-offsets request for them all and one read of the progress topic, not two consumers per
    topic and one per subscription (before: 87 s in a full test run)."""
    for _ in range(3):
        assert varadhi_cli("topic", "create", unique_name("many"), "--partitions", "1")[0] == 0
    consumers = []
    made = kafka_clients.consumer
    monkeypatch.setattr(
        kafka_clients, "consumer", lambda *a, **kw: consumers.append(kw) or made(*a, **kw)
    )
    code, out, _ = varadhi_cli("topic", "list", "--output", "json")
    assert code == 0 and len(json.loads(out)) >= 3
    # the catalog's reader, the topics' end offsets (the statistics' too), the progress
    assert len(consumers) <= 3, consumers


def test_add_storage_warns_about_a_partition_change(varadhi_cli, unique_name):
    name = unique_name("cli")
    assert varadhi_cli("topic", "create", name, "--partitions", "4")[0] == 0
    code, out, err = varadhi_cli(
        "topic", "add-storage", name, "--partitions", "6", "--output", "json"
    )
    assert code == 0
    assert json.loads(out) == {
        "name": f"{name}.1",
        "partitions": 6,
        "k": 1,
        "partition_change": True,
    }
    assert err.startswith("warning: ") and "partition change" in err


def test_uneven_counts_need_allow_uneven_and_refusals_change_nothing(varadhi_cli, unique_name):
    name = unique_name("cli")
    code, _, err = varadhi_cli("topic", "create", name, "--partitions", "10")
    assert code == 2
    assert err.count("\n") == 1 and "--allow-uneven" in err
    assert varadhi_cli("topic", "describe", name)[0] == 2  # nothing was created

    assert varadhi_cli("topic", "create", name, "--partitions", "2")[0] == 0
    before = describe(varadhi_cli, name)
    code, _, err = varadhi_cli("topic", "add-storage", name, "--partitions", "10")
    assert code == 2 and "cannot be sharded evenly" in err
    assert describe(varadhi_cli, name) == before

    code, out, _ = varadhi_cli("topic", "add-storage", name, "--partitions", "10", "--allow-uneven")
    assert code == 0 and "K=5" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["topic", "describe", "no-such-topic"], "topic 'no-such-topic' does not exist"),
        (["topic", "add-storage", "no-such-topic", "--partitions", "2"], "does not exist"),
        (["topic", "switch-produce", "no-such-topic"], "does not exist"),
        (["topic", "create", "bad.name", "--partitions", "2"], "not a valid name"),
        (["topic", "create", "ok-name", "--partitions", "0"], "must be a positive integer"),
        (["topic", "create", "ok-name", "--partitions", "-3"], "must be a positive integer"),
        (["topic", "create", "ok-name", "--partitions", "20000"], "at most"),
        (["produce", "no-such-topic", "--value", "x"], "topic 'no-such-topic' does not exist"),
        (["produce", "orders.rq", "--value", "x"], "internal queue"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(varadhi_cli, args, message):
    code, out, err = varadhi_cli(*args)
    assert code == 2
    assert out == ""
    assert err.startswith("varadhi: ") and err.count("\n") == 1
    assert message in err


def test_create_twice_and_switch_past_the_end_are_refused(varadhi_cli, unique_name):
    name = unique_name("cli")
    assert varadhi_cli("topic", "create", name, "--partitions", "2")[0] == 0
    code, _, err = varadhi_cli("topic", "create", name, "--partitions", "2")
    assert code == 2 and "already exists" in err
    code, _, err = varadhi_cli("topic", "switch-produce", name)
    assert code == 2 and "last storage topic" in err
    assert describe(varadhi_cli, name)["produce_pointer"] == 0


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["topic"],
        ["topic", "create"],
        ["topic", "add-storage"],
        ["topic", "switch-produce"],
        ["topic", "describe"],
        ["topic", "list"],
        ["produce"],
    ],
)
def test_help_everywhere(varadhi_cli, args):
    with pytest.raises(SystemExit) as e:
        varadhi_cli(*args, "--help")
    assert e.value.code == 0


def test_produce_value_lands_where_the_router_says(varadhi_cli, make_topic, read_records):
    name = make_topic(2, 12, switches=1)
    code, out, _ = varadhi_cli(
        "produce", name, "--group-id", "g-42", "--value", "hello", "--header", "trace=t1",
        "--message-id", "m-1", "--output", "json",
    )  # fmt: skip
    assert code == 0
    [row] = json.loads(out)
    partition = routing.route_group("g-42", 12, 6)
    assert row == {
        "storage_topic": f"{name}.1",
        "partition": partition,
        "offset": 0,
        "group_id": "g-42",
        "message_id": "m-1",
    }
    [record] = read_records(f"{name}.1")
    assert (record.partition, record.key, record.value) == (partition, b"g-42", b"hello")
    headers = messages.headers_to_dict(record.headers)
    assert headers[messages.H_MSG_ID] == "m-1"
    assert headers[messages.H_GROUP_ID] == "g-42"
    assert headers["trace"] == "t1"


def test_produce_file(varadhi_cli, make_topic, read_records, tmp_path):
    name = make_topic(4)
    lines = [json.dumps({"value": f"v{i}", "group_id": f"g{i % 3}"}) for i in range(9)]
    lines.append(json.dumps({"value": {"ungrouped": True}}))
    path = tmp_path / "messages.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = varadhi_cli("produce", name, "--file", str(path), "--output", "json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 10 and len({r["message_id"] for r in rows}) == 10
    for row in rows[:9]:
        assert row["partition"] == routing.route_group(row["group_id"], 4, 1)
    records = {(r.partition, r.offset): r for r in read_records(f"{name}.0")}
    assert len(records) == 10
    for i, row in enumerate(rows):
        record = records[(row["partition"], row["offset"])]
        expected = f"v{i}".encode() if i < 9 else b'{"ungrouped":true}'
        assert record.value == expected
        assert messages.headers_to_dict(record.headers)[messages.H_MSG_ID] == row["message_id"]


def test_produce_file_with_a_bad_line_sends_nothing(
    varadhi_cli, make_topic, read_records, tmp_path
):
    name = make_topic(2)
    path = tmp_path / "messages.jsonl"
    path.write_text('{"value": "a", "group_id": "g1"}\n{"value": "b", "group_id": ""}\n')
    code, out, err = varadhi_cli("produce", name, "--file", str(path))
    assert code == 2
    assert (
        err
        == "varadhi: line 2: group_id: must be a non-empty string (or None for an ungrouped message), got ''\n"
    )
    assert read_records(f"{name}.0", isolation="read_uncommitted") == []


def test_produce_file_transactional(varadhi_cli, make_topic, read_records, tmp_path):
    name = make_topic(2)
    path = tmp_path / "messages.jsonl"
    path.write_text(
        "".join(json.dumps({"value": f"v{i}", "group_id": "g"}) + "\n" for i in range(5))
    )
    code, out, err = varadhi_cli("produce", name, "--file", str(path), "--transactional")
    assert code == 0, err
    assert len(out.splitlines()) == 5
    assert [r.value for r in read_records(f"{name}.0")] == [f"v{i}".encode() for i in range(5)]


def test_concurrent_creates_of_one_name_exactly_one_wins(varadhi_processes, unique_name, catalog):
    from varadhi.kafka.topics import TopicService

    name = unique_name("race")
    results = varadhi_processes(
        [["topic", "create", name, "--partitions", str(p)] for p in (2, 2, 2, 4, 4, 6)]
    )
    winners = [r for r in results if r.returncode == 0]
    assert len(winners) == 1, [
        (r.args[-1], r.returncode, r.stdout, r.stderr[-300:]) for r in results
    ]
    for loser in results:
        if loser.returncode != 0:
            # kafka-python may log the fencing between the writers before our one-line refusal
            last_line = loser.stderr.splitlines()[-1]
            assert loser.returncode == 2, loser.stderr
            assert last_line.startswith("varadhi: ") and "already exists" in last_line
    topic = TopicService(catalog).get(name)
    won = int(winners[0].args[-1])
    assert [(st.name, st.partitions, st.k) for st in topic.storage_topics] == [
        (f"{name}.0", won, 1)
    ]


def test_concurrent_add_storage_never_corrupts_the_topic(
    varadhi_processes, make_topic, topic_service, bootstrap
):
    """Processes that really overlap: one wins, the others are refused. A process that starts
    after a winner finished legitimately appends the next storage topic. Either way the catalog
    must equal some serial order of the winners, with the K rule applied and the Kafka topics
    matching."""
    name = make_topic(2)
    counts = (4, 6, 8, 12, 12, 12)
    results = varadhi_processes(
        [["topic", "add-storage", name, "--partitions", str(p)] for p in counts]
    )
    winners = [r for r in results if r.returncode == 0]
    assert winners, [r.stderr for r in results]
    for loser in results:
        if loser.returncode != 0:
            assert loser.returncode == 2, loser.stderr
            assert loser.stderr.splitlines()[-1].startswith("varadhi: ")

    topic = topic_service.get(name)
    storages = topic.storage_topics
    assert storages[0].partitions == 2 and len(storages) == 1 + len(winners)
    for prev, st in zip(storages, storages[1:], strict=False):
        assert st.k == routing.next_k(prev.partitions, prev.k, st.partitions)
    said = {r.stdout.strip() for r in winners}
    assert said == {f"added {st.name}: {st.partitions} partitions, K={st.k}" for st in storages[1:]}
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        for st in storages:
            assert len(consumer.partitions_for_topic(st.name)) == st.partitions
    finally:
        consumer.close()


def test_concurrent_creates_of_different_names_all_land(varadhi_processes, unique_name, catalog):
    """Writers fence each other on the catalog; every one must still commit its own change."""
    from varadhi.kafka.topics import TopicService

    names = [unique_name("many") for _ in range(6)]
    results = varadhi_processes([["topic", "create", n, "--partitions", "2"] for n in names])
    assert [r.returncode for r in results] == [0] * 6, [r.stderr for r in results]
    known = {t.name for t in TopicService(catalog).list()}
    assert set(names) <= known
