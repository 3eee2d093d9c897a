"""A subscription filter compiled to Spark (`varadhi.spark.columns.filter_column`) on records of every awkward
shape, pinned to its Python twin (`varadhi.core.filters.matches`, the library runtime's) on the same
corpus, and `varadhi.spark.records.filter_records`: main-topic records only, counted, before Python."""

from __future__ import annotations

import pandas as pd
import pytest
from pyspark.sql import functions as F

from varadhi.core import filters
from varadhi.spark.columns import filter_column
from varadhi.spark.records import filter_records

SCHEMA = "i int, kind string, key binary, kheaders array<struct<key:string,value:binary>>"

# (key, headers) per record; the comments say what the filters below see.
CORPUS = [
    (b"tenant-7/a", [("type", b"order.created"), ("region", b"eu-west")]),  # 0
    (b"tenant-8/b", [("type", b"order.paid"), ("region", b"us-east")]),  # 1
    (b"tenant-7/c", [("region", b"eu-north")]),  # 2: no type
    (None, [("type", b"\xff\xfeorder.created"), ("region", b"eu-\xff")]),  # 3: not UTF-8
    (b"", [("type", b""), ("region", None)]),  # 4: empty key, empty and null values
    (b"\xfftenant-7/", None),  # 5: no headers at all, a key that is not UTF-8
    (b"k", [("type", b"order.viewed"), ("type", b"order.paid")]),  # 6: repeated, first counts
    (b"k", [('it\'s "odd"', b"v"), ("Type", b"order.paid")]),  # 7: odd name; names are exact
    (b"k", [("type", "größe-日本".encode()), ("region", b"eu-")]),  # 8
    # 9: a surrogate key; a surrogate in type; an overlong '/' in region: none is UTF-8
    (b"\xed\xa0\x80", [("type", b"\xed\xa0\x80order.paid"), ("region", b"eu-\xc0\xaf")]),
    # 10: a NUL in key and type (valid UTF-8); region's first value null, its second ignored
    (b"tenant-7/\x00x", [("region", None), ("region", b"eu-late"), ("type", b"order.paid\x00")]),
    (b"k", []),  # 11: an empty header list
    (b"\xf4\x90\x80\x80", [("type", "größe".encode())]),  # 12: a key beyond U+10FFFF
]

CASES = [
    ({"header": "type", "in": ["order.created", "order.paid"]}, {0, 1}),
    ({"header": "type", "in": ["größe-日本"]}, {8}),
    ({"header": "type", "prefix": "größe"}, {8, 12}),
    ({"header": "region", "prefix": "eu-"}, {0, 2, 8}),  # 3's and 9's values are not UTF-8
    ({"header": "region", "exists": True}, {0, 1, 2, 3, 8, 9}),  # 4's and 10's first are null
    ({"header": "type", "exists": False}, {2, 4, 5, 7, 11}),
    ({"header": 'it\'s "odd"', "in": ["v"]}, {7}),
    ({"key": {"prefix": "tenant-7/"}}, {0, 2, 10}),
    ({"key": {"in": ["k", "tenant-8/b"]}}, {1, 6, 7, 8, 11}),
    ({"key": {"exists": False}}, {3, 4}),
    (
        {"not": {"header": "type", "in": ["order.created", "order.paid"]}},
        {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12},
    ),
    (
        {
            "all": [
                {"header": "type", "in": ["order.created", "order.paid"]},
                {"header": "region", "prefix": "eu-"},
            ]
        },
        {0},
    ),
    (
        {"any": [{"key": {"prefix": "tenant-8/"}}, {"not": {"header": "region", "exists": True}}]},
        {1, 4, 5, 6, 7, 10, 11, 12},
    ),
]


@pytest.fixture(scope="module")
def corpus(spark):
    rows = [(i, "mq", k, h) for i, (k, h) in enumerate(CORPUS)]
    return spark.createDataFrame(rows, SCHEMA)


