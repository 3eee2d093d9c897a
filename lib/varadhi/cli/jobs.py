"""`varadhi jobs render NAME --target TARGET`: deployable job definitions for a subscription's
current state (see `varadhi.jobs.definitions`); `varadhi jobs launcher`: the file spark-submit runs.

Bad input (an unknown target or option, a flag of another target, a local warehouse, an
unsupported runtime or EMR release) is refused with one line and exit code 2 before the catalog
is read or anything is written."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata

from varadhi.cli import common
from varadhi.core.errors import InvalidArgument, NotFound
from varadhi.jobs import databricks_definitions as databricks_defs
from varadhi.jobs import definitions as jobdefs
from varadhi.jobs import emr_definitions as emr_defs
from varadhi.jobs import spark_submit_definitions as spark_submit_defs
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.subscriptions import KIND as SUBSCRIPTION
from varadhi.spark import lines as spark_lines
from varadhi.spark.telemetry import MetricsOptions

_D = jobdefs.DEFAULTS
_DATABRICKS = ("databricks", "databricks-bundle")
_EMR = ("emr", "emr-serverless")
_ONLY: dict[str, tuple[str, ...]] = {  # flag -> the targets it applies to
    "code_path": ("spark-submit", *_EMR),
    "wheel": _DATABRICKS,
    "node_type": _DATABRICKS,
    "workers": _DATABRICKS,
    "spark_version": _DATABRICKS,
    "secret_scope": _DATABRICKS,
    "run_as": _DATABRICKS,
    "backlog_seconds": _DATABRICKS,
    "backlog_records": _DATABRICKS,
    "notify_email": _DATABRICKS,
    "notify_webhook": _DATABRICKS,
    "spark_line": ("spark-submit",),
    "emr_release": _EMR,
    "python_archive": _EMR,
    "cluster_id": ("emr",),
    "emr_format": ("emr",),
    "application_id": ("emr-serverless",),
    "execution_role_arn": ("emr-serverless",),
}


class _OneLineParser(argparse.ArgumentParser):
    """A sub-command parser whose errors, unknown options included, are one line (exit 2).

    argparse hands options a sub-command does not know up to the top-level parser, which prints
    its whole usage; this parser refuses them itself."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _defaults(key: str) -> str:
    return "; ".join(f"{t}: {_D[t][key]}" for t in jobdefs.TARGETS if key in _D[t])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="job definitions that run a subscription's shards")
    jsub = p.add_subparsers(
        dest="jobs_command", metavar="ACTION", required=True, parser_class=_OneLineParser
    )
    r = jsub.add_parser(
        "render",
        help="spark-submit commands, a Databricks job or bundle, EMR steps or job runs",
        description="Render the jobs that run subscription NAME as it is now: one per shard, "
        "plus one feeder per old RQ/DLQ storage topic while a shard-count change needs them. "
        "Render again (and replace the deployed definition) after change-shards and once its "
        "feeders are done. docs/deployment.md explains each target.",
    )
    r.add_argument("name", help="subscription name")
    r.add_argument("--target", required=True, choices=jobdefs.TARGETS)
    r.add_argument(
        "-o", "--output", metavar="FILE", help="write the definition to FILE instead of stdout"
    )
    r.add_argument(
        "--warehouse",
        help="storage every node sees for GroupState and checkpoints (default: "
        + _defaults("warehouse")
        + "); a local path is refused",
    )
    r.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT,...",
        help="Kafka bootstrap servers the jobs use (default: the ones this command reads the "
        "catalog from, --bootstrap or $VARADHI_BOOTSTRAP)",
    )
    r.add_argument(
        "--kafka-config",
        metavar="PATH",
        help="the Kafka client properties file as the jobs see it, set as $VARADHI_KAFKA_CONFIG "
        "(databricks: an absolute path such as /Volumes/main/varadhi/conf/kafka.properties; "
        "emr: an s3:// object, shipped with --files, or a path on every node). Its secrets are "
        "${env:NAME} references: name each with --secret",
    )
    r.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME[=SCOPE/KEY]",
        help="an environment variable the jobs read a secret from (repeatable). databricks: set "
        "to the reference {{secrets/SCOPE/KEY}} (default SCOPE: --secret-scope, KEY: NAME); "
        "other targets: listed as a variable the cluster must provide. The endpoint's auth_env "
        "is always one",
    )
    r.add_argument(
        "--spark-extra",
        action="append",
        choices=spark_lines.EXTRAS,
        metavar="EXTRA",
        help="jars beyond the Kafka connector and Delta, for the cluster's Spark line "
        f"(repeatable; {', '.join(spark_lines.EXTRAS)}): msk-iam for Amazon MSK IAM "
        "(databricks: a Maven library), s3 for an s3a:// warehouse with spark-submit",
    )
    r.add_argument(
        "--code-path",
        help=f"spark-submit, emr: folder holding {jobdefs.LAUNCHER} (`varadhi jobs launcher`) "
        f"(default: {_defaults('code_path')})",
    )
    r.add_argument(
        "--wheel",
        help="databricks: the varadhi-spark wheel, a Unity Catalog volume or workspace file "
        "(default: "
        + _D["databricks"]["wheel"].format(version="VERSION")
        + " with this package's version)",
    )
    r.add_argument(
        "--node-type",
        help=f"databricks: node_type_id (default: {_D['databricks']['node_type']})",
    )
    r.add_argument(
        "--workers",
        type=int,
        help=f"databricks: num_workers of the job cluster (default: {_D['databricks']['workers']})",
    )
    r.add_argument(
        "--spark-version",
        help="databricks: runtime, one of a supported Spark line "
        f"(default: {_D['databricks']['spark_version']})",
    )
    r.add_argument(
        "--secret-scope",
        help="databricks: the secret scope of --secret NAME and of the endpoint's auth_env "
        f"(default: {_D['databricks']['secret_scope']})",
    )
    r.add_argument(
        "--allow-private-endpoints",
        action="store_true",
        help="let endpoints reach private, loopback and link-local addresses (by default the "
        "rendered jobs set VARADHI_ENDPOINT_DENY_PRIVATE=true: no cloud metadata service, no "
        "in-cluster address)",
    )
    r.add_argument(
        "--run-as",
        metavar="WHO",
        help="databricks: a user's e-mail or a service principal's application id; the job "
        "runs as it and its cluster is dedicated to it (default: the job's creator)",
    )
    r.add_argument(
        "--backlog-seconds",
        type=int,
        metavar="N",
        help="databricks: a health rule, STREAMING_BACKLOG_SECONDS greater than N (the largest "
        "consumer delay of the job's streams), notified with --notify-email/--notify-webhook",
    )
    r.add_argument(
        "--backlog-records",
        type=int,
        metavar="N",
        help="databricks: a health rule, STREAMING_BACKLOG_RECORDS greater than N (the largest "
        "offset lag of the job's streams)",
    )
    r.add_argument(
        "--notify-email",
        action="append",
        metavar="ADDRESS",
        help="databricks: e-mail ADDRESS when a task fails (each failed attempt) or the run "
        "fails, and when a backlog rule is exceeded (repeatable)",
    )
    r.add_argument(
        "--notify-webhook",
        action="append",
        metavar="ID",
        help="databricks: the same, to a notification destination (Slack, PagerDuty, Teams, "
        "webhook) by its id (repeatable)",
    )
    r.add_argument(
        "--spark-line",
        choices=[line.line for line in spark_lines.LINES],
        help=f"spark-submit: the cluster's Spark line, for --packages (default: "
        f"{spark_lines.CURRENT.line})",
    )
    r.add_argument(
        "--emr-release",
        help="emr: the cluster's or application's release label, which sets the Spark line "
        f"and --packages (default: {_D['emr']['emr_release']})",
    )
    r.add_argument(
        "--emr-spark-version",
        metavar="X.Y.Z",
        help="emr: the Spark version of an --emr-release this version of varadhi does not know "
        "(from AWS's release notes), for its Kafka connector",
    )
    r.add_argument(
        "--python-archive",
        help="emr: s3:// virtualenv archive with Python 3.11+ and the wheel, or `none` for the "
        "Python of the nodes or of a custom image (PYSPARK_PYTHON set there) "
        f"(default: {_D['emr']['python_archive']})",
    )
    r.add_argument(
        "--cluster-id", help="emr: the cluster (j-...), the request's JobFlowId (api format)"
    )
    r.add_argument(
        "--emr-format",
        choices=["api", "cli"],
        help="emr: `api` = the AddJobFlowSteps request (boto3 add_job_flow_steps(**request), "
        "SDKs), `cli` = the steps that `aws emr add-steps --steps file://FILE` reads "
        "(default: api)",
    )
    r.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="every job serves Prometheus metrics on its driver: shard 0 on PORT, the next job "
        "on PORT+1, and so on (0: each a free port, logged; default: $VARADHI_METRICS_PORT, "
        "else none)",
    )
    r.add_argument(
        "--metrics-addr",
        metavar="ADDR",
        help="the address the jobs' metrics ports bind (default: $VARADHI_METRICS_ADDR or "
        "127.0.0.1; 0.0.0.0 for a Prometheus on another host)",
    )
    r.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="json: the jobs log JSON lines, Spark's driver log too (default: "
        "$VARADHI_LOG_FORMAT or text)",
    )
    r.add_argument("--application-id", help="emr-serverless: the application's id")
    r.add_argument("--execution-role-arn", help="emr-serverless: the IAM role the job runs with")
    r.set_defaults(func=_render)
    launcher = jsub.add_parser(
        "launcher",
        help=f"print {jobdefs.LAUNCHER}, the file spark-submit and EMR run",
        description=f"Print {jobdefs.LAUNCHER}: it runs the installed wheel's "
        "`varadhi-job NAME [options]`. Copy it to --code-path (for example "
        f"`aws s3 cp {jobdefs.LAUNCHER} s3://.../jobs/`).",
    )
    launcher.add_argument("-o", "--output", metavar="FILE", help="write it to FILE")
    launcher.set_defaults(func=_launcher)


