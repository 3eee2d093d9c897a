"""Job definitions for a subscription: spark-submit commands, a Databricks job, EMR steps.

Pure functions from catalog documents to deployable definitions. `plan` reads the
subscription's record (`subscription/<name>`) and its shard-count change, if any
(`operation/<name>/change-shards`); the renderers turn that plan and a `DeployConfig` into:

- `spark_submit_script`: one `./spark-submit.sh SUB SHARD` line per shard for this checkout, and
  the same jobs as plain `spark-submit` commands for a cluster;
- `databricks_job`: the body of a Jobs API 2.2 `POST /api/2.2/jobs/create` request;
- `emr_steps`: the `Steps` of EMR's AddJobFlowSteps (`HadoopJarStep` with `command-runner.jar`),
  and `emr_cli_steps` the same steps in the shape `aws emr add-steps --steps file://...` reads.

Every definition runs one job per shard of the *current* shard count, plus one feeder per entry
of the change-shards operation's `feeders` while that operation is not done (feeders drain old
RQ/DLQ storage topics into the new shards, DESIGN section 1). Definitions are snapshots: after a
shard-count change, when its feeders are no longer needed, or after pause/resume, render again
and replace the deployed definition (Databricks: `POST /api/2.2/jobs/reset` with the rendered
body as `new_settings`).

Cluster hazards the definitions take care of:

- Jobs on a cluster must read the same catalog the definition was rendered from: the bootstrap
  servers are passed as `--bootstrap`, and the catalog topic as the `VARADHI_CATALOG_TOPIC`
  environment variable (the job scripts have no flag for it).
- The warehouse (Delta GroupState and Spark checkpoints) must be storage every node and every
  restart sees (`dbfs:/`, `s3://`, `hdfs://`); a driver-local path would lose a shard's
  checkpoint and state when its driver moves. So cluster definitions always pass `--warehouse`.
- The endpoint's credential (`endpoint.auth_env`) is read from the environment by the delivery
  code on every executor. Databricks gets it from a secret (`spark_env_vars` with a
  `{{secrets/<scope>/<key>}}` reference, never the value); for spark-submit and EMR the variable
  must already be in the executors' environment, which the definitions say but cannot do without
  writing the secret into a command line.
- The Python package and its native dependencies (pycurl, mmh3) must be importable on every
  node. Databricks installs them as task libraries; on EMR and other clusters a bootstrap
  action must `pip install` them (docs/operations.md). The wheel declares pyspark and
  delta-spark as dependencies for local runs; a cluster that brings its own Spark should
  install it with `--no-deps` plus the runtime dependencies (`RUNTIME_PYPI`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import InvalidArgument
from .subscriptions import Subscription

Target = Literal["spark-submit", "databricks", "emr"]
TARGETS: tuple[Target, ...] = ("spark-submit", "databricks", "emr")

SHARD_JOB = "subscription_shard.py"
FEEDER_JOB = "feeder.py"
OPERATION_KIND = "operation"
CHANGE_SHARDS = "change-shards"
FEED_STEP = "feed"  # varadhi.resharding.STEPS: fence, queues, state, layouts, activate, feed, done

# The Kafka source/sink and Delta for a Spark 4.1 / Scala 2.13 cluster, the versions the project
# pins (pyproject.toml: pyspark 4.1.1, delta-spark 4.1.0; scripts/jars/spark-pom.xml).
SPARK_PACKAGES: tuple[str, ...] = (
    "org.apache.spark:spark-sql-kafka-0-10_2.13:4.1.1",
    "io.delta:delta-spark_4.1_2.13:4.1.0",
)
DELTA_CONF: dict[str, str] = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}
# What the jobs import beyond what a Spark runtime ships (pyproject.toml pins these versions).
RUNTIME_PYPI: tuple[str, ...] = (
    "kafka-python==3.0.12",
    "mmh3==5.3.1",
    "pycurl==7.49.0",
    "crc32c==2.9",
)

# Kafka topic names (the feeders' sources): Kafka's own rule.
_KAFKA_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")
JOB_CLUSTER_KEY = "varadhi"


@dataclass(frozen=True)
class Feeder:
    """One old RQ/DLQ storage topic to drain into the current shards."""

    queue: Literal["rq", "dlq"]
    source: str


@dataclass(frozen=True)
class JobPlan:
    """What to run for one subscription now: its shards and the feeders an operation needs."""

    subscription: str
    shard_count: int
    paused: bool
    generation: int
    feeders: tuple[Feeder, ...] = ()
    operation: Mapping[str, Any] | None = None  # the change-shards document, until done
    auth_env: str | None = None  # the environment variable holding the endpoint's credential

    @property
    def shards(self) -> range:
        return range(self.shard_count)


@dataclass(frozen=True)
class DeployConfig:
    """Where the code and data live on the cluster and what cluster to ask for.

    `code_path` is the folder holding `subscription_shard.py` and `feeder.py` (the repository's
    `jobs/` copied there); `warehouse` is None only for local `./spark-submit.sh` runs, which use
    `$VARADHI_WAREHOUSE`. The defaults per target are `DEFAULTS`.
    """

    bootstrap_servers: str
    catalog_topic: str
    code_path: str
    warehouse: str
    wheel: str = ""
    node_type: str = "i3.xlarge"
    workers: int = 2
    spark_version: str = "17.3.x-scala2.13"
    secret_scope: str = "varadhi"
    packages: tuple[str, ...] = SPARK_PACKAGES


# Documented defaults (the CLI's flags fall back to these). Paths are examples of where a
# deployment usually puts things; replace them with your workspace's or bucket's.
DEFAULTS: dict[str, dict[str, Any]] = {
    "spark-submit": {"code_path": "jobs", "warehouse": "hdfs:///varadhi/warehouse"},
    "databricks": {
        "code_path": "/Workspace/Shared/varadhi/jobs",
        "warehouse": "dbfs:/varadhi/warehouse",
        "wheel": "/Volumes/main/varadhi/artifacts/varadhi_spark-{version}-py3-none-any.whl",
        "node_type": "i3.xlarge",
        "workers": 2,
        "spark_version": "17.3.x-scala2.13",
        "secret_scope": "varadhi",
    },
    "emr": {
        "code_path": "s3://varadhi-artifacts/jobs",
        "warehouse": "s3://varadhi-artifacts/warehouse",
    },
}


# -- the plan --------------------------------------------------------------------------------


def feeders_needed(operation: Mapping[str, Any] | None) -> tuple[Feeder, ...]:
    """The feeders a change-shards operation document still needs run.

    The document (`varadhi.resharding`) is `{"kind": "change-shards", "from": 2, "to": 4,
    "step": ..., "feeders": [{"queue": "rq", "source": "<old storage topic>", "done": false},
    ...]}`. Feeders are needed while the step is `feed`: before it they are refused (the new
    shards and queues are not active yet; a feeder job would exit 2, and in a continuous
    Databricks job fail over and over), and at `done` they are finished. An entry marked
    `done` has been fed. An entry that names no valid Kafka topic or queue is refused (it
    could only render a job that fails later).
    """
    if not operation:
        return ()
    kind = operation.get("kind", CHANGE_SHARDS)
    if kind != CHANGE_SHARDS:
        raise InvalidArgument(f"expected a {CHANGE_SHARDS} operation, got {kind!r}", field="kind")
    if operation.get("step") != FEED_STEP:
        return ()
    raw = operation.get("feeders") or []
    if not isinstance(raw, list):
        raise InvalidArgument(f"must be a list, got {raw!r}", field="operation.feeders")
    feeders: list[Feeder] = []
    for i, entry in enumerate(raw):
        where = f"operation.feeders[{i}]"
        if not isinstance(entry, Mapping):
            raise InvalidArgument(f"must be a mapping, got {entry!r}", field=where)
        queue, source = entry.get("queue"), entry.get("source")
        if queue not in ("rq", "dlq"):
            raise InvalidArgument(f"must be rq or dlq, got {queue!r}", field=f"{where}.queue")
        if not isinstance(source, str) or not _KAFKA_TOPIC_RE.fullmatch(source):
            raise InvalidArgument(
                f"must be a Kafka topic name, got {source!r}", field=f"{where}.source"
            )
        feeder = Feeder(queue, source)
        if entry.get("done") is not True and feeder not in feeders:
            feeders.append(feeder)
    return tuple(feeders)


def plan(
    subscription_doc: Mapping[str, Any], operation_doc: Mapping[str, Any] | None = None
) -> JobPlan:
    """The jobs for a subscription record and its change-shards operation (None: no operation).

    The shard count is the record's live `shard_count` (a shard-count change moves it), not the
    spec's creation-time `shards`.
    """
    sub = Subscription.from_dict(subscription_doc)
    feeders = feeders_needed(operation_doc)
    return JobPlan(
        subscription=sub.name,
        shard_count=sub.shard_count,
        paused=sub.paused,
        generation=sub.generation,
        feeders=feeders,
        operation=dict(operation_doc)
        if operation_doc and operation_doc.get("step") != "done"
        else None,
        auth_env=sub.spec.endpoint.auth_env,
    )


# -- job arguments ---------------------------------------------------------------------------


def shard_args(p: JobPlan, shard: int) -> list[str]:
    return ["--subscription", p.subscription, "--shard", str(shard)]


def feeder_args(p: JobPlan, feeder: Feeder) -> list[str]:
    return ["--subscription", p.subscription, "--source", feeder.source]


def cluster_args(cfg: DeployConfig, warehouse: bool = True) -> list[str]:
    """What a job on a cluster adds: the cluster's Spark, the Kafka and (shards; feeders keep
    no state) the warehouse."""
    args = ["--cluster", "--bootstrap", cfg.bootstrap_servers]
    return args + ["--warehouse", cfg.warehouse] if warehouse else args


def job_env(cfg: DeployConfig) -> dict[str, str]:
    """Environment the jobs need on the cluster (the catalog topic has no command-line flag)."""
    return {"VARADHI_CATALOG_TOPIC": cfg.catalog_topic}


def _jobs(p: JobPlan, cfg: DeployConfig) -> list[tuple[str, str, list[str]]]:
    """(key, python file, arguments) of every job: shards first, then feeders."""
    jobs = [
        (f"shard-{s}", f"{cfg.code_path}/{SHARD_JOB}", shard_args(p, s) + cluster_args(cfg))
        for s in p.shards
    ]
    jobs += [
        (
            f"feeder-{i}",
            f"{cfg.code_path}/{FEEDER_JOB}",
            feeder_args(p, f) + cluster_args(cfg, warehouse=False),
        )
        for i, f in enumerate(p.feeders)
    ]
    return jobs


def operation_note(p: JobPlan) -> str | None:
    """A line about the shard-count change in progress, if any (None: none)."""
    op = p.operation
    if op is None:
        return None
    text = f"change-shards {op.get('from', '?')} -> {op.get('to', '?')} in progress"
    if op.get("step") == FEED_STEP:
        return f"{text}, step {FEED_STEP}: {len(p.feeders)} feeder(s) still to run"
    return (
        f"{text}, step {op.get('step', '?')}: keep the shards stopped until "
        f"`varadhi subscription change-shards {p.subscription} --to {op.get('to', '?')}` "
        "has activated it, then render again"
    )


# -- spark-submit ----------------------------------------------------------------------------


def spark_submit_commands(p: JobPlan, cfg: DeployConfig) -> tuple[list[list[str]], list[list[str]]]:
    """(local commands for this checkout's `./spark-submit.sh`, plain `spark-submit` commands
    for a cluster), each shards first, then feeders, as argument lists."""
    local = [["./spark-submit.sh", p.subscription, str(s)] for s in p.shards]
    local += [["./spark-submit.sh", "--job", "feeder", *feeder_args(p, f)] for f in p.feeders]
    submit = ["spark-submit", "--packages", ",".join(cfg.packages)]
    for k, v in DELTA_CONF.items():
        submit += ["--conf", f"{k}={v}"]
    cluster = [[*submit, path, *args] for _key, path, args in _jobs(p, cfg)]
    return local, cluster


def spark_submit_script(p: JobPlan, cfg: DeployConfig) -> str:
    """A shell script: the environment, then one line per job, local and cluster variants.

    Every job runs until stopped, so each line is meant for its own terminal or service unit.
    The cluster commands run the driver in client mode on the submitting host (so the exported
    environment reaches it) with the cluster's default master; the wheel and `RUNTIME_PYPI` must
    be installed on every node.
    """
    local, cluster = spark_submit_commands(p, cfg)
    env = {"VARADHI_BOOTSTRAP": cfg.bootstrap_servers, **job_env(cfg)}
    lines = [
        f"# varadhi jobs for subscription {p.subscription}: {p.shard_count} shard(s), "
        f"generation {p.generation}",
    ]
    if p.paused:
        lines.append(
            "# the subscription is paused: shards started now wait until "
            f"`varadhi subscription resume {p.subscription}`"
        )
    note = operation_note(p)
    if note:
        lines.append(f"# {note}")
    if p.auth_env:
        lines.append(
            f"# the endpoint's credential is read from ${p.auth_env} on every executor: "
            "export it (locally) or set it in the cluster's executor environment"
        )
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += ["", "# this checkout (local Spark, the project's jars and venv), one per terminal:"]
    lines += [shlex.join(c) for c in local]
    lines += [
        "# optional standbys (another host or terminal): each waits, Spark started, and takes its",
        "# shard over once the active instance's lease has not been renewed for its TTL:",
    ]
    lines += [f"# {shlex.join([*c, '--standby'])}" for c in local if c[1] != "--job"]
    lines += [
        "",
        "# a cluster (its spark-submit and master; wheel and "
        f"{', '.join(RUNTIME_PYPI)} on every node):",
    ]
    lines += [shlex.join(c) for c in cluster]
    return "\n".join(lines) + "\n"


# -- Databricks ------------------------------------------------------------------------------


def databricks_libraries(cfg: DeployConfig) -> list[dict[str, Any]]:
    libraries: list[dict[str, Any]] = [{"whl": cfg.wheel}] if cfg.wheel else []
    return libraries + [{"pypi": {"package": pkg}} for pkg in RUNTIME_PYPI]


def databricks_env(p: JobPlan, cfg: DeployConfig) -> dict[str, str]:
    """`spark_env_vars`: the catalog topic, and the endpoint's credential as a reference to the
    secret `<secret_scope>/<auth_env>` (Databricks resolves it when the cluster starts)."""
    env = job_env(cfg)
    if p.auth_env:
        env[p.auth_env] = f"{{{{secrets/{cfg.secret_scope}/{p.auth_env}}}}}"
    return env


def databricks_job(p: JobPlan, cfg: DeployConfig) -> dict[str, Any]:
    """A Jobs API 2.2 create request: one continuous job, one `spark_python_task` per shard and
    feeder, all on one job cluster.

    Why one job with a task per shard: continuous jobs were limited to a single task when the
    trigger was introduced, but Jobs API 2.1/2.2 continuous jobs take several tasks as long as
    they have no `depends_on` (Databricks, "Run jobs continuously"), which these never have.
    One job keeps pause/resume a single switch (`continuous.pause_status` mirrors the
    subscription's `paused` flag) and the shards on one cluster.

    - `task_retry_mode: ON_FAILURE` retries a failed shard while the others keep running; with
      the default (`NEVER`) one failed shard would stay down until every other task ended,
      which for streaming shards is never. When retries run out Databricks cancels the run and
      starts a new one; shards resume from their checkpoints (at-least-once).
    - Task `max_retries` and `depends_on` are not allowed in continuous jobs and are not set.
    - Serverless compute does not run continuous jobs, so tasks use a job cluster
      (`job_cluster_key`), not an `environment_key`.
    - A feeder task exits when its source is drained; it does not end the run (the shards keep
      it going), and a restarted run starts it again, which must find nothing left to feed.
      Re-render without it once the operation is done.
    """
    tasks = []
    for key, path, args in _jobs(p, cfg):
        task: dict[str, Any] = {
            "task_key": key,
            "job_cluster_key": JOB_CLUSTER_KEY,
            "spark_python_task": {"python_file": path, "parameters": args},
            "libraries": databricks_libraries(cfg),
        }
        if key.startswith("feeder-"):
            feeder = p.feeders[int(key.split("-", 1)[1])]
            task["description"] = f"drain {feeder.source} ({feeder.queue}) into the current shards"
        else:
            task["description"] = f"shard {key.split('-', 1)[1]} of {p.subscription}"
        tasks.append(task)
    return {
        "name": f"varadhi-{p.subscription}",
        "description": (
            f"varadhi subscription {p.subscription}: {p.shard_count} shard(s)"
            + (f"; {operation_note(p)}" if p.operation else "")
            + ". Generated by `varadhi jobs render`; re-render after shard-count changes."
        ),
        "tags": {
            "varadhi-subscription": p.subscription,
            "varadhi-shard-count": str(p.shard_count),
        },
        "continuous": {
            "pause_status": "PAUSED" if p.paused else "UNPAUSED",
            "task_retry_mode": "ON_FAILURE",
        },
        "max_concurrent_runs": 1,
        "job_clusters": [
            {
                "job_cluster_key": JOB_CLUSTER_KEY,
                "new_cluster": {
                    "spark_version": cfg.spark_version,
                    "node_type_id": cfg.node_type,
                    "num_workers": cfg.workers,
                    "spark_conf": {
                        **DELTA_CONF,
                        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
                    },
                    "spark_env_vars": databricks_env(p, cfg),
                },
            }
        ],
        "tasks": tasks,
    }


# -- EMR -------------------------------------------------------------------------------------


def emr_steps(p: JobPlan, cfg: DeployConfig) -> list[dict[str, Any]]:
    """AddJobFlowSteps `Steps`: one `command-runner.jar` spark-submit step per shard and feeder.

    Steps on a cluster run one after another (StepConcurrencyLevel 1 by default) and a step
    lasts as long as its spark-submit. A streaming job never ends, so each step submits in
    cluster mode without waiting (`spark.yarn.submit.waitAppCompletion=false`): the step ends
    once YARN accepted the application, and the next shard's step can start. YARN, not EMR,
    restarts a failed driver: `spark.yarn.maxAppAttempts` (at most the cluster's
    `yarn.resourcemanager.am.max-attempts`) attempts, counted per hour.
    `ActionOnFailure: CONTINUE` keeps the cluster and the other steps when one submission fails.
    The endpoint's credential (`JobPlan.auth_env`) is not passed: it would be visible in the
    step's arguments; set it in the cluster's executor environment (docs/operations.md).
    """
    conf = {
        **DELTA_CONF,
        "spark.yarn.submit.waitAppCompletion": "false",
        "spark.yarn.maxAppAttempts": "4",
        "spark.yarn.am.attemptFailuresValidityInterval": "1h",
        "spark.sql.streaming.stopGracefullyOnShutdown": "true",
    }
    for k, v in job_env(cfg).items():
        conf[f"spark.yarn.appMasterEnv.{k}"] = v
        conf[f"spark.executorEnv.{k}"] = v
    submit = ["spark-submit", "--deploy-mode", "cluster", "--packages", ",".join(cfg.packages)]
    for k, v in conf.items():
        submit += ["--conf", f"{k}={v}"]
    return [
        {
            "Name": f"varadhi-{p.subscription}-{key}",
            "ActionOnFailure": "CONTINUE",
            "HadoopJarStep": {"Jar": "command-runner.jar", "Args": [*submit, path, *args]},
        }
        for key, path, args in _jobs(p, cfg)
    ]


def emr_cli_steps(steps: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The same steps in the AWS CLI's own shape (`aws emr add-steps --steps file://x.json`
    reads `Type`/`Jar`/`Args`, not the API's `HadoopJarStep`)."""
    return [
        {
            "Type": "CUSTOM_JAR",
            "Name": s["Name"],
            "ActionOnFailure": s["ActionOnFailure"],
            "Jar": s["HadoopJarStep"]["Jar"],
            "Args": list(s["HadoopJarStep"]["Args"]),
        }
        for s in steps
    ]
