"""Spark SQL forms of the core's rules, for a query's records: the text forms of record ids
(`varadhi.core.record_ids`) and a subscription filter (`varadhi.core.filters`).

Each is the twin of a pure Python rule in the core and must agree with it on every input:
`tests/spark/test_record_ids.py` and `tests/spark/test_filters.py` pin them together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from varadhi.core import messages as m
from varadhi.core.filters import All, AnyOf, Filter, Not
from varadhi.core.record_ids import B64_MAX_BYTES, B64_PREFIX, SHA256_PREFIX, TEXT_MAX_BYTES

if TYPE_CHECKING:
    from pyspark.sql import Column

_CONTROL_SQL = "[\\x00-\\x1F\\x7F]"  # record_ids' control class, as a Java regular expression


# -- record ids ---------------------------------------------------------------------------------


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


def group_id_column(header: Column | None = None, key_text: Column | None = None) -> Column:
    """A record's group id: the text form of its `varadhi-group-id` header, else of its key;
    null when both are absent or empty (the message is ungrouped). `header`: that header's
    value, and `key_text`: the key's text form, when a column holds it already (default:
    looked up in `headers`, computed from `key`)."""
    from pyspark.sql import functions as F

    header = header_column(m.H_GROUP_ID) if header is None else header
    key_text = text_id_column(F.col("key")) if key_text is None else key_text
    return F.coalesce(text_id_column(header), key_text)


def group_key_column(
    grouped: bool, group_id: Column | None = None, msg_id: Column | None = None
) -> Column:
    """What orders a Kafka record: its group id, else "~" + its message id; always "~" + message
    id when the subscription is ungrouped. `group_id` / `msg_id`: the record's ids as
    `group_id_column` / `msg_id_column` give them (default: those columns).

    Shards, feeders (`varadhi.ops.feeders`) and replay must agree on it: a record's group key
    decides which GroupState entry it belongs to and which shard's partitions a feeder routes it
    to."""
    from pyspark.sql import functions as F

    ungrouped = F.concat(F.lit("~"), msg_id_column() if msg_id is None else msg_id)
    if not grouped:
        return ungrouped
    return F.coalesce(group_id_column() if group_id is None else group_id, ungrouped)


# -- the Spark expression -------------------------------------------------------------------


def filter_column(f: Filter, key: Column | None = None, headers: Column | None = None) -> Column:
    """`f` as a non-null boolean Spark Column over a Kafka record's `key` (binary) and `headers`
    (array of {key: string, value: binary}); by default the Kafka source's own columns."""
    from pyspark.sql import functions as F

    key = F.col("key") if key is None else key
    headers = F.col("headers") if headers is None else headers

    def compile_(f: Filter) -> Column:
        if isinstance(f, All):
            out = compile_(f.conditions[0])
            for c in f.conditions[1:]:
                out = out & compile_(c)
            return out
        if isinstance(f, AnyOf):
            out = compile_(f.conditions[0])
            for c in f.conditions[1:]:
                out = out | compile_(c)
            return out
        if isinstance(f, Not):
            return ~compile_(f.condition)
        data = key if f.header is None else header_of(headers, f.header)
        if f.op == "exists":
            present = F.coalesce(F.length(data) > 0, F.lit(False))
            return present if f.present else ~present
        text = utf8_text_column(data)
        test = text.isin(list(f.values)) if f.op == "in" else text.startswith(f.values[0])
        return F.coalesce(test, F.lit(False))  # missing or not UTF-8: no match, never null

    return compile_(f)
