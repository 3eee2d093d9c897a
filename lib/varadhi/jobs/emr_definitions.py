"""A subscription's jobs on Amazon EMR: `emr_add_steps`, an EMR on EC2 `AddJobFlowSteps` request
(`emr_steps` its `Steps`, `emr_cli_steps` the shape `aws emr add-steps --steps file://...` reads),
and `emr_serverless_runs`, one EMR Serverless `StartJobRun` request (`mode: STREAMING`) per job,
from a `JobPlan` and a `DeployConfig` (`varadhi.jobs.definitions`). Every job is a spark-submit
of `LAUNCHER`, which runs the wheel's `varadhi-job` console script.

Hazards the definitions take care of:

- The Kafka connector and Delta jars must match the cluster's Spark: they are those of the
  chosen EMR release's Spark line (`emr_line`, `varadhi.spark.lines`).
- EMR's default Python is older than the 3.11 the package needs: the jobs run in a virtualenv
  archive (`spark.archives` + `PYSPARK_PYTHON`, `python_conf`) built with the wheel installed.
- Secrets cannot be set without writing them into a command line: the variables must already be
  in the driver's and executors' environment (the cluster's configuration); the definitions name
  them (`secret_env_names`) and pass none.
- A streaming job never ends: an EC2 step submits without waiting and YARN restarts a failed
  driver (`emr_steps`); a Serverless run restarts from its checkpoint (`emr_serverless_runs`).
  EMR Serverless splits `sparkSubmitParameters` at spaces, so a value with a space or quote is
  refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from varadhi.core.errors import InvalidArgument
from varadhi.jobs.definitions import (
    DELTA_CONF,
    LAUNCHER,
    STREAMING_CONF,
    DeployConfig,
    JobPlan,
    emr_line,
    job_env,
    jobs_to_run,
    scheme,
    submit_conf,
)
from varadhi.spark import lines as spark_lines

# Where the virtualenv archive is unpacked in each container (`spark.archives` ...#environment).
VENV_DIR = "environment"
VENV_PYTHON = f"./{VENV_DIR}/bin/python"


def python_conf(driver_env_prefix: str) -> dict[str, str]:
    """Spark settings that run the driver and executors with the virtualenv archive's Python
    (`spark.archives` unpacks it as `./environment` in every container)."""
    return {
        f"{driver_env_prefix}PYSPARK_PYTHON": VENV_PYTHON,
        f"{driver_env_prefix}PYSPARK_DRIVER_PYTHON": VENV_PYTHON,
        "spark.executorEnv.PYSPARK_PYTHON": VENV_PYTHON,
    }


def _emr_submit(p: JobPlan, cfg: DeployConfig, serverless: bool) -> list[str]:
    """The spark-submit options of an EMR job: the release's packages, Delta, the Python of the
    virtualenv archive, the jobs' environment on driver and executors, the Kafka properties."""
    line = emr_line(cfg.emr_release, cfg.emr_spark_version)
    driver = "spark.emr-serverless.driverEnv." if serverless else "spark.yarn.appMasterEnv."
    conf = {**DELTA_CONF, **STREAMING_CONF}
    if cfg.python_archive:
        conf.update({"spark.archives": f"{cfg.python_archive}#{VENV_DIR}", **python_conf(driver)})
    if not serverless:
        conf.update(
            {
                "spark.yarn.submit.waitAppCompletion": "false",
                "spark.yarn.maxAppAttempts": "4",
                "spark.yarn.am.attemptFailuresValidityInterval": "1h",
            }
        )
    for k, v in job_env(cfg).items():
        conf[f"{driver}{k}"] = v
        conf[f"spark.executorEnv.{k}"] = v
    args = ["--packages", ",".join(spark_lines.packages(line, cfg.extras))]
    if scheme(cfg.kafka_config) in ("s3", "s3a"):
        args += ["--files", cfg.kafka_config]
    return args + submit_conf(conf)


