"""Job definitions from hand-made catalog documents, checked against the APIs' own models
offline: Databricks job settings with databricks-sdk's `JobSettings` and databricks-bundles'
`Job` (a round trip that drops or rejects no field), EMR requests with botocore's service models
(`AddJobFlowSteps`, EMR Serverless `StartJobRun`: required members, types, lengths, patterns and
enums); spark-submit commands; feeders only while needed; refusals of what could only fail."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path

import botocore.session
import botocore.validate
import pytest
import yaml
from databricks.bundles.jobs import Job as BundleJob
from databricks.sdk.service.compute import DataSecurityMode
from databricks.sdk.service.jobs import JobSettings

from varadhi.core.errors import InvalidArgument
from varadhi.core.subscription_spec import parse_spec
from varadhi.jobs import databricks_definitions as databricks_defs
from varadhi.jobs import definitions as jobdefs
from varadhi.jobs import emr_definitions as emr_defs
from varadhi.jobs import spark_submit_definitions as spark_submit_defs
from varadhi.kafka import config as kafka_config
from varadhi.kafka.subscriptions import Subscription
from varadhi.spark import lines as spark_lines
from varadhi.spark.telemetry import MetricsOptions

ROOT = Path(__file__).resolve().parents[2]

KAFKA_SECRET = jobdefs.Secret("KAFKA_PASSWORD", "varadhi", "KAFKA_PASSWORD")
CFG = jobdefs.DeployConfig(
    bootstrap_servers="kafka-1:9092,kafka-2:9092",
    catalog_topic="__varadhi_catalog",
    warehouse="/Volumes/main/varadhi/warehouse",
    wheel="/Volumes/main/varadhi/artifacts/varadhi_spark-0.1.0-py3-none-any.whl",
    kafka_config="/Volumes/main/varadhi/conf/kafka.properties",
    secrets=(KAFKA_SECRET,),
)
EMR_CFG = replace(
    CFG,
    warehouse="s3://bucket/warehouse",
    code_path="s3://bucket/jobs",
    python_archive="s3://bucket/varadhi-venv.tar.gz",
    kafka_config="s3://bucket/conf/kafka.properties",
    emr_release="emr-7.12.0",
    cluster_id="j-2AXXXXXXGAPLF",
    application_id="00fabcdefgh12345",
    execution_role_arn="arn:aws:iam::123456789012:role/varadhi-jobs",
)


def sub_doc(shards=2, shard_count=None, paused=False, generation=0, **spec):
    """A catalog record `subscription/<name>` as SubscriptionService writes it."""
    doc = {
        "name": "orders-http",
        "topic": "orders",
        "endpoint": {"url": "http://127.0.0.1:8080/x"},
        "shards": shards,
        **spec,
    }
    sub = Subscription(
        parse_spec(doc),
        shard_count=shard_count or shards,
        created_ms=1,
        paused=paused,
        generation=generation,
    )
    return sub.to_dict()


def change_shards(step="feed", feeders=None):
    """An `operation/<sub>/change-shards` document as varadhi.ops.change_shards records it."""
    return {
        "kind": "change-shards",
        "from": 2,
        "to": 4,
        "step": step,
        "feeders": [
            {
                "queue": "rq",
                "source": "orders-http.rq.0",
                "target": "orders-http.rq.1",
                "done": False,
            },
            {
                "queue": "dlq",
                "source": "orders-http.dlq.0",
                "target": "orders-http.dlq.1",
                "done": False,
            },
        ]
        if feeders is None
        else feeders,
        "feeders_mode": "external",
    }


# -- the APIs' own models ----------------------------------------------------------------------


def check_job_settings(body: dict) -> None:
    """Raise unless `body` is Jobs API job settings by databricks-sdk's `JobSettings` and the
    bundle's `Job`: both parse it and give back exactly the same document (the SDK drops
    unknown fields silently, so equality is what catches them; the bundle model raises)."""
    assert json.loads(json.dumps(body)) == body, "only JSON types"
    assert JobSettings.from_dict(body).as_dict() == body
    assert BundleJob.from_dict(body).as_dict() == body


_BOTO = botocore.session.get_session()


# Java regex surrogate pairs in the models' XML-string patterns (any supplementary character).
_SURROGATES = re.compile(r"\\uD800\\u(?:DC00-\\uDBFF|DBFF-\\uDC00)\\uDFFF")


def python_pattern(pattern: str) -> str:
    return _SURROGATES.sub(lambda _m: r"\U00010000-\U0010FFFF", pattern)


def _check_shape(shape, value, where: str) -> None:
    """What `validate_parameters` leaves out: string patterns and enums, recursively."""
    kind = shape.type_name
    if kind == "structure":
        for k, v in value.items():
            _check_shape(shape.members[k], v, f"{where}.{k}")
    elif kind == "list":
        for i, v in enumerate(value):
            _check_shape(shape.member, v, f"{where}[{i}]")
    elif kind == "map":
        for k, v in value.items():
            _check_shape(shape.key, k, f"{where} key")
            _check_shape(shape.value, v, f"{where}.{k}")
    elif kind == "string":
        pattern = shape.metadata.get("pattern")
        assert pattern is None or re.fullmatch(python_pattern(pattern), value, re.DOTALL), (
            where,
            value,
        )
        assert not shape.enum or value in shape.enum, (where, value, shape.enum)


def check_request(service: str, operation: str, params: dict) -> None:
    """Raise unless `params` is a valid `operation` request by botocore's model of `service`."""
    shape = _BOTO.get_service_model(service).operation_model(operation).input_shape
    botocore.validate.validate_parameters(params, shape)  # ParamValidationError otherwise
    _check_shape(shape, params, operation)


