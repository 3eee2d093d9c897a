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
`text_id_column` (Spark SQL: the group key a batch is partitioned by). They must agree on every
input; `tests/spark/test_record_ids.py` pins them together on a corpus of awkward inputs.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import TYPE_CHECKING

from . import messages as m

if TYPE_CHECKING:
    from pyspark.sql import Column

TEXT_MAX_BYTES = 1024
B64_MAX_BYTES = 256
B64_PREFIX = m.B64_PREFIX
SHA256_PREFIX = "sha256:"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_SQL = "[\\x00-\\x1F\\x7F]"  # the same class, as a Java regular expression


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


def text_id_column(data: Column) -> Column:
    """`text_id` as a Spark column over a binary column."""
    from pyspark.sql import functions as F

    as_text = data.cast("string")
    printable_text = (
        (F.length(data) <= TEXT_MAX_BYTES)
        & _valid_utf8(data, as_text)
        & ~as_text.rlike(_CONTROL_SQL)
    )
    # Spark 4 chunks base64 into 76-character lines (`spark.sql.chunkBase64String.enabled`);
    # a CR/LF would break the HTTP header the id goes into.
    unchunked_b64 = F.regexp_replace(F.base64(data), "[\\r\\n]", "")
    return (
        F.when(data.isNull() | (F.length(data) == 0), F.lit(None).cast("string"))
        .when(printable_text, as_text)
        .when(F.length(data) <= B64_MAX_BYTES, F.concat(F.lit(B64_PREFIX), unchunked_b64))
        .otherwise(F.concat(F.lit(SHA256_PREFIX), F.sha2(data, 256)))
    )


def _valid_utf8(data: Column, as_text: Column) -> Column:
    """Whether binary `data` is valid UTF-8, given `as_text` = CAST(data AS STRING).

    CAST(binary AS STRING) does not check the bytes; encoding the result back gives the same
    bytes only for valid UTF-8 (invalid sequences come back as U+FFFD). Works on Spark 3.5+."""
    from pyspark.sql import functions as F

    return F.encode(as_text, "UTF-8") == data


def utf8_text_column(data: Column) -> Column:
    """Binary `data` as a string when it is valid UTF-8; null when it is not, or null."""
    from pyspark.sql import functions as F

    as_text = data.cast("string")
    return F.when(_valid_utf8(data, as_text), as_text)


def header_of(headers: Column, name: str) -> Column:
    """The first value of Kafka header `name` (binary; null when absent) in a column of the
    Kafka source's `headers` type. Any name is safe: it is a literal, not SQL text.

    Built from expressions Spark generates code for (the position of the first name in the
    names, then the value there): a lambda over the headers would be interpreted, which splits
    the projection out of its generated stage and makes every task generate a projection."""
    from pyspark.sql import functions as F

    # `name` itself, not `F.lit(name)`: PySpark 3.5 takes only a Python value here.
    first = F.array_position(headers["key"], name)  # 1-based; 0 when absent
    return F.get(headers["value"], (first - 1).cast("int"))


def header_column(name: str) -> Column:
    """The first value of Kafka header `name` (binary; null when absent), over the Kafka
    source's `headers` column."""
    from pyspark.sql import functions as F

    return header_of(F.col("headers"), name)


def msg_id_column(header: Column | None = None) -> Column:
    """A record's message id: the text form of its `varadhi-msg-id` header, else
    `<topic>-<partition>-<offset>`. `header`: that header's value, when a column holds it
    already (default: looked up in `headers`)."""
    from pyspark.sql import functions as F

    header = header_column(m.H_MSG_ID) if header is None else header
    return F.coalesce(text_id_column(header), F.concat_ws("-", "topic", "partition", "offset"))


def group_id_column(header: Column | None = None) -> Column:
    """A record's group id: the text form of its `varadhi-group-id` header, else of its key;
    null when both are absent or empty (the message is ungrouped). `header`: that header's
    value, when a column holds it already (default: looked up in `headers`)."""
    from pyspark.sql import functions as F

    header = header_column(m.H_GROUP_ID) if header is None else header
    return F.coalesce(text_id_column(header), text_id_column(F.col("key")))


def group_key_column(
    grouped: bool, group_id: Column | None = None, msg_id: Column | None = None
) -> Column:
    """What orders a Kafka record: its group id, else "~" + its message id; always "~" + message
    id when the subscription is ungrouped. `group_id` / `msg_id`: the record's ids as
    `group_id_column` / `msg_id_column` give them (default: those columns).

    Shards, feeders (`varadhi.resharding`) and replay must agree on it: a record's group key
    decides which GroupState entry it belongs to and which shard's partitions a feeder routes it
    to."""
    from pyspark.sql import functions as F

    ungrouped = F.concat(F.lit("~"), msg_id_column() if msg_id is None else msg_id)
    if not grouped:
        return ungrouped
    return F.coalesce(group_id_column() if group_id is None else group_id, ungrouped)
