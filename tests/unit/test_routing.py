import random
from collections import Counter

import pytest

from varadhi.core import routing
from varadhi.kafka import producer, topics

# Known routes, computed without varadhi or mmh3 (so a change of hash, encoding or formula shows):
# h is MurmurHash3_x86_32, seed 0, of the group id's UTF-8 bytes (`s.getBytes(UTF_8)` in Java),
# from three Java implementations that agreed on every row: Guava 33.4.8
# `Hashing.murmur3_32_fixed(0).hashBytes(b).asInt()`, Commons Codec 1.19
# `MurmurHash3.hash32x86(b, 0, b.length, 0)` (both in pyspark's jars) and hash4j 0.22
# `Hashing.murmur3_32().hashBytesToInt(b)` (.jars/kafka), read unsigned
# (`Integer.toUnsignedLong`). Then, in Java long arithmetic, DESIGN.md's
# `Router(h) = (K*h) % P + (h // P) % K` and the default assignment (shard s of S owns partitions
# [s*P/S, (s+1)*P/S), so partition j is shard j / (P/S) when S divides P).
# Each row: group id, h, then for each (P, K, shard counts) of LAYOUTS: (partition, its shards).
LAYOUTS = ((12, 1, (2, 3, 4, 6)), (24, 2, (2, 3, 4, 6)), (10, 5, (2, 5)))
KNOWN_ROUTES = [
    ("", 0, (0, (0, 0, 0, 0)), (0, (0, 0, 0, 0)), (0, (0, 0))),
    ("hello", 613153351, (7, (1, 1, 2, 3)), (14, (1, 1, 2, 3)), (5, (1, 2))),
    ("g", 4052411414, (2, (0, 0, 0, 1)), (5, (0, 0, 0, 1)), (1, (0, 0))),
    ("customer-42", 220234549, (1, (0, 0, 0, 0)), (3, (0, 0, 0, 0)), (9, (1, 4))),
    ("order-1", 4117911073, (1, (0, 0, 0, 0)), (2, (0, 0, 0, 0)), (7, (1, 3))),
    ("ü-ñ", 249486141, (9, (1, 2, 3, 4)), (19, (1, 2, 3, 4)), (9, (1, 4))),
    ("größe", 3822294591, (3, (0, 0, 1, 1)), (6, (0, 0, 1, 1)), (9, (1, 4))),
    ("東京", 2529104194, (10, (1, 2, 3, 5)), (21, (1, 2, 3, 5)), (4, (0, 2))),
    ("🦊", 822772547, (11, (1, 2, 3, 5)), (23, (1, 2, 3, 5)), (9, (1, 4))),
    ("caf\u00e9", 605818632, (0, (0, 0, 0, 0)), (1, (0, 0, 0, 0)), (3, (0, 1))),  # é: NFC
    ("cafe\u0301", 3014779529, (5, (0, 1, 1, 2)), (11, (0, 1, 1, 2)), (7, (1, 3))),  # NFD
]


@pytest.mark.parametrize("group, h, routes", [(g, h, r) for g, h, *r in KNOWN_ROUTES])
def test_known_routes_of_group_ids(group, h, routes):
    assert routing.group_hash(group) == h
    for (p, k, counts), (partition, shards) in zip(LAYOUTS, routes, strict=True):
        assert routing.route_group(group, p, k) == partition, (p, k)
        assert [routing.shard_of_partition(partition, s, p) for s in counts] == list(shards), (p, k)


@pytest.mark.parametrize("group, routes", [(g, r) for g, _, *r in KNOWN_ROUTES if g])
def test_a_producer_sends_a_group_where_the_known_routes_say(group, routes):
    """The producer's choice on composite topics grown 12 -> 24 and 2 -> 10 partitions (K 2, 5)."""
    grown_from = {24: 12, 10: 2}  # the first storage topic's partition count
    for (p, k, _), (partition, _) in zip(LAYOUTS[1:], routes[1:], strict=True):
        topic = topics.new_topic("orders", grown_from[p])
        topic, _ = topics.add_storage(topic, p, allow_uneven=True)  # 10: uneven for 3 shards
        topic = topics.switch_produce(topic, now_ms=0)
        assert (topic.produce_topic.partitions, topic.produce_topic.k) == (p, k)
        assert producer.plan(topic, group) == ("orders.1", partition)
        assert producer.RouteCache(topic).partition(group) == partition