def test_the_model_checks_catch_what_they_are_for():
    """The checks fail on a bad document (so a passing one means something)."""
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc()), CFG)
    with pytest.raises(AssertionError):
        check_job_settings({**body, "max_retries": -1})  # a task field at the job level
    with pytest.raises(AssertionError):
        check_job_settings({**body, "tasks": [{**body["tasks"][0], "retries": 3}]})
    request = emr_defs.emr_add_steps(jobdefs.plan(sub_doc()), EMR_CFG)
    with pytest.raises(botocore.exceptions.ParamValidationError):
        check_request("emr", "AddJobFlowSteps", {"Steps": request["Steps"]})
    run = emr_defs.emr_serverless_runs(jobdefs.plan(sub_doc()), EMR_CFG)[0]
    with pytest.raises(AssertionError):
        check_request("emr-serverless", "StartJobRun", {**run, "mode": "CONTINUOUS"})
    with pytest.raises(AssertionError):
        check_request("emr-serverless", "StartJobRun", {**run, "applicationId": "App_1"})


# -- plan --------------------------------------------------------------------------------------


def test_plan_uses_the_live_shard_count_paused_flag_and_generation():
    p = jobdefs.plan(sub_doc(shards=2, shard_count=4, paused=True, generation=3))
    assert (p.subscription, p.shard_count, p.paused, p.generation) == ("orders-http", 4, True, 3)
    assert list(p.shards) == [0, 1, 2, 3]
    assert p.feeders == () and p.operation is None


def test_feeders_only_while_the_operation_feeds():
    assert jobdefs.feeders_needed(None) == ()
    assert jobdefs.feeders_needed(change_shards(step="done")) == ()
    assert jobdefs.feeders_needed(change_shards(feeders=[])) == ()
    assert jobdefs.feeders_needed(change_shards(step="feed")) == (
        jobdefs.Feeder("rq", "orders-http.rq.0"),
        jobdefs.Feeder("dlq", "orders-http.dlq.0"),
    )
    # Before `feed` the new shards are not active and feeder jobs would be refused.
    for step in ("fence", "queues", "state", "layouts", "activate"):
        assert jobdefs.feeders_needed(change_shards(step=step)) == ()
    twice = [{"queue": "rq", "source": "a.rq.0"}, {"queue": "rq", "source": "a.rq.0"}]
    assert jobdefs.feeders_needed(change_shards(feeders=twice)) == (jobdefs.Feeder("rq", "a.rq.0"),)


def test_fed_entries_are_not_rendered_again():
    op = change_shards()
    op["feeders"][0]["done"] = True
    assert jobdefs.feeders_needed(op) == (jobdefs.Feeder("dlq", "orders-http.dlq.0"),)
    op["feeders"][1]["done"] = True
    assert jobdefs.feeders_needed(op) == ()


def test_a_change_before_its_feed_step_is_noted_not_fed():
    p = jobdefs.plan(sub_doc(shards=2), change_shards(step="state"))
    assert p.feeders == ()
    note = jobdefs.operation_note(p)
    assert "step state" in note and "change-shards orders-http --to 4" in note
    assert "keep the shards stopped" in spark_submit_defs.spark_submit_script(p, CFG)
    assert "keep the shards stopped" in databricks_defs.databricks_job(p, CFG)["description"]
    assert "2 feeder(s)" in jobdefs.operation_note(jobdefs.plan(sub_doc(), change_shards()))
    assert jobdefs.operation_note(jobdefs.plan(sub_doc(), change_shards(step="done"))) is None


@pytest.mark.parametrize(
    ("operation", "field"),
    [
        ({"kind": "offset-reset", "step": "x"}, "kind"),
        (change_shards(feeders={"queue": "rq"}), "operation.feeders"),
        (change_shards(feeders=["orders.rq.0"]), "operation.feeders[0]"),
        (change_shards(feeders=[{"queue": "main", "source": "t.0"}]), "operation.feeders[0].queue"),
        (change_shards(feeders=[{"queue": "rq"}]), "operation.feeders[0].source"),
        (
            change_shards(feeders=[{"queue": "rq", "source": "a b; rm -rf /"}]),
            "operation.feeders[0].source",
        ),
    ],
)
def test_malformed_operations_are_refused_by_field(operation, field):
    with pytest.raises(InvalidArgument) as e:
        jobdefs.plan(sub_doc(), operation)
    assert e.value.field == field


# -- Databricks --------------------------------------------------------------------------------


def test_databricks_job_runs_the_wheel_one_task_per_shard():
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc(shards=3)), CFG)
    check_job_settings(body)
    assert body["name"] == "varadhi-orders-http"
    assert [t["task_key"] for t in body["tasks"]] == ["shard-0", "shard-1", "shard-2"]
    for shard, task in enumerate(body["tasks"]):
        assert task["python_wheel_task"] == {
            "package_name": "varadhi-spark",
            "entry_point": "varadhi-job",
            "parameters": [
                "shard",
                "--subscription",
                "orders-http",
                "--shard",
                str(shard),
                "--cluster",
                "--bootstrap",
                "kafka-1:9092,kafka-2:9092",
                "--warehouse",
                "/Volumes/main/varadhi/warehouse",
            ],
        }
        assert task["libraries"] == [{"whl": CFG.wheel}]
        assert task["job_cluster_key"] == body["job_clusters"][0]["job_cluster_key"]
    cluster = body["job_clusters"][0]["new_cluster"]
    assert (cluster["spark_version"], cluster["num_workers"]) == ("17.3.x-scala2.13", 2)
    # Dedicated access mode: SINGLE_USER is the API's (legacy) name of DATA_SECURITY_MODE_DEDICATED.
    assert cluster["data_security_mode"] == "SINGLE_USER"
    assert "DEDICATED" in DataSecurityMode.__doc__.split("``SINGLE_USER``: Legacy alias for")[1]
    assert "spark.sql.catalog.spark_catalog" not in cluster["spark_conf"]  # the runtime's own


def test_databricks_restarts_one_failed_shard_and_leaves_the_others_running():
    """Triggered job, tasks side by side, each retried without limit (a continuous job's
    ON_FAILURE retry would cancel every shard once each had failed once)."""
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc(shards=2), change_shards()), CFG)
    check_job_settings(body)
    assert not {"continuous", "schedule", "trigger"} & set(body)
    assert body["max_concurrent_runs"] == 1 and body["queue"] == {"enabled": False}
    for task in body["tasks"]:
        assert "depends_on" not in task and "timeout_seconds" not in task
        assert task["max_retries"] == -1
        assert task["min_retry_interval_millis"] == databricks_defs.RETRY_INTERVAL_MS
        assert task["retry_on_timeout"] is False


