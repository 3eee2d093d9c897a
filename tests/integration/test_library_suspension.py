"""Endpoint health in the library runtime (`varadhi.library.suspension`) against the real broker
and a real HTTP endpoint: a member whose every attempt failed for `circuit_breaker.suspend_after`
suspends the subscription (recorded in the catalog with its member id, shown by `status`); under
`resume: operator` it then reads and sends nothing, even once the endpoint is healthy, until a
resume, and delivers everything afterwards, each key in order; under `resume: probe` its
circuit's probes find the endpoint healthy and it ends the suspension itself."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from varadhi.cli import main as cli
from varadhi.core.policies import CircuitPolicy, Endpoint
from varadhi.kafka.progress import member_documents, progress_documents
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.library import Consumer
from varadhi.ops import status
from varadhi.testing.endpoint import TestEndpoint
from varadhi.testing.library import FAST_RETRY, lost, order_violations, produce_rounds, wait_for
from varadhi.testing.library import subscription_spec as library_spec

pytestmark = pytest.mark.kafka

#: Retried about every 200 ms and never dead-lettered here: every message waits out the outage.
RETRY = replace(FAST_RETRY, max_backoff_ms=200, max_attempts=1_000)


def _keys(ids: list[str]) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for msg_id in ids:
        keys.setdefault(msg_id.split("-")[0], []).append(msg_id)
    return keys


def _failing(settings, catalog, topic: str, name: str, endpoint: TestEndpoint, policy):
    """A library subscription of `topic` with the circuit `policy`, its endpoint answering 503
    to everything until healed (`endpoint.outage(0)`), and messages of 6 keys produced: the
    spec and the ids in produce order."""
    spec = library_spec(
        name, topic, Endpoint(endpoint.url + "/hook"), circuit_breaker=policy, retry=RETRY
    )
    SubscriptionService(catalog).create(spec)
    endpoint.outage(3_600)
    return spec, produce_rounds(settings, spec.topic, groups=6, start=0, stop=3)


def test_a_member_suspends_on_sustained_failure_and_holds_everything_until_a_resume(
    settings, catalog, make_topic, unique_name, capsys
):
    policy = CircuitPolicy(enabled=False, suspend_after_ms=1_500, resume="operator")
    with TestEndpoint() as endpoint:
        spec, ids = _failing(settings, catalog, make_topic(4), unique_name("lib"), endpoint, policy)
        service = SubscriptionService(catalog)
        consumer = Consumer(spec.name, settings).start()
        try:
            member = consumer.health()["member"]
            wait_for(lambda: consumer.health()["state"] == "suspended", "the suspension", consumer)
            suspended = service.get(spec.name).suspended
            assert suspended is not None and suspended.member == member, suspended
            assert suspended.resume == "operator" and suspended.shard == -1, suspended
            assert suspended.reason.startswith("every attempt to the endpoint failed for ")
            assert consumer.counters()["suspended"] == 1
            assert consumer.health()["suspended"] == suspended.to_dict()
            assert status.collect(catalog, spec.name)["suspended"] == suspended.to_dict()
            assert cli(["status", spec.name]) == 0
            assert f"by member {member}" in capsys.readouterr().out

            # Healthy again, but suspended: the member reads and sends nothing. The evidence is
            # its own report, made after the heal (a report goes out every 5 s), that it is
            # suspended with nothing in flight, and nothing delivered by then.
            endpoint.outage(0)
            healed_ms = int(time.time() * 1000)
            read = consumer.counters()["read"]

            def reported_suspended_since_the_heal() -> bool:
                found = progress_documents(settings, spec.name, None, healed_ms)
                doc = member_documents(found).get(member, {})
                return (
                    doc.get("state") == "suspended"
                    and doc["updated_ms"] > healed_ms + 1_000
                    and doc["counters"]["in_flight"] == 0
                )

            wait_for(reported_suspended_since_the_heal, "a report while suspended", consumer)
            assert [r for r in endpoint.records() if r.status < 300] == []
            assert consumer.counters()["read"] == read  # reading paused too

            assert cli(["subscription", "resume", spec.name]) == 0
            wait_for(
                lambda: not lost(ids, endpoint.records(), []), "every message delivered", consumer
            )
            assert service.get(spec.name).suspended is None
            assert consumer.health()["state"] == "running"
            assert consumer.counters()["suspended"] == 0
            assert order_violations(endpoint.records(), _keys(ids)) == []
        finally:
            consumer.stop()
        assert consumer.health()["state"] == "stopped", consumer.health()


def test_a_probe_suspension_ends_when_the_members_circuit_finds_the_endpoint_healthy(
    settings, catalog, make_topic, unique_name
):
    policy = CircuitPolicy(
        min_requests=5,
        window_ms=10_000,
        open_for_ms=500,
        max_open_for_ms=1_000,
        probes=2,
        suspend_after_ms=1_500,
        resume="probe",
    )
    with TestEndpoint() as endpoint:
        spec, ids = _failing(settings, catalog, make_topic(4), unique_name("lib"), endpoint, policy)
        service = SubscriptionService(catalog)
        consumer = Consumer(spec.name, settings).start()
        try:
            wait_for(lambda: consumer.health()["state"] == "suspended", "the suspension", consumer)
            suspended = service.get(spec.name).suspended
            assert suspended is not None and suspended.resume == "probe", suspended
            assert suspended.member == consumer.health()["member"], suspended
            endpoint.outage(0)
            wait_for(
                lambda: service.get(spec.name).suspended is None,
                "the suspension ended by a probe",
                consumer,
            )
            wait_for(
                lambda: not lost(ids, endpoint.records(), []), "every message delivered", consumer
            )
            # the member notes the end right after it wrote it to the catalog: waited for, not
            # asserted at once (a CI run read the counter between the two)
            wait_for(lambda: consumer.counters()["suspended"] == 0, "the member's end", consumer)
            assert order_violations(endpoint.records(), _keys(ids)) == []
        finally:
            consumer.stop()
