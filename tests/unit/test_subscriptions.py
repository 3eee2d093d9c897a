import copy
import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from varadhi.cli.subscription import load_specs
from varadhi.core import subscription_spec
from varadhi.core.errors import AlreadyExists, InvalidArgument
from varadhi.core.policies import (
    DEFAULT_RESPONSES,
    BlockedPolicy,
    CircuitPolicy,
    ConsumptionPolicy,
    Endpoint,
    RequestShaping,
    ResponseRule,
    RetryPolicy,
    SecretRef,
    SigningKey,
    SubscriptionSpec,
)
from varadhi.kafka import subscriptions as subs
from varadhi.kafka.catalog import Snapshot
from varadhi.kafka.topics import CompositeTopic, StorageTopic, new_topic

EXAMPLE = Path(__file__).resolve().parents[2] / "conf" / "subscriptions" / "example.yaml"


def doc(**overrides):
    """A minimal valid document; `overrides` maps dotted paths to values (None deletes)."""
    d = {"name": "orders-http", "topic": "orders", "endpoint": {"url": "http://127.0.0.1:8080/x"}}
    for path, value in overrides.items():
        *parents, leaf = path.split("__")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return d


def parse(**overrides):
    return subscription_spec.parse_spec(doc(**overrides), source="test.yaml")


def field_of(**overrides) -> str:
    with pytest.raises(InvalidArgument) as e:
        parse(**overrides)
    assert "test.yaml" in str(e.value)
    assert "\n" not in str(e.value)
    return e.value.field


# -- parsing and defaults ---------------------------------------------------------------------


def test_minimal_document_takes_every_default():
    spec = parse()
    assert spec == SubscriptionSpec(
        name="orders-http",
        topic="orders",
        endpoint=Endpoint(url="http://127.0.0.1:8080/x"),
        rq_partitions=2,
        dlq_partitions=1,
    )
    assert spec.retry == RetryPolicy() and spec.consumption == ConsumptionPolicy()
    assert spec.circuit_breaker == CircuitPolicy()
    assert spec.retry.responses == DEFAULT_RESPONSES
    assert spec.dedup_window_ms is None and spec.allow_uneven is False


def test_internal_partition_defaults_follow_shards():
    spec = parse(shards=3)
    assert (spec.rq_partitions, spec.dlq_partitions) == (6, 3)
    spec = parse(shards=3, rq_partitions=9, dlq_partitions=12)
    assert (spec.rq_partitions, spec.dlq_partitions) == (9, 12)


def test_rq_partitions_need_not_be_an_even_count_when_they_are_a_multiple_of_shards():
    # 10 is not 1, 2, 3 or a multiple of 4 or 6, but 5 shards own 2 partitions each.
    assert parse(shards=5).rq_partitions == 10


def test_full_document_is_parsed():
    spec = parse(
        endpoint={
            "url": "https://h.example/v1",
            "method": "put",
            "headers": {"X-B": "2", "Content-Type": "application/json"},
            "auth_header": "X-Api-Key",
            "auth_env": "ORDERS_TOKEN",
            "connect_timeout": "500ms",
            "request_timeout": "1m",
        },
        shards=2,
        grouped=False,
        retry={
            "max_attempts": 3,
            "backoff": "fixed",
            "min_backoff": "1s",
            "max_backoff": "1h",
            "multiplier": 3,
            "jitter": 0,
            "responses": [
                {"codes": "2xx", "action": "success"},
                {"codes": 409, "action": "success"},
                {"codes": "5xx", "action": "retry", "honour_retry_after": True},
            ],
            "in_place_window": "500ms",
            "in_place_linger": "250ms",
        },
        consumption={
            "concurrency": 4,
            "max_in_flight": 8,
            "max_messages_per_batch": 1000,
            "trigger_interval": 0,
        },
        circuit_breaker={
            "enabled": True,
            "failure_rate": 1,
            "min_requests": 5,
            "window": "30s",
            "open_for": "2s",
            "max_open_for": "1m",
            "probes": 3,
        },
        on_dead_letter="skip",
        max_message_bytes=100,
        dedup_window="30m",
        allow_uneven=True,
    )
    e = spec.endpoint
    assert e.method == "PUT"
    assert e.headers == (("Content-Type", "application/json"), ("X-B", "2"))  # sorted
    assert (e.auth_header, e.auth_env) == ("X-Api-Key", "ORDERS_TOKEN")
    assert (e.connect_timeout_ms, e.request_timeout_ms) == (500, 60_000)
    assert spec.retry == RetryPolicy(
        max_attempts=3,
        backoff="fixed",
        min_backoff_ms=1000,
        max_backoff_ms=3_600_000,
        multiplier=3.0,
        jitter=0.0,
        responses=(
            ResponseRule("2xx", "success"),
            ResponseRule("409", "success"),
            ResponseRule("5xx", "retry", honour_retry_after=True),
        ),
        in_place_window_ms=500,
        in_place_linger_ms=250,
    )
    assert spec.consumption == ConsumptionPolicy(4, 8, 1000, 0)
    assert spec.circuit_breaker == CircuitPolicy(True, 1.0, 5, 30_000, 2_000, 60_000, 3)
    assert (spec.grouped, spec.on_dead_letter, spec.max_message_bytes) == (False, "skip", 100)
    assert (spec.dedup_window_ms, spec.allow_uneven) == (1_800_000, True)