def test_databricks_kafka_config_and_secrets_are_references_never_values():
    doc = sub_doc(endpoint={"url": "https://example.test/x", "auth_env": "ORDERS_TOKEN"})
    cfg = replace(CFG, secret_scope="prod", secrets=(KAFKA_SECRET,))
    body = databricks_defs.databricks_job(jobdefs.plan(doc), cfg)
    check_job_settings(body)
    assert body["job_clusters"][0]["new_cluster"]["spark_env_vars"] == {
        "VARADHI_CATALOG_TOPIC": "__varadhi_catalog",
        "VARADHI_ENDPOINT_DENY_PRIVATE": "true",
        "VARADHI_KAFKA_CONFIG": "/Volumes/main/varadhi/conf/kafka.properties",
        "KAFKA_PASSWORD": "{{secrets/varadhi/KAFKA_PASSWORD}}",
        "ORDERS_TOKEN": "{{secrets/prod/ORDERS_TOKEN}}",
    }

    # The endpoint's credential may come from another scope and key.
    other = replace(cfg, secrets=(jobdefs.parse_secret("ORDERS_TOKEN=ops/orders-token", "x"),))
    env = databricks_defs.databricks_env(jobdefs.plan(doc), other)
    assert env["ORDERS_TOKEN"] == "{{secrets/ops/orders-token}}"


def test_rendered_jobs_deny_private_endpoints_unless_allowed_and_sign_with_secrets():
    """Every renderer's job environment denies private endpoint addresses by default (cloud
    metadata at 169.254.169.254); the variables of the signing keys, the TLS client key and the
    OAuth2 client secret are secrets like auth_env's."""
    endpoint = {
        "url": "https://example.test/x",
        "signing": [{"scheme": "v1", "env": "VARADHI_ENDPOINT_WHSEC"}],
        "tls": {"cert": {"file": "/s/c.pem"}, "key": {"env": "VARADHI_ENDPOINT_TLS_KEY"}},
        "oauth2": {
            "token_url": "https://idp.test/token",
            "client_id": "c",
            "client_secret": {"env": "VARADHI_ENDPOINT_CLIENT_SECRET"},
        },
    }
    p = jobdefs.plan(sub_doc(endpoint=endpoint))
    assert jobdefs.job_env(CFG)["VARADHI_ENDPOINT_DENY_PRIVATE"] == "true"
    allowed = replace(CFG, deny_private_endpoints=False)
    assert jobdefs.job_env(allowed)["VARADHI_ENDPOINT_DENY_PRIVATE"] == "false"
    env = databricks_defs.databricks_job(p, CFG)["job_clusters"][0]["new_cluster"]
    assert env["spark_env_vars"]["VARADHI_ENDPOINT_WHSEC"] == (
        "{{secrets/varadhi/VARADHI_ENDPOINT_WHSEC}}"
    )
    assert env["spark_env_vars"]["VARADHI_ENDPOINT_DENY_PRIVATE"] == "true"
    for name in ("VARADHI_ENDPOINT_TLS_KEY", "VARADHI_ENDPOINT_CLIENT_SECRET"):
        assert env["spark_env_vars"][name] == f"{{{{secrets/varadhi/{name}}}}}"
    args = emr_args(emr_defs.emr_steps(p, EMR_CFG)[0])
    assert "spark.executorEnv.VARADHI_ENDPOINT_DENY_PRIVATE=true" in args


@pytest.mark.parametrize(
    ("who", "field"),
    [
        ("ops@example.com", "user_name"),
        ("6e5b1c4a-1f0a-4c8e-9d3b-2f7a8c9e0b1d", "service_principal_name"),
    ],
)
def test_databricks_run_as_dedicates_the_cluster_to_it(who, field):
    cfg = replace(CFG, run_as=who)
    jobdefs.check_config("databricks", cfg)
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc()), cfg)
    check_job_settings(body)
    assert body["run_as"] == {field: who}
    assert body["job_clusters"][0]["new_cluster"]["single_user_name"] == who
    assert "run_as" not in databricks_defs.databricks_job(jobdefs.plan(sub_doc()), CFG)


HOOK = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"


def test_databricks_backlog_rules_and_failure_notifications_when_asked():
    cfg = replace(
        CFG,
        backlog_seconds=300,
        backlog_records=50_000,
        notify_emails=("ops@example.com", "oncall@example.com"),
        notify_webhooks=(HOOK,),
    )
    jobdefs.check_config("databricks", cfg)
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc(), change_shards()), cfg)
    check_job_settings(body)
    assert body["health"]["rules"] == [
        {"metric": "STREAMING_BACKLOG_SECONDS", "op": "GREATER_THAN", "value": 300},
        {"metric": "STREAMING_BACKLOG_RECORDS", "op": "GREATER_THAN", "value": 50_000},
    ]
    emails = ["ops@example.com", "oncall@example.com"]
    assert body["email_notifications"] == {
        "on_failure": emails,
        "on_streaming_backlog_exceeded": emails,
    }
    assert body["webhook_notifications"] == {
        "on_failure": [{"id": HOOK}],
        "on_streaming_backlog_exceeded": [{"id": HOOK}],
    }
    # Every task (shards and feeders) reports its own failed attempts: the run goes on.
    assert len(body["tasks"]) > 2
    for task in body["tasks"]:
        assert task["email_notifications"] == {"on_failure": emails}
        assert task["webhook_notifications"] == {"on_failure": [{"id": HOOK}]}
    bundle = databricks_defs.databricks_bundle(jobdefs.plan(sub_doc()), cfg)
    (job,) = bundle["resources"]["jobs"].values()
    check_job_settings(job)
    assert job["health"] == body["health"]


