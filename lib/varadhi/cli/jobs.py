"""`varadhi jobs render NAME --target spark-submit|databricks|emr`: deployable job definitions
for a subscription's current state (see `varadhi.jobdefs`)."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata

from .. import jobdefs
from ..catalog import Catalog
from ..errors import InvalidArgument, NotFound
from ..subscriptions import KIND as SUBSCRIPTION
from . import common

_D = jobdefs.DEFAULTS
_ONLY = {  # flag -> the one target it applies to
    "wheel": "databricks",
    "node_type": "databricks",
    "workers": "databricks",
    "spark_version": "databricks",
    "secret_scope": "databricks",
    "emr_format": "emr",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("jobs", help="job definitions that run a subscription's shards")
    jsub = p.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    r = jsub.add_parser(
        "render",
        help="spark-submit commands, a Databricks job or EMR steps for a subscription",
        description="Render the jobs that run subscription NAME as it is now: one per shard, "
        "plus one feeder per old RQ/DLQ storage topic while a shard-count change needs them. "
        "Render again (and replace the deployed definition) after change-shards, once its "
        "feeders are done, and after pause/resume (Databricks mirrors the paused flag).",
    )
    r.add_argument("name", help="subscription name")
    r.add_argument("--target", required=True, choices=jobdefs.TARGETS)
    r.add_argument(
        "-o", "--output", metavar="FILE", help="write the definition to FILE instead of stdout"
    )
    r.add_argument(
        "--code-path",
        help="folder on the cluster holding the repository's jobs/ scripts (default: "
        + "; ".join(f"{t}: {_D[t]['code_path']}" for t in jobdefs.TARGETS)
        + "; local ./spark-submit.sh lines always use this checkout)",
    )
    r.add_argument(
        "--warehouse",
        help="shared storage for GroupState and checkpoints on the cluster (default: "
        + "; ".join(f"{t}: {_D[t]['warehouse']}" for t in jobdefs.TARGETS)
        + ")",
    )
    r.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT,...",
        help="Kafka bootstrap servers the jobs use (default: the ones this command reads the "
        "catalog from, --bootstrap or $VARADHI_BOOTSTRAP)",
    )
    r.add_argument(
        "--wheel",
        help="databricks: path of the varadhi-spark wheel to install (default: "
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
        help=f"databricks: runtime, a Spark 4 one (default: {_D['databricks']['spark_version']})",
    )
    r.add_argument(
        "--secret-scope",
        help="databricks: secret scope holding the endpoint's credential, if the subscription "
        "has endpoint.auth_env (key: that variable's name; default: "
        f"{_D['databricks']['secret_scope']})",
    )
    r.add_argument(
        "--emr-format",
        choices=["api", "cli"],
        help="emr: `api` = AddJobFlowSteps Steps (HadoopJarStep; boto3, SDKs, CloudFormation), "
        "`cli` = what `aws emr add-steps --steps file://FILE` reads (default: api)",
    )
    r.set_defaults(func=_render)


def _version() -> str:
    try:
        return metadata.version("varadhi-spark")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def config(args: argparse.Namespace, bootstrap: str, catalog_topic: str) -> jobdefs.DeployConfig:
    """The deployment configuration from the flags and the target's documented defaults;
    flags that do not apply to the target are refused (they would be silently ignored)."""
    for flag, only in _ONLY.items():
        if getattr(args, flag, None) is not None and args.target != only:
            raise InvalidArgument(
                f"--{flag.replace('_', '-')} applies to --target {only} only", field=flag
            )
    defaults = _D[args.target]
    workers = args.workers if args.workers is not None else _D["databricks"]["workers"]
    if workers < 1:
        raise InvalidArgument(f"must be at least 1, got {workers}", field="workers")
    for flag in (
        "code_path",
        "warehouse",
        "bootstrap_servers",
        "wheel",
        "node_type",
        "spark_version",
        "secret_scope",
    ):
        value = getattr(args, flag, None)
        if value is not None and not value.strip():
            raise InvalidArgument("must not be empty", field=flag)
    return jobdefs.DeployConfig(
        bootstrap_servers=args.bootstrap_servers or bootstrap,
        catalog_topic=catalog_topic,
        code_path=(args.code_path or defaults["code_path"]).rstrip("/"),
        warehouse=args.warehouse or defaults["warehouse"],
        wheel=args.wheel or _D["databricks"]["wheel"].format(version=_version()),
        node_type=args.node_type or _D["databricks"]["node_type"],
        workers=workers,
        spark_version=args.spark_version or _D["databricks"]["spark_version"],
        secret_scope=args.secret_scope or _D["databricks"]["secret_scope"],
    )


def render(args: argparse.Namespace, catalog: Catalog) -> str:
    """The definition's text for the subscription's current catalog state."""
    cfg = config(args, catalog.settings.bootstrap, catalog.settings.catalog_topic)
    snap = catalog.snapshot()
    sub_doc = snap.get(SUBSCRIPTION, args.name)
    if sub_doc is None:
        raise NotFound("subscription", args.name)
    op_doc = snap.get(jobdefs.OPERATION_KIND, f"{args.name}/{jobdefs.CHANGE_SHARDS}")
    p = jobdefs.plan(sub_doc, op_doc)
    if args.target == "spark-submit":
        return jobdefs.spark_submit_script(p, cfg)  # notes are comments in the script
    note = jobdefs.operation_note(p)
    if note:
        _note(note)
    if args.target == "databricks":
        data = jobdefs.databricks_job(p, cfg)
    else:
        data = jobdefs.emr_steps(p, cfg)
        if args.emr_format == "cli":
            data = jobdefs.emr_cli_steps(data)
        if p.paused:
            _note(f"{args.name} is paused; its shards will wait until resumed")
        if p.auth_env:
            _note(
                f"the endpoint's credential is read from ${p.auth_env} on every executor; "
                "set it in the cluster's executor environment (it is not in the steps)"
            )
    return json.dumps(data, indent=2) + "\n"


def _note(text: str) -> None:
    print(f"varadhi: note: {text}", file=sys.stderr)


def _render(args: argparse.Namespace) -> int:
    catalog = common.catalog(args)
    try:
        text = render(args, catalog)
    finally:
        catalog.close()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.target} definition of {args.name} to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
