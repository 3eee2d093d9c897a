"""The library members' shared circuit (varadhi.library.shared_circuit), pure, clock injected:
counts of other members summed with a member's own, stale reports dropped, probes limited
while half-open and decided once they all ended, a heal elsewhere closing the circuit."""

from __future__ import annotations

from varadhi.core.policies import CircuitPolicy
from varadhi.library.shared_circuit import (
    PeerEvidence,
    Report,
    SharedCircuit,
    encode,
    parse,
    peer_evidence,
    report_key,
)

POLICY = CircuitPolicy(
    failure_rate=0.5, min_requests=10, window_ms=2_000, open_for_ms=1_000, probes=3
)
NONE = PeerEvidence()


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def attempts(circuit: SharedCircuit, n: int, failed: bool) -> None:
    """`n` messages handed out and ended with one attempt each."""
    for _ in range(n):
        item = circuit.admit(object)
        assert item is not None
        circuit.ended(item, failed)


def test_peer_evidence_sums_the_others_live_reports_and_drops_its_own_and_stale_ones():
    now = 50_000
    reports = [
        Report("me", now, 100, 100, None),  # its own: fed directly, never twice
        Report("a", now - 500, 6, 5, 40_000),
        Report("b", now - 2_000, 4, 4, 45_000),  # exactly window_ms old: still live
        Report("c", now - 2_001, 50, 50, 49_000),  # stale: the member may be gone
        Report("d", now, 3, 9, None),  # failures never exceed attempts
    ]
    assert peer_evidence(reports, "me", now, 2_000) == PeerEvidence(13, 12, 45_000)
    assert peer_evidence([], "me", now, 2_000) == PeerEvidence()


def test_reports_round_trip_and_other_records_are_not_reports():
    report = Report("host-1-abc", 123, 7, 2, None)
    key = report_key("orders", report.member)
    assert parse(key, encode(report), "orders") == report
    assert parse(key, encode(report), "orders2") is None  # another subscription's
    assert parse(b"orders/member/host-1-abc", encode(report), "orders") is None  # progress
    assert parse(key, None, "orders") is None  # a tombstone (subscription delete)
    assert parse(key, b"{not json", "orders") is None


def test_the_others_failures_open_a_member_that_saw_too_few_itself():
    clock = Clock()
    circuit = SharedCircuit(POLICY, clock)
    attempts(circuit, 4, failed=True)  # 4 of its own: below min_requests (10)
    assert circuit.tick(NONE) == ("closed", False)
    clock.ms += 500
    attempts(circuit, 1, failed=False)
    # another member's 6 failures arrive: 11 attempts in the window, 10 failed
    assert circuit.tick(PeerEvidence(6, 6)) == ("open", True)
    assert circuit.admit(object) is None  # open: nothing is handed out


def test_the_others_successes_keep_the_subscriptions_rate_below_the_threshold():
    clock = Clock()
    circuit = SharedCircuit(POLICY, clock)
    attempts(circuit, 10, failed=True)  # alone, 100% of 10 would open it
    assert circuit.tick(PeerEvidence(30, 0)) == ("closed", False)  # 10 of 40 failed


def test_counts_leave_the_window_as_a_shards_batches_do():
    clock = Clock()
    circuit = SharedCircuit(POLICY, clock)
    circuit.tick(PeerEvidence(9, 9))
    clock.ms += 2_001
    attempts(circuit, 2, failed=True)
    assert circuit.tick(NONE) == ("closed", False)  # the 9 left the window


def opened(clock: Clock) -> SharedCircuit:
    circuit = SharedCircuit(POLICY, clock)
    assert circuit.tick(PeerEvidence(10, 10)) == ("open", True)
    return circuit


def test_half_open_hands_out_probes_and_decides_once_they_all_ended():
    clock = Clock()
    circuit = opened(clock)
    clock.ms += 1_000
    probes = [circuit.admit(object) for _ in range(4)]
    assert probes[3] is None  # at most `probes` (3)
    circuit.ended(probes[0], False)
    # the admits moved it to half-open since the last tick; the peers' counts are no verdict
    assert circuit.tick(PeerEvidence(50, 50)) == ("half_open", True)
    circuit.ended(probes[1], False)
    assert circuit.tick(NONE) == ("half_open", False)  # one probe still in flight
    circuit.ended(probes[2], True)
    assert circuit.tick(NONE) == ("closed", True)  # 1 of 3 failed < 50%
    assert circuit.status()["healed_ms"] == clock.ms
    assert circuit.admit(object) is not None


def test_a_failed_probe_batch_opens_it_again_for_twice_as_long():
    clock = Clock()
    circuit = opened(clock)
    clock.ms += 1_000
    probes = [circuit.admit(object) for _ in range(3)]
    for p in probes:
        circuit.ended(p, True)
    assert circuit.tick(NONE) == ("open", True)  # open again: a move
    assert circuit.status()["open_until_ms"] == clock.ms + 2_000
    clock.ms += 2_000
    assert circuit.admit(object) is not None  # a new half-open spell: its own probes


def test_probes_dead_lettered_unsent_decide_nothing_and_the_next_go():
    clock = Clock()
    circuit = opened(clock)
    clock.ms += 1_000
    for _ in range(3):
        circuit.ended(circuit.admit(object), None)
    assert circuit.admit(object) is None  # the spell's probes are out until the tick
    assert circuit.tick(NONE) == ("half_open", True)
    assert circuit.admit(object) is not None


def test_a_heal_elsewhere_closes_an_open_member_but_not_with_a_heal_older_than_its_open():
    clock = Clock()
    circuit = opened(clock)
    opened_at = clock.ms
    clock.ms += 300
    assert circuit.tick(PeerEvidence(healed_ms=opened_at - 1)) == ("open", False)
    assert circuit.tick(PeerEvidence(5, 5, healed_ms=opened_at + 200)) == ("closed", True)
    assert circuit.status()["healed_ms"] == opened_at + 200
    # the heal's tick made no verdict of the counts; the window starts afresh
    assert circuit.tick(PeerEvidence(9, 9)) == ("closed", False)


def test_a_report_carries_the_counts_since_the_last_one_and_a_new_heal_at_once():
    clock = Clock()
    circuit = SharedCircuit(POLICY, clock)
    assert circuit.report("me", clock.ms, due=True) is None  # nothing ended
    attempts(circuit, 3, failed=True)
    attempts(circuit, 2, failed=False)
    assert circuit.report("me", clock.ms, due=False) is None  # not due yet
    assert circuit.report("me", clock.ms, due=True) == Report("me", clock.ms, 5, 3, None)
    assert circuit.report("me", clock.ms, due=True) is None
    circuit.tick(PeerEvidence(10, 10))
    clock.ms += 1_000
    circuit.ended(circuit.admit(object), False)
    circuit.tick(NONE)  # its probe healed it
    assert circuit.report("me", clock.ms, due=False) == Report("me", clock.ms, 1, 0, clock.ms)


def test_a_disabled_circuit_hands_everything_out_and_never_opens():
    circuit = SharedCircuit(CircuitPolicy(enabled=False), Clock())
    circuit.tick(PeerEvidence(100, 100))
    assert circuit.admit(object) is not None
    assert circuit.status()["enabled"] is False