def test_databricks_notifications_without_rules_are_failures_only_and_nothing_by_default():
    cfg = replace(CFG, notify_emails=("ops@example.com",))
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc()), cfg)
    check_job_settings(body)
    assert "health" not in body and "webhook_notifications" not in body
    assert body["email_notifications"] == {"on_failure": ["ops@example.com"]}
    plain = databricks_defs.databricks_job(jobdefs.plan(sub_doc()), CFG)
    assert not {"health", "email_notifications", "webhook_notifications"} & set(plain)
    assert not any("email_notifications" in t for t in plain["tasks"])
    rules_only = databricks_defs.databricks_job(
        jobdefs.plan(sub_doc()), replace(CFG, backlog_records=10)
    )
    check_job_settings(rules_only)
    assert rules_only["health"]["rules"][0]["metric"] == "STREAMING_BACKLOG_RECORDS"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"backlog_seconds": -1}, "backlog_seconds"),
        ({"backlog_records": -5}, "backlog_records"),
        ({"notify_emails": ("ops team",)}, "notify_email"),
        ({"notify_webhooks": ("https://hooks.example.com/x",)}, "notify_webhook"),
    ],
)
def test_alert_settings_the_jobs_api_would_reject_are_refused(change, field):
    with pytest.raises(InvalidArgument) as e:
        jobdefs.check_config("databricks", replace(CFG, **change))
    assert e.value.field == field and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("KAFKA_PASSWORD", jobdefs.Secret("KAFKA_PASSWORD", "dflt", "KAFKA_PASSWORD")),
        (
            "VARADHI_KAFKA_SASL_JAAS_CONFIG=kafka/jaas",
            jobdefs.Secret("VARADHI_KAFKA_SASL_JAAS_CONFIG", "kafka", "jaas"),
        ),
        ("KAFKA_PASSWORD=hunter2", None),  # a value where a reference belongs
        ("KAFKA PASSWORD", None),
        ("A=scope/", None),
        ("A=sc ope/key", None),
    ],
)
def test_secrets_parse_as_references(text, expected):
    if expected is None:
        with pytest.raises(InvalidArgument) as e:
            jobdefs.parse_secret(text, "dflt")
        assert e.value.field == "secret"
    else:
        assert jobdefs.parse_secret(text, "dflt") == expected


def test_a_secret_value_of_the_kafka_configuration_is_never_written():
    kafka = kafka_config.from_properties(
        {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
            'required username="alice" password="${env:KAFKA_PASSWORD}";',
        },
        environ={"KAFKA_PASSWORD": "s3cr3t-pw"},
    )
    p = jobdefs.plan(sub_doc())
    ok = json.dumps(databricks_defs.databricks_job(p, CFG))
    jobdefs.check_no_secret_values(ok, kafka.secrets())
    typed_in = replace(CFG, kafka_config="/Volumes/main/varadhi/conf/s3cr3t-pw")  # a slip
    leaked = json.dumps(databricks_defs.databricks_job(p, typed_in))
    with pytest.raises(InvalidArgument) as e:
        jobdefs.check_no_secret_values(leaked, kafka.secrets())
    assert "s3cr3t-pw" not in str(e.value)


def test_databricks_feeder_tasks_only_while_the_operation_needs_them():
    doc = sub_doc(shards=2, shard_count=4)
    feeding = databricks_defs.databricks_job(jobdefs.plan(doc, change_shards()), CFG)
    check_job_settings(feeding)
    keys = [t["task_key"] for t in feeding["tasks"]]
    assert keys == ["shard-0", "shard-1", "shard-2", "shard-3", "feeder-0", "feeder-1"]
    feeders = [t["python_wheel_task"]["parameters"] for t in feeding["tasks"][4:]]
    cluster = ["--cluster", "--bootstrap", "kafka-1:9092,kafka-2:9092"]  # feeders keep no state
    assert feeders == [
        ["feeder", "--subscription", "orders-http", "--source", "orders-http.rq.0", *cluster],
        ["feeder", "--subscription", "orders-http", "--source", "orders-http.dlq.0", *cluster],
    ]
    assert "change-shards 2 -> 4" in feeding["description"]
    done = databricks_defs.databricks_job(jobdefs.plan(doc, change_shards(step="done")), CFG)
    assert [t["task_key"] for t in done["tasks"]] == keys[:4]


def test_bundle_holds_the_same_job():
    p = jobdefs.plan(sub_doc(name="orders-http-v2"))
    text = databricks_defs.bundle_yaml(p, CFG)
    bundle = yaml.safe_load(text)
    # Top-level keys: no schema of databricks.yml ships offline on PyPI; these are the ones the
    # bundle format documents for what this file uses.
    assert list(bundle) == ["bundle", "resources"]
    assert bundle["bundle"] == {"name": "varadhi-orders-http-v2"}
    jobs = bundle["resources"]["jobs"]
    assert list(jobs) == ["varadhi_orders_http_v2"]
    job = jobs["varadhi_orders_http_v2"]
    check_job_settings(job)
    assert job == databricks_defs.databricks_job(p, CFG)
    assert "databricks bundle run varadhi_orders_http_v2" in text


@pytest.mark.parametrize(
    ("runtime", "line"),
    [("17.3.x-scala2.13", "4.0"), ("16.4.x-scala2.12", "3.5"), ("15.4.x-photon-scala2.12", "3.5")],
)
def test_databricks_runtime_maps_to_a_supported_spark_line(runtime, line):
    assert jobdefs.databricks_line(runtime).line == line


@pytest.mark.parametrize(
    "runtime",
    [
        "14.3.x-scala2.12",  # Spark 3.5, but Python 3.10
        "13.3.x-scala2.12",
        "12.2.x-scala2.12",
        "latest",
        "17.3",
    ],
)
def test_databricks_runtime_outside_the_lines_is_refused(runtime):
    with pytest.raises(InvalidArgument) as e:
        jobdefs.check_config("databricks", replace(CFG, spark_version=runtime))
    assert e.value.field == "spark_version" and "\n" not in str(e.value)


