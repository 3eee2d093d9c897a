"""Parsing and validation of subscription filters (`varadhi.core.filters`), alone and in a spec.

The Spark expression a filter compiles to is tested on DataFrames in tests/spark/test_filters.py.
"""

from __future__ import annotations

import pytest
import yaml

from varadhi.core import filters, subscription_spec
from varadhi.core.errors import InvalidArgument
from varadhi.core.filters import All, AnyOf, Match, Not
from varadhi.kafka import subscriptions as subs

EXAMPLE = """
all:
  - {header: type, in: [order.paid, order.created, order.paid]}
  - any:
      - {header: region, prefix: "eu-"}
      - {key: {prefix: "tenant-7/"}}
  - not: {header: test, exists: true}
"""


def test_parse_example():
    got = filters.parse(yaml.safe_load(EXAMPLE))
    assert got == All(
        (
            Match("type", "in", ("order.created", "order.paid")),  # sorted, distinct
            AnyOf((Match("region", "prefix", ("eu-",)), Match(None, "prefix", ("tenant-7/",)))),
            Not(Match("test", "exists", present=True)),
        )
    )


@pytest.mark.parametrize(
    "doc",
    [
        {"header": "type", "in": ["a"]},
        {"header": 'it\'s "quoted"', "prefix": "x"},
        {"key": {"exists": False}},
        {"key": {"in": ["k1", "k2"]}},
        {"not": {"any": [{"header": "a", "exists": True}, {"key": {"prefix": "p"}}]}},
        yaml.safe_load(EXAMPLE),
    ],
)
def test_to_dict_round_trips(doc):
    f = filters.parse(doc)
    assert filters.parse(filters.to_dict(f)) == f
    assert filters.to_dict(filters.parse(filters.to_dict(f))) == filters.to_dict(f)


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ("type == x", "filter", "must be a condition"),
        ({}, "filter", "must be a condition"),
        ([{"header": "a", "in": ["x"]}], "filter", "must be a condition"),
        ({"header": "a", "key": {"in": ["x"]}}, "filter", "exactly one of header, key"),
        ({"headr": "a", "in": ["x"]}, "filter", "exactly one of header, key"),
        ({"header": "", "in": ["x"]}, "filter.header", "non-empty header name"),
        ({"header": 5, "in": ["x"]}, "filter.header", "non-empty header name"),
        ({"header": "a"}, "filter", "exactly one of in, prefix, exists"),
        ({"header": "a", "in": ["x"], "prefix": "y"}, "filter", "exactly one of in, prefix"),
        ({"header": "a", "equals": "x"}, "filter", "exactly one of in, prefix, exists"),
        ({"header": "a", "in": []}, "filter.in", "non-empty list of strings"),
        ({"header": "a", "in": "x"}, "filter.in", "non-empty list of strings"),
        ({"header": "a", "in": ["x", 1]}, "filter.in[1]", 'quote numbers and booleans: "1"'),
        ({"header": "a", "in": ["x", ""]}, "filter.in[1]", "non-empty string"),
        ({"header": "a", "prefix": ""}, "filter.prefix", "non-empty string"),
        ({"header": "a", "prefix": None}, "filter.prefix", "non-empty string"),
        ({"header": "a", "exists": "yes"}, "filter.exists", "true or false"),
        ({"key": "abc"}, "filter.key", "exactly one of in, prefix, exists"),
        ({"key": {"in": ["x"]}, "extra": 1}, "filter.extra", "unknown key(s) extra next to key"),
        ({"all": []}, "filter.all", "non-empty list of conditions"),
        ({"any": {"header": "a", "in": ["x"]}}, "filter.any", "non-empty list of conditions"),
        ({"all": [{"header": "a", "in": ["x"]}], "any": []}, "filter", "got all and any"),
        ({"not": [{"header": "a", "in": ["x"]}]}, "filter.not", "must be a condition"),
        (
            {"all": [{"header": "a", "in": ["x"]}, {"header": "r", "prefix": 7}]},
            "filter.all[1].prefix",
            "non-empty string",
        ),
        (
            {"any": [{"not": {"key": {"in": ["x", None]}}}]},
            "filter.any[0].not.key.in[1]",
            "non-empty string",
        ),
    ],
)
def test_invalid_filters_name_the_field(doc, field, words):
    with pytest.raises(InvalidArgument) as e:
        filters.parse(doc, source="f.yaml")
    assert e.value.field == field
    assert words in str(e.value) and "(in f.yaml)" in str(e.value)


def test_size_limits():
    leaf = {"header": "a", "exists": True}
    deep = leaf
    for _ in range(filters.MAX_DEPTH - 1):
        deep = {"not": deep}
    filters.parse(deep)  # exactly MAX_DEPTH levels
    with pytest.raises(InvalidArgument, match="nests more than"):
        filters.parse({"not": deep})
    filters.parse({"any": [leaf] * (filters.MAX_CONDITIONS - 1)})
    with pytest.raises(InvalidArgument, match="more than 100 conditions"):
        filters.parse({"any": [leaf] * filters.MAX_CONDITIONS})
    with pytest.raises(InvalidArgument, match="at most 1000"):
        filters.parse({"header": "a", "in": [str(i) for i in range(filters.MAX_VALUES + 1)]})