def test_group_hash_is_unsigned_murmur3_of_utf8():
    # Reference values of MurmurHash3_x86_32 with seed 0.
    assert routing.group_hash("") == 0
    assert routing.group_hash("hello") == 613153351
    h = routing.group_hash("grüße")
    assert 0 <= h < 2**32


@pytest.mark.parametrize("p,k", [(1, 1), (2, 1), (10, 5), (12, 3), (7, 1), (24, 4)])
def test_route_is_in_range_and_matches_formula(p, k):
    rng = random.Random(7)
    for _ in range(2000):
        h = rng.randrange(2**32)
        r = routing.route(h, p, k)
        assert 0 <= r < p
        assert r == (k * h) % p + (h // p) % k


def test_route_rejects_non_positive():
    with pytest.raises(ValueError):
        routing.route(1, 0, 1)
    with pytest.raises(ValueError):
        routing.route(1, 4, 0)


@pytest.mark.parametrize(
    "chain,shards",
    [([2, 10], 2), ([4, 12, 24], 4), ([3, 6, 12], 3), ([6, 12], 6), ([4, 8], 2)],
)
def test_shard_consistency_across_compatible_storage_topics(chain, shards):
    """A group's shard is the same on every storage topic of compatible K."""
    topics = []
    k = 1
    for i, p in enumerate(chain):
        if i:
            k = routing.next_k(topics[-1][0], topics[-1][1], p)
        topics.append((p, k))
    rng = random.Random(1)
    for _ in range(3000):
        g = f"group-{rng.randrange(10**9)}"
        h = routing.group_hash(g)
        owners = {routing.shard_of_partition(routing.route(h, p, k), shards, p) for p, k in topics}
        assert len(owners) == 1, (g, topics)


def test_spread_is_even_for_random_keys():
    p = 12
    counts = Counter(routing.route_group(f"k{i}", p, 1) for i in range(120_000))
    expected = 120_000 / p
    assert set(counts) == set(range(p))
    assert all(abs(c - expected) / expected < 0.05 for c in counts.values())


def test_spread_is_even_on_a_scaled_topic():
    counts = Counter(routing.route_group(f"k{i}", 10, 5) for i in range(100_000))
    assert set(counts) == set(range(10))
    assert all(abs(c - 10_000) / 10_000 < 0.06 for c in counts.values())


@pytest.mark.parametrize(
    "prev,prev_k,new,k",
    [
        (2, 1, 10, 5),
        (2, 1, 2, 1),
        (7, 1, 10, 1),
        (10, 5, 20, 10),
        (10, 5, 7, 1),
        (4, 1, 12, 3),
        (6, 2, 9, 3),
    ],
)
def test_k_rule(prev, prev_k, new, k):
    assert routing.next_k(prev, prev_k, new) == k


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8, 12, 18, 24, 36, 48, 60])
def test_even_partition_counts_allowed(p):
    assert routing.is_even_partition_count(p)


@pytest.mark.parametrize("p", [0, 5, 7, 10, 14, 22, -4])
def test_uneven_partition_counts_refused(p):
    assert not routing.is_even_partition_count(p)


def test_shard_assignment_ranges():
    assert routing.assignment(2, 12) == [list(range(0, 6)), list(range(6, 12))]
    assert routing.assignment(3, 12) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # uneven assignments are representable
    assert routing.assignment(3, 7) == [[0, 1], [2, 3], [4, 5, 6]]
    assert routing.assignment(4, 2) == [[], [0], [], [1]]
    for s in range(1, 13):
        flat = [p for part in routing.assignment(s, 12) for p in part]
        assert flat == list(range(12))


def test_internal_partition_stays_in_the_shards_range():
    owned = [4, 5, 6, 7]
    for h in range(100):
        assert routing.internal_partition(h, owned) in owned
    with pytest.raises(ValueError):
        routing.internal_partition(1, [])