# -- the warehouse and other refusals ----------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("databricks", "dbfs:/varadhi/warehouse"),
        ("databricks", "abfss://c@acct.dfs.core.windows.net/varadhi"),
        ("databricks-bundle", "/Volumes/main/varadhi/warehouse"),
        ("emr", "s3://bucket/warehouse"),
        ("emr", "hdfs:///varadhi"),
        ("emr-serverless", "s3a://bucket/warehouse"),
        ("spark-submit", "gs://bucket/warehouse"),
        ("spark-submit", "hdfs://nn:8020/varadhi"),
    ],
)
def test_shared_warehouses_are_accepted(target, path):
    jobdefs.check_warehouse(target, path)


@pytest.mark.parametrize(
    ("target", "path", "says"),
    [
        ("databricks", "/tmp/warehouse", "is a local path"),
        ("databricks", "file:///tmp/warehouse", "is a local path"),
        ("databricks", "spark-warehouse", "is a local path"),
        ("databricks", "/Volumes/", "is a local path"),
        ("emr", "/mnt/warehouse", "is a local path"),
        ("emr", "dbfs:/varadhi", "cannot use dbfs: storage"),
        ("emr-serverless", "hdfs:///varadhi", "cannot use hdfs: storage"),
        ("spark-submit", "./warehouse", "is a local path"),
        ("spark-submit", "/Volumes/main/x/y", "is a local path"),
    ],
)
def test_local_warehouses_are_refused_in_one_line(target, path, says):
    with pytest.raises(InvalidArgument) as e:
        jobdefs.check_warehouse(target, path)
    assert e.value.field == "warehouse" and says in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("target", "change", "field"),
    [
        ("databricks", {"wheel": "/Volumes/main/varadhi/varadhi.zip"}, "wheel"),
        ("databricks", {"kafka_config": "dbfs:/conf/kafka.properties"}, "kafka_config"),
        ("databricks", {"run_as": "ops team"}, "run_as"),
        ("emr", {"emr_release": "emr-6.15.0"}, "emr_release"),
        ("emr", {"emr_release": "emr-8.0.0"}, "emr_release"),
        ("emr", {"emr_release": "7.1.0"}, "emr_release"),
        ("emr", {"python_archive": "/home/me/venv.tar.gz"}, "python_archive"),
        ("emr", {"python_archive": "s3://bucket/venv"}, "python_archive"),
        ("emr", {"code_path": "/home/me/jobs"}, "code_path"),
        ("emr", {"kafka_config": "conf/kafka.properties"}, "kafka_config"),
        ("emr", {"cluster_id": "cluster-1"}, "cluster_id"),
        ("emr-serverless", {"application_id": "My-App"}, "application_id"),
        ("emr-serverless", {"emr_release": "emr-7.0.0"}, "emr_release"),  # no retries yet
        ("emr-serverless", {"execution_role_arn": "varadhi-jobs"}, "execution_role_arn"),
    ],
)
def test_configurations_that_could_only_fail_are_refused(target, change, field):
    cfg = replace(EMR_CFG if target.startswith("emr") else CFG, **change)
    with pytest.raises(InvalidArgument) as e:
        jobdefs.check_config(target, cfg)
    assert e.value.field == field and "\n" not in str(e.value)


def test_valid_configurations_pass():
    for target in ("databricks", "databricks-bundle"):
        jobdefs.check_config(target, CFG)
    for target in ("emr", "emr-serverless"):
        jobdefs.check_config(target, EMR_CFG)


# -- EMR ---------------------------------------------------------------------------------------


def emr_args(step: dict) -> list[str]:
    return step["HadoopJarStep"]["Args"]