def test_null_means_default():
    assert parse(shards=None, retry={"max_attempts": None}, dedup_window=None) == parse()


# -- durations --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,ms",
    [(0, 0), (250, 250), ("500ms", 500), ("2s", 2000), ("1m", 60_000), ("30m", 1_800_000),
     ("1h", 3_600_000), (" 3 s ", 3000), ("7d", 604_800_000)],
)  # fmt: skip
def test_parse_duration_ms(text, ms):
    assert subscription_spec.parse_duration_ms(text, "x.y") == ms


@pytest.mark.parametrize(
    "text", ["500", "1.5s", "-1s", "1w", "s", "", -1, True, None, 1.5, "2 sec", "2s\n", "\u0663s"]
)
def test_parse_duration_ms_refuses(text):
    with pytest.raises(InvalidArgument) as e:
        subscription_spec.parse_duration_ms(text, "retry.min_backoff")
    assert e.value.field == "retry.min_backoff"


def test_a_duration_string_without_unit_says_so():
    with pytest.raises(InvalidArgument, match="'500' has no unit: write 500ms or 500s"):
        subscription_spec.parse_duration_ms("500", "retry.min_backoff")


def test_durations_in_documents():
    spec = parse(endpoint__connect_timeout="2s", retry__min_backoff="1s", dedup_window="30m")
    assert spec.endpoint.connect_timeout_ms == 2000
    assert spec.retry.min_backoff_ms == 1000
    assert spec.dedup_window_ms == 1_800_000
    assert parse(consumption__trigger_interval=250).consumption.trigger_interval_ms == 250
    assert parse(retry__in_place_window=0).retry.in_place_window_ms == 0  # off


