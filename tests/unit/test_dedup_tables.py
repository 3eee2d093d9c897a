"""Which dedup tables a shard evicts (`varadhi.spark.dedup.owned_tables`, pure): every table of
the subscription has exactly one owner at the current shard count, so each keeps one writer."""

from __future__ import annotations

from varadhi.spark.dedup import owned_tables

TABLES = [f"s{count}/shard-{j}" for count in (2, 3, 5) for j in range(count)] + ["notes", "s2/x"]


def test_a_shard_owns_its_own_table_and_earlier_counts_tables_by_index_modulo_the_count():
    assert owned_tables(TABLES, 3, 0) == ["s2/shard-0", "s3/shard-0", "s5/shard-0", "s5/shard-3"]
    assert owned_tables(TABLES, 3, 2) == ["s3/shard-2", "s5/shard-2"]
    assert owned_tables(TABLES, 2, 1) == ["s2/shard-1", "s3/shard-1", "s5/shard-1", "s5/shard-3"]


def test_every_table_has_exactly_one_owner_at_any_count():
    for count in (1, 2, 3, 4, 7):
        owners = [t for shard in range(count) for t in owned_tables(TABLES, count, shard)]
        assert sorted(owners) == sorted(t for t in TABLES if t.startswith("s") and "shard" in t)
