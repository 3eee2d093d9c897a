"""When a shard warms its Spark up before the first batch (`varadhi.warm_up.wanted`): pure, no
JVM. The warm-up itself runs against a real session and broker in
tests/integration/test_warm_up.py."""

from __future__ import annotations

import pytest

from varadhi import warm_up


def never_asked() -> str:
    raise AssertionError("the master is asked only when the rest allows a warm-up")


IDLE, BUSY = (0.7, 2), (2.0, 2)  # 1-minute load average, cores


@pytest.mark.parametrize("master", ["local[2]", "local", "local[*]"])
def test_a_session_of_its_own_on_a_local_master_with_a_core_to_spare_is_warmed_up(master):
    assert warm_up.wanted({}, True, lambda: master, *IDLE)


@pytest.mark.parametrize("master", ["spark://10.0.0.5:7077", "yarn", "k8s://https://api:6443"])
def test_a_cluster_master_is_not(master):
    assert not warm_up.wanted({}, True, lambda: master, *IDLE)


def test_a_session_given_to_the_shard_is_not():
    """A notebook's or a test's session: the shard did not start it, so it leaves it alone."""
    assert not warm_up.wanted({}, False, never_asked, *IDLE)


def test_a_busy_machine_is_not_unless_the_environment_says_always():
    """The work moves earlier, it does not go away: with no core to spare it only competes."""
    assert not warm_up.wanted({}, True, never_asked, *BUSY)
    assert not warm_up.wanted({warm_up.ENV: "maybe"}, True, never_asked, *BUSY)
    assert warm_up.wanted({warm_up.ENV: "1"}, True, lambda: "local[2]", *BUSY)
    assert not warm_up.wanted({warm_up.ENV: "1"}, True, lambda: "yarn", *BUSY)


@pytest.mark.parametrize("off", ["0", "false", "No", " off "])
def test_the_environment_turns_it_off(off):
    assert not warm_up.wanted({warm_up.ENV: off}, True, never_asked, *IDLE)


@pytest.mark.parametrize("on", ["1", "true", "", "yes"])
def test_other_values_leave_it_on_with_a_core_to_spare(on):
    assert warm_up.wanted({warm_up.ENV: on}, True, lambda: "local[2]", *IDLE)
