"""The supported Spark lines and their jars (`varadhi.spark.lines`)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from varadhi.core.errors import InvalidArgument, UnsupportedSparkVersion
from varadhi.spark.lines import CURRENT, LINES, by_line, line_for, packages


def test_the_supported_lines_current_first():
    assert [line.line for line in LINES] == ["4.1", "4.0", "3.5"]
    assert CURRENT.line == "4.1"


def test_each_entry_is_its_own_line_with_a_release_of_it():
    for line in LINES:
        assert line.spark_version.startswith(line.line + ".")
        assert line.pyspark_pin.startswith(line.line + ".")
        assert line.delta_artifact.endswith("_" + line.scala)


def test_line_for_keeps_the_running_release_in_the_kafka_coordinate():
    line = line_for("3.5.1")
    assert line.line == "3.5"
    assert line.scala == "2.12"
    assert line.kafka_coordinate == "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.1"
    assert line.delta_coordinate == "io.delta:delta-spark_2.12:3.3.2"
    assert line.hadoop_aws_coordinate == "org.apache.hadoop:hadoop-aws:3.3.4"


def test_line_for_drops_a_vendor_suffix():
    assert line_for("3.5.1-amzn-0").spark_version == "3.5.1"
    assert line_for(" 4.0.0 ").kafka_coordinate == (
        "org.apache.spark:spark-sql-kafka-0-10_2.13:4.0.0"
    )


def test_line_for_the_current_line():
    line = line_for("4.1.1")
    assert line == CURRENT
    assert line.delta_coordinate == "io.delta:delta-spark_4.1_2.13:4.1.0"
    assert line_for("4.0.2").delta_coordinate == "io.delta:delta-spark_2.13:4.0.0"


@pytest.mark.parametrize("version", ["3.4.1", "3.3.0", "4.2.0", "5.0.0", "2.4.8", "3.5", "", "x"])
def test_unsupported_versions_are_refused_with_one_line(version):
    with pytest.raises(UnsupportedSparkVersion) as caught:
        line_for(version)
    message = str(caught.value)
    assert "\n" not in message
    assert f"Spark {version} is not supported" in message
    assert "4.1, 4.0, 3.5" in message
    assert isinstance(caught.value, InvalidArgument)
    assert caught.value.exit_code == 2


def test_by_line():
    assert by_line("4.0").spark_version == "4.0.0"
    with pytest.raises(UnsupportedSparkVersion):
        by_line("3.4")


def test_packages_kafka_and_delta_then_extras():
    line = by_line("3.5")
    assert packages(line) == (
        "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.7",
        "io.delta:delta-spark_2.12:3.3.2",
    )
    assert packages(line, ["s3"])[-1] == "org.apache.hadoop:hadoop-aws:3.3.4"
    assert packages(CURRENT, ("s3", "s3")) == (
        "org.apache.spark:spark-sql-kafka-0-10_2.13:4.1.1",
        "io.delta:delta-spark_4.1_2.13:4.1.0",
        "org.apache.hadoop:hadoop-aws:3.4.2",
    )


def test_packages_refuses_an_unknown_extra():
    with pytest.raises(InvalidArgument, match="unknown extra 'gcs'"):
        packages(CURRENT, ["gcs"])


def test_lines_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CURRENT.scala = "2.12"  # type: ignore[misc]


def test_the_current_line_is_what_pyproject_and_the_jars_pin():
    root = Path(__file__).resolve().parents[2]
    pins = (root / "constraints.txt").read_text().splitlines()  # pyproject.toml holds ranges
    assert f"pyspark=={CURRENT.pyspark_pin}" in pins
    assert f"delta-spark=={CURRENT.delta_pip_pin}" in pins
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom = ET.parse(root / "scripts" / "jars" / "spark-pom.xml").getroot()
    assert pom.findtext("m:properties/m:spark.version", namespaces=ns) == CURRENT.spark_version
    assert pom.findtext("m:properties/m:delta.version", namespaces=ns) == CURRENT.delta_version
    artifacts = [
        d.findtext("m:artifactId", namespaces=ns) for d in pom.iterfind(".//m:dependency", ns)
    ]
    assert CURRENT.delta_artifact in artifacts
    assert f"spark-sql-kafka-0-10_{CURRENT.scala}" in artifacts


# The refusals of a new session are checked in a fresh interpreter: this run's own Spark session
# (the spark tier's, in the same pytest process) would otherwise be the active one. In it, starting
# any process (a JVM first of all) fails, so a refusal that came after a JVM start would show as
# that failure instead; no service starts. It reports what it raised and whether a SparkContext or
# a JVM gateway exists afterwards, as one JSON line.
FRESH_PROCESS = """
import json, subprocess, sys
import pyspark
from pyspark import SparkContext