def confs(args: list[str]) -> dict[str, str]:
    pairs = [args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--conf"]
    return dict(pairs)


def launcher_and_params(args: list[str]) -> tuple[str, list[str]]:
    i = next(i for i, a in enumerate(args) if a.endswith(f"/{jobdefs.LAUNCHER}"))
    return args[i], args[i + 1 :]


def test_emr_release_sets_the_spark_line_and_packages():
    line = jobdefs.emr_line("emr-7.12.0")
    assert (line.line, line.scala) == ("3.5", "2.12") and line.delta_version.startswith("3.")
    assert jobdefs.emr_line("emr-7.0.0").line == line.line


@pytest.mark.parametrize(
    ("release", "spark"),
    [
        ("emr-7.0.0", "3.5.0"),
        ("emr-7.5.0", "3.5.2"),
        ("emr-7.9.0", "3.5.5"),
        ("emr-7.12.0", "3.5.6"),
    ],
)
def test_each_emr_release_gets_the_connector_of_its_own_spark(release, spark):
    """Every emr-7.x release got spark-sql-kafka-0-10_2.12:3.5.7, the tested line's, though
    the connector is built per Spark release (issue 30); the values are AWS's release notes'."""
    line = jobdefs.emr_line(release)
    assert line.spark_version == spark
    assert spark_lines.packages(line)[0] == f"org.apache.spark:spark-sql-kafka-0-10_2.12:{spark}"


def test_an_emr_release_not_in_the_table_is_refused_unless_its_spark_is_given():
    with pytest.raises(InvalidArgument, match="--emr-spark-version") as e:
        jobdefs.emr_line("emr-7.2.0")
    assert e.value.field == "emr_release"
    assert jobdefs.emr_line("emr-7.2.0", "3.5.1").spark_version == "3.5.1"
    with pytest.raises(InvalidArgument, match="emr-6.15.0"):
        jobdefs.emr_line("emr-6.15.0", "3.4.1")  # outside the supported lines


def test_emr_add_steps_is_a_valid_request_per_shard():
    request = emr_defs.emr_add_steps(jobdefs.plan(sub_doc(shards=2)), EMR_CFG)
    check_request("emr", "AddJobFlowSteps", request)
    assert request["JobFlowId"] == "j-2AXXXXXXGAPLF"
    steps = request["Steps"]
    assert [s["Name"] for s in steps] == [
        "varadhi-orders-http-shard-0",
        "varadhi-orders-http-shard-1",
    ]
    for shard, step in enumerate(steps):
        assert step["ActionOnFailure"] == "CONTINUE"
        args = emr_args(step)
        assert step["HadoopJarStep"]["Jar"] == "command-runner.jar"
        assert args[:3] == ["spark-submit", "--deploy-mode", "cluster"]
        # Spark 3.5 / Scala 2.12 / Delta 3.x for an EMR 7 release, not the local Spark 4.1 jars.
        packages = args[args.index("--packages") + 1].split(",")
        assert packages[0] == "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.6"  # emr-7.12.0's
        assert packages[1:] == list(spark_lines.packages(spark_lines.by_line("3.5"))[1:])
        assert args[args.index("--files") + 1] == "s3://bucket/conf/kafka.properties"
        conf = confs(args)
        assert conf["spark.archives"] == "s3://bucket/varadhi-venv.tar.gz#environment"
        for key in (
            "spark.yarn.appMasterEnv.PYSPARK_PYTHON",
            "spark.yarn.appMasterEnv.PYSPARK_DRIVER_PYTHON",
            "spark.executorEnv.PYSPARK_PYTHON",
        ):
            assert conf[key] == "./environment/bin/python"
        assert conf["spark.yarn.submit.waitAppCompletion"] == "false"  # streaming steps never end
        for prefix in ("spark.yarn.appMasterEnv.", "spark.executorEnv."):
            assert conf[prefix + "VARADHI_CATALOG_TOPIC"] == "__varadhi_catalog"
            assert conf[prefix + "VARADHI_KAFKA_CONFIG"] == "kafka.properties"  # the --files copy
        launcher, params = launcher_and_params(args)
        assert launcher == "s3://bucket/jobs/varadhi_job.py"
        assert params[:5] == ["shard", "--subscription", "orders-http", "--shard", str(shard)]
        assert params[params.index("--warehouse") + 1] == "s3://bucket/warehouse"


def test_emr_feeder_steps_only_while_the_operation_needs_them():
    doc = sub_doc(shards=2)
    feeding = emr_defs.emr_add_steps(jobdefs.plan(doc, change_shards()), EMR_CFG)
    check_request("emr", "AddJobFlowSteps", feeding)
    assert [s["Name"].rsplit("-", 2)[1:] for s in feeding["Steps"]] == [
        ["shard", "0"],
        ["shard", "1"],
        ["feeder", "0"],
        ["feeder", "1"],
    ]
    _, params = launcher_and_params(emr_args(feeding["Steps"][3]))
    assert params[:5] == [
        "feeder",
        "--subscription",
        "orders-http",
        "--source",
        "orders-http.dlq.0",
    ]
    assert len(emr_defs.emr_steps(jobdefs.plan(doc, change_shards(step="done")), EMR_CFG)) == 2


def test_emr_secrets_are_never_in_the_requests():
    doc = sub_doc(endpoint={"url": "https://example.test/x", "auth_env": "ORDERS_TOKEN"})
    p = jobdefs.plan(doc)
    assert jobdefs.secret_env_names(p, EMR_CFG) == ["KAFKA_PASSWORD", "ORDERS_TOKEN"]
    rendered = json.dumps(
        [emr_defs.emr_add_steps(p, EMR_CFG), emr_defs.emr_serverless_runs(p, EMR_CFG)]
    )
    assert "ORDERS_TOKEN" not in rendered and "KAFKA_PASSWORD" not in rendered


def test_emr_cli_shape_carries_the_same_steps():
    steps = emr_defs.emr_steps(jobdefs.plan(sub_doc(), change_shards()), EMR_CFG)
    cli = emr_defs.emr_cli_steps(steps)
    assert len(cli) == len(steps)
    for api, c in zip(steps, cli, strict=True):
        assert set(c) == {"Type", "Name", "ActionOnFailure", "Jar", "Args"}
        assert c["Type"] == "CUSTOM_JAR"
        assert (c["Name"], c["ActionOnFailure"]) == (api["Name"], api["ActionOnFailure"])
        assert (c["Jar"], c["Args"]) == (api["HadoopJarStep"]["Jar"], api["HadoopJarStep"]["Args"])


def test_emr_serverless_runs_are_valid_streaming_start_job_run_requests():
    runs = emr_defs.emr_serverless_runs(jobdefs.plan(sub_doc(shards=2), change_shards()), EMR_CFG)
    assert [r["name"] for r in runs] == [
        "varadhi-orders-http-shard-0",
        "varadhi-orders-http-shard-1",
        "varadhi-orders-http-feeder-0",
        "varadhi-orders-http-feeder-1",
    ]
    assert len({r["clientToken"] for r in runs}) == 4
    for run in runs:
        check_request("emr-serverless", "StartJobRun", run)
        assert run["mode"] == "STREAMING"
        # streaming: no maxAttempts; at most 10 failed attempts an hour
        assert set(run["retryPolicy"]) == {"maxFailedAttemptsPerHour"}
        assert 1 <= run["retryPolicy"]["maxFailedAttemptsPerHour"] <= 10
        driver = run["jobDriver"]["sparkSubmit"]
        assert driver["entryPoint"] == "s3://bucket/jobs/varadhi_job.py"
        assert driver["entryPointArguments"][0] in ("shard", "feeder")
        args = driver["sparkSubmitParameters"].split(" ")
        conf = confs(args)
        assert conf["spark.archives"] == "s3://bucket/varadhi-venv.tar.gz#environment"
        assert conf["spark.emr-serverless.driverEnv.PYSPARK_PYTHON"] == "./environment/bin/python"
        assert conf["spark.executorEnv.PYSPARK_PYTHON"] == "./environment/bin/python"
        assert conf["spark.emr-serverless.driverEnv.VARADHI_KAFKA_CONFIG"] == "kafka.properties"
        assert not any(k.startswith("spark.yarn.") for k in conf)
        assert "io.delta:delta-spark_2.12:3." in args[args.index("--packages") + 1]


def test_emr_without_an_archive_uses_the_nodes_or_images_python():
    cfg = replace(EMR_CFG, python_archive="")
    jobdefs.check_config("emr-serverless", cfg)
    (run,) = emr_defs.emr_serverless_runs(jobdefs.plan(sub_doc(shards=1)), cfg)
    check_request("emr-serverless", "StartJobRun", run)
    params = run["jobDriver"]["sparkSubmit"]["sparkSubmitParameters"]
    assert "spark.archives" not in params and "PYSPARK_PYTHON" not in params
    (step,) = emr_defs.emr_steps(jobdefs.plan(sub_doc(shards=1)), cfg)
    assert not any("PYSPARK_PYTHON" in a for a in emr_args(step))


def test_emr_serverless_refuses_values_it_would_split():
    cfg = replace(EMR_CFG, catalog_topic="my catalog")
    with pytest.raises(InvalidArgument):
        emr_defs.emr_serverless_runs(jobdefs.plan(sub_doc()), cfg)


MSK = pytest.mark.skipif("msk-iam" not in spark_lines.EXTRAS, reason="no msk-iam extra yet")


@MSK
def test_msk_iam_jar_comes_with_the_clusters_spark_line():
    cfg = replace(CFG, extras=("msk-iam",))
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc()), cfg)
    check_job_settings(body)
    (msk,) = spark_lines.packages(spark_lines.CURRENT, ["msk-iam"])[2:]
    assert body["tasks"][0]["libraries"] == [{"whl": CFG.wheel}, {"maven": {"coordinates": msk}}]
    steps = emr_defs.emr_steps(jobdefs.plan(sub_doc()), replace(EMR_CFG, extras=("msk-iam",)))
    args = emr_args(steps[0])
    assert args[args.index("--packages") + 1].split(",")[2:] == [msk]