# -- every invalid value names its field --------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"name": None}, "name"),
        ({"name": "a.b"}, "name"),
        ({"name": 5}, "name"),
        ({"topic": "orders.rq"}, "topic"),
        ({"topic": None}, "topic"),
        ({"endpoint": None}, "endpoint"),
        ({"endpoint": "http://h/x"}, "endpoint"),
        ({"endpoint__url": None}, "endpoint.url"),
        ({"endpoint__url": "ftp://h/x"}, "endpoint.url"),
        ({"endpoint__url": "http:///x"}, "endpoint.url"),
        ({"endpoint__url": "localhost:8080"}, "endpoint.url"),
        ({"endpoint__url": "http://user:pw@h/x"}, "endpoint.url"),
        ({"endpoint__method": "GET"}, "endpoint.method"),
        ({"endpoint__headers": ["X-A: 1"]}, "endpoint.headers"),
        ({"endpoint__headers": {"X A": "1"}}, "endpoint.headers.X A"),
        ({"endpoint__headers": {"X-A\n": "1"}}, "endpoint.headers.'X-A\\n'"),
        ({"endpoint__headers": {"X-A": 1}}, "endpoint.headers.X-A"),
        ({"endpoint__headers": {"X-A": "a\r\nb"}}, "endpoint.headers.X-A"),
        ({"endpoint__headers": {"X-A": "1", "x-a": "2"}}, "endpoint.headers.x-a"),
        ({"endpoint__headers": {"Idempotency-Key": "k"}}, "endpoint.headers.Idempotency-Key"),
        ({"endpoint__headers": {"x-varadhi-redriven": "r"}}, "endpoint.headers.x-varadhi-redriven"),
        ({"endpoint__headers": {"Host": "other.test"}}, "endpoint.headers.Host"),
        ({"endpoint__headers": {"Content-Length": "0"}}, "endpoint.headers.Content-Length"),
        ({"endpoint__headers": {"transfer-encoding": "x"}}, "endpoint.headers.transfer-encoding"),
        ({"endpoint__headers": {"webhook-id": "forged"}}, "endpoint.headers.webhook-id"),
        ({"endpoint__key_header": "X Key"}, "endpoint.key_header"),
        ({"endpoint__key_header": 5}, "endpoint.key_header"),
        ({"endpoint__key_header": "Idempotency-Key"}, "endpoint.key_header"),
        ({"endpoint__key_header": "Authorization"}, "endpoint.key_header"),
        ({"endpoint__key_header": "Content-Length"}, "endpoint.key_header"),
        ({"endpoint__key_header": "x-a", "endpoint__headers": {"X-A": "1"}},
         "endpoint.key_header"),
        ({"endpoint__key_header": "x-tenant", "endpoint__forward_headers": {"t": "X-Tenant"}},
         "endpoint.key_header"),
        ({"endpoint__key_header": "X-Key", "delivery__mode": "batch"}, "endpoint.key_header"),
        ({"endpoint__signing": {"scheme": "v1"}}, "endpoint.signing"),
        ({"endpoint__signing": []}, "endpoint.signing"),
        ({"endpoint__signing": [{"scheme": "v2", "env": "VARADHI_ENDPOINT_K"}]},
         "endpoint.signing[0].scheme"),
        ({"endpoint__signing": [{"scheme": "v1"}]}, "endpoint.signing[0]"),
        ({"endpoint__signing": [{"scheme": "v1", "env": "A", "file": "/k"}]}, "endpoint.signing[0]"),
        ({"endpoint__signing": [{"scheme": "v1", "env": "whsec_abc="}]},
         "endpoint.signing[0].env"),
        ({"endpoint__signing": [{"scheme": "v1", "file": "keys/k"}]}, "endpoint.signing[0].file"),
        ({"endpoint__signing": [{"scheme": "v1", "env": "VARADHI_ENDPOINT_K"},
                                {"scheme": "v1a", "env": "VARADHI_ENDPOINT_K"}]},
         "endpoint.signing[1].env"),
        ({"endpoint__signing": [{"scheme": "v1", "secret": "whsec_abc"}]},
         "endpoint.signing[0].secret"),
        ({"endpoint__auth_header": "Bad Header"}, "endpoint.auth_header"),
        ({"endpoint__auth_env": "1TOKEN"}, "endpoint.auth_env"),
        ({"endpoint__auth_env": "MY-TOKEN"}, "endpoint.auth_env"),
        ({"endpoint__auth_env": "TOKEN\n"}, "endpoint.auth_env"),
        ({"endpoint__auth_header": "X-Key\n"}, "endpoint.auth_header"),
        ({"endpoint__connect_timeout": 0}, "endpoint.connect_timeout"),
        ({"endpoint__request_timeout": "10 minutes"}, "endpoint.request_timeout"),
        ({"shards": 0}, "shards"),
        ({"shards": "2"}, "shards"),
        ({"shards": 2.0}, "shards"),
        ({"shards": True}, "shards"),
        ({"shards": 10_001}, "shards"),
        ({"grouped": "yes"}, "grouped"),
        ({"shards": 2, "rq_partitions": 3}, "rq_partitions"),
        ({"shards": 3, "dlq_partitions": 4}, "dlq_partitions"),
        ({"rq_partitions": 0}, "rq_partitions"),
        ({"dlq_partitions": 20_000}, "dlq_partitions"),
        ({"retry": 5}, "retry"),
        ({"retry__max_attempts": 0}, "retry.max_attempts"),
        ({"retry__backoff": "linear"}, "retry.backoff"),
        ({"retry__min_backoff": "-1s"}, "retry.min_backoff"),
        ({"retry__min_backoff": "2m", "retry__max_backoff": "1m"}, "retry.max_backoff"),
        ({"retry__multiplier": 0.5}, "retry.multiplier"),
        ({"retry__multiplier": float("inf")}, "retry.multiplier"),
        ({"retry__jitter": 1}, "retry.jitter"),
        ({"retry__jitter": -0.1}, "retry.jitter"),
        ({"retry__in_place_window": "-1s"}, "retry.in_place_window"),
        ({"retry__in_place_window": "61s"}, "retry.in_place_window"),
        ({"retry__in_place_linger": "61s"}, "retry.in_place_linger"),
        ({"retry__responses": []}, "retry.responses"),
        ({"retry__responses": [{"codes": "4xx", "action": "retry"}]}, "retry.responses"),
        ({"retry__responses": [{"codes": "600", "action": "success"}]}, "retry.responses[0].codes"),
        ({"retry__responses": [{"action": "success"}]}, "retry.responses[0].codes"),
        (
            {"retry__responses": [{"codes": "2xx", "action": "success"}, {"codes": "2xx", "action": "retry"}]},
            "retry.responses[1].codes",
        ),
        ({"retry__responses": [{"codes": "2xx"}]}, "retry.responses[0].action"),
        ({"retry__responses": [{"codes": "2xx", "action": "ok"}]}, "retry.responses[0].action"),
        (
            {"retry__responses": [{"codes": "2xx", "action": "success", "honour_retry_after": True}]},
            "retry.responses[0].honour_retry_after",
        ),
        ({"retry__responses": ["2xx"]}, "retry.responses[0]"),
        ({"consumption__concurrency": 0}, "consumption.concurrency"),
        ({"consumption__max_in_flight": -1}, "consumption.max_in_flight"),
        ({"consumption__max_messages_per_batch": 0}, "consumption.max_messages_per_batch"),
        ({"consumption__trigger_interval": -5}, "consumption.trigger_interval"),
        ({"consumption__error_rate_threshold": 0}, "consumption.error_rate_threshold"),
        ({"consumption__error_rate_threshold": 1.5}, "consumption.error_rate_threshold"),
        ({"consumption__throttle": "5"}, "consumption.throttle"),
        ({"circuit_breaker": "on"}, "circuit_breaker"),
        ({"circuit_breaker__enable": True}, "circuit_breaker.enable"),
        ({"circuit_breaker__enabled": "yes"}, "circuit_breaker.enabled"),
        ({"circuit_breaker__failure_rate": 0}, "circuit_breaker.failure_rate"),
        ({"circuit_breaker__failure_rate": 1.5}, "circuit_breaker.failure_rate"),
        ({"circuit_breaker__failure_rate": "half"}, "circuit_breaker.failure_rate"),
        ({"circuit_breaker__min_requests": 0}, "circuit_breaker.min_requests"),
        ({"circuit_breaker__window": "10"}, "circuit_breaker.window"),
        ({"circuit_breaker__open_for": 0}, "circuit_breaker.open_for"),
        ({"circuit_breaker__open_for": "5s", "circuit_breaker__max_open_for": "4s"},
         "circuit_breaker.max_open_for"),
        ({"circuit_breaker__probes": 0}, "circuit_breaker.probes"),
        ({"on_dead_letter": "drop"}, "on_dead_letter"),
        ({"blocked": 100}, "blocked"),
        ({"blocked__max_hold": 10}, "blocked.max_hold"),
        ({"blocked__max_held": -1}, "blocked.max_held"),
        ({"blocked__max_held": "10"}, "blocked.max_held"),
        ({"blocked__max_held_bytes": 1.5}, "blocked.max_held_bytes"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"dedup_window": 0}, "dedup_window"),
        ({"dedup_window": "forever"}, "dedup_window"),
        ({"allow_uneven": 1}, "allow_uneven"),
    ],
)  # fmt: skip
def test_invalid_values_name_their_field(overrides, field):
    assert field_of(**overrides) == field


