import random
from collections import Counter

import pytest

from varadhi import routing


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