def no_process(self, args, *rest, **kwargs):
    raise RuntimeError(f"a process would start here: {args!r}")

subprocess.Popen._execute_child = no_process  # launch_gateway starts the JVM with Popen

def outcome(error):
    print(json.dumps({
        "error": type(error).__name__ if error else None,
        "message": str(error) if error else None,
        "context": SparkContext._active_spark_context is not None,
        "gateway": SparkContext._gateway is not None,
    }))
"""


def in_a_fresh_process(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS + textwrap.dedent(code)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def outcome_of(code: str) -> dict:
    done = in_a_fresh_process(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_fresh_process_cannot_start_a_jvm():
    """The fresh process's guard holds: a supported pyspark gets as far as starting the JVM."""
    got = outcome_of("""
        from varadhi.spark import session as spark
        try:
            spark.get_spark("varadhi-guard")
        except Exception as e:
            outcome(e)
    """)
    assert got["error"] == "RuntimeError" and "a process would start here" in got["message"]
    assert "spark-submit" in got["message"]
    assert not got["context"] and not got["gateway"]


def test_get_spark_refuses_an_unsupported_pyspark_before_starting_a_jvm():
    got = outcome_of("""
        from varadhi.spark import session as spark
        pyspark.__version__ = "3.4.1"
        try:
            spark.get_spark("varadhi-unsupported")
        except Exception as e:
            outcome(e)
    """)
    assert got["error"] == "UnsupportedSparkVersion", got
    assert "Spark 3.4.1 is not supported" in got["message"]
    assert not got["context"] and not got["gateway"]


@pytest.mark.parametrize("line", [line for line in LINES if line != CURRENT], ids=lambda x: x.line)
def test_each_older_lines_jars_are_pinned_as_the_table_says(line):
    root = Path(__file__).resolve().parents[2]
    line_id = line.line.replace(".", "")
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom = ET.parse(root / "scripts" / "jars" / f"spark{line_id}-pom.xml").getroot()
    assert pom.findtext("m:properties/m:spark.version", namespaces=ns) == line.spark_version
    assert pom.findtext("m:properties/m:delta.version", namespaces=ns) == line.delta_version
    artifacts = [
        d.findtext("m:artifactId", namespaces=ns) for d in pom.iterfind(".//m:dependency", ns)
    ]
    assert artifacts == [
        f"spark-sql_{line.scala}",
        f"spark-sql-kafka-0-10_{line.scala}",
        line.delta_artifact,
    ]
    sums = (root / "scripts" / "jars" / f"spark{line_id}.sha256").read_text()
    assert f"  {line.delta_artifact}-{line.delta_version}.jar" in sums
    assert f"  spark-sql-kafka-0-10_{line.scala}-{line.spark_version}.jar" in sums
    assert f"  hadoop-client-api-{line.hadoop_version}.jar" in sums  # hadoop-aws must match it


def test_get_spark_refuses_an_unsupported_cluster_spark_before_starting_a_jvm():
    got = outcome_of("""
        from varadhi.spark import session as spark
        pyspark.__version__ = "3.3.2"
        try:
            spark.get_spark("varadhi-unsupported", local=False)
        except Exception as e:
            outcome(e)
    """)
    assert got["error"] == "UnsupportedSparkVersion", got
    assert "Spark 3.3.2 is not supported" in got["message"]
    assert not got["context"] and not got["gateway"]


def test_get_spark_refuses_an_active_session_of_an_unsupported_spark(monkeypatch):
    from pyspark.sql import SparkSession

    from varadhi.spark import session as spark

    class Notebook:  # what a notebook's or spark-submit's session reports; only `version` is read
        version = "3.4.1"

    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: Notebook()))
    with pytest.raises(UnsupportedSparkVersion, match="Spark 3.4.1 is not supported"):
        spark.get_spark("varadhi-unsupported")


def test_a_job_on_an_unsupported_spark_stops_with_one_line_and_exit_2():
    done = in_a_fresh_process("""
        from varadhi.jobs import runner
        pyspark.__version__ = "3.4.1"
        code = runner.main(["smoke_count", "--topic", "orders.0"])
        outcome(None)
        sys.exit(code)
    """)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "varadhi: Spark 3.4.1 is not supported (supported lines: 4.1, 4.0, 3.5)\n"
    got = json.loads(done.stdout.splitlines()[-1])
    assert not got["context"] and not got["gateway"]