@pytest.mark.parametrize(("doc", "expected"), CASES)
def test_filter_column_and_its_python_twin_agree(corpus, doc, expected):
    f = filters.parse(doc)
    keep = filter_column(f, corpus["key"], corpus["kheaders"])
    frame = corpus.select("i", keep.alias("keep")).toPandas()
    assert frame["keep"].notna().all()  # never null, whatever the bytes
    assert {int(i) for i in frame.loc[frame["keep"], "i"]} == expected
    assert {i for i, (k, h) in enumerate(CORPUS) if filters.matches(f, k, h)} == expected


def test_default_columns_are_the_kafka_sources(spark):
    frame = spark.createDataFrame(
        [(0, b"a", [("type", b"x")]), (1, b"b", [("type", b"y")])],
        "i int, key binary, headers array<struct<key:string,value:binary>>",
    )
    f = filters.parse({"all": [{"header": "type", "in": ["x"]}, {"key": {"in": ["a"]}}]})
    assert [r.i for r in frame.where(filter_column(f)).collect()] == [0]


def seen_by_python(frame) -> pd.DataFrame:
    """What a mapInPandas stage (the delivery path) receives of `frame`, via toPandas as the
    shard collects its results."""

    def stage(frames):
        yield from (f[["i", "kind"]] for f in frames)

    return frame.coalesce(2).mapInPandas(stage, "i int, kind string").toPandas()


def test_filter_records_drops_unmatched_main_topic_records_before_python(spark):
    rows = [(i, "mq", k, h) for i, (k, h) in enumerate(CORPUS)]
    rows += [(100 + i, "rq", k, h) for i, (k, h) in enumerate(CORPUS[:4])]  # retries: all kept
    frame = spark.createDataFrame(rows, SCHEMA)
    f = filters.parse({"header": "type", "in": ["order.created", "order.paid"]})

    kept, observed = filter_records(frame, f)
    seen = seen_by_python(kept)

    assert sorted(seen["i"]) == [0, 1, 100, 101, 102, 103]
    assert observed is not None and observed.get["filtered"] == len(CORPUS) - 2
    assert list(kept.columns) == list(frame.columns)


def test_a_traced_filter_names_the_messages_it_drops(spark):
    """With the delivery trace on, the Observation also lists the dropped main-topic records'
    ids (the shard's driver traces them as `filtered`); RQ records are never among them."""
    rows = [(i, "mq", k, h) for i, (k, h) in enumerate(CORPUS)]
    rows += [(100 + i, "rq", k, h) for i, (k, h) in enumerate(CORPUS[:4])]
    frame = (
        spark.createDataFrame(rows, SCHEMA)
        .withColumn("msg_id", F.concat(F.lit("m"), F.col("i").cast("string")))
        .withColumn("group_id", F.when(F.col("i") % 2 == 0, F.lit("even")))
    )
    f = filters.parse({"header": "type", "in": ["order.created", "order.paid"]})
    kept, observed = filter_records(frame, f, traced=True)
    assert sorted(r["i"] for r in kept.collect()) == [0, 1, 100, 101, 102, 103]
    traced = sorted((r["msg_id"], r["group_id"]) for r in observed.get["traced"])
    expected = [(f"m{i}", "even" if i % 2 == 0 else None) for i in range(2, len(CORPUS))]
    assert traced == sorted(expected)


def test_filter_records_counts_zero_on_an_empty_batch_and_is_absent_without_a_filter(spark):
    empty = spark.createDataFrame([], SCHEMA)
    kept, observed = filter_records(empty, filters.parse({"key": {"exists": True}}))
    assert seen_by_python(kept).empty
    assert observed is not None and observed.get["filtered"] == 0

    frame = spark.createDataFrame([(0, "mq", None, None)], SCHEMA)
    same, none = filter_records(frame, None)
    assert same is frame and none is None
