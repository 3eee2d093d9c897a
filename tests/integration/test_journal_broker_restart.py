"""The delivery journal's writer against a broker that dies and comes back while a task delivers
(`varadhi.spark.journal.JournalWriter`), on a broker of its own (scripts/kafka on free ports, its data
folder in tmp; the shared broker on 19092 is never touched). A task that starts while the broker
is down journals nothing until it is back; none of its entries may be lost for that: the batch's
re-run and a shard-count change's hand-over read them (docs/architecture.md, "Delivery journal").
"""

from __future__ import annotations

import time

import pytest

from varadhi.core import messages as m
from varadhi.kafka.settings import Settings
from varadhi.spark import journal
from varadhi.testing.local_broker import LocalBroker


@pytest.fixture
def broker(tmp_path):
    made = LocalBroker(tmp_path / "kafka")
    made.start()
    yield made
    made.wipe()


def test_a_task_that_starts_while_the_broker_is_down_loses_no_journal_entry(broker):
    """The broker is SIGKILLed; a task starts and delivers (its journal producer cannot even be
    made); the broker comes back before the task ends. Every accepted message is in the
    journal, and still is, for the hand-over's read, right after a second SIGKILL and restart.
    Before, the writer's first failure turned its journal off for the whole task."""
    settings = Settings(bootstrap=broker.bootstrap)
    topic = journal.topic_name("restart-http")
    partition = journal.partition_of(0, journal.ensure_topic(settings, topic, 1))
    key = journal.batch_key("restart-http.g0.s1.0.L0", 3, 1)
    target = journal.JournalTarget(broker.bootstrap, topic, partition, key, interval_ms=50)

    broker.kill()
    writer = journal.JournalWriter(target)
    for offset in range(300):  # accepted while the broker is away
        writer.accepted(m.Origin(0, 0, offset))
    broker.start()
    for offset in range(300, 400):
        writer.accepted(m.Origin(0, 0, offset))
    writer.close()

    found = journal.read(settings, topic, partition, key, since_ms=0)
    assert found.runs() == [(0, 0, 0, 399)]
    assert writer.unjournaled == 0

    # The broker SIGKILLed again and restarted: a shard-count change's hand-over reads the
    # records acknowledged before the kill (to the partition's end, or it raises).
    broker.kill()
    broker.start()
    handed = journal.read_shard(
        settings, "restart-http", 0, key, since_ms=int(time.time() * 1000) - journal.LOOKBACK_MS
    )
    assert handed.runs() == [(0, 0, 0, 399)]
