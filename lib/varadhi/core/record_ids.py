"""Binary-safe text forms of the ids a Kafka record carries, for records any producer wrote.

A record's group id (its `varadhi-group-id` header, else its key) and message id (its
`varadhi-msg-id` header, else `<topic>-<partition>-<offset>`) become HTTP header values, Delta
strings and Arrow strings. Producers other than ours write keys and headers in any binary form:
Avro or Protobuf keys with a Schema Registry frame (a zero byte and a four-byte schema id before
the payload), bytes that are not UTF-8, control characters, megabytes. So every id is turned into
its *text form* by one rule (`text_id`):

| the bytes                                                      | text form                    |
|----------------------------------------------------------------|------------------------------|
| absent or empty                                                | none (the id is missing)     |
| valid UTF-8, no control character (U+0000-U+001F, U+007F), at most 1024 bytes | the text itself |
| anything else of at most 256 bytes                             | `b64:` + standard base64     |
| anything else                                                  | `sha256:` + hex SHA-256      |

Every text form is valid UTF-8, printable and at most 1024 bytes, so it is its own text form:
the RQ and DLQ copies of a record carry the text forms of its ids and map to the same group key
when read back. Two different ids share a text form only if a text id itself starts with `b64:`
or `sha256:` and equals another's encoding, or by a SHA-256 collision; either would only make two
groups one (more ordering, nothing lost).

The rule exists twice, as `text_id` (Python: executors, kafka-python readers) and as
`varadhi.spark.columns.text_id_column` (Spark SQL: the group key a batch is partitioned by). They must agree on every
input; `tests/spark/test_record_ids.py` pins them together on a corpus of awkward inputs.
"""

from __future__ import annotations

import base64
import hashlib
import re

from varadhi.core import messages as m

TEXT_MAX_BYTES = 1024
B64_MAX_BYTES = 256
B64_PREFIX = m.B64_PREFIX
SHA256_PREFIX = "sha256:"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def text_id(data: bytes | None) -> str | None:
    """The text form of an id's bytes (see the module docstring); None when absent or empty."""
    if not data:
        return None
    data = bytes(data)
    if len(data) <= TEXT_MAX_BYTES:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and not _CONTROL.search(text):
            return text
    if len(data) <= B64_MAX_BYTES:
        return B64_PREFIX + base64.b64encode(data).decode("ascii")
    return SHA256_PREFIX + hashlib.sha256(data).hexdigest()


def header_value(headers, name: str) -> bytes | None:
    """The first value of header `name` among (key, value) pairs (Spark's rows or
    kafka-python's tuples), as the Spark side (`header_column`) takes it."""
    for k, v in headers or ():
        if k == name:
            return None if v is None else bytes(v)
    return None


def record_ids(
    topic: str, partition: int, offset: int, key: bytes | None, headers
) -> tuple[str, str | None]:
    """A record's message id and group id, in text form, by the module docstring's rule (the
    kafka-python readers: a library member's intake, the DLQ's listing); None: no group id."""
    msg_id = text_id(header_value(headers, m.H_MSG_ID)) or f"{topic}-{partition}-{offset}"
    return msg_id, text_id(header_value(headers, m.H_GROUP_ID)) or text_id(key)
