"""A subscription's jobs as spark-submit commands (`spark_submit_script`): one
`./spark-submit.sh SUB SHARD` line per shard (and one per feeder) for this checkout, and the same
jobs as plain `spark-submit` commands running `LAUNCHER` for a YARN or Kubernetes cluster, from a
`JobPlan` and a `DeployConfig` (`varadhi.jobs.definitions`).

Every job runs until stopped, so each line is meant for its own terminal or service unit. The
cluster commands run the driver in client mode on the submitting host, so the script's exported
environment reaches it; the wheel must be installed on every node. Secrets are read from the
environment of the driver and every executor: the script names them (`secret_env_names`), never
holds their values; export them, or set them in the cluster's driver and executor environment.
"""

from __future__ import annotations

import shlex

from varadhi.jobs.definitions import (
    DELTA_CONF,
    DISTRIBUTION,
    LAUNCHER,
    STREAMING_CONF,
    DeployConfig,
    JobPlan,
    feeder_args,
    job_env,
    job_telemetry_args,
    jobs_to_run,
    operation_note,
    secret_env_names,
    submit_conf,
)


def spark_submit_commands(p: JobPlan, cfg: DeployConfig) -> tuple[list[list[str]], list[list[str]]]:
    """(local commands for this checkout's `./spark-submit.sh`, plain `spark-submit` commands
    for a cluster), each shards first, then feeders, as argument lists."""
    local = [["./spark-submit.sh", p.subscription, str(s)] for s in p.shards]
    local += [["./spark-submit.sh", "--job", "feeder", *feeder_args(p, f)] for f in p.feeders]
    local = [[*c, *job_telemetry_args(cfg.telemetry, i)] for i, c in enumerate(local)]
    submit = ["spark-submit", "--packages", ",".join(cfg.packages)]
    submit += submit_conf({**DELTA_CONF, **STREAMING_CONF})
    launcher = f"{cfg.code_path.rstrip('/')}/{LAUNCHER}"
    cluster = [[*submit, launcher, *args] for _key, args in jobs_to_run(p, cfg)]
    return local, cluster


def spark_submit_script(p: JobPlan, cfg: DeployConfig) -> str:
    """A shell script: the environment, then one line per job, local and cluster variants.

    Every job runs until stopped, so each line is meant for its own terminal or service unit.
    The cluster commands run the driver in client mode on the submitting host (so the exported
    environment reaches it) with the cluster's default master; the wheel must be installed on
    every node (docs/deployment.md for YARN and Kubernetes).
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
    names = secret_env_names(p, cfg)
    if names:
        lines.append(
            f"# secrets read from the environment on the driver and every executor: "
            f"{', '.join('$' + n for n in names)}; export them (locally) or set them in the "
            "cluster's driver and executor environment"
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
        f"# a cluster (its spark-submit and master; the {DISTRIBUTION} wheel installed for the "
        f"cluster's Python 3.11+, {LAUNCHER} from `varadhi jobs launcher` in "
        f"{cfg.code_path}):",
    ]
    lines += [shlex.join(c) for c in cluster]
    return "\n".join(lines) + "\n"
