"""The Spark lines varadhi supports, and the jars that match each of them.

A Spark "line" is a major.minor release (4.1, 4.0, 3.5); every patch release of a line runs the
same jars. The table below is the one place that says, per line, which Scala binary version its
builds use, which Kafka connector, Delta and hadoop-aws coordinates match it, and which pyspark and
delta-spark releases the tests run it with (`scripts/setup --spark-line X`).

Contracts:
- `line_for(version)` accepts what `spark.version` reports on a cluster ("3.5.1", "3.5.1-amzn-0",
  "4.0.0") and returns that line with `spark_version` set to the running release's number, so the
  Kafka connector coordinate names exactly the running Spark (the connector is built per release).
  Anything outside the table raises `UnsupportedSparkVersion`, before any side effect.
- `packages(line, extras)` gives `--packages` / `spark.jars.packages` coordinates: the Kafka
  connector and Delta always (every job reads Kafka and keeps state in Delta), plus the named
  extras ("s3": hadoop-aws, matching the line's bundled Hadoop; "msk-iam": aws-msk-iam-auth,
  Amazon MSK IAM's login handler for the Kafka source/sink, `varadhi.kafka.config.MSK_IAM_PACKAGE`).

Hazards:
- hadoop-aws must be the very Hadoop version the Spark build bundles (hadoop-client-api's);
  a different one fails at run time with NoSuchMethodError, not at start.
- Delta's artifact name changed: 3.x and 4.0 are `delta-spark_<scala>`, 4.1 is
  `delta-spark_4.1_<scala>`. The table holds the full artifact, never a derived one.
- On Databricks the runtime brings its own Delta and Kafka connector; `packages` is for clusters
  that do not (EMR, spark-submit on YARN/Kubernetes, local runs).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from varadhi.core.errors import InvalidArgument, UnsupportedSparkVersion
from varadhi.kafka.config import MSK_IAM_PACKAGE


@dataclass(frozen=True)
class SparkLine:
    """One supported Spark line. `spark_version` is the release in use (the tested one in `LINES`,
    the running one from `line_for`)."""

    line: str  # "4.1"
    spark_version: str  # "4.1.1"
    scala: str  # Scala binary version of the line's builds: "2.13" / "2.12"
    delta_artifact: str  # "delta-spark_4.1_2.13"
    delta_version: str  # "4.1.0"
    hadoop_version: str  # the Hadoop the Spark build bundles (hadoop-client-api)
    pyspark_pin: str  # the pyspark release the tests run this line with
    delta_pip_pin: str  # the delta-spark (PyPI) release the tests run this line with

    @property
    def kafka_coordinate(self) -> str:
        return f"org.apache.spark:spark-sql-kafka-0-10_{self.scala}:{self.spark_version}"

    @property
    def delta_coordinate(self) -> str:
        return f"io.delta:{self.delta_artifact}:{self.delta_version}"

    @property
    def hadoop_aws_coordinate(self) -> str:
        return f"org.apache.hadoop:hadoop-aws:{self.hadoop_version}"


LINES: tuple[SparkLine, ...] = (
    SparkLine(
        line="4.1",
        spark_version="4.1.1",
        scala="2.13",
        delta_artifact="delta-spark_4.1_2.13",
        delta_version="4.1.0",
        hadoop_version="3.4.2",
        pyspark_pin="4.1.1",
        delta_pip_pin="4.1.0",
    ),
    SparkLine(
        line="4.0",
        spark_version="4.0.0",
        scala="2.13",
        delta_artifact="delta-spark_2.13",
        delta_version="4.0.0",
        hadoop_version="3.4.1",
        pyspark_pin="4.0.0",
        delta_pip_pin="4.0.0",
    ),
    SparkLine(
        line="3.5",
        spark_version="3.5.7",
        scala="2.12",
        delta_artifact="delta-spark_2.12",
        delta_version="3.3.2",
        hadoop_version="3.3.4",
        pyspark_pin="3.5.7",
        delta_pip_pin="3.3.2",
    ),
)
CURRENT = LINES[0]

EXTRAS = ("s3", "msk-iam")

_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)(?:[-+.][0-9A-Za-z.+-]*)?")


def supported_text() -> str:
    return ", ".join(line.line for line in LINES)


def by_line(line: str) -> SparkLine:
    """The table's entry for a line name ("3.5"); `UnsupportedSparkVersion` for any other."""
    for entry in LINES:
        if entry.line == line:
            return entry
    raise UnsupportedSparkVersion(line, supported_text())


def line_for(spark_version: str) -> SparkLine:
    """The supported line of a running Spark release, carrying that release's number.

    Vendor suffixes are accepted ("3.5.1-amzn-0" is 3.5.1); a version without a patch number or
    outside the supported lines raises `UnsupportedSparkVersion`."""
    match = _VERSION.fullmatch(spark_version.strip())
    if match is None:
        raise UnsupportedSparkVersion(spark_version, supported_text())
    major, minor, patch = match.groups()
    try:
        entry = by_line(f"{major}.{minor}")
    except UnsupportedSparkVersion:
        raise UnsupportedSparkVersion(spark_version, supported_text()) from None
    return replace(entry, spark_version=f"{major}.{minor}.{patch}")


def packages(line: SparkLine, extras: Iterable[str] = ()) -> tuple[str, ...]:
    """Maven coordinates for `--packages`: the Kafka connector, Delta, then each extra in order.

    `extras` names from `EXTRAS`; an unknown one raises `InvalidArgument`."""
    coordinates = [line.kafka_coordinate, line.delta_coordinate]
    for extra in extras:
        if extra == "s3":
            coordinates.append(line.hadoop_aws_coordinate)
        elif extra == "msk-iam":  # the JVM side of Amazon MSK IAM (any Spark line)
            coordinates.append(MSK_IAM_PACKAGE)
        else:
            raise InvalidArgument(
                f"unknown extra {extra!r} (known: {', '.join(EXTRAS)})", field="extras"
            )
    return tuple(dict.fromkeys(coordinates))
