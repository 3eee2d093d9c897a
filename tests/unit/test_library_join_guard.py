"""`join_guard`: a member's coordinator needs a join while a join task exists; a kafka-python
without those internals is refused, not run unguarded."""

from __future__ import annotations

import pytest

from varadhi.core.errors import VaradhiError
from varadhi.library.join_guard import guard


class Coordinator:
    def __init__(self):
        self._join_task = None
        self.rejoin_needed = False

    def need_rejoin(self):
        return self.rejoin_needed


class Client:
    def __init__(self, coordinator):
        self._coordinator = coordinator


def test_a_join_task_in_flight_or_untaken_means_a_join_is_needed():
    coordinator = Coordinator()
    guard(Client(coordinator))
    assert coordinator.need_rejoin() is False
    coordinator._join_task = object()  # the assignment snapshot caught up mid-join
    assert coordinator.need_rejoin() is True
    coordinator._join_task = None
    coordinator.rejoin_needed = True  # its own reasons still count
    assert coordinator.need_rejoin() is True


def test_a_kafka_python_without_the_join_task_is_refused():
    class Other:
        def need_rejoin(self):
            return False

    with pytest.raises(VaradhiError, match="not supported by the library runtime"):
        guard(Client(Other()))
    with pytest.raises(VaradhiError, match="install kafka-python 3.0.x"):
        guard(object())
