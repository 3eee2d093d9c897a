#!/usr/bin/env bash
# Run one job of the suite with spark-submit, the project's jars and its Python environment.
#
#   ./spark-submit.sh SUBSCRIPTION SHARD [job options]     a subscription shard
#   ./spark-submit.sh --job NAME [job options]             any job in jobs/ (e.g. smoke_count;
#                                                          each calls varadhi.jobs.NAME)
#
# Environment: VARADHI_BOOTSTRAP (Kafka), VARADHI_WAREHOUSE (Delta tables, checkpoints),
# VARADHI_SPARK_MASTER (default local[2]), VARADHI_DRIVER_MEMORY (default 2g), VARADHI_S3A_*,
# VARADHI_LOG_FORMAT=json (or the job's --log-format json: Spark's driver log is JSON lines too).
# PYSPARK_PYTHON is set to the project's venv: executors must import pycurl, mmh3 and pyarrow.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help|"") usage; exit 0 ;; esac

LOCALFS_JAR="$ROOT/.jars/localfs/varadhi-localfs.jar"
if [[ ! -x "$ROOT/.venv/bin/python" || ! -d "$ROOT/.jars/spark" || ! -f "$LOCALFS_JAR" ]]; then
  echo "spark-submit.sh: run scripts/setup first" >&2; exit 2
fi
if [[ "$1" == "--job" ]]; then
  JOB="$ROOT/jobs/${2:?--job needs a name}.py"; shift 2
  ARGS=("$@")
else
  [[ $# -ge 2 ]] || { usage >&2; exit 2; }
  JOB="$ROOT/jobs/subscription_shard.py"
  ARGS=(--subscription "$1" --shard "$2" "${@:3}")
fi
[[ -f "$JOB" ]] || { echo "spark-submit.sh: no job $JOB" >&2; exit 2; }

export PYSPARK_PYTHON="$ROOT/.venv/bin/python"
export PYSPARK_DRIVER_PYTHON="$ROOT/.venv/bin/python"
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
export VARADHI_SPARK_MASTER="${VARADHI_SPARK_MASTER:-local[2]}"
{ read -r SPARK_HOME; read -r SPARK_VERSION; } < <("$ROOT/.venv/bin/python" -c \
  'import os, pyspark; print(os.path.dirname(pyspark.__file__)); print(pyspark.__version__)')
[[ -n "${SPARK_VERSION:-}" ]] || { echo "spark-submit.sh: pyspark does not import in .venv" >&2; exit 2; }
JARS="$(ls "$ROOT"/.jars/spark/*.jar | paste -sd, -)"
S3A=()  # hadoop-aws for an s3a:// warehouse: on the JVM class path (docs/object-storage.md)
if [[ -f "$ROOT/.jars/s3a/.complete" ]]; then
  S3A=(--driver-class-path "$ROOT/.jars/s3a/*" --conf "spark.executor.extraClassPath=$ROOT/.jars/s3a/*")
fi
# Hadoop's local file system sets each new file's permission with a `chmod` child process when its
# native library is missing (pip's pyspark has none); a Ctrl-C or SIGTERM to the process group (or
# systemd's unit) kills that child, the checkpoint write fails and a stop becomes a failed query.
# varadhi.hadoop's file systems (jvm/src, built by scripts/setup) set it in the JVM instead. On the
# class path's end (SPARK_DIST_CLASSPATH): --jars come too late for the file system, and the
# class-data archive below needs the class path it was built with at the front. Local masters only:
# a cluster's executors (started by its workers) do not find the class.
LOCALFS=()
if [[ "$VARADHI_SPARK_MASTER" == local* ]]; then
  export SPARK_DIST_CLASSPATH="${SPARK_DIST_CLASSPATH:+$SPARK_DIST_CLASSPATH:}$LOCALFS_JAR"
  LOCALFS=(--conf spark.hadoop.fs.file.impl=varadhi.hadoop.InProcessLocalFileSystem
           --conf spark.hadoop.fs.AbstractFileSystem.file.impl=varadhi.hadoop.InProcessLocalFs)
fi
# Spark's classes mapped from the class-data archive scripts/setup builds (varadhi.spark.class_archive,
# whose java_options() these are): a faster, cheaper JVM start; JVM log warnings go to stderr.
CDS="$ROOT/.jars/cds/spark-$SPARK_VERSION.jsa"
if [[ -f "$CDS" && "${SPARK_SUBMIT_OPTS:-}" != *Archive* ]]; then
  export SPARK_SUBMIT_OPTS="${SPARK_SUBMIT_OPTS:-} -XX:SharedArchiveFile=$CDS -Xlog:disable -Xlog:all=warning:stderr"
fi
# JSON logs: the driver JVM's log4j2 writes JSON lines from its start (varadhi.spark.telemetry).
# Asked of Python only then: importing varadhi costs a launch about a CPU-second (pandas and
# pyarrow with it; 3-10 s on a loaded machine) where pyspark alone costs a quarter of one.
JSON_LOGS=()
if [[ "${VARADHI_LOG_FORMAT:-}" == json || " ${ARGS[*]} " == *" --log-format json "* \
      || " ${ARGS[*]} " == *" --log-format=json "* ]]; then
  LOG4J2_JSON="$("$ROOT/.venv/bin/python" -c \
    'from varadhi.spark import telemetry; print(telemetry.log4j2_java_option(telemetry.log4j2_json_file()))')" || true
  JSON_LOGS=(--driver-java-options "$LOG4J2_JSON")
fi
# Python workers on Unix domain sockets (Spark 4.1+; older lines ignore it): over loopback TCP the
# end of a task's input, a few bytes after a large Arrow batch, often waited 40 ms for the
# worker's delayed ACK (docs/benchmarks.md, "Latency").
exec "$SPARK_HOME/bin/spark-submit" \
  --master "$VARADHI_SPARK_MASTER" \
  --driver-memory "${VARADHI_DRIVER_MEMORY:-2g}" \
  --jars "$JARS" \
  "${S3A[@]}" \
  "${LOCALFS[@]}" \
  "${JSON_LOGS[@]}" \
  --conf spark.ui.enabled=false \
  --conf spark.log.level=WARN \
  --conf spark.python.unix.domain.socket.enabled=true \
  --conf spark.sql.shuffle.partitions=2 \
  --conf spark.driver.bindAddress=127.0.0.1 \
  --conf spark.driver.host=127.0.0.1 \
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension \
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog \
  "$JOB" "${ARGS[@]}"