def _version() -> str:
    try:
        return metadata.version(jobdefs.DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0.1.0"


def config(args: argparse.Namespace, bootstrap: str, catalog_topic: str) -> jobdefs.DeployConfig:
    """The deployment configuration from the flags and the target's documented defaults,
    checked by `varadhi.jobs.definitions.check_config`; flags that do not apply to the target are refused
    (they would be silently ignored)."""
    for flag, only in _ONLY.items():
        if getattr(args, flag, None) is not None and args.target not in only:
            raise InvalidArgument(
                f"--{flag.replace('_', '-')} applies to --target {' or '.join(only)} only",
                field=flag,
            )
    defaults = _D[args.target]
    db, emr = _D["databricks"], _D["emr"]
    workers = args.workers if args.workers is not None else db["workers"]
    if workers < 1:
        raise InvalidArgument(f"must be at least 1, got {workers}", field="workers")
    for flag in (*_ONLY, "warehouse", "bootstrap_servers", "kafka_config"):
        value = getattr(args, flag, None)
        if isinstance(value, str) and not value.strip():
            raise InvalidArgument("must not be empty", field=flag)
    if args.target == "emr" and args.emr_format != "cli" and not args.cluster_id:
        raise InvalidArgument(
            "required for --target emr (the request's JobFlowId), or use --emr-format cli "
            "for the steps alone",
            field="cluster_id",
        )
    if args.target == "emr-serverless":
        for flag in ("application_id", "execution_role_arn"):
            if not getattr(args, flag):
                raise InvalidArgument("required for --target emr-serverless", field=flag)
    scope = args.secret_scope or db["secret_scope"]
    line = spark_lines.by_line(args.spark_line) if args.spark_line else spark_lines.CURRENT
    extras = tuple(dict.fromkeys(args.spark_extra or ()))
    cfg = jobdefs.DeployConfig(
        bootstrap_servers=args.bootstrap_servers or bootstrap,
        catalog_topic=catalog_topic,
        warehouse=args.warehouse or defaults["warehouse"],
        code_path=(args.code_path or defaults.get("code_path", ".")).rstrip("/") or "/",
        wheel=args.wheel or db["wheel"].format(version=_version()),
        kafka_config=args.kafka_config or "",
        secrets=tuple(jobdefs.parse_secret(s, scope) for s in args.secret),
        node_type=args.node_type or db["node_type"],
        workers=workers,
        spark_version=args.spark_version or db["spark_version"],
        secret_scope=scope,
        packages=spark_lines.packages(line, extras),
        python_archive=""
        if args.python_archive == "none"
        else args.python_archive or emr["python_archive"],
        emr_release=args.emr_release or emr["emr_release"],
        emr_spark_version=args.emr_spark_version or "",
        cluster_id=args.cluster_id or "",
        application_id=args.application_id or "",
        execution_role_arn=args.execution_role_arn or "",
        extras=extras,
        run_as=args.run_as or "",
        backlog_seconds=args.backlog_seconds or 0,
        backlog_records=args.backlog_records or 0,
        notify_emails=tuple(args.notify_email or ()),
        notify_webhooks=tuple(args.notify_webhook or ()),
        telemetry=telemetry(args),
        deny_private_endpoints=not args.allow_private_endpoints,
    )
    jobdefs.check_config(args.target, cfg)
    return cfg


def telemetry(args: argparse.Namespace) -> MetricsOptions:
    """The jobs' metrics and log options: the flags, else the environment this command runs
    with (`MetricsOptions.from_env`)."""
    return MetricsOptions.from_env(args.metrics_port, args.metrics_addr, args.log_format)


def render(args: argparse.Namespace, cfg: jobdefs.DeployConfig, catalog: Catalog) -> str:
    """The definition's text for the subscription's current catalog state."""
    snap = catalog.snapshot()
    sub_doc = snap.get(SUBSCRIPTION, args.name)
    if sub_doc is None:
        raise NotFound("subscription", args.name)
    op_doc = snap.get(jobdefs.OPERATION_KIND, f"{args.name}/{jobdefs.CHANGE_SHARDS}")
    p = jobdefs.plan(sub_doc, op_doc)
    if args.target == "spark-submit":
        return spark_submit_defs.spark_submit_script(p, cfg)  # notes are comments in the script
    note = jobdefs.operation_note(p)
    if note:
        _note(note)
    if p.paused:
        _note(f"{args.name} is paused; its shards will wait until resumed")
    if args.target == "databricks":
        return json.dumps(databricks_defs.databricks_job(p, cfg), indent=2) + "\n"
    if args.target == "databricks-bundle":
        return databricks_defs.bundle_yaml(p, cfg)
    names = jobdefs.secret_env_names(p, cfg)
    if names:
        _note(
            f"the jobs read {', '.join('$' + n for n in names)} from their environment; set "
            "them in the driver's and executors' environment (they are not in the definition)"
        )
    if args.target == "emr-serverless":
        data: object = emr_defs.emr_serverless_runs(p, cfg)
    elif args.emr_format == "cli":
        data = emr_defs.emr_cli_steps(emr_defs.emr_steps(p, cfg))
    else:
        data = emr_defs.emr_add_steps(p, cfg)
    return json.dumps(data, indent=2) + "\n"


def _note(text: str) -> None:
    print(f"varadhi: note: {text}", file=sys.stderr)


def _write(text: str, output: str | None, what: str) -> None:
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {what} to {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _render(args: argparse.Namespace) -> int:
    settings = common.settings(args)
    cfg = config(args, settings.bootstrap, settings.catalog_topic)  # refusals before any I/O
    catalog = Catalog(settings)
    try:
        text = render(args, cfg, catalog)
    finally:
        catalog.close()
    jobdefs.check_no_secret_values(text, settings.kafka.secrets())
    _write(text, args.output, f"{args.target} definition of {args.name}")
    return 0


def _launcher(args: argparse.Namespace) -> int:
    _write(jobdefs.LAUNCHER_SOURCE, args.output, jobdefs.LAUNCHER)
    return 0
