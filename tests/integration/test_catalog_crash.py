"""A catalog writer killed inside its transaction, against the real broker: a shard SIGKILLed
during a lease heartbeat leaves its lease writer's transaction open (no other process uses that
transactional id, so nobody fences and aborts it), and read_committed readers see nothing past
it until the broker aborts it. Every catalog reader must get through within its own wait
(`varadhi.kafka.catalog`, TRANSACTION_TIMEOUT_MS)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from varadhi.kafka.catalog import Catalog

pytestmark = pytest.mark.kafka

# A lease heartbeat's write, in a process of its own (the catalog topic from the environment).
HEARTBEAT = """
from varadhi.kafka.catalog import Catalog
Catalog(writer="lease.test/0").mutate(lambda _snapshot: {"lease/test/0": {"epoch": 1}})
"""


def test_a_writer_killed_inside_its_transaction_holds_readers_back_less_than_their_wait(
    settings, unique_name
):
    """Before, the transaction stayed open for Kafka's client default of 60 s (plus the
    broker's 10 s check): the next write's read of its own commit gave up after 30 s with
    "timed out waiting for the commit" (a chaos run's `subscription pause` exited 1 so)."""
    mine = replace(settings, catalog_topic=f"__varadhi_catalog_{unique_name('crash')}")
    env = {
        **os.environ,
        "VARADHI_BOOTSTRAP": mine.bootstrap,
        "VARADHI_CATALOG_TOPIC": mine.catalog_topic,
        "VARADHI_CRASH_AT": "catalog_in_transaction",
    }
    dead = subprocess.run(
        [sys.executable, "-c", HEARTBEAT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dead.returncode == 137, dead.stderr  # died with its transaction open
    catalog = Catalog(mine)  # waits for a commit at most 30 s (timeout_s)
    try:
        catalog.mutate(lambda _snapshot: {"test/after": {"written": True}})
        assert catalog.get("test", "after") == {"written": True}
        assert catalog.get("lease", "test/0") is None  # the dead writer's change was aborted
    finally:
        catalog.close()
