"""Endpoint health in a library member (`varadhi.library.suspension`): when it suspends the
subscription, when its probe ends the suspension, and what holds it."""

from __future__ import annotations

import pytest

from varadhi.kafka.subscriptions import Suspension
from varadhi.library.suspension import NOTHING, Step, holds, step

PROBE = Suspension("every attempt failed for 60 s", 1, -1, "probe", "vm-1-a")
OPERATOR = Suspension("every attempt failed for 60 s", 1, -1, "operator", "vm-1-a")
DUE = "every attempt to the endpoint failed for 60 s"


def test_a_member_suspends_once_every_attempt_failed_for_suspend_after():
    assert step(None, False, DUE, "open", True) == Step("suspend", DUE)
    assert step(None, False, None, "open", True) == NOTHING  # not long enough yet


def test_a_suspension_another_member_recorded_stays_whatever_this_member_counts():
    assert step(OPERATOR, True, DUE, "open", True) == NOTHING
    assert step(OPERATOR, False, None, "closed", False) == NOTHING  # only a resume ends it
    assert step(PROBE, True, DUE, "half_open", True) == NOTHING  # its probes decide


def test_a_probe_suspension_ends_once_the_circuit_closed_with_no_failure_since():
    assert step(PROBE, True, None, "closed", False) == Step("end")
    assert step(PROBE, True, None, "closed", True) == NOTHING  # closed, still failing
    # a member started during a suspension knows of no failure: it ends it, as a restarted
    # probing shard does (suspended again `suspend_after` later if the endpoint still fails)
    assert step(PROBE, False, None, "closed", False) == Step("end")


def test_a_suspension_ended_by_a_resume_or_another_member_starts_the_count_afresh():
    assert step(None, True, DUE, "open", True) == Step("resumed")
    assert step(None, True, None, "closed", False) == Step("resumed")


@pytest.mark.parametrize(("suspended", "held"), [(None, False), (PROBE, False), (OPERATOR, True)])
def test_only_an_operator_suspension_holds_a_member_probe_ones_leave_it_to_the_circuit(
    suspended, held
):
    assert holds(suspended) is held


def test_a_member_suspension_names_the_member_and_reads_back():
    doc = PROBE.to_dict()
    assert doc["member"] == "vm-1-a" and doc["shard"] == -1
    assert Suspension.from_dict(doc) == PROBE and PROBE.by == "member vm-1-a"
    shard = Suspension("r", 1, 2, "probe")
    assert "member" not in shard.to_dict() and shard.by == "shard 2"
    assert Suspension.from_dict(shard.to_dict()) == shard
