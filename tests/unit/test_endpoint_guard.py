"""Which secrets an endpoint may name and which addresses it may reach
(`varadhi.core.endpoint_guard`): the platform's settings decide, never the spec's author."""

import pytest

from varadhi.core import endpoint_guard as guard
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint, SecretRef, SigningKey

DEFAULT = EndpointPolicy.from_env({})


def refused(policy: EndpointPolicy, **ref) -> str | None:
    return policy.refusal(SecretRef(**ref))


def test_by_default_only_variables_under_the_endpoint_prefix_may_be_named():
    assert refused(DEFAULT, env="VARADHI_ENDPOINT_ORDERS_TOKEN") is None
    for name in ("AWS_SECRET_ACCESS_KEY", "KAFKA_PASSWORD", "HOME", "VARADHI_ENDPOINT"):
        reason = refused(DEFAULT, env=name)
        assert (
            reason and "VARADHI_ENDPOINT_" in reason and "VARADHI_ENDPOINT_SECRET_NAMES" in reason
        )


def test_the_operator_sets_the_prefix_and_an_allow_list():
    policy = EndpointPolicy.from_env(
        {"VARADHI_ENDPOINT_SECRET_PREFIX": "HOOK_", "VARADHI_ENDPOINT_SECRET_NAMES": "A, B_TOKEN"}
    )
    assert refused(policy, env="HOOK_X") is None
    assert refused(policy, env="B_TOKEN") is None
    assert refused(policy, env="VARADHI_ENDPOINT_X") is not None


def test_the_kafka_configurations_variables_are_never_allowed():
    policy = EndpointPolicy.from_env(
        {"VARADHI_ENDPOINT_SECRET_NAMES": "VARADHI_KAFKA_SASL_PASSWORD,KAFKA_PW"},
        kafka_names={"KAFKA_PW", "VARADHI_ENDPOINT_SHARED"},
    )
    for name in ("VARADHI_KAFKA_SASL_PASSWORD", "KAFKA_PW", "VARADHI_ENDPOINT_SHARED"):
        assert "Kafka configuration" in refused(policy, env=name)
    for prefix in ("VARADHI_", "VARADHI_KAFKA_", "VARADHI_KAFKA_X", ""):
        with pytest.raises(InvalidArgument) as e:
            EndpointPolicy.from_env({"VARADHI_ENDPOINT_SECRET_PREFIX": prefix})
        assert e.value.field == "VARADHI_ENDPOINT_SECRET_PREFIX"


def test_secret_files_only_under_the_operators_directory(tmp_path):
    assert "VARADHI_ENDPOINT_SECRET_DIR" in refused(DEFAULT, file="/etc/passwd")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "k").write_text("whsec_a2V5\n")
    (tmp_path / "outside").write_text("x")
    (keys / "link").symlink_to(tmp_path / "outside")
    policy = EndpointPolicy.from_env({"VARADHI_ENDPOINT_SECRET_DIR": str(keys)})
    assert refused(policy, file=str(keys / "k")) is None
    assert guard.read_secret(SecretRef(file=str(keys / "k")), "f", policy) == "whsec_a2V5"
    for path in (f"{keys}/../outside", str(keys / "link"), "/etc/passwd"):
        assert "is not under" in refused(policy, file=path)


def test_read_secret_names_the_field_and_never_the_value():
    with pytest.raises(InvalidArgument) as e:
        guard.read_secret(SecretRef(env="VARADHI_ENDPOINT_NONE"), "endpoint.auth_env", DEFAULT, {})
    assert e.value.field == "endpoint.auth_env" and "is not set" in str(e.value)
    with pytest.raises(InvalidArgument) as e:
        guard.read_secret(
            SecretRef(env="DB_PASSWORD"), "endpoint.auth_env", DEFAULT, {"DB_PASSWORD": "hunter2"}
        )
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("::ffff:169.254.169.254", "link-local"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd00:ec2::254", "private"),
        ("0.0.0.0", "private"),
        ("224.0.0.1", "reserved"),
    ],
)
def test_private_and_link_local_addresses_are_refused_with_the_reason(address, kind):
    reason = guard.address_refusal(address)
    assert reason is not None and kind in reason and "VARADHI_ENDPOINT_DENY_PRIVATE" in reason


def test_public_addresses_and_names_pass_the_address_check():
    for address in ("93.184.216.34", "2606:2800:220:1::1", "example.test"):
        assert guard.address_refusal(address) is None


def test_a_literal_private_address_is_refused_at_apply_only_when_the_platform_denies_them():
    deny = EndpointPolicy.from_env({"VARADHI_ENDPOINT_DENY_PRIVATE": "true"})
    metadata = Endpoint(url="http://169.254.169.254/latest/meta-data/")
    guard.check_endpoint(metadata, DEFAULT)
    with pytest.raises(InvalidArgument) as e:
        guard.check_endpoint(metadata, deny)
    assert e.value.field == "endpoint.url" and "cloud metadata" in str(e.value)
    guard.check_endpoint(Endpoint(url="http://[::ffff:8.8.8.8]/x"), deny)
    with pytest.raises(InvalidArgument) as e:
        EndpointPolicy.from_env({"VARADHI_ENDPOINT_DENY_PRIVATE": "yes please"})
    assert e.value.field == "VARADHI_ENDPOINT_DENY_PRIVATE"


def test_check_endpoint_names_the_field_of_each_reference():
    ep = Endpoint(url="https://h.test/x", auth_env="VARADHI_ENDPOINT_T")
    guard.check_endpoint(ep, DEFAULT)
    with pytest.raises(InvalidArgument) as e:
        guard.check_endpoint(
            Endpoint(url="https://h.test/x", auth_env="AWS_SECRET_ACCESS_KEY"), DEFAULT
        )
    assert e.value.field == "endpoint.auth_env"
    keys = (
        SigningKey("v1", SecretRef(env="VARADHI_ENDPOINT_K")),
        SigningKey("v1", SecretRef(env="PGPASSWORD")),
    )
    with pytest.raises(InvalidArgument) as e:
        guard.check_endpoint(Endpoint(url="https://h.test/x", signing=keys), DEFAULT)
    assert e.value.field == "endpoint.signing[1]"
