"""A catalog write whose broker goes away inside its transaction ends, with an error, instead of
waiting for ever (`varadhi.kafka.catalog`), against a broker of the test's own: kafka-python's
`commit_transaction` waits without a time limit, and a shard whose lease heartbeat waited so
delivered nothing more (a three-node run with a broker killed, on a loaded machine)."""

from __future__ import annotations

import threading

import pytest

from varadhi.core import faults
from varadhi.core.errors import ConcurrentModification, KafkaUnavailable
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings
from varadhi.testing.local_broker import LocalBroker

pytestmark = pytest.mark.kafka

#: One generous deadline for a write that must end (it needs the catalog's own timeouts: a
#: commit's `timeout_s`, then the next attempt's look for the broker), on a loaded machine.
DEADLINE_S = 180


def test_a_write_whose_broker_dies_inside_its_transaction_fails_instead_of_hanging(
    tmp_path, monkeypatch
):
    broker = LocalBroker(tmp_path / "kafka")
    broker.start()
    settings = Settings(bootstrap=broker.bootstrap, catalog_topic="__cat", warehouse=str(tmp_path))
    catalog = Catalog(settings, timeout_s=5)
    try:
        catalog.mutate(lambda snap: {"topic/a": {"n": 1}})  # topic, producer, fence: all up
        crash_point = faults.crash_point

        def broker_dies(point: str) -> None:  # between the sends and the commit
            if point == "catalog_in_transaction":
                broker.kill()
            crash_point(point)

        monkeypatch.setattr(faults, "crash_point", broker_dies)
        outcome: list[BaseException | None] = []

        def write() -> None:
            try:
                catalog.mutate(lambda snap: {"topic/b": {"n": 2}})
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - the outcome the test checks
                outcome.append(e)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        writer.join(DEADLINE_S)
        assert not writer.is_alive(), f"the write still waits {DEADLINE_S} s after the broker died"
        [error] = outcome
        assert isinstance(error, KafkaUnavailable | ConcurrentModification), repr(error)
    finally:
        catalog.close()  # its clients would look for the dead broker for the rest of the run
        broker.wipe()
