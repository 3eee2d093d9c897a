"""Subscription filters: which main-topic messages a subscription delivers, decided by their key
and headers outside the delivery path: inside the Spark plan, before any Python delivery code
sees them (shards), or as a record is read, before it is scheduled (the library runtime).

A filter is the `filter` key of a subscription document: one *condition*, written as YAML.

- `{header: NAME, in: [V, ...]}`: header NAME's value is one of the strings V;
- `{header: NAME, prefix: P}`: header NAME's value starts with the string P;
- `{header: NAME, exists: true}` (`false`): header NAME is present with a non-empty value (not);
- `{key: {in: [V, ...]}}`, `{key: {prefix: P}}`, `{key: {exists: B}}`: the same on the record key;
- `{all: [C, ...]}`: every condition C matches; `{any: [C, ...]}`: at least one does;
- `{not: C}`: C does not match;

for example `{all: [{header: type, in: [order.created, order.paid]}, {header: region, prefix:
"eu-"}]}`. Values and prefixes are non-empty strings (quote numbers: `"1"`).

Comparison rules (the same for keys and headers). A Kafka header value or key is bytes; it is
compared as UTF-8 text, exactly as written, case-sensitive. Header names are case-sensitive too
(Kafka's), and when a header is repeated its first value counts (as for the ids of
`varadhi.core.record_ids`). A key or header that is absent, null or empty is *missing*: it matches
`exists: false` and never `in` or `prefix`. A value that is not valid UTF-8 is present (`exists:
true`) but never matches `in` or `prefix`: malformed bytes make a condition false, never an
error, so `{not: {header: type, in: [x]}}` does deliver such a message. Every condition is true
or false for every record (never null), so `not`, `all` and `any` are plain boolean logic.

Only main-topic records are filtered: the retry queue holds messages the filter already
accepted, and they are always delivered (or dead-lettered) as if there were no filter. A message
the filter drops is not delivered, not retried and not dead-lettered; it never holds up its group
and is counted as `filtered` (`varadhi.spark.shard.job`, `varadhi.ops.replay`,
`varadhi.library.runtime`).

`parse` validates a document into frozen dataclasses (errors name the dotted field, e.g.
`filter.all[1].prefix`), `to_dict` is its inverse (the catalog form),
`varadhi.spark.columns.filter_column` compiles a filter to a Spark Column over the Kafka source's
`key` and `headers` columns (the shards), and `matches` evaluates it in Python on one record's
key and headers (the library runtime, `varadhi.library`, before it schedules the record). The two
must agree on every input: `tests/spark/test_filters.py` pins them together on one corpus of
awkward records. Nesting is limited
to `MAX_DEPTH` levels and `MAX_CONDITIONS` conditions, so a filter stays a small expression.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from varadhi.core.errors import InvalidArgument
from varadhi.core.record_ids import header_value

MAX_DEPTH = 8
MAX_CONDITIONS = 100
MAX_VALUES = 1000  # in one `in` list

Op = Literal["in", "prefix", "exists"]
_OPS: tuple[Op, ...] = ("in", "prefix", "exists")


@dataclass(frozen=True)
class Match:
    """A test of one field: header `header`, or the record key when `header` is None.

    `op` "in": the text is one of `values`; "prefix": it starts with `values[0]`; "exists": the
    field is present and non-empty, or (`present` False) it is not."""

    header: str | None
    op: Op
    values: tuple[str, ...] = ()
    present: bool = True


@dataclass(frozen=True)
class All:
    conditions: tuple[Filter, ...]


@dataclass(frozen=True)
class AnyOf:
    conditions: tuple[Filter, ...]


@dataclass(frozen=True)
class Not:
    condition: Filter


Filter = Match | All | AnyOf | Not


# -- parsing --------------------------------------------------------------------------------


class _Budget:
    def __init__(self) -> None:
        self.conditions = 0


def parse(doc: Any, field: str = "filter", source: str = "<input>") -> Filter:
    """A validated filter from its document, or `InvalidArgument` naming the offending field
    (`field` is the dotted path of `doc` itself; `source` is quoted in the message)."""
    return _parse(doc, field, source, 1, _Budget())


def _error(field: str, source: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{message} (in {source})", field=field)


def _parse(doc: Any, field: str, source: str, depth: int, budget: _Budget) -> Filter:
    if depth > MAX_DEPTH:
        raise _error(field, source, f"nests more than {MAX_DEPTH} levels deep")
    budget.conditions += 1
    if budget.conditions > MAX_CONDITIONS:
        raise _error(field, source, f"the filter has more than {MAX_CONDITIONS} conditions")
    if not isinstance(doc, Mapping) or not doc:
        raise _error(
            field,
            source,
            "must be a condition: {header: NAME, in|prefix|exists: ...}, "
            f"{{key: {{in|prefix|exists: ...}}}}, {{all: [...]}}, {{any: [...]}} or {{not: ...}}; "
            f"got {doc!r}",
        )
    kinds = [k for k in ("header", "key", "all", "any", "not") if k in doc]
    if len(kinds) != 1:
        what = " and ".join(kinds) if kinds else ", ".join(map(str, doc))
        raise _error(
            field,
            source,
            f"a condition has exactly one of header, key, all, any, not; got {what}",
        )
    kind = kinds[0]
    if kind == "header":
        return _parse_header(doc, field, source)
    if kind == "key":
        _only(doc, ("key",), field, source)
        return _parse_match(doc["key"], None, f"{field}.key", source)
    _only(doc, (kind,), field, source)
    inner = doc[kind]
    if kind == "not":
        return Not(_parse(inner, f"{field}.not", source, depth + 1, budget))
    if not isinstance(inner, list) or not inner:
        raise _error(
            f"{field}.{kind}", source, f"must be a non-empty list of conditions, got {inner!r}"
        )
    conditions = tuple(
        _parse(c, f"{field}.{kind}[{i}]", source, depth + 1, budget) for i, c in enumerate(inner)
    )
    return All(conditions) if kind == "all" else AnyOf(conditions)


def _only(doc: Mapping, allowed: tuple[str, ...], field: str, source: str) -> None:
    unknown = sorted(str(k) for k in doc if k not in allowed)
    if unknown:
        raise _error(
            f"{field}.{unknown[0]}",
            source,
            f"unknown key(s) {', '.join(unknown)} next to {allowed[0]}; allowed: "
            f"{', '.join(allowed)}",
        )


def _parse_header(doc: Mapping, field: str, source: str) -> Match:
    name = doc["header"]
    if not isinstance(name, str) or not name or not name.isprintable():
        raise _error(f"{field}.header", source, f"must be a non-empty header name, got {name!r}")
    return _parse_match({k: v for k, v in doc.items() if k != "header"}, name, field, source)


def _parse_match(doc: Any, header: str | None, field: str, source: str) -> Match:
    """The operator part of a header condition (its keys besides `header`) or of `key: {...}`."""
    if not isinstance(doc, Mapping) or len(doc) != 1 or next(iter(doc)) not in _OPS:
        got = list(doc) if isinstance(doc, Mapping) else doc
        raise _error(field, source, f"needs exactly one of in, prefix, exists; got {got!r}")
    op, operand = next(iter(doc.items()))
    where = f"{field}.{op}"
    if op == "exists":
        if not isinstance(operand, bool):
            raise _error(where, source, f"must be true or false, got {operand!r}")
        return Match(header, "exists", present=operand)
    if op == "prefix":
        return Match(header, "prefix", (_text(operand, where, source),))
    if not isinstance(operand, list) or not operand:
        raise _error(where, source, f"must be a non-empty list of strings, got {operand!r}")
    if len(operand) > MAX_VALUES:
        raise _error(where, source, f"has {len(operand)} values; at most {MAX_VALUES}")
    values = [_text(v, f"{where}[{i}]", source) for i, v in enumerate(operand)]
    # Sorted and distinct: a canonical form, so an unchanged filter compares equal on `apply`.
    return Match(header, "in", tuple(sorted(set(values))))


def _text(value: Any, field: str, source: str) -> str:
    if not isinstance(value, str) or not value:
        hint = ' (quote numbers and booleans: "1")' if not isinstance(value, str) else ""
        raise _error(field, source, f"must be a non-empty string, got {value!r}{hint}")
    return value


def matches(
    f: Filter, key: bytes | None, headers: Sequence[tuple[str, bytes | None]] | None
) -> bool:
    """Whether a record with Kafka key `key` and Kafka headers `headers` ((name, value) pairs, as
    kafka-python gives them) passes `f`, by the comparison rules of the module docstring: the
    first value of a repeated header, UTF-8 text compared exactly, a missing, empty or not-UTF-8
    value matching no `in` or `prefix`. Never raises on a record's bytes (pure)."""
    if isinstance(f, All):
        return all(matches(c, key, headers) for c in f.conditions)
    if isinstance(f, AnyOf):
        return any(matches(c, key, headers) for c in f.conditions)
    if isinstance(f, Not):
        return not matches(f.condition, key, headers)
    data = key if f.header is None else header_value(headers, f.header)
    if f.op == "exists":
        return bool(data) == f.present
    if not data:
        return False
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return text in f.values if f.op == "in" else text.startswith(f.values[0])


def to_dict(f: Filter) -> dict[str, Any]:
    """The document `parse` reads back into an equal filter (JSON-safe)."""
    if isinstance(f, Match):
        body: dict[str, Any]
        if f.op == "exists":
            body = {"exists": f.present}
        elif f.op == "prefix":
            body = {"prefix": f.values[0]}
        else:
            body = {"in": list(f.values)}
        return {"key": body} if f.header is None else {"header": f.header, **body}
    if isinstance(f, Not):
        return {"not": to_dict(f.condition)}
    kind = "all" if isinstance(f, All) else "any"
    return {kind: [to_dict(c) for c in f.conditions]}
