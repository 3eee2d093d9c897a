"""A class-data archive (AppCDS) of the Spark driver JVM: a faster, cheaper JVM start.

A Spark driver spends much of its first seconds loading, parsing and verifying thousands of
classes. The JVM can map them ready-made from an archive written once by an earlier JVM that
loaded them (`-XX:ArchiveClassesAtExit`, then `-XX:SharedArchiveFile`). `scripts/setup` writes
it to `.jars/cds/spark-<pyspark version>.jsa` with `varadhi.spark.class_archive_build` (a local session doing what a shard
does: Delta, Arrow, a Python UDF, the Kafka source), and every driver JVM of a checkout with that
pyspark uses it: `./spark-submit.sh` and `get_spark` (local, `launch_env`) put `java_options()`
into `SPARK_SUBMIT_OPTS`, which Spark's launcher gives the driver JVM. bench/startup.py measures
what it saves (docs/benchmarks.md).

Hazards:
- The archive belongs to one JDK build and one set of Spark jars (the class path it was built
  with must begin the JVM's class path). After a change the JVM does not use it, prints one
  warning (on stderr: the options send the JVM's log warnings there, not to stdout) and starts
  as it would without it; `scripts/setup` builds it again when its stamp changes.
- No option is given without the file: `-XX:SharedArchiveFile` naming a missing file turns off
  the JDK's own default archive too, which would make the start slower.
- Only the driver JVM uses it: a cluster's executors (and `--cluster` jobs) start as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# A source checkout's archives (lib/varadhi/spark/class_archive.py -> the checkout); none when installed.
FOLDER = Path(__file__).resolve().parents[3] / ".jars" / "cds"
OPTS_ENV = "SPARK_SUBMIT_OPTS"
# JVM log warnings (an archive built for other jars, for one) go to stderr, never into a job's
# stdout.
LOG_TO_STDERR = "-Xlog:disable -Xlog:all=warning:stderr"


def archive_path(spark_version: str | None = None, folder: Path = FOLDER) -> Path:
    """The archive of the driver JVM of `spark_version` (default: the installed pyspark's):
    each Spark line of a checkout (`scripts/setup --spark-line`) has its own jars."""
    if spark_version is None:
        import pyspark

        spark_version = pyspark.__version__
    return folder / f"spark-{spark_version}.jsa"


def java_options(archive: Path) -> str:
    """The driver JVM's options that use `archive`; "" when the file does not exist."""
    return f"-XX:SharedArchiveFile={archive} {LOG_TO_STDERR}" if archive.is_file() else ""


def with_archive(opts: str | None, archive: Path) -> str:
    """`opts` (a `SPARK_SUBMIT_OPTS` value) with `java_options(archive)` added, unless they
    name a class-data archive already (pure but for the file's existence)."""
    opts = (opts or "").strip()
    if "SharedArchiveFile" in opts or "ArchiveClassesAtExit" in opts:
        return opts
    return " ".join(filter(None, [opts, java_options(archive)]))


@contextmanager
def launch_env(archive: Path | None) -> Iterator[None]:
    """Within the block, `SPARK_SUBMIT_OPTS` names `archive` (`with_archive`), for a driver JVM
    this process launches there (`SparkSession.builder.getOrCreate`); restored afterwards, so
    other programs this process starts (another Spark, with other jars) never inherit it.
    `archive` None: nothing changes."""
    if archive is None:
        yield
        return
    before = os.environ.get(OPTS_ENV)
    os.environ[OPTS_ENV] = with_archive(before, archive)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OPTS_ENV, None)
        else:
            os.environ[OPTS_ENV] = before