def test_signing_keys_are_references_and_round_trip_through_the_catalog_form():
    signing = [
        {"scheme": "v1", "env": "VARADHI_ENDPOINT_OLD"},
        {"scheme": "v1", "env": "VARADHI_ENDPOINT_NEW"},
        {"scheme": "v1a", "file": "/run/secrets/ed25519"},
    ]
    spec = parse(endpoint__signing=signing)
    assert spec.endpoint.signing == (
        SigningKey("v1", SecretRef(env="VARADHI_ENDPOINT_OLD")),
        SigningKey("v1", SecretRef(env="VARADHI_ENDPOINT_NEW")),
        SigningKey("v1a", SecretRef(file="/run/secrets/ed25519")),
    )
    stored = json.loads(json.dumps(subscription_spec.spec_to_dict(spec)))
    assert subscription_spec.spec_from_dict(stored) == spec
    assert parse().endpoint.signing == ()


def test_request_shaping_round_trips_through_the_catalog_form():
    spec = parse(
        endpoint__forward_headers={"tenant": "X-Tenant", "trace": "traceparent"},
        endpoint__path="/orders/{header:tenant}",
        endpoint__key_header="X-Record-Key",
    )
    assert spec.endpoint.shaping == RequestShaping(
        (("tenant", "X-Tenant"), ("trace", "traceparent")),
        "/orders/{header:tenant}",
        "X-Record-Key",
    )
    stored = json.loads(json.dumps(subscription_spec.spec_to_dict(spec)))
    assert subscription_spec.spec_from_dict(stored) == spec


def test_document_must_be_a_mapping():
    with pytest.raises(InvalidArgument) as e:
        subscription_spec.parse_spec(["name"], source="x.yaml")  # type: ignore[arg-type]
    assert e.value.field is None and "mapping" in str(e.value)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"retries": 3}, "retries"),
        ({"endpoint__timeout": "1s"}, "endpoint.timeout"),
        ({"retry__max_attempt": 3}, "retry.max_attempt"),
        ({"consumption__parallelism": 3}, "consumption.parallelism"),
        ({"retry__responses": [{"codes": "2xx", "action": "success", "why": 1}]},
         "retry.responses[0].why"),
        ({"retry__min_backoff_ms": 5}, "retry.min_backoff_ms"),
    ],
)  # fmt: skip
def test_unknown_keys_are_refused_by_name(overrides, field):
    with pytest.raises(InvalidArgument) as e:
        parse(**overrides)
    assert e.value.field == field
    assert f"unknown key(s) {field.rsplit('.', 1)[-1]}" in str(e.value)


def test_unknown_keys_with_control_characters_keep_the_message_on_one_line():
    assert field_of(**{"retry__a\nb": 1}) == "retry.'a\\nb'"


def test_all_unknown_keys_are_named():
    with pytest.raises(InvalidArgument) as e:
        parse(zeta=1, alpha=2)
    assert "alpha, zeta" in str(e.value)


