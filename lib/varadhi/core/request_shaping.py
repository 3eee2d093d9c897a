"""Request shaping (`endpoint.forward_headers`, `endpoint.path`, `endpoint.key_header`): what of a
Kafka record, besides its value, a single request carries. Pure.

- `forward_headers` maps chosen Kafka header names to HTTP header names: an allow-list, so a
  producer cannot set arbitrary request headers. A record without the header sends none.
- `path` is a template appended to the endpoint URL's path, over the record's headers:
  `/orders/{header:tenant}`. Each value is percent-encoded as one path segment (a `/` in it
  becomes `%2F`), and `.`/`..` or an empty value are refused, so no value can climb the URL.

- `key_header` names the HTTP header that carries the record's Kafka key in its text form (the
  rule of `varadhi.core.record_ids.text_id`: the key itself when it is printable UTF-8 of at most
  1024 bytes, else `b64:`/`sha256:` forms); a record without a key (or an empty one) sends none.
  The key need not be the group id (a `varadhi-group-id` header wins over it), and the RQ
  and DLQ copies of a message are keyed by its group id, so the key travels with the message in
  the shard-only header `messages.H_KEY`: the shard's Spark plan computes the key's text form
  only while `key_header` is set (no Arrow column otherwise) and `varadhi.spark.batch.record_entry`
  puts it into the entry's headers, which state rows and RQ/DLQ copies keep (and re-drives from
  the DLQ, and `varadhi replay`, which reads the main topic again). Hazard: a message already
  waiting in the RQ, the DLQ or the state when `key_header` is first set has no such header and is
  sent without the key header.

A message whose headers cannot be shaped (a header the path needs is missing, a value with a
CR/LF, a `..` segment) cannot be delivered: building its request raises `InvalidArgument`, and
the shard dead-letters it as malformed with the reason, in order, like a message with a bad id.
Batched requests carry several messages in one request, so shaping is for single mode only
(`check_mode`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import quote

from varadhi.core.errors import InvalidArgument
from varadhi.core.messages import H_KEY
from varadhi.core.policies import RequestShaping

# `{header:NAME}`, NAME a Kafka header name without braces
_PLACEHOLDER = re.compile(r"\{header:([^{}]+)\}")
# What a template's literal text may hold: RFC 3986 path characters, no `%` escapes of its own.
_LITERAL = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")
_BAD_VALUE = re.compile("[\r\n\0]")


def placeholders(template: str) -> list[str]:
    """The Kafka header names a path template reads, in order. Raises ValueError saying what is
    wrong with the template (module docstring)."""
    if not template.startswith("/"):
        raise ValueError(f"must start with /, got {template!r}")
    names: list[str] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        _check_literal(template[pos : m.start()])
        names.append(m.group(1))
        pos = m.end()
    _check_literal(template[pos:])
    segments = _PLACEHOLDER.sub("x", template).split("/")
    if any(s in (".", "..") for s in segments) or "//" in template:
        raise ValueError(f"must not hold '.', '..' or '//' segments, got {template!r}")
    return names


def _check_literal(text: str) -> None:
    if "{" in text or "}" in text:
        raise ValueError(f"{text!r} has an unknown placeholder: use {{header:NAME}}")
    if not _LITERAL.fullmatch(text):
        raise ValueError(f"{text!r} holds characters a URL path cannot (?, #, %, spaces...)")


def render_path(template: str, headers: Mapping[str, str]) -> str:
    """The path of one request. Raises InvalidArgument (field `endpoint.path`) when a value is
    missing, empty, `.`/`..`, or holds CR/LF/NUL."""

    def value(m: re.Match) -> str:
        name = m.group(1)
        text = headers.get(name)
        what = f"header {name!r}"
        if text is None or text in ("", ".", ".."):
            raise InvalidArgument(
                f"{what} is missing, empty, '.' or '..': no path for {template!r}",
                field="endpoint.path",
            )
        if _BAD_VALUE.search(text):
            raise InvalidArgument(f"{what} has a CR, LF or NUL", field="endpoint.path")
        return quote(text, safe="")

    return _PLACEHOLDER.sub(value, template)


def shaped_headers(shaping: RequestShaping, headers: Mapping[str, str]) -> dict[str, str]:
    """The HTTP headers a message's headers give: the forwarded Kafka headers and, with
    `key_header`, the key's text form from `messages.H_KEY` (absent ones give none)."""
    out: dict[str, str] = {}
    for kafka_name, http_name in shaping.forward_headers:
        value = headers.get(kafka_name)
        if value is not None:
            out[http_name] = value
    if shaping.key_header is not None:
        key = headers.get(H_KEY)
        if key:
            out[shaping.key_header] = key
    return out


def fields_set(shaping: RequestShaping) -> list[str]:
    """The names of the `endpoint` fields of `shaping` that are set."""
    given = (
        ("path", shaping.path is not None),
        ("forward_headers", bool(shaping.forward_headers)),
        ("key_header", shaping.key_header is not None),
    )
    return [name for name, is_set in given if is_set]


def check_mode(shaping: RequestShaping, mode: str) -> str | None:
    """Why shaping cannot be used in delivery mode `mode`, or None."""
    if mode == "batch" and fields_set(shaping):
        return "applies to single requests only; delivery.mode batch sends many messages at once"
    return None
