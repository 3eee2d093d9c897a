"""A subscription's jobs as a Databricks job: `databricks_job`, the body of a Jobs API 2.2
`POST /api/2.2/jobs/create` request, and `databricks_bundle` (`bundle_yaml`) the same job as a
`databricks.yml` Asset Bundle, from a `JobPlan` and a `DeployConfig` (`varadhi.jobs.definitions`).

One `python_wheel_task` per shard and feeder (`varadhi-job NAME ...` from the wheel), all on one
job cluster in dedicated access mode; each task retries itself without limit while the others keep
running (why a triggered job, not a continuous one: `databricks_job`). A definition is a snapshot:
after a shard-count change, and once its feeders are done, render again and replace the job
(`POST /api/2.2/jobs/reset` with the rendered body as `new_settings`, or `databricks bundle
deploy`).

Hazards the definition takes care of:

- Secrets: each secret variable, and the endpoint's credential (`endpoint.auth_env`), is a
  `{{secrets/<scope>/<key>}}` reference in `spark_env_vars` (`databricks_env`), which Databricks
  resolves when the cluster starts; the value is never in the job's settings.
- Databricks runtimes bring Delta and the Kafka connector of their Spark line (`databricks_line`):
  only the wheel and the jars of `cfg.extras` are installed.
- `max_concurrent_runs: 1` and no queue keep a second run from starting shards that already run
  (the shards' leases would fence each other).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import yaml

from varadhi.jobs.definitions import (
    DISTRIBUTION,
    EMAIL_RE,
    ENTRY_POINT,
    STREAMING_CONF,
    DeployConfig,
    JobPlan,
    databricks_line,
    job_env,
    jobs_to_run,
    operation_note,
    secrets,
)
from varadhi.spark import lines as spark_lines

# A Databricks task is retried without limit, at most once a minute; a retry of one task leaves
# the job's other tasks running (see `databricks_job`).
RETRY_INTERVAL_MS = 60_000

JOB_CLUSTER_KEY = "varadhi"


def _description(p: JobPlan, key: str) -> str:
    if key.startswith("feeder-"):
        feeder = p.feeders[int(key.split("-", 1)[1])]
        return f"drain {feeder.source} ({feeder.queue}) into the current shards"
    return f"shard {key.split('-', 1)[1]} of {p.subscription}"


def databricks_env(p: JobPlan, cfg: DeployConfig) -> dict[str, str]:
    """`spark_env_vars`: the catalog topic, the Kafka client configuration file, and every
    secret as a `{{secrets/<scope>/<key>}}` reference (Databricks resolves it when the cluster
    starts; the value is never in the job's settings)."""
    return {**job_env(cfg), **{s.env: s.reference for s in secrets(p, cfg)}}


def extra_packages(line: spark_lines.SparkLine, extras: Sequence[str]) -> list[str]:
    """The coordinates `extras` add to the line's Kafka connector and Delta."""
    base = spark_lines.packages(line)
    return [c for c in spark_lines.packages(line, extras) if c not in base]


def databricks_libraries(cfg: DeployConfig) -> list[dict[str, Any]]:
    """The wheel, and a Maven library per extra jar (the runtime has Kafka and Delta)."""
    line = databricks_line(cfg.spark_version)
    maven = [{"maven": {"coordinates": c}} for c in extra_packages(line, cfg.extras)]
    return [{"whl": cfg.wheel}, *maven]


def databricks_job(p: JobPlan, cfg: DeployConfig) -> dict[str, Any]:
    """A Jobs API 2.2 create request: one job, one `python_wheel_task` per shard and feeder
    (`varadhi-job NAME ...` from the wheel), all on one job cluster in dedicated access mode.

    Restart policy (why not a continuous job): a continuous job's `task_retry_mode: ON_FAILURE`
    retries a failed task only "if at least one other task in the job is still running its
    first attempt"; once every shard has failed once (one broker outage is enough), the next
    failure of any shard cancels the run and restarts all of them, and retry policies
    (`max_retries`) are not allowed in continuous jobs. So the job is a triggered one (start it
    once with `jobs run-now`) whose tasks have no `depends_on`: they run side by side, a failed
    task only affects tasks that depend on it (none), and each task retries itself without
    limit (`max_retries: -1`), at most once a minute (`min_retry_interval_millis`), while the
    others keep running. Streaming tasks never time out (no `timeout_seconds`, so
    `retry_on_timeout` does not apply). The run ends only when every task has ended (a feeder
    ends when it has drained its source) or someone cancels it; `max_concurrent_runs: 1` and no
    queue keep a second run from starting shards that already run (the shards' leases would
    fence each other).

    Serverless job compute does not run Structured Streaming with processing-time triggers, so
    the tasks use a job cluster; `data_security_mode: SINGLE_USER` (the API's name for the
    dedicated access mode) gives the shards Unity Catalog volumes and the full Spark API. With
    `cfg.run_as` the job runs as that user or service principal (`run_as`) and the cluster is
    dedicated to it (`single_user_name`); without, Databricks uses the job's creator.
    Databricks runtimes bring Delta and the Kafka connector, so no packages are installed besides
    the wheel (whose dependencies are resolved from PyPI when the library is installed) and the
    jars of `cfg.extras`, as Maven libraries.
    Pausing the subscription (`varadhi subscription pause`) makes the running shards wait; the
    job keeps running.
    """
    tasks = [
        {
            "task_key": key,
            "description": _description(p, key),
            "job_cluster_key": JOB_CLUSTER_KEY,
            "python_wheel_task": {
                "package_name": DISTRIBUTION,
                "entry_point": ENTRY_POINT,
                "parameters": args,
            },
            "libraries": databricks_libraries(cfg),
            "max_retries": -1,
            "min_retry_interval_millis": RETRY_INTERVAL_MS,
            "retry_on_timeout": False,
        }
        for key, args in jobs_to_run(p, cfg)
    ]
    cluster: dict[str, Any] = {
        "spark_version": cfg.spark_version,
        "node_type_id": cfg.node_type,
        "num_workers": cfg.workers,
        "data_security_mode": "SINGLE_USER",
        "spark_conf": dict(STREAMING_CONF),
        "spark_env_vars": databricks_env(p, cfg),
    }
    job: dict[str, Any] = {
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
        "max_concurrent_runs": 1,
        "queue": {"enabled": False},
        "job_clusters": [{"job_cluster_key": JOB_CLUSTER_KEY, "new_cluster": cluster}],
        "tasks": tasks,
    }
    if cfg.run_as:
        who = "user_name" if EMAIL_RE.fullmatch(cfg.run_as) else "service_principal_name"
        job["run_as"] = {who: cfg.run_as}
        cluster["single_user_name"] = cfg.run_as
    job_alerts, task_alerts = databricks_alerts(cfg)
    job.update(job_alerts)
    for task in tasks:
        task.update(task_alerts)
    return job


def databricks_alerts(cfg: DeployConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The health rules and notifications of `databricks_job` (job settings, task settings);
    empty unless asked for (pure).

    Job: `health.rules`, one `GREATER_THAN` rule per threshold set, `STREAMING_BACKLOG_SECONDS`
    (the largest consumer delay across the job's streams) and `STREAMING_BACKLOG_RECORDS` (the
    largest offset lag), and whom to tell when one is exceeded
    (`on_streaming_backlog_exceeded`) or the run fails (`on_failure`), by e-mail and through
    notification destinations (`webhook_notifications`: Slack, PagerDuty, Teams or a webhook,
    by id). Tasks: `on_failure` too, because the job run almost never fails: every task retries
    itself without limit, so a failing shard is seen in its task's failed attempts."""
    emails, hooks = list(cfg.notify_emails), [{"id": h} for h in cfg.notify_webhooks]
    rules = [
        {"metric": metric, "op": "GREATER_THAN", "value": value}
        for metric, value in (
            ("STREAMING_BACKLOG_SECONDS", cfg.backlog_seconds),
            ("STREAMING_BACKLOG_RECORDS", cfg.backlog_records),
        )
        if value
    ]
    events = ["on_failure"] + (["on_streaming_backlog_exceeded"] if rules else [])
    job: dict[str, Any] = {"health": {"rules": rules}} if rules else {}
    task: dict[str, Any] = {}
    if emails:
        job["email_notifications"] = {e: emails for e in events}
        task["email_notifications"] = {"on_failure": emails}
    if hooks:
        job["webhook_notifications"] = {e: hooks for e in events}
        task["webhook_notifications"] = {"on_failure": hooks}
    return job, task


def bundle_resource_key(subscription: str) -> str:
    """The job's key under `resources.jobs` (letters, digits and '_' only)."""
    return "varadhi_" + re.sub(r"[^A-Za-z0-9_]", "_", subscription)


def databricks_bundle(p: JobPlan, cfg: DeployConfig) -> dict[str, Any]:
    """A `databricks.yml` Asset Bundle holding `databricks_job`'s job as `resources.jobs.<key>`.

    `databricks bundle deploy` creates or updates the job (re-render and deploy again after a
    shard-count change); `databricks bundle run <key>` starts it. The workspace comes from the
    CLI's profile or `DATABRICKS_HOST`."""
    return {
        "bundle": {"name": f"varadhi-{re.sub(r'[^A-Za-z0-9_-]', '-', p.subscription)}"},
        "resources": {"jobs": {bundle_resource_key(p.subscription): databricks_job(p, cfg)}},
    }


def bundle_yaml(p: JobPlan, cfg: DeployConfig) -> str:
    key = bundle_resource_key(p.subscription)
    head = (
        f"# Databricks Asset Bundle for varadhi subscription {p.subscription}, generated by "
        "`varadhi jobs render --target databricks-bundle`.\n"
        f"# databricks bundle deploy && databricks bundle run {key}\n"
    )
    return head + yaml.safe_dump(databricks_bundle(p, cfg), sort_keys=False, width=100)