@pytest.mark.parametrize("name", ["Authorization", "authorization", "Proxy-Authorization"])
def test_literal_authorization_header_is_refused(name):
    with pytest.raises(InvalidArgument) as e:
        parse(endpoint__headers={name: "Bearer secret"})
    assert e.value.field == f"endpoint.headers.{name}"
    assert "auth_env" in str(e.value)
    assert "s3cr3t" not in str(e.value)  # the error never echoes the credential


def test_literal_custom_auth_header_is_refused():
    with pytest.raises(InvalidArgument) as e:
        parse(endpoint__auth_header="X-Api-Key", endpoint__headers={"x-api-key": "k"})
    assert "auth_env" in str(e.value)


# -- documents --------------------------------------------------------------------------------


def rich_spec() -> SubscriptionSpec:
    return parse(
        endpoint__headers={"X-Z": "z", "Accept": "*/*"},
        endpoint__auth_env="TOKEN",
        shards=3,
        rq_partitions=12,
        grouped=False,
        retry__responses=[
            {"codes": "2xx", "action": "success"},
            {"codes": 429, "action": "retry", "honour_retry_after": True},
            {"codes": "timeout", "action": "dead_letter"},
        ],
        retry__multiplier=1.5,
        circuit_breaker__failure_rate=0.25,
        circuit_breaker__open_for="2m",
        blocked__max_held=0,
        blocked__max_held_bytes=4096,
        dedup_window="1h",
        allow_uneven=True,
    )


@pytest.mark.parametrize("spec", [parse(), rich_spec()], ids=["defaults", "rich"])
def test_spec_round_trips_through_the_catalog_encoding(spec):
    d = subscription_spec.spec_to_dict(spec)
    stored = json.loads(json.dumps(d, sort_keys=True))  # what Catalog.mutate writes
    assert subscription_spec.spec_from_dict(stored) == spec
    assert subscription_spec.spec_to_dict(subscription_spec.spec_from_dict(stored)) == d


def old_record(**consumption) -> dict:
    """A catalog record as a version before the circuit breaker wrote it."""
    d = subscription_spec.spec_to_dict(parse())
    d.pop("circuit_breaker")
    d["consumption"].update({"error_rate_threshold": 0.5, "throttle": 5000, **consumption})
    return {"spec": d, "state": {"shard_count": 1, "created_ms": 0}}


def test_a_record_from_before_the_circuit_breaker_still_loads(caplog):
    record = old_record()
    with caplog.at_level("WARNING", logger="varadhi.kafka.subscriptions"):
        sub = subs.Subscription.from_dict(record)
    # The old defaults (throttle 5 s above a 50% failure rate) are the breaker's defaults.
    assert sub.spec.circuit_breaker == CircuitPolicy()
    assert "consumption.error_rate_threshold and consumption.throttle (in catalog)" in caplog.text
    assert "deprecated" in caplog.text
    # Written back (any edit), it has the new shape only, and reads without a warning.
    rewritten = sub.to_dict()
    assert "throttle" not in rewritten["spec"]["consumption"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="varadhi.kafka.subscriptions"):
        assert subs.Subscription.from_dict(rewritten) == sub
    assert not caplog.text


def test_old_throttle_settings_map_to_the_breaker():
    mapped = subs.Subscription.from_dict(old_record(error_rate_threshold=0.8, throttle=90_000))
    assert mapped.spec.circuit_breaker == CircuitPolicy(
        failure_rate=0.8, open_for_ms=90_000, max_open_for_ms=90_000
    )
    never = subs.Subscription.from_dict(old_record(throttle=0))  # "0 never waits"
    assert never.spec.circuit_breaker == CircuitPolicy(enabled=False)
    assert parse(consumption__throttle="0ms").circuit_breaker.enabled is False


def test_old_throttle_keys_next_to_a_circuit_breaker_section_are_ignored(caplog):
    with caplog.at_level("WARNING", logger="varadhi.kafka.subscriptions"):
        spec = parse(consumption__throttle="0ms", circuit_breaker__probes=3)
    assert spec.circuit_breaker == CircuitPolicy(probes=3)
    assert "consumption.throttle (in test.yaml) are deprecated, ignored" in caplog.text


def test_spec_to_dict_is_the_yaml_shape():
    d = subscription_spec.spec_to_dict(rich_spec())
    assert d["endpoint"]["headers"] == {"Accept": "*/*", "X-Z": "z"}
    assert d["dedup_window"] == 3_600_000 and d["retry"]["min_backoff"] == 1000
    assert d["allow_uneven"] is True
    assert subscription_spec.parse_spec(d) == rich_spec()


