"""Composite topic model (seed 000): names, partition counts, K, add-storage and switch-produce."""

import pytest

from varadhi.core import names, routing
from varadhi.core.errors import InvalidArgument
from varadhi.kafka import topics


def chain(*counts: int, allow_uneven: bool = True) -> tuple[topics.CompositeTopic, list]:
    """A topic with storage topics of `counts` partitions, and the add-storage reports."""
    topic = topics.new_topic("orders", counts[0], allow_uneven=allow_uneven)
    reports = []
    for p in counts[1:]:
        topic, report = topics.add_storage(topic, p, allow_uneven=allow_uneven)
        reports.append(report)
    return topic, reports


def test_new_topic_has_one_storage_topic_with_k_1():
    topic = topics.new_topic("orders", 4)
    assert topic.storage_topics == (topics.StorageTopic("orders.0", 4, 1),)
    assert topic.produce_pointer == 0
    assert topic.produce_topic.name == "orders.0"
    assert topic.switched_at_ms == (None,)


def test_two_then_ten_partitions_gives_k_5():
    topic, [report] = chain(2, 10)
    assert topic.storage_topics[1] == topics.StorageTopic("orders.1", 10, 5)
    assert report.compatible
    assert "K=5" in report.describe()


@pytest.mark.parametrize(
    "counts,ks",
    [
        ((2, 12), [1, 6]),
        ((2, 10, 20), [1, 5, 10]),
        ((4, 12, 24), [1, 3, 6]),
        ((3, 6, 12), [1, 2, 4]),
        ((6, 6), [1, 1]),
        ((2, 10, 2), [1, 5, 1]),  # back to the base count: still shard-consistent
    ],
)
def test_k_follows_the_base_partition_count(counts, ks):
    topic, reports = chain(*counts)
    assert [st.k for st in topic.storage_topics] == ks
    assert all(r.compatible for r in reports)


@pytest.mark.parametrize("counts", [(2, 3), (4, 6), (4, 2), (2, 10, 7), (6, 4)])
def test_a_non_multiple_gives_k_1_and_is_reported_as_a_partition_change(counts):
    topic, reports = chain(*counts)
    assert topic.storage_topics[-1].k == 1
    assert not reports[-1].compatible
    assert "partition change" in reports[-1].describe()
    assert "stop at the end of the previous storage topic" in reports[-1].describe()


def test_k_after_a_partition_change_starts_from_the_new_base():
    topic, reports = chain(2, 7, 14)  # 7 resets K; 14 is a multiple of the new base 7
    assert [st.k for st in topic.storage_topics] == [1, 1, 2]
    assert [r.compatible for r in reports] == [False, True]


def test_compatible_k_keeps_every_group_on_its_old_partition_block():
    topic, _ = chain(2, 12)
    old, new = topic.storage_topics
    for i in range(2000):
        h = routing.group_hash(f"g{i}")
        j = routing.route(h, old.partitions, old.k)
        assert j * new.k <= routing.route(h, new.partitions, new.k) < (j + 1) * new.k


def test_add_storage_does_not_move_the_produce_pointer_and_names_storage_topics_in_order():
    topic, _ = chain(2, 4, 8)
    assert [st.name for st in topic.storage_topics] == ["orders.0", "orders.1", "orders.2"]
    assert topic.produce_pointer == 0
    assert topic.switched_at_ms == (None, None, None)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8, 12, 18, 24, 30, 48, 10_000 - 4])
def test_even_partition_counts_are_accepted(p):
    assert names.validate_partitions(p) == p


@pytest.mark.parametrize("p", [5, 7, 9, 10, 14, 22])
def test_uneven_counts_need_allow_uneven(p):
    with pytest.raises(InvalidArgument, match="--allow-uneven"):
        names.validate_partitions(p)
    assert names.validate_partitions(p, allow_uneven=True) == p
    with pytest.raises(InvalidArgument):
        topics.new_topic("orders", p)
    base = topics.new_topic("orders", 2)
    with pytest.raises(InvalidArgument):
        topics.add_storage(base, p)


@pytest.mark.parametrize("p", [0, -1, -4, True, 4.0, "4", None, names.MAX_PARTITIONS + 4])
def test_bad_partition_counts_are_refused_even_when_uneven_is_allowed(p):
    with pytest.raises(InvalidArgument, match="partitions"):
        names.validate_partitions(p, allow_uneven=True)


def test_switch_produce_moves_one_step_and_records_when():
    topic, _ = chain(2, 4, 8)
    once = topics.switch_produce(topic, now_ms=1000)
    assert once.produce_pointer == 1
    assert once.produce_topic.name == "orders.1"
    assert once.switched_at_ms == (1000, None, None)
    twice = topics.switch_produce(once, now_ms=2000)
    assert twice.produce_pointer == 2
    assert twice.switched_at_ms == (1000, 2000, None)


def test_switch_produce_stays_at_the_last_storage_topic():
    topic, _ = chain(2, 4)
    last = topics.switch_produce(topic, now_ms=1000)
    assert topics.switch_produce(last, now_ms=5000) == last
    single = topics.new_topic("orders", 2)
    assert topics.switch_produce(single, now_ms=1) == single


def test_sealed_waits_for_the_grace_period_after_a_switch():
    topic, _ = chain(2, 4)
    assert not topics.sealed(topic, 0, now_ms=10_000, grace_ms=100)  # still the produce topic
    switched = topics.switch_produce(topic, now_ms=1000)
    assert not topics.sealed(switched, 0, now_ms=1050, grace_ms=100)
    assert topics.sealed(switched, 0, now_ms=1100, grace_ms=100)
    assert not topics.sealed(switched, 1, now_ms=99_999, grace_ms=100)


def test_dict_round_trip():
    topic, _ = chain(2, 12)
    topic = topics.switch_produce(topic, now_ms=42)
    assert topics.CompositeTopic.from_dict(topic.to_dict()) == topic


@pytest.mark.parametrize("name", ["orders", "a", "Orders_2", "x-y-z", "9lives", "a" * 200])
def test_valid_names(name):
    assert names.validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "a.b", "orders.rq", "-a", "_a", "a b", "a/b", "ü", "orders\n", "a" * 201, None, 5]
)
def test_invalid_names(name):
    with pytest.raises(InvalidArgument, match="name"):
        names.validate_name(name)


def test_internal_names_are_the_subscription_queues_only():
    assert names.validate_name("orders-http.rq", internal=True)
    assert names.validate_name("orders-http.dlq", internal=True)
    for bad in ("orders", "orders.0", "orders.rq.rq"):
        with pytest.raises(InvalidArgument):
            names.validate_name(bad, internal=True)