def test_the_s3_extra_is_for_spark_submit_only():
    for target, cfg in (("databricks", CFG), ("emr", EMR_CFG), ("emr-serverless", EMR_CFG)):
        with pytest.raises(InvalidArgument) as e:
            jobdefs.check_config(target, replace(cfg, extras=("s3",)))
        assert e.value.field == "spark_extra"


# -- spark-submit ------------------------------------------------------------------------------


def commands(script: str) -> list[list[str]]:
    return [shlex.split(line) for line in script.splitlines() if line and not line.startswith("#")]


def test_spark_submit_script_has_local_and_cluster_commands_per_shard():
    cfg = replace(CFG, code_path="/opt/varadhi", warehouse="hdfs:///varadhi/warehouse", secrets=())
    script = spark_submit_defs.spark_submit_script(jobdefs.plan(sub_doc(shards=2)), cfg)
    cmds = commands(script)
    assert cmds[:4] == [
        ["export", "VARADHI_BOOTSTRAP=kafka-1:9092,kafka-2:9092"],
        ["export", "VARADHI_CATALOG_TOPIC=__varadhi_catalog"],
        ["export", "VARADHI_ENDPOINT_DENY_PRIVATE=true"],
        ["export", "VARADHI_KAFKA_CONFIG=/Volumes/main/varadhi/conf/kafka.properties"],
    ]
    assert cmds[4:6] == [
        ["./spark-submit.sh", "orders-http", "0"],
        ["./spark-submit.sh", "orders-http", "1"],
    ]
    cluster = cmds[6:]
    assert len(cluster) == 2
    for shard, c in enumerate(cluster):
        assert c[:3] == ["spark-submit", "--packages", ",".join(jobdefs.SPARK_PACKAGES)]
        launcher, params = launcher_and_params(c)
        assert launcher == "/opt/varadhi/varadhi_job.py"
        assert params == [
            "shard",
            "--subscription",
            "orders-http",
            "--shard",
            str(shard),
            "--cluster",
            "--bootstrap",
            "kafka-1:9092,kafka-2:9092",
            "--warehouse",
            "hdfs:///varadhi/warehouse",
        ]
    assert "paused" not in script and "feeder" not in script and "secrets" not in script
    assert "# ./spark-submit.sh orders-http 1 --standby" in script.splitlines()


def test_spark_submit_feeders_secrets_and_pause_note():
    doc = sub_doc(shards=2, paused=True)
    script = spark_submit_defs.spark_submit_script(jobdefs.plan(doc, change_shards()), CFG)
    cmds = commands(script)
    for source in ("orders-http.rq.0", "orders-http.dlq.0"):
        local = ["./spark-submit.sh", "--job", "feeder", "--subscription", "orders-http"]
        assert [*local, "--source", source] in cmds
    cluster_feeders = [
        launcher_and_params(c)[1] for c in cmds if c[0] == "spark-submit" and "feeder" in c
    ]
    assert [params[:5] for params in cluster_feeders] == [
        ["feeder", "--subscription", "orders-http", "--source", "orders-http.rq.0"],
        ["feeder", "--subscription", "orders-http", "--source", "orders-http.dlq.0"],
    ]
    assert "# the subscription is paused" in script
    assert "$KAFKA_PASSWORD" in script  # named as a variable to provide, never a value
    assert "feeder" not in spark_submit_defs.spark_submit_script(
        jobdefs.plan(doc, change_shards(step="done")), CFG
    )


def test_spark_submit_quotes_what_the_shell_would_split():
    cfg = replace(CFG, warehouse="hdfs:///shared drive/warehouse", catalog_topic="cat$alog")
    script = spark_submit_defs.spark_submit_script(jobdefs.plan(sub_doc()), cfg)
    cmds = commands(script)
    assert ["export", "VARADHI_CATALOG_TOPIC=cat$alog"] in cmds
    assert all(c[-1] == "hdfs:///shared drive/warehouse" for c in cmds if c[0] == "spark-submit")


# -- agreement with the wheel and its jobs --------------------------------------------------------


def test_the_wheel_has_the_distribution_and_console_script_the_definitions_run():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == jobdefs.DISTRIBUTION
    assert project["scripts"][jobdefs.ENTRY_POINT].startswith("varadhi.jobs.")


