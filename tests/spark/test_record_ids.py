"""The Spark and Python forms of `varadhi.core.record_ids` agree on every awkward input."""

from __future__ import annotations

from varadhi.core.record_ids import text_id
from varadhi.spark.columns import text_id_column

CORPUS = [
    None,
    b"",
    b"customer-42",
    "größe-日本-😀".encode(),
    b"\xff\xfe",
    b"\x00\x00\x00\x00\x07\x06abc",
    b"a\r\nb",
    b"\x7f",
    b"\xed\xa0\x80",
    b"\xc0\xaf",  # overlong encoding of '/'
    b"\xf4\x90\x80\x80",  # beyond U+10FFFF
    b"b64:AAAA",
    b"x" * 1024,
    b"x" * 1025,
    b"\xff" * 256,
    b"\xff" * 257,
    "é".encode() * 512,
    "é".encode() * 513,
]


def test_spark_and_python_agree(spark):
    frame = spark.createDataFrame([(i, d) for i, d in enumerate(CORPUS)], "i int, data binary")
    rows = frame.select("i", text_id_column(frame["data"]).alias("text")).toPandas()
    got = {
        int(i): (None if t is None else str(t))
        for i, t in zip(rows["i"], rows["text"], strict=True)
    }
    assert got == {i: text_id(d) for i, d in enumerate(CORPUS)}
