"""Pure parts of the producer: where a message goes, what is validated, which headers it carries,
and the CLI's JSON-lines reader."""

from collections import Counter

import pytest

from varadhi.cli.produce import parse_headers, read_messages
from varadhi.core import messages, routing
from varadhi.core.errors import InvalidArgument
from varadhi.kafka import topics
from varadhi.kafka.producer import Message, RouteCache, kafka_headers, plan, validate


def grown(*counts: int, switches: int = 0) -> topics.CompositeTopic:
    topic = topics.new_topic("orders", counts[0], allow_uneven=True)
    for p in counts[1:]:
        topic, _ = topics.add_storage(topic, p, allow_uneven=True)
    for i in range(switches):
        topic = topics.switch_produce(topic, now_ms=i)
    return topic


def test_grouped_plan_is_the_router_on_the_produce_topic():
    topic = grown(2, 12, switches=1)
    for i in range(500):
        g = f"customer-{i}"
        assert plan(topic, g) == ("orders.1", routing.route_group(g, 12, 6))


def test_plan_ignores_storage_topics_not_yet_switched_to():
    topic = grown(2, 12)
    assert plan(topic, "g1") == ("orders.0", routing.route_group("g1", 2, 1))


def test_a_group_stays_in_its_partition_block_across_the_switch():
    before, after = grown(2, 12), grown(2, 12, switches=1)
    for i in range(2000):
        g = f"g{i}"
        _, j = plan(before, g)
        _, q = plan(after, g)
        assert 6 * j <= q < 6 * (j + 1)


def test_grouped_plan_ignores_the_spread_counter():
    topic = grown(12)
    assert {plan(topic, "g", spread) for spread in range(50)} == {plan(topic, "g")}


def test_ungrouped_messages_go_round_robin():
    topic = grown(2, 12, switches=1)
    assert [plan(topic, None, s) for s in range(24)] == [("orders.1", s % 12) for s in range(24)]
    counts = Counter(plan(topic, None, s)[1] for s in range(1000, 13_000))
    assert set(counts.values()) == {1000}


def test_validate_encodes_and_keeps_fields():
    record = validate(Message("grüße", "g1", {"k": "v"}, "m-1"), 1000)
    assert record.value == "grüße".encode()
    assert record.key == b"g1"
    assert record.group_id == "g1"
    assert record.message_id == "m-1"
    assert record.headers == (("k", b"v"),)


def test_validate_generates_a_message_id_and_leaves_ungrouped_keyless():
    a, b = validate(Message(b"x"), 10), validate(Message(b"x"), 10)
    assert a.key is None and a.group_id is None
    assert len(a.message_id) == 32 and int(a.message_id, 16) >= 0
    assert a.message_id != b.message_id


def test_value_size_limit_is_inclusive():
    assert validate(Message(b"x" * 100), 100).value == b"x" * 100
    with pytest.raises(InvalidArgument, match="value: is 101 bytes"):
        validate(Message(b"x" * 101), 100)
    with pytest.raises(InvalidArgument, match="value"):  # the limit is on the UTF-8 bytes
        validate(Message("é" * 51), 100)


@pytest.mark.parametrize(
    "message,field",
    [
        (Message(b"x", ""), "group_id"),
        (Message(b"x", 7), "group_id"),
        (Message(None), "value"),
        (Message(12), "value"),
        (Message(bytearray(b"x")), "value"),
        (Message({"a": 1}), "value"),
        (Message(b"x", message_id=""), "message_id"),
        (Message(b"x", message_id=5), "message_id"),
        (Message(b"x", headers={"varadhi-msg-id": "spoof"}), "headers"),
        (Message(b"x", headers={"": "v"}), "headers"),
        (Message(b"x", headers={"k": 1}), "headers"),
        (Message(b"x", headers=[("k", "v")]), "headers"),
        (Message("\ud800"), "value"),
        (Message(b"x", "\udcff"), "group_id"),
    ],
)
def test_invalid_messages_are_refused_naming_the_field(message, field):
    with pytest.raises(InvalidArgument, match=f"^{field}: "):
        validate(message, 1000)


def test_kafka_headers_follow_the_wire_format():
    grouped = kafka_headers(validate(Message(b"x", "g1", {"trace": "t1"}, "m-1"), 10), 1234)
    assert dict(grouped) == {
        messages.H_MSG_ID: b"m-1",
        messages.H_PRODUCED_MS: b"1234",
        messages.H_GROUP_ID: b"g1",
        "trace": b"t1",
    }
    ungrouped = dict(kafka_headers(validate(Message(b"x", None, {}, "m-2"), 10), 5))
    assert messages.H_GROUP_ID not in ungrouped
    assert ungrouped[messages.H_MSG_ID] == b"m-2"
    assert messages.headers_to_dict(grouped)[messages.H_GROUP_ID] == "g1"


def test_jsonl_reader_parses_lines_and_skips_blank_ones():
    lines = [
        '{"value": "a", "group_id": "g1", "headers": {"k": "v"}, "message_id": "m1"}',
        "",
        '{"value": {"order": 1, "items": [1, 2]}}',
        '{"value": "b", "group_id": null}',
    ]
    got = read_messages(lines, 1000)
    assert got == [
        Message("a", "g1", {"k": "v"}, "m1"),
        Message('{"order":1,"items":[1,2]}', None, {}, None),
        Message("b", None, {}, None),
    ]


@pytest.mark.parametrize(
    "bad,why",
    [
        ("{not json", "not valid JSON"),
        ('["value"]', "expected a JSON object"),
        ('{"group_id": "g"}', "'value' is required"),
        ('{"value": null}', "'value' is required"),
        ('{"value": "x", "key": "k"}', "unknown field"),
        ('{"value": "x", "headers": ["k"]}', "'headers' must be an object"),
        ('{"value": "x", "group_id": ""}', "group_id"),
        ('{"value": "x", "group_id": 3}', "group_id"),
        ('{"value": "xxxxxxxxxxxx"}', "bytes, more than the limit"),
        ('{"value": "x", "headers": {"varadhi-group-id": "g"}}', "reserved"),
    ],
)
def test_jsonl_reader_names_the_first_bad_line(bad, why):
    lines = ['{"value": "ok"}', "", bad, "{also bad"]
    with pytest.raises(InvalidArgument, match="^line 3: ") as e:
        read_messages(lines, 10)
    assert why in str(e.value)


def test_header_flags():
    assert parse_headers(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    for bad in ("novalue", "=v"):
        with pytest.raises(InvalidArgument, match="KEY=VALUE"):
            parse_headers([bad])


def test_route_cache_is_plan_memoised_and_bounded():
    topic = grown(2, 12, switches=1)
    cache = RouteCache(topic, max_groups=50)
    assert cache.storage == "orders.1"
    for _ in range(2):
        for i in range(120):  # more groups than the bound: it starts over, still right
            g = f"g{i}"
            assert cache.partition(g) == plan(topic, g)[1]
    assert len(cache._partitions) <= 50