def job_flags(job: str, capsys) -> set[str]:
    """The long options a job's argparse accepts (its `--help`, in this process)."""
    module = importlib.import_module(f"varadhi.jobs.{job}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    return set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))


def test_rendered_arguments_are_flags_of_the_jobs(capsys):
    body = databricks_defs.databricks_job(jobdefs.plan(sub_doc(), change_shards()), CFG)
    for task in (body["tasks"][0], body["tasks"][-1]):
        job, *args = task["python_wheel_task"]["parameters"]
        assert {a for a in args if a.startswith("--")} <= job_flags(job, capsys), job


def test_launcher_runs_the_varadhi_job_console_script(tmp_path):
    if not list(entry_points(group="console_scripts", name=jobdefs.ENTRY_POINT)):
        pytest.skip("varadhi-job is not installed in this environment yet (scripts/setup)")
    launcher = tmp_path / jobdefs.LAUNCHER
    launcher.write_text(jobdefs.LAUNCHER_SOURCE)
    out = subprocess.run(
        [sys.executable, str(launcher), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "shard" in out.stdout and "feeder" in out.stdout
    bad = subprocess.run(
        [sys.executable, str(launcher), "no-such-job"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2


@pytest.mark.parametrize("job", ["shard", "feeder", "replay", "outbox_relay"])
def test_every_long_running_job_takes_the_metrics_and_log_options(job, capsys):
    assert {"--metrics-port", "--metrics-addr", "--log-format"} <= job_flags(job, capsys)


# -- the jobs' metrics and log options (varadhi.spark.telemetry) -----------------------------

TELEMETRY = MetricsOptions(port=9109, addr="0.0.0.0", json_logs=True)


def test_each_rendered_job_gets_the_options_and_a_port_of_its_own():
    p = jobdefs.plan(sub_doc(shards=2), change_shards())
    jobs = jobdefs.jobs_to_run(p, replace(CFG, telemetry=TELEMETRY))
    assert [args[args.index("--metrics-port") + 1] for _key, args in jobs] == [
        "9109", "9110", "9111", "9112",
    ]  # fmt: skip
    for _key, args in jobs:
        assert args[-4:] == ["--metrics-addr", "0.0.0.0", "--log-format", "json"]
    free = jobdefs.jobs_to_run(p, replace(CFG, telemetry=MetricsOptions(port=0)))
    assert all(args[-2:] == ["--metrics-port", "0"] for _key, args in free)
    plain = jobdefs.jobs_to_run(p, CFG)
    assert not any("--metrics-port" in args or "--log-format" in args for _key, args in plain)
    with pytest.raises(InvalidArgument) as e:
        jobdefs.jobs_to_run(p, replace(CFG, telemetry=MetricsOptions(port=65534)))
    assert e.value.field == "metrics_port"


def test_every_target_passes_them_in_a_valid_definition(capsys):
    p = jobdefs.plan(sub_doc(shards=2), change_shards())
    cfg = replace(CFG, telemetry=TELEMETRY)
    body = databricks_defs.databricks_job(p, cfg)
    check_job_settings(body)
    params = [t["python_wheel_task"]["parameters"] for t in body["tasks"]]
    assert [a[a.index("--metrics-port") + 1] for a in params] == ["9109", "9110", "9111", "9112"]
    for job, *args in (params[0], params[-1]):
        assert {a for a in args if a.startswith("--")} <= job_flags(job, capsys), job
    bundle = yaml.safe_load(databricks_defs.bundle_yaml(p, cfg))
    (job,) = bundle["resources"]["jobs"].values()
    assert [t["python_wheel_task"]["parameters"] for t in job["tasks"]] == params

    emr = replace(EMR_CFG, telemetry=TELEMETRY)
    request = emr_defs.emr_add_steps(p, emr)
    check_request("emr", "AddJobFlowSteps", request)
    steps = [emr_args(s) for s in request["Steps"]]
    assert [s[-6:] for s in steps] == [
        ["--metrics-port", str(port), "--metrics-addr", "0.0.0.0", "--log-format", "json"]
        for port in range(9109, 9113)
    ]
    runs = emr_defs.emr_serverless_runs(p, emr)
    for run in runs:
        check_request("emr-serverless", "StartJobRun", run)
        assert run["jobDriver"]["sparkSubmit"]["entryPointArguments"][-2:] == [
            "--log-format",
            "json",
        ]

    script = spark_submit_defs.spark_submit_script(p, replace(cfg, code_path="/opt/varadhi"))
    lines = [c for c in commands(script) if c[0] in ("./spark-submit.sh", "spark-submit")]
    assert len(lines) == 8  # 2 shards and 2 feeders, local and on a cluster
    for c in lines:
        assert c[-6] == "--metrics-port" and c[-2:] == ["--log-format", "json"]
    assert [c[-5] for c in lines[:4]] == ["9109", "9110", "9111", "9112"]


def test_jobs_render_reads_the_options_from_its_flags_or_the_environment(monkeypatch):
    """`varadhi jobs render`'s own flags, else $VARADHI_METRICS_PORT/ADDR and
    $VARADHI_LOG_FORMAT; a bad value is refused (one line, exit 2) before the catalog is read."""
    from varadhi.cli import jobs as cli_jobs

    def config(*argv: str) -> jobdefs.DeployConfig:
        parser = argparse.ArgumentParser()
        cli_jobs.register(parser.add_subparsers())
        args = parser.parse_args(["jobs", "render", "o", "--target", "databricks", *argv])
        return cli_jobs.config(args, "k:9092", "c")

    for name in ("VARADHI_METRICS_PORT", "VARADHI_METRICS_ADDR", "VARADHI_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    assert config().telemetry == MetricsOptions()
    got = config("--metrics-port", "9109", "--log-format", "json").telemetry
    assert got == MetricsOptions(port=9109, json_logs=True)
    monkeypatch.setenv("VARADHI_METRICS_PORT", "9200")
    monkeypatch.setenv("VARADHI_LOG_FORMAT", "json")
    assert config().telemetry == MetricsOptions(port=9200, json_logs=True)
    assert config("--metrics-port", "0").telemetry.port == 0
    with pytest.raises(InvalidArgument) as e:
        config("--metrics-port", "70000")
    assert e.value.field == "metrics_port"
