"""The ordering key of a message: which messages of a partition must be delivered one after
another (pure).

By default it is the message's group id (`varadhi-group-id` header, else the record key, as
`varadhi.core.record_ids` reads it). A consumer may instead order by the record key alone,
by another header, or by a value inside a JSON body (an RFC 6901 JSON pointer). A message
without a key (no such header, a body that is not JSON or lacks the pointer) is *unordered*:
it is delivered concurrently with everything else, as an ungrouped message is by the shards.

Text forms: a header value is the text `messages.headers_to_dict` made of it; a record key is
its `record_ids.text_id`; a JSON value is the string itself, or the compact JSON text of any
other value (so `42` and `"42"` are different keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from varadhi.core import messages as m
from varadhi.core.errors import InvalidArgument
from varadhi.core.record_ids import text_id

Kind = Literal["group-id", "record-key", "header", "json"]

_MISSING = object()


@dataclass(frozen=True)
class OrderingKey:
    """How a message's ordering key is found. `name` is the header's name (`header`) or the
    JSON pointer (`json`); empty for the others. `parse` reads the command line's form."""

    kind: Kind = "group-id"
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> OrderingKey:
        """`group-id`, `record-key`, `header:NAME` or `json:/POINTER`; InvalidArgument (field
        `ordering-key`) otherwise."""
        if text in ("group-id", "record-key"):
            return cls(text)  # type: ignore[arg-type]
        kind, _, rest = text.partition(":")
        if kind == "header" and rest:
            return cls("header", rest)
        if kind == "json":
            _pointer_tokens(rest)  # validates
            return cls("json", rest)
        raise InvalidArgument(
            f"must be group-id, record-key, header:NAME or json:/POINTER, got {text!r}",
            field="ordering-key",
        )

    def describe(self) -> str:
        return self.kind if not self.name else f"{self.kind}:{self.name}"


def ordering_key(
    rule: OrderingKey, key: bytes | None, headers: dict[str, str], value: bytes | None
) -> str | None:
    """The message's ordering key by `rule`, or None when it has none (delivered unordered).
    `headers` as `messages.headers_to_dict` makes them. Never raises on what a producer wrote."""
    if rule.kind == "group-id":
        return headers.get(m.H_GROUP_ID) or text_id(key)
    if rule.kind == "record-key":
        return text_id(key)
    if rule.kind == "header":
        return headers.get(rule.name) or None
    return json_key(rule.name, value)


def json_key(pointer: str, value: bytes | None) -> str | None:
    """The value at JSON pointer `pointer` in `value` as a key (see the module docstring); None
    when `value` is not JSON or has nothing there (or null)."""
    if not value:
        return None
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return None
    for token in _pointer_tokens(pointer):
        if isinstance(doc, dict):
            doc = doc.get(token, _MISSING)
        elif isinstance(doc, list) and token.isdigit() and (token == "0" or token[0] != "0"):
            index = int(token)
            doc = doc[index] if index < len(doc) else _MISSING
        else:
            return None
        if doc is _MISSING:
            return None
    if doc is None:
        return None
    if isinstance(doc, str):
        return doc or None
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def _pointer_tokens(pointer: str) -> list[str]:
    """The reference tokens of an RFC 6901 pointer (`""` is the whole document; otherwise it
    starts with `/`; `~1` is `/` and `~0` is `~`). InvalidArgument for a malformed one."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise InvalidArgument(
            f"a JSON pointer starts with '/', got {pointer!r}", field="ordering-key"
        )
    tokens = pointer[1:].split("/")
    for token in tokens:
        if "~" in token.replace("~0", "").replace("~1", ""):
            raise InvalidArgument(
                f"'~' must be followed by 0 or 1 in a JSON pointer, got {pointer!r}",
                field="ordering-key",
            )
    return [t.replace("~1", "/").replace("~0", "~") for t in tokens]