def test_blocked_limits_default_to_a_thousand_messages_and_16_mib_and_reach_the_catalog():
    assert parse().blocked == BlockedPolicy(max_held=1000, max_held_bytes=16 * 1_048_576)
    assert rich_spec().blocked == BlockedPolicy(max_held=0, max_held_bytes=4096)
    assert subscription_spec.spec_to_dict(rich_spec())["blocked"] == {
        "max_held": 0,
        "max_held_bytes": 4096,
    }
    # A record written before the policy existed loads with its defaults.
    d = subscription_spec.spec_to_dict(parse())
    d.pop("blocked")
    assert subscription_spec.spec_from_dict(d).blocked == BlockedPolicy()


def test_spec_from_dict_refuses_an_invalid_record():
    d = subscription_spec.spec_to_dict(parse())
    d["shards"] = 0
    with pytest.raises(InvalidArgument, match="catalog"):
        subscription_spec.spec_from_dict(d)


def test_subscription_round_trip_and_document_shape():
    sub = subs.Subscription(rich_spec(), shard_count=3, created_ms=123, paused=True, generation=4)
    d = sub.to_dict()
    assert set(d) == {"spec", "state"}
    assert d["state"] == {
        "paused": True,
        "generation": 4,
        "shard_count": 3,
        "created_ms": 123,
        "rq_from": 0,
        "dlq_from": 0,
        "suspended": None,
    }
    assert subs.Subscription.from_dict(json.loads(json.dumps(d, sort_keys=True))) == sub
    suspension = subs.Suspension("every attempt to the endpoint failed for 600 s", 9, 2, "probe")
    suspended = subs.Subscription(rich_spec(), shard_count=3, created_ms=1, suspended=suspension)
    d = suspended.to_dict()
    assert d["state"]["suspended"] == {
        "reason": "every attempt to the endpoint failed for 600 s",
        "since_ms": 9,
        "shard": 2,
        "resume": "probe",
    }
    back = subs.Subscription.from_dict(json.loads(json.dumps(d)))
    assert back == suspended and back.stopped and not back.paused


def test_subscription_from_dict_tolerates_state_added_by_other_components():
    d = subs.Subscription(parse(), shard_count=1, created_ms=1).to_dict()
    d["state"]["operation"] = {"kind": "change-shards"}
    assert subs.Subscription.from_dict(d).shard_count == 1


# -- shard assignment -------------------------------------------------------------------------


def sub_of(shards: int, shard_count: int | None = None, **overrides) -> subs.Subscription:
    spec = parse(shards=shards, allow_uneven=True, **overrides)
    return subs.Subscription(spec, shard_count=shard_count or shards, created_ms=0)


def topic(name: str, *partitions: int, internal: bool = False) -> CompositeTopic:
    storages = tuple(StorageTopic(f"{name}.{i}", p, 1) for i, p in enumerate(partitions))
    return CompositeTopic(name, storages, len(storages) - 1, (None,) * len(storages), internal)


