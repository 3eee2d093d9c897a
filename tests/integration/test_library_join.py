"""A library member's first join is its only one (`varadhi.library.join_guard.subscribe`): the
coordinator knows the subscription's partitions before the first poll joins, so the member does
not join again at once when the metadata arrives (a rebalance on every start, which took back
what the member had handed out: CI, a dead letter attempted twice)."""

from __future__ import annotations

import pytest

from varadhi.kafka import clients as kafka_clients
from varadhi.library import join_guard
from varadhi.library.assign import SlotAssignor

pytestmark = pytest.mark.kafka


def test_a_subscribed_member_knows_its_topics_partitions_before_it_first_joins(
    settings, topic_service, unique_name
):
    names = [unique_name("t"), unique_name("t")]
    for name in names:
        topic_service.create(name, 3)
    storage = [f"{name}.0" for name in names]
    for attempt in range(5):  # the old order lost this race nearly every time
        consumer = kafka_clients.consumer(
            settings,
            group_id=unique_name("g"),
            enable_auto_commit=False,
            partition_assignment_strategy=[SlotAssignor(1)],
        )
        try:
            join_guard.subscribe(consumer, storage, None)
            # kafka-python's snapshot the leader assigns with (its internals: what the guard
            # is about); empty, the next metadata update makes the member join again
            snapshot = consumer._coordinator._metadata_snapshot
            assert snapshot == {t: {0, 1, 2} for t in storage}, (attempt, snapshot)
        finally:
            consumer.close(autocommit=False)