def emr_steps(p: JobPlan, cfg: DeployConfig) -> list[dict[str, Any]]:
    """AddJobFlowSteps `Steps`: one `command-runner.jar` spark-submit step per shard and feeder.

    Steps on a cluster run one after another (StepConcurrencyLevel 1 by default) and a step
    lasts as long as its spark-submit. A streaming job never ends, so each step submits in
    cluster mode without waiting (`spark.yarn.submit.waitAppCompletion=false`): the step ends
    once YARN accepted the application, and the next shard's step can start. YARN, not EMR,
    restarts a failed driver: `spark.yarn.maxAppAttempts` (at most the cluster's
    `yarn.resourcemanager.am.max-attempts`) attempts, counted per hour; one shard's restart does
    not touch the others (each is its own application).
    `ActionOnFailure: CONTINUE` keeps the cluster and the other steps when one submission fails.
    Secrets (`secret_env_names`) are not passed: they would be visible in the step's arguments;
    the cluster's configuration must put them in the driver's and executors' environment.
    """
    submit = ["spark-submit", "--deploy-mode", "cluster", *_emr_submit(p, cfg, serverless=False)]
    launcher = f"{cfg.code_path.rstrip('/')}/{LAUNCHER}"
    return [
        {
            "Name": f"varadhi-{p.subscription}-{key}",
            "ActionOnFailure": "CONTINUE",
            "HadoopJarStep": {"Jar": "command-runner.jar", "Args": [*submit, launcher, *args]},
        }
        for key, args in jobs_to_run(p, cfg)
    ]


def emr_add_steps(p: JobPlan, cfg: DeployConfig) -> dict[str, Any]:
    """The AddJobFlowSteps request (boto3 `add_job_flow_steps(**request)`, the SDKs)."""
    return {"JobFlowId": cfg.cluster_id, "Steps": emr_steps(p, cfg)}


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


def emr_serverless_runs(p: JobPlan, cfg: DeployConfig) -> list[dict[str, Any]]:
    """One EMR Serverless StartJobRun request per shard and feeder, each a streaming job run.

    `mode: STREAMING` runs the job until cancelled, with no execution timeout, and restarts a
    failed one from its checkpoint, up to `retryPolicy.maxFailedAttemptsPerHour` (1-10, the
    service's default 5; streaming runs take no `maxAttempts`); a run that keeps failing for an
    hour is not retried any more (EMR's thrash prevention) and must be started again. Retries
    need emr-7.1.0 or later (`check_config`). Each job is its own run, so one shard's restart
    leaves the others running. The application
    must run an EMR release of the supported lines (`cfg.emr_release`; its `--packages` come
    from that line) and reach Maven Central for them (or replace `--packages` with `--jars` on
    S3). `clientToken` is derived from the subscription, job and generation, so submitting the
    same rendered request twice starts one run; a run started again after it ended needs a new
    token (`aws emr-serverless start-job-run` makes one when the field is left out).
    EMR Serverless splits `sparkSubmitParameters` at spaces without shell quoting, so a value
    with a space or quote is refused (`InvalidArgument`).
    """
    options = _emr_submit(p, cfg, serverless=True)
    if any(re.search(r"[\s'\"\\]", a) for a in options):
        raise InvalidArgument(  # EMR Serverless splits sparkSubmitParameters at spaces
            "a path or setting with a space, quote or backslash cannot go into "
            "sparkSubmitParameters",
            field="emr-serverless",
        )
    submit = " ".join(options)
    launcher = f"{cfg.code_path.rstrip('/')}/{LAUNCHER}"
    runs = []
    for key, args in jobs_to_run(p, cfg):
        name = f"varadhi-{p.subscription}-{key}"
        runs.append(
            {
                "applicationId": cfg.application_id,
                "executionRoleArn": cfg.execution_role_arn,
                "clientToken": re.sub(r"[^A-Za-z0-9._-]", "-", f"{name}-g{p.generation}")[-64:],
                "name": name,
                "mode": "STREAMING",
                "retryPolicy": {"maxFailedAttemptsPerHour": 5},
                "jobDriver": {
                    "sparkSubmit": {
                        "entryPoint": launcher,
                        "entryPointArguments": args,
                        "sparkSubmitParameters": submit,
                    }
                },
                "tags": {
                    "varadhi-subscription": p.subscription,
                    "varadhi-job": key,
                },
            }
        )
    return runs