def spec_doc(**extra):
    return {"name": "s", "topic": "t", "endpoint": {"url": "http://localhost:1/x"}, **extra}


def test_spec_carries_the_filter_through_the_catalog_form():
    assert subscription_spec.parse_spec(spec_doc()).filter is None
    assert subscription_spec.parse_spec(spec_doc(filter=None)).filter is None
    spec = subscription_spec.parse_spec(spec_doc(filter=yaml.safe_load(EXAMPLE)))
    assert isinstance(spec.filter, All)
    stored = subscription_spec.spec_to_dict(spec)
    assert stored["filter"] == filters.to_dict(spec.filter)
    assert subscription_spec.spec_from_dict(stored) == spec
    assert (
        subscription_spec.spec_to_dict(subscription_spec.parse_spec(spec_doc()))["filter"] is None
    )


def test_spec_errors_name_the_filter_field():
    doc = spec_doc(filter={"all": [{"header": "type", "in": ["a"]}, {"header": "r", "prefx": "e"}]})
    with pytest.raises(InvalidArgument) as e:
        subscription_spec.parse_spec(doc, source="orders.yaml")
    assert e.value.field == "filter.all[1]"
    assert "exactly one of in, prefix, exists" in str(e.value) and "orders.yaml" in str(e.value)


def test_apply_may_change_the_filter():
    current = subs.Subscription(
        subscription_spec.parse_spec(spec_doc()), shard_count=1, created_ms=0
    )
    new = subscription_spec.parse_spec(spec_doc(filter={"header": "type", "in": ["a"]}))
    assert subs.changed_fields(current, new) == ["filter"]
    # The same filter written differently (order, repeats) is no change.
    again = subs.Subscription(new, shard_count=1, created_ms=0)
    same = subscription_spec.parse_spec(spec_doc(filter={"header": "type", "in": ["a", "a"]}))
    assert subs.changed_fields(again, same) == []
    assert subs.changed_fields(again, subscription_spec.parse_spec(spec_doc())) == ["filter"]


# (filter, key, headers, matches): the comparison rules of `filters` on one record each. The Spark
# twin is pinned to `matches` on a corpus of its own in tests/spark/test_filters.py.
MATCHES = [
    ({"header": "type", "in": ["a", "b"]}, None, [("type", b"b")], True),
    ({"header": "type", "in": ["a"]}, None, [("Type", b"a")], False),  # names are exact
    ({"header": "type", "in": ["a"]}, None, [("type", b"A")], False),  # values too
    ({"header": "type", "in": ["a"]}, None, [("type", b"x"), ("type", b"a")], False),  # first
    ({"header": "type", "in": ["a"]}, None, [("type", None), ("type", b"a")], False),
    ({"header": "type", "exists": True}, None, [("type", None), ("type", b"a")], False),
    ({"header": "type", "exists": True}, None, [("type", b"")], False),
    ({"header": "type", "exists": False}, None, None, True),
    ({"header": "type", "exists": True}, None, [("type", b"\xff")], True),  # present, not text
    ({"header": "type", "prefix": "\u00e9"}, None, [("type", b"\xff")], False),
    ({"not": {"header": "type", "in": ["x"]}}, None, [("type", b"\xfe\xff")], True),
    ({"header": "t", "prefix": "größe"}, None, [("t", "größe-日本".encode())], True),
    ({"header": "t", "in": ["日本"]}, None, [("t", "日本".encode())], True),
    ({"header": "t", "prefix": "g"}, None, [("t", b"g\xed\xa0\x80")], False),  # a surrogate
    ({"header": "t", "prefix": "/"}, None, [("t", b"\xc0\xaf")], False),  # overlong '/'
    ({"key": {"prefix": "tenant-7/"}}, b"tenant-7/\x00", [], True),
    ({"key": {"prefix": "t"}}, bytearray(b"tx"), [], True),
    ({"key": {"in": ["k"]}}, b"", [], False),
    ({"key": {"exists": False}}, b"", [], True),
    ({"key": {"exists": True}}, b"\xff", [], True),
    ({"all": [{"key": {"in": ["k"]}}, {"header": "a", "exists": True}]}, b"k", [("a", b"1")], True),
    ({"all": [{"key": {"in": ["k"]}}, {"header": "a", "exists": True}]}, b"k", [], False),
    ({"any": [{"key": {"in": ["x"]}}, {"header": "a", "exists": False}]}, b"k", [], True),
]


@pytest.mark.parametrize(("doc", "key", "headers", "expected"), MATCHES)
def test_matches_follows_the_comparison_rules(doc, key, headers, expected):
    assert filters.matches(filters.parse(doc), key, headers) is expected
