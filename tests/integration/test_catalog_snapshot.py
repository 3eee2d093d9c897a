"""`Catalog.snapshot(max_age_s)` against the real broker: what a read that began within the age
found is reused without a request to Kafka (so another writer's newer commit is not seen yet);
without an age, or once the last read is older, the snapshot reads what is new. A shard's
micro-batch relies on it to read the catalog once, in its lease check, not twice."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from varadhi.kafka.catalog import Catalog

pytestmark = pytest.mark.kafka


def test_a_snapshot_within_its_age_reuses_the_last_read(settings, unique_name):
    mine = replace(settings, catalog_topic=f"__varadhi_catalog_{unique_name('snapshot')}")
    reader, writer = Catalog(mine), Catalog(mine)
    try:
        assert reader.snapshot().get("test", "a") is None
        writer.mutate(lambda _snapshot: {"test/a": {"v": 1}})
        assert reader.snapshot(max_age_s=60).get("test", "a") is None  # no request: not seen
        assert reader.snapshot().get("test", "a") == {"v": 1}  # no age: read
        writer.mutate(lambda _snapshot: {"test/a": {"v": 2}})
        time.sleep(0.3)
        assert reader.snapshot(max_age_s=0.2).get("test", "a") == {"v": 2}  # older: read
    finally:
        reader.close()
        writer.close()
