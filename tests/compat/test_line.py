"""The compatibility tier's own check: the session really runs the Spark line the tier was asked
for, with that line's Kafka connector and Delta jars.

`scripts/test --spark-line X` runs the tier (this file and the flows marked `compat` in
tests/integration) in `.venv-sparkXY` with `VARADHI_SPARK_LINE=X`; a full `scripts/test` runs it
on the current line too, where the variable is unset. Without this check a venv or jar folder of
the wrong line would pass the flows on the current Spark and prove nothing about the others.
"""

from __future__ import annotations

import os

import pytest

from varadhi.spark.lines import CURRENT, by_line, line_for

pytestmark = [pytest.mark.compat, pytest.mark.spark]


def test_the_session_runs_the_asked_for_line_with_its_jars(spark):
    expected = by_line(os.environ.get("VARADHI_SPARK_LINE", CURRENT.line))
    assert line_for(spark.version).line == expected.line
    assert spark.version == expected.spark_version
    jars = [os.path.basename(j) for j in spark.conf.get("spark.jars", "").split(",") if j]
    assert f"{expected.delta_artifact}-{expected.delta_version}.jar" in jars
    kafka = f"spark-sql-kafka-0-10_{expected.scala}-{expected.spark_version}.jar"
    assert kafka in jars


def test_a_delta_table_round_trip(spark, tmp_path):
    table = str(tmp_path / "t")
    spark.range(3).write.format("delta").save(table)
    spark.range(3, 5).write.format("delta").mode("append").save(table)
    assert sorted(r.id for r in spark.read.format("delta").load(table).collect()) == [0, 1, 2, 3, 4]
