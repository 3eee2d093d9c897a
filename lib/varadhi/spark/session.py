"""Building a SparkSession with the Kafka source/sink and Delta wired in.

A local session (`get_spark(local=True)`: tests, the demo, `varadhi-job`, `python -m
varadhi.jobs.*`) needs the Kafka connector and Delta jars, found by configuration, first match:

1. `$VARADHI_SPARK_JARS`: comma-separated jar files or folders (every `*.jar` in a folder);
2. `$VARADHI_SPARK_PACKAGES`: comma-separated Maven coordinates, which Spark downloads (Ivy) at
   start; `auto` stands for `spark_packages()` of the installed pyspark (Kafka connector, Delta);
3. jars or packages the launch already names (`spark-submit --jars/--packages`,
   `spark.jars[.packages]` in `$SPARK_CONF_DIR/spark-defaults.conf`, `$PYSPARK_SUBMIT_ARGS`):
   used as they are (under `spark-submit` these are the only ones that count);
4. in a source checkout only, `.jars/spark` (fetched once by `scripts/setup`), the development
   default; an installed package has no such folder.

With none of them `get_spark` refuses in one line (`InvalidArgument`) naming the coordinates for
the running Spark. `jar_settings` is that decision, pure; `get_spark` does the I/O around it.

A warehouse on S3 or an S3-compatible store (`s3a://`): in a checkout, hadoop-aws and the AWS SDK
bundle come from `.jars/s3a` (on the JVM class path, `s3a_classpath`); `VARADHI_S3A_*` variables
give every session its `fs.s3a.*` settings (`varadhi.spark.s3a.hadoop_conf`,
docs/object-storage.md).

On Databricks and EMR the cluster already has Delta and the Kafka connector (or the job definition
adds them), so `get_spark(local=False)` only sets the Delta SQL extension and leaves the rest to
the cluster. `spark_packages()` gives the `--packages` coordinates that match a Spark version
(`varadhi.spark.lines`); an unsupported version raises `UnsupportedSparkVersion`.

Hazards:
- Under `spark-submit` the JVM is already running when Python starts: jars set on the session
  then miss the driver's class path ("Failed to find data source: kafka"). So there only
  `--jars`/`--packages` (or spark-defaults.conf) count, and a launch without them is refused;
  `$VARADHI_SPARK_JARS` and `$VARADHI_SPARK_PACKAGES` work where this process launches the JVM
  (plain `python`, `varadhi-job`, `python -m varadhi.jobs.*`).
- Executors run the interpreter named by PYSPARK_PYTHON. Unless it is this project's environment,
  executor code fails to import our dependencies (pycurl, mmh3, pyarrow); the launch scripts set
  it, and `get_spark` defaults it to the driver's interpreter for local runs.
- With `VARADHI_LOG_FORMAT=json` (a job's `--log-format json` sets it) a session `get_spark`
  builds logs Spark's driver lines as JSON (`varadhi.spark.telemetry`): from the JVM's first
  line where this process starts the JVM, else from the session's start on.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pyspark.sql import SparkSession

from varadhi.core.errors import InvalidArgument
from varadhi.spark import class_archive, telemetry
from varadhi.spark import lines as spark_lines
from varadhi.spark.s3a import hadoop_conf

JARS_ENV = "VARADHI_SPARK_JARS"
PACKAGES_ENV = "VARADHI_SPARK_PACKAGES"
AUTO_PACKAGES = "auto"
# A source checkout's jar folder (lib/varadhi/spark/session.py -> the checkout); absent when installed.
DEV_JARS = Path(__file__).resolve().parents[3] / ".jars" / "spark"


def running_spark_version() -> str:
    """The version of the installed pyspark, which is the Spark a local session runs."""
    import pyspark

    return pyspark.__version__


def spark_packages(spark_version: str | None = None, extras: Iterable[str] = ()) -> tuple[str, ...]:
    """`--packages` coordinates (Kafka connector, Delta, then `extras`: "s3" for hadoop-aws)
    matching `spark_version` (default: the installed pyspark). On a cluster pass the cluster's
    `spark.version`. Raises `UnsupportedSparkVersion` outside the supported lines."""
    line = spark_lines.line_for(spark_version or running_spark_version())
    return spark_lines.packages(line, extras)


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def jar_settings(
    env: Mapping[str, str],
    launch: Mapping[str, str],
    dev_jars: Sequence[str],
    packages: Sequence[str],
    jvm_running: bool = False,
) -> dict[str, str]:
    """The `spark.jars` / `spark.jars.packages` settings a local session gets (pure).

    `env`: the environment (`VARADHI_SPARK_JARS` entries already expanded to jar files by the
    caller); `launch`: `spark.jars` and `spark.jars.packages` the launch already set; `dev_jars`:
    the checkout's jars (empty when installed); `packages`: the coordinates `auto` stands for and
    that a refusal names; `jvm_running`: spark-submit started the JVM, which only the launch's
    jars reach (settings made now would miss the driver's class path). A configured setting is
    added to what the launch names, never instead of it. Raises `InvalidArgument` when nothing
    provides the jars."""
    if jvm_running:
        if launch.get("spark.jars") or launch.get("spark.jars.packages"):
            return {}
        raise InvalidArgument(
            "spark-submit started Spark without the Kafka connector and Delta: pass --jars "
            f"(e.g. the files of {JARS_ENV}) or --packages {','.join(packages)}, or --cluster "
            "when the cluster's Spark has them",
            field="spark jars",
        )
    out: dict[str, str] = {}
    jars = _split(env.get(JARS_ENV))
    coords = [
        c for p in _split(env.get(PACKAGES_ENV)) for c in (packages if p == AUTO_PACKAGES else [p])
    ]
    if jars:
        out["spark.jars"] = ",".join(dict.fromkeys([*_split(launch.get("spark.jars")), *jars]))
    if coords:
        existing = _split(launch.get("spark.jars.packages"))
        out["spark.jars.packages"] = ",".join(dict.fromkeys([*existing, *coords]))
    if out or launch.get("spark.jars") or launch.get("spark.jars.packages"):
        return out
    if dev_jars:
        return {"spark.jars": ",".join(dev_jars)}
    raise InvalidArgument(
        f"no Kafka connector and Delta jars for Spark: set {JARS_ENV} to their jar files or "
        f"folder, or {PACKAGES_ENV}={AUTO_PACKAGES} to download {','.join(packages)} at start "
        "(or pass --jars/--packages to spark-submit)",
        field="spark jars",
    )


def expand_jars(value: str | None) -> str:
    """`$VARADHI_SPARK_JARS` with each folder replaced by its `*.jar` files (sorted). Raises
    `InvalidArgument` for an entry that does not exist or a folder without jars."""
    out: list[str] = []
    for entry in _split(value):
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.glob("*.jar"))
            if not found:
                raise InvalidArgument(f"{entry} holds no *.jar files", field=JARS_ENV)
            out += found
        elif path.is_file():
            out.append(str(path))
        else:
            raise InvalidArgument(f"{entry} does not exist", field=JARS_ENV)
    return ",".join(out)


def launch_settings(env: Mapping[str, str]) -> dict[str, str]:
    """`spark.jars` / `spark.jars.packages` the JVM launch already names, read without starting
    a JVM: the running JVM's configuration under spark-submit (PYSPARK_GATEWAY_PORT), else
    spark-defaults.conf of `$SPARK_CONF_DIR` and `--jars`/`--packages` in
    `$PYSPARK_SUBMIT_ARGS`."""
    keys = ("spark.jars", "spark.jars.packages")
    if env.get("PYSPARK_GATEWAY_PORT"):  # spark-submit started this process: ask its JVM
        from pyspark import SparkConf, SparkContext

        SparkContext._ensure_initialized()  # connects to spark-submit's JVM, starts none
        conf = SparkConf()
        return {k: v for k in keys if (v := conf.get(k, None))}
    found: dict[str, str] = {}
    defaults = Path(env.get("SPARK_CONF_DIR", "")) / "spark-defaults.conf"
    if env.get("SPARK_CONF_DIR") and defaults.is_file():
        for line in defaults.read_text().splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) == 2 and parts[0] in keys:
                found[parts[0]] = parts[1].strip()
    args = shlex.split(env.get("PYSPARK_SUBMIT_ARGS", ""))
    for flag, key in (("--jars", "spark.jars"), ("--packages", "spark.jars.packages")):
        if flag in args[:-1]:
            found[key] = args[args.index(flag) + 1]
    return found


def local_jar_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`jar_settings` for this process: its environment, launch and checkout."""
    env = dict(os.environ if env is None else env)
    if env.get(JARS_ENV):
        env[JARS_ENV] = expand_jars(env[JARS_ENV])
    dev = sorted(str(p) for p in DEV_JARS.glob("*.jar")) if DEV_JARS.is_dir() else []
    running = bool(env.get("PYSPARK_GATEWAY_PORT"))
    return jar_settings(env, launch_settings(env), dev, spark_packages(), running)


def s3a_classpath() -> str | None:
    """hadoop-aws and the AWS SDK bundle of a source checkout (`.jars/s3a`, fetched by
    scripts/setup) as a class path entry (a folder wildcard), or None when absent (an installed
    package: pass hadoop-aws with `spark_packages(extras=["s3"])` or the cluster's own). They go
    on the JVM's class path, not `spark.jars`: the SDK bundle is some 600 MB, which `spark.jars`
    would copy for every session."""
    folder = DEV_JARS.parent / "s3a"
    return str(folder / "*") if (folder / ".complete").is_file() else None


#: A local master's executor lives in the driver's JVM, so a heartbeat it misses means only that
#: the JVM got no CPU (a starved machine, a stopped process): yet the driver then removes it
#: ("Removing executor driver with no recent heartbeats", after `spark.network.timeout`, 120 s),
#: and its block manager's re-registration fails in local mode (a NullPointerException in
#: `BlockManagerMasterEndpoint.register`, "Issue communicating with driver in heartbeater"). A
#: test session on Spark 4.0 starved that way at its start (a compatibility tier at nice 10
#: on a machine with a core kept busy, 2026-12-07), and later hung in two Delta table loads
#: until its test's timeout: the removal is the one fault its log shows. The executor's
#: heartbeat timeout (which `spark.network.timeout` only defaults) is a day for local
#: masters; clusters keep Spark's.
LOCAL_EXECUTOR_SETTINGS = {"spark.storage.blockManagerHeartbeatTimeoutMs": str(86_400_000)}


def get_spark(app_name: str = "varadhi", local: bool = True, cores: int = 2) -> SparkSession:
    """The active session, or a new one. `local=True` builds `local[cores]` with the jars found
    by configuration (module docstring), the UI off and few shuffle partitions (small, fast
    micro-batches); it raises `InvalidArgument` before starting anything when there are none.
    A Spark outside the supported lines (`varadhi.spark.lines`) raises `UnsupportedSparkVersion`:
    an active session's (a notebook's, spark-submit's) by its `version`, otherwise pyspark's
    before a JVM starts."""
    active = SparkSession.getActiveSession()
    if active is not None:
        spark_lines.line_for(active.version)
        if telemetry.wants_json_logs() and telemetry.json_spark_logs(active):  # a cluster's
            active.sparkContext.setLogLevel(os.environ.get("VARADHI_SPARK_LOG_LEVEL", "WARN"))
        return active
    spark_lines.line_for(running_spark_version())
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .config("spark.databricks.delta.snapshotPartitions", "2")
    )
    archive = None  # the driver JVM's class-data archive, where this process starts that JVM
    json_logs = telemetry.wants_json_logs()  # VARADHI_LOG_FORMAT=json: Spark's log4j2 too
    if json_logs and not os.environ.get("PYSPARK_GATEWAY_PORT"):  # from the JVM's first line
        option = telemetry.log4j2_java_option(telemetry.log4j2_json_file())
        builder = builder.config("spark.driver.extraJavaOptions", option)
    for key, value in hadoop_conf(os.environ).items():  # VARADHI_S3A_*: an s3a:// warehouse
        builder = builder.config(f"spark.hadoop.{key}", value)
    if local:
        for key, value in local_jar_settings().items():
            builder = builder.config(key, value)
        if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # this process starts the driver JVM
            archive = class_archive.archive_path(running_spark_version())  # scripts/setup's
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        master = os.environ.get("VARADHI_SPARK_MASTER", f"local[{cores}]")
        if master.startswith("local"):
            for key, value in LOCAL_EXECUTOR_SETTINGS.items():
                builder = builder.config(key, value)
        builder = (
            builder.master(master)
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", str(cores))
            .config("spark.default.parallelism", str(cores))
            .config("spark.driver.memory", os.environ.get("VARADHI_DRIVER_MEMORY", "2g"))
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.sql.execution.arrow.pyspark.enabled", "true")
            .config("spark.python.worker.reuse", "true")
            # Spark 4.1+ (older lines ignore it); as ./spark-submit.sh, which says why.
            .config("spark.python.unix.domain.socket.enabled", "true")
            .config("spark.ui.showConsoleProgress", "false")
        )
        s3a = s3a_classpath()
        if s3a:
            builder = builder.config("spark.driver.extraClassPath", s3a).config(
                "spark.executor.extraClassPath", s3a
            )
    with class_archive.launch_env(archive):
        spark = builder.getOrCreate()
    if json_logs:  # a JVM started before this process (spark-submit): from here on
        telemetry.json_spark_logs(spark)
    spark.sparkContext.setLogLevel(os.environ.get("VARADHI_SPARK_LOG_LEVEL", "WARN"))
    return spark
