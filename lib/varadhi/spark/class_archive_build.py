"""Writes the class-data archive of the Spark driver JVM (`varadhi.spark.class_archive`): a local
session doing what a shard does (Delta, Arrow, a Python UDF, the Kafka source), whose JVM dumps
the classes it loaded when it exits. Run by scripts/setup:

    python -m varadhi.spark.class_archive_build [ARCHIVE]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from varadhi.spark.class_archive import LOG_TO_STDERR, OPTS_ENV, archive_path
from varadhi.spark.session import get_spark


def _workload(spark, folder: str) -> None:
    """What a shard's start loads: a Delta table written and read, Arrow to pandas, a
    mapInPandas job (Python workers), and the Kafka source and sink resolved (not connected)."""
    table = f"{folder}/table"
    spark.range(10).withColumnRenamed("id", "n").write.format("delta").save(table)
    from delta.tables import DeltaTable

    DeltaTable.isDeltaTable(spark, table)
    df = spark.read.format("delta").load(table)
    df.mapInPandas(lambda batches: batches, df.schema).toPandas()
    for read in (spark.read, spark.readStream):  # resolving the source connects to nothing
        read.format("kafka").option("kafka.bootstrap.servers", "127.0.0.1:9").option(
            "assign", '{"t": [0]}'
        ).load()


def build(archive: Path | None = None) -> Path:
    """Write the archive: start a local driver JVM that dumps the classes it loaded at its
    exit, run `_workload`, stop it and wait for the dump. Replaces `archive` only once the new
    one is complete. Run by scripts/setup (a minute or so on 2 cores)."""
    from pyspark import SparkContext

    archive = archive or archive_path()
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".jsa.partial")
    partial.unlink(missing_ok=True)
    os.environ[OPTS_ENV] = f"-XX:ArchiveClassesAtExit={partial} {LOG_TO_STDERR}"
    folder = tempfile.mkdtemp(prefix="varadhi-class-archive-")
    try:
        spark = get_spark("varadhi-class-archive")
        _workload(spark, folder)
        gateway = SparkContext._gateway
        spark.stop()
        assert gateway is not None and gateway.proc is not None
        gateway.shutdown()
        gateway.proc.stdin.close()  # the JVM exits when its stdin closes, then writes the dump
        gateway.proc.wait(600)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not partial.is_file():
        raise RuntimeError(f"the JVM wrote no class-data archive at {partial}")
    partial.replace(archive)
    return archive


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