def test_owned_partitions_even():
    sub, mq = sub_of(3), topic("orders", 12)
    assert [subs.owned_partitions(sub, mq, 0, s) for s in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


def test_owned_partitions_uneven_cover_every_partition_once():
    sub, mq = sub_of(3), topic("orders", 4)
    owned = [subs.owned_partitions(sub, mq, 0, s) for s in range(3)]
    assert owned == [[0], [1], [2, 3]]


def test_owned_partitions_per_storage_topic():
    sub, mq = sub_of(2), topic("orders", 2, 6)
    assert subs.owned_partitions(sub, mq, 0, 1) == [1]
    assert subs.owned_partitions(sub, mq, 1, 1) == [3, 4, 5]


def test_owned_partitions_use_the_live_shard_count():
    sub, mq = sub_of(2, shard_count=4), topic("orders", 8)
    assert subs.owned_partitions(sub, mq, 0, 3) == [6, 7]


def test_owned_partitions_refuses_wrong_topic_shard_or_index():
    sub = sub_of(2)
    with pytest.raises(InvalidArgument) as e:
        subs.owned_partitions(sub, topic("payments", 4), 0, 0)
    assert e.value.field == "topic"
    with pytest.raises(InvalidArgument) as e:
        subs.owned_partitions(sub, topic("orders", 4), 0, 2)
    assert e.value.field == "shard"
    with pytest.raises(InvalidArgument):
        subs.owned_partitions(sub, topic("orders", 4), 1, 0)


def test_internal_partitions():
    sub = sub_of(2, rq_partitions=6)
    rq = new_topic("orders-http.rq", 6, allow_uneven=True, internal=True)
    dlq = new_topic("orders-http.dlq", 2, internal=True)
    assert [subs.internal_partitions(sub, rq, 0, s) for s in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [subs.internal_partitions(sub, dlq, 0, s) for s in range(2)] == [[0], [1]]


def test_internal_partitions_refuses_the_main_topic():
    with pytest.raises(InvalidArgument):
        subs.internal_partitions(sub_of(1), topic("orders", 4), 0, 0)


def test_shard_assignments_table():
    sub = sub_of(2)
    rq = topic("orders-http.rq", 4, internal=True)
    dlq = topic("orders-http.dlq", 2, 4, internal=True)
    table = subs.shard_assignments(sub, topic("orders", 4, 8), rq, dlq)
    assert [t["shard"] for t in table] == [0, 1]
    assert table[1]["mq"] == [
        {"storage_topic_idx": 0, "storage_topic": "orders.0", "partitions": [2, 3]},
        {"storage_topic_idx": 1, "storage_topic": "orders.1", "partitions": [4, 5, 6, 7]},
    ]
    assert table[1]["rq"] == [
        {"storage_topic_idx": 0, "storage_topic": "orders-http.rq.0", "partitions": [2, 3]}
    ]
    assert [a["partitions"] for a in table[0]["dlq"]] == [[0], [0, 1]]


# -- decisions against the catalog --------------------------------------------------------------


def snapshot(*topics_: CompositeTopic, subscriptions=()) -> Snapshot:
    entries = {f"topic/{t.name}": t.to_dict() for t in topics_}
    entries.update({f"subscription/{s.name}": s.to_dict() for s in subscriptions})
    return Snapshot(entries)


def test_check_main_topic():
    snap = snapshot(topic("orders", 4))
    assert subs.check_main_topic(snap, parse(shards=2)).name == "orders"
    with pytest.raises(InvalidArgument) as e:
        subs.check_main_topic(snap, parse(shards=3))
    assert e.value.field == "shards" and "1, 2, 4" in str(e.value)
    assert "allow_uneven" in str(e.value)
    subs.check_main_topic(snap, parse(shards=3, allow_uneven=True))
    with pytest.raises(InvalidArgument) as e:  # a shard would own nothing, even when uneven
        subs.check_main_topic(snap, parse(shards=5, allow_uneven=True))
    assert e.value.field == "shards"


def test_check_main_topic_uses_the_produce_storage_topic():
    mq = topic("orders", 4, 6)  # produce pointer at index 1
    subs.check_main_topic(snapshot(mq), parse(shards=3))
    with pytest.raises(InvalidArgument):
        subs.check_main_topic(snapshot(mq), parse(shards=4))
    old = replace(mq, produce_pointer=0)
    subs.check_main_topic(snapshot(old), parse(shards=4))


def test_check_main_topic_refuses_missing_and_internal_topics():
    with pytest.raises(InvalidArgument) as e:
        subs.check_main_topic(snapshot(), parse())
    assert e.value.field == "topic" and "does not exist" in str(e.value)
    internal_named = CompositeTopic("orders", topic("orders", 2).storage_topics, internal=True)
    with pytest.raises(InvalidArgument, match="internal"):
        subs.check_main_topic(snapshot(internal_named), parse())


def test_check_create_lists_missing_queues_and_accepts_a_crashed_create():
    spec = parse(shards=2)
    mq = topic("orders", 4)
    assert subs.check_create(snapshot(mq), spec) == [("orders-http.rq", 4), ("orders-http.dlq", 2)]
    rq = new_topic("orders-http.rq", 4, internal=True)
    dlq = new_topic("orders-http.dlq", 2, internal=True)
    assert subs.check_create(snapshot(mq, rq), spec) == [("orders-http.dlq", 2)]
    assert subs.check_create(snapshot(mq, rq, dlq), spec) == []


def test_check_create_refuses_existing_subscription_and_mismatched_queues():
    spec = parse(shards=2)
    mq = topic("orders", 4)
    existing = subs.Subscription(spec, shard_count=2, created_ms=0)
    with pytest.raises(AlreadyExists):
        subs.check_create(snapshot(mq, subscriptions=[existing]), spec)
    wrong = new_topic("orders-http.dlq", 4, internal=True)
    with pytest.raises(InvalidArgument) as e:
        subs.check_create(snapshot(mq, wrong), spec)
    assert e.value.field == "dlq_partitions" and "dlq_partitions: 4" in str(e.value)


def test_mutable_and_immutable_fields_partition_the_spec():
    names = {f.name for f in fields(SubscriptionSpec)}
    assert names == subs.MUTABLE_FIELDS | subs.IMMUTABLE_FIELDS
    assert not subs.MUTABLE_FIELDS & subs.IMMUTABLE_FIELDS


def test_changed_fields_allows_policy_updates():
    current = subs.Subscription(parse(shards=2), shard_count=2, created_ms=0)
    new = parse(
        shards=2,
        endpoint__url="http://other/x",
        retry__max_attempts=9,
        consumption__concurrency=8,
        on_dead_letter="skip",
        blocked__max_held=5,
        dedup_window="5m",
        max_message_bytes=10,
    )
    assert subs.changed_fields(current, new) == [
        "endpoint",
        "retry",
        "consumption",
        "on_dead_letter",
        "blocked",
        "max_message_bytes",
        "dedup_window_ms",
    ]
    assert subs.changed_fields(current, parse(shards=2)) == []


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"topic": "payments"}, "topic"),
        ({"grouped": False}, "grouped"),
        ({"rq_partitions": 8}, "rq_partitions"),
        ({"dlq_partitions": 4}, "dlq_partitions"),
    ],
)
def test_changed_fields_refuses_what_cannot_change(overrides, field):
    current = subs.Subscription(parse(shards=2), shard_count=2, created_ms=0)
    with pytest.raises(InvalidArgument) as e:
        subs.changed_fields(current, parse(shards=2, **overrides))
    assert e.value.field == field and "cannot change" in str(e.value)


