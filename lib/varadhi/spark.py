"""Building a SparkSession with the Kafka source/sink and Delta wired in.

Locally (tests, demo, `spark-submit.sh`) the jars come from `.jars/spark`, fetched once by
`scripts/setup`; nothing is downloaded at run time. On Databricks and EMR the cluster already has
Delta and the Kafka connector (or the job definition adds them), so `get_spark(local=False)` only
sets the Delta SQL extension and leaves the rest to the cluster.

Hazard: executors run the interpreter named by PYSPARK_PYTHON. Unless it is this project's
environment, executor code fails to import our dependencies (pycurl, mmh3, pyarrow); the launch
scripts set it, and `get_spark` defaults it to the driver's interpreter for local runs.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[2]


def local_jars() -> list[str]:
    jars = sorted(glob.glob(str(ROOT / ".jars" / "spark" / "*.jar")))
    if not jars:
        raise RuntimeError(f"no Spark jars in {ROOT / '.jars' / 'spark'}: run scripts/setup first")
    return jars


def get_spark(app_name: str = "varadhi", local: bool = True, cores: int = 2) -> SparkSession:
    """The active session, or a new one. `local=True` builds `local[cores]` with the project's jars,
    the UI off and few shuffle partitions (small, fast micro-batches)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.databricks.delta.snapshotPartitions", "2")
    )
    if local:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (
            builder.master(os.environ.get("VARADHI_SPARK_MASTER", f"local[{cores}]"))
            .config("spark.jars", ",".join(local_jars()))
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", str(cores))
            .config("spark.default.parallelism", str(cores))
            .config("spark.driver.memory", os.environ.get("VARADHI_DRIVER_MEMORY", "2g"))
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.python.worker.reuse", "true")
            .config("spark.ui.showConsoleProgress", "false")
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("VARADHI_SPARK_LOG_LEVEL", "WARN"))
    return spark
