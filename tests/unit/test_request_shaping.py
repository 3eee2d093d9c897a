"""Request shaping (`varadhi.core.request_shaping`, issue 29 part 6): Kafka headers copied to HTTP
headers through an allow-list, the URL path from a template over headers, and the record key in a
header."""

import pytest

from varadhi.core import request_shaping as shaping
from varadhi.core.errors import InvalidArgument
from varadhi.core.group_state import Entry, request_of
from varadhi.core.messages import H_KEY, Origin
from varadhi.core.policies import RequestShaping


def entry(**headers: str) -> Entry:
    return Entry(Origin(0, 0, 1), "m-1", "g", "new", b"{}", dict(headers), source="t.0/0/1")


@pytest.mark.parametrize(
    ("template", "names"),
    [
        ("/orders", []),
        ("/orders/{header:tenant}", ["tenant"]),
        ("/t/{header:tenant}/r/{header:region}.json", ["tenant", "region"]),
        ("/{header:a b}", ["a b"]),
    ],
)
def test_placeholders_are_the_headers_a_template_reads(template, names):
    assert shaping.placeholders(template) == names


@pytest.mark.parametrize(
    ("template", "why"),
    [
        ("orders/{header:tenant}", "must start with /"),
        ("/orders/{tenant}", "unknown placeholder"),
        ("/orders/{key}", "unknown placeholder"),
        ("/orders/{header:}", "unknown placeholder"),
        ("/orders/{header:t", "unknown placeholder"),
        ("/orders/../admin", "'..'"),
        ("/orders/./{header:t}", "'..'"),
        ("//evil.test/x", "'//'"),
        ("/orders?x={header:t}", "cannot"),
        ("/orders#{header:t}", "cannot"),
        ("/a%2F..", "cannot"),
        ("/a b", "cannot"),
    ],
)
def test_a_template_that_could_leave_its_path_is_refused(template, why):
    with pytest.raises(ValueError, match=why):
        shaping.placeholders(template)


def test_values_are_percent_encoded_one_segment_each():
    headers = {"tenant": "acme/../../admin?x=1#f", "region": "eu west"}
    path = shaping.render_path("/t/{header:tenant}/{header:region}", headers)
    assert path == "/t/acme%2F..%2F..%2Fadmin%3Fx%3D1%23f/eu%20west"
    assert shaping.render_path("/t/{header:u}", {"u": "grüße"}) == "/t/gr%C3%BC%C3%9Fe"


@pytest.mark.parametrize("value", [None, "", ".", "..", "a\r\nb"])
def test_a_missing_or_climbing_value_makes_the_message_undeliverable(value):
    headers = {} if value is None else {"tenant": value}
    with pytest.raises(InvalidArgument) as e:
        shaping.render_path("/t/{header:tenant}", headers)
    assert e.value.field == "endpoint.path" and "tenant" in str(e.value)


def test_requests_carry_the_allowed_headers_and_the_path():
    rule = RequestShaping((("tenant", "X-Tenant"), ("trace", "traceparent")), "/t/{header:tenant}")
    request = request_of(entry(tenant="acme", other="not forwarded"), rule)
    assert request.path == "/t/acme"
    assert request.headers["X-Tenant"] == "acme" and "traceparent" not in request.headers
    assert "other" not in request.headers and "X-Varadhi-Message-Id" in request.headers
    plain = request_of(entry(tenant="acme"))
    assert plain.path is None and "X-Tenant" not in plain.headers
    with pytest.raises(InvalidArgument):  # a forwarded value with a line break: dead-lettered
        request_of(entry(tenant="acme", trace="a\nb"), rule)


def test_the_key_header_carries_the_key_the_message_kept():
    """The key's text form travels in the shard-only header `varadhi-key` (set from the record,
    kept by RQ/DLQ copies); a message without one (no key) sends no key header."""
    rule = RequestShaping(key_header="X-Record-Key")
    keyed = request_of(entry(**{H_KEY: "order-42", "tenant": "acme"}), rule)
    assert keyed.headers["X-Record-Key"] == "order-42" and "tenant" not in keyed.headers
    assert keyed.headers["X-Varadhi-Group-Id"] == "g"  # the group id is not the key
    assert "X-Record-Key" not in request_of(entry(tenant="acme"), rule).headers
    assert "X-Record-Key" not in request_of(entry(**{H_KEY: ""}), rule).headers
    # Without key_header, the kept key is not sent, nor is any `varadhi-*` header.
    plain = request_of(entry(**{H_KEY: "order-42"}), RequestShaping((("tenant", "X-Tenant"),)))
    assert "order-42" not in plain.headers.values()


def test_shaping_is_for_single_requests():
    assert shaping.check_mode(RequestShaping(path="/x"), "batch")
    assert shaping.check_mode(RequestShaping((("a", "X-A"),)), "batch")
    assert shaping.check_mode(RequestShaping(key_header="X-Key"), "batch")
    assert shaping.check_mode(RequestShaping(path="/x"), "single") is None
    assert shaping.check_mode(RequestShaping(), "batch") is None


def test_fields_set_names_what_shapes_requests():
    assert shaping.fields_set(RequestShaping()) == []
    full = RequestShaping((("a", "X-A"),), "/x", "X-Key")
    assert shaping.fields_set(full) == ["path", "forward_headers", "key_header"]