def test_changing_shards_points_at_change_shards():
    current = subs.Subscription(parse(shards=2), shard_count=2, created_ms=0)
    with pytest.raises(InvalidArgument) as e:
        subs.changed_fields(current, parse(shards=4, rq_partitions=4))
    assert e.value.field == "shards"
    assert "subscription change-shards orders-http --to 4" in str(e.value)


def test_shards_are_compared_with_the_live_shard_count():
    current = subs.Subscription(parse(shards=2), shard_count=4, created_ms=0)
    with pytest.raises(InvalidArgument, match="change-shards"):
        subs.changed_fields(current, parse(shards=2))


def test_plan_apply():
    mq = topic("orders", 4)
    spec = parse(shards=2)
    assert subs.plan_apply(snapshot(mq), spec) == "create"
    existing = subs.Subscription(spec, shard_count=2, created_ms=0)
    snap = snapshot(mq, subscriptions=[existing])
    assert subs.plan_apply(snap, spec) == "unchanged"
    assert subs.plan_apply(snap, parse(shards=2, retry__max_attempts=2)) == "update"
    with pytest.raises(InvalidArgument):
        subs.plan_apply(snapshot(mq), parse(shards=3))


def test_a_record_left_at_the_creation_shard_count_is_read_with_the_live_one():
    # What change-shards 2 -> 4 wrote before its activate step set the spec too: spec.shards 2,
    # state.shard_count 4. Reading it (and so pause, resume, apply) takes the live values.
    rq = topic("orders-http.rq", 4, 8, internal=True)
    dlq = topic("orders-http.dlq", 2, 4, internal=True)
    legacy = subs.Subscription(parse(shards=2), shard_count=4, created_ms=0, rq_from=1, dlq_from=1)
    snap = snapshot(topic("orders", 4), rq, dlq, subscriptions=[legacy])
    sub = subs.from_snapshot(snap, "orders-http")
    assert (sub.spec.shards, sub.spec.rq_partitions, sub.spec.dlq_partitions) == (4, 8, 4)
    assert subs.plan_apply(snap, parse(shards=4)) == "unchanged"
    with pytest.raises(InvalidArgument, match="change-shards"):
        subs.plan_apply(snap, parse(shards=2))
    consistent = subs.Subscription(parse(shards=2), shard_count=2, created_ms=0).to_dict()
    assert subs.live_record(snap, consistent) is consistent


# -- files ------------------------------------------------------------------------------------


def test_example_parses_and_shows_every_field_at_its_default():
    raw = yaml.safe_load(EXAMPLE.read_text())
    spec = subscription_spec.parse_spec(raw, source=str(EXAMPLE))
    assert spec == SubscriptionSpec(
        name=spec.name,
        topic=spec.topic,
        endpoint=Endpoint(url=spec.endpoint.url),
        rq_partitions=2,
        dlq_partitions=1,
    )

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "headers":
                out |= keys(v, f"{prefix}{k}.")
        return out

    assert keys(raw) == keys(subscription_spec.spec_to_dict(spec))  # every field, nothing else


def test_load_specs_single_and_list(tmp_path):
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(doc()))
    assert load_specs(str(one)) == [parse()]
    many = tmp_path / "many.yaml"
    second = copy.deepcopy(doc(name="b"))
    many.write_text(yaml.safe_dump({"subscriptions": [doc(), second]}))
    assert [s.name for s in load_specs(str(many))] == ["orders-http", "b"]


def test_load_specs_names_the_item_of_a_list(tmp_path):
    many = tmp_path / "many.yaml"
    many.write_text(yaml.safe_dump({"subscriptions": [doc(), doc(shards=0)]}))
    with pytest.raises(InvalidArgument) as e:
        load_specs(str(many))
    assert e.value.field == "shards" and "subscriptions[1]" in str(e.value)


@pytest.mark.parametrize(
    "text,match",
    [
        ("", "empty"),
        ("name: [unclosed", "not valid YAML"),
        ("subscriptions: []", "non-empty list"),
        ("subscriptions: [{}]\nname: x", "holds nothing else"),
        ("- a\n- b", "must be a mapping"),
    ],
)
def test_load_specs_refuses_bad_files(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=match) as e:
        load_specs(str(path))
    assert "\n" not in str(e.value)


def test_load_specs_missing_file(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read"):
        load_specs(str(tmp_path / "nope.yaml"))
