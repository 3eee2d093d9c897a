"""`varadhi jobs render` against the real broker: definitions follow the catalog's current state
(shard count, a change-shards operation's feeders) for every target; bad input (an unknown
target or option, a flag of another target, a local warehouse, an unknown EMR release, a missing
subscription) is one line on stderr, exit 2, and nothing written."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from varadhi.core.subscription_spec import parse_spec
from varadhi.jobs import definitions as jobdefs
from varadhi.kafka.catalog import key
from varadhi.kafka.subscriptions import SubscriptionService
from varadhi.kafka.topics import TopicService

pytestmark = pytest.mark.kafka

EMR = ["--cluster-id", "j-1ABCDEFGHIJK"]
SERVERLESS = [
    "--application-id",
    "00fabcdefgh12345",
    "--execution-role-arn",
    "arn:aws:iam::123456789012:role/varadhi-jobs",
]


@pytest.fixture
def subscription(catalog, unique_name):
    """A fresh 4-partition topic and a 2-shard subscription on it; returns its name."""
    topic = unique_name("jobs")
    TopicService(catalog).create(topic, 4)
    name = unique_name("jobs-sub")
    spec = parse_spec(
        {"name": name, "topic": topic, "endpoint": {"url": "http://127.0.0.1:9/x"}, "shards": 2}
    )
    SubscriptionService(catalog).create(spec)
    return name


def render(varadhi_cli, name, target, *flags):
    code, out, err = varadhi_cli("jobs", "render", name, "--target", target, *flags)
    assert code == 0, err
    return out


def test_databricks_job_and_bundle_follow_the_catalog(varadhi_cli, catalog, settings, subscription):
    flags = [
        "--workers",
        "3",
        "--kafka-config",
        "/Volumes/main/varadhi/conf/kafka.properties",
        "--secret",
        "KAFKA_PASSWORD",
    ]
    body = json.loads(render(varadhi_cli, subscription, "databricks", *flags))
    assert body["name"] == f"varadhi-{subscription}"
    assert [t["task_key"] for t in body["tasks"]] == ["shard-0", "shard-1"]
    cluster = body["job_clusters"][0]["new_cluster"]
    assert cluster["num_workers"] == 3 and cluster["data_security_mode"] == "SINGLE_USER"
    params = body["tasks"][1]["python_wheel_task"]["parameters"]
    assert params[:5] == ["shard", "--subscription", subscription, "--shard", "1"]
    # The jobs use the Kafka and the catalog this command read (unless told otherwise).
    assert params[params.index("--bootstrap") + 1] == settings.bootstrap
    assert cluster["spark_env_vars"] == {
        "VARADHI_CATALOG_TOPIC": settings.catalog_topic,
        "VARADHI_KAFKA_CONFIG": "/Volumes/main/varadhi/conf/kafka.properties",
        "KAFKA_PASSWORD": "{{secrets/varadhi/KAFKA_PASSWORD}}",
        # rendered cloud jobs deny private endpoint addresses (docs/delivery.md)
        "VARADHI_ENDPOINT_DENY_PRIVATE": "true",
    }
    bundle = yaml.safe_load(render(varadhi_cli, subscription, "databricks-bundle", *flags))
    (job,) = bundle["resources"]["jobs"].values()
    assert job == body

    SubscriptionService(catalog).set_paused(subscription, True)
    code, out, err = varadhi_cli("jobs", "render", subscription, "--target", "databricks", *flags)
    assert (code, json.loads(out)) == (0, body)  # the shards wait; the job stays as it is
    assert f"{subscription} is paused; its shards will wait until resumed" in err


def test_feeders_appear_while_a_change_shards_operation_needs_them(
    varadhi_cli, catalog, subscription
):
    op_key = key("operation", f"{subscription}/change-shards")
    op = {
        "kind": "change-shards",
        "from": 2,
        "to": 4,
        "step": "feed",
        "feeders": [
            {"queue": "rq", "source": f"{subscription}.rq.0", "done": False},
            {"queue": "dlq", "source": f"{subscription}.dlq.0", "done": True},
        ],
    }
    catalog.mutate(lambda _snap: {op_key: op})
    request = json.loads(
        render(varadhi_cli, subscription, "emr", *EMR, "--code-path", "s3://b/jobs")
    )
    assert request["JobFlowId"] == "j-1ABCDEFGHIJK"
    steps = request["Steps"]
    assert [s["Name"] for s in steps] == [
        f"varadhi-{subscription}-shard-0",
        f"varadhi-{subscription}-shard-1",
        f"varadhi-{subscription}-feeder-0",
    ]
    args = steps[2]["HadoopJarStep"]["Args"]
    launcher = args.index("s3://b/jobs/varadhi_job.py")
    assert args[launcher + 1 : launcher + 6] == [
        "feeder",
        "--subscription",
        subscription,
        "--source",
        f"{subscription}.rq.0",
    ]
    runs = json.loads(render(varadhi_cli, subscription, "emr-serverless", *SERVERLESS))
    assert [r["jobDriver"]["sparkSubmit"]["entryPointArguments"][0] for r in runs] == [
        "shard",
        "shard",
        "feeder",
    ]
    assert {r["mode"] for r in runs} == {"STREAMING"}
    script = render(varadhi_cli, subscription, "spark-submit")
    local_feeder = ["./spark-submit.sh", "--job", "feeder", "--subscription", subscription]
    assert local_feeder + ["--source", f"{subscription}.rq.0"] in [
        shlex.split(line) for line in script.splitlines() if not line.startswith("#")
    ]

    catalog.mutate(lambda _snap: {op_key: {**op, "step": "done"}})
    done = json.loads(render(varadhi_cli, subscription, "databricks"))
    assert [t["task_key"] for t in done["tasks"]] == ["shard-0", "shard-1"]


def test_output_file_and_cli_shaped_emr_steps(varadhi_cli, subscription, tmp_path):
    out_file = tmp_path / "steps.json"
    printed = render(
        varadhi_cli, subscription, "emr", "--emr-format", "cli", "--output", str(out_file)
    )
    assert printed == ""
    steps = json.loads(out_file.read_text())
    assert [s["Type"] for s in steps] == ["CUSTOM_JAR", "CUSTOM_JAR"]
    assert all(s["Args"][0] == "spark-submit" for s in steps)


def test_spark_submit_lines_per_shard(varadhi_cli, subscription):
    script = render(
        varadhi_cli, subscription, "spark-submit", "--spark-line", "3.5", "--spark-extra", "s3"
    )
    lines = [shlex.split(x) for x in script.splitlines() if x.startswith("./spark-submit.sh")]
    assert lines == [
        ["./spark-submit.sh", subscription, "0"],
        ["./spark-submit.sh", subscription, "1"],
    ]
    cluster = [x for x in script.splitlines() if x.startswith("spark-submit ")]
    assert len(cluster) == 2 and all("--cluster" in x for x in cluster)
    assert all("spark-sql-kafka-0-10_2.12:3.5." in x for x in cluster)
    assert all("org.apache.hadoop:hadoop-aws:3.3." in x for x in cluster)  # the line's Hadoop


def test_databricks_backlog_rules_and_notifications_from_flags(varadhi_cli, subscription):
    hook = "1b2c3d4e-5f60-4718-8a9b-0c1d2e3f4a5b"
    flags = ["--backlog-seconds", "600", "--notify-email", "ops@example.com"]
    body = json.loads(
        render(varadhi_cli, subscription, "databricks", *flags, "--notify-webhook", hook)
    )
    assert body["health"] == {
        "rules": [{"metric": "STREAMING_BACKLOG_SECONDS", "op": "GREATER_THAN", "value": 600}]
    }
    assert body["email_notifications"]["on_streaming_backlog_exceeded"] == ["ops@example.com"]
    assert body["webhook_notifications"]["on_failure"] == [{"id": hook}]
    assert all(t["email_notifications"] for t in body["tasks"])
    bundle = yaml.safe_load(render(varadhi_cli, subscription, "databricks-bundle", *flags))
    (job,) = bundle["resources"]["jobs"].values()
    assert job["health"] == body["health"]


def test_launcher_prints_the_file_spark_submit_runs(varadhi_cli, tmp_path):
    code, out, _ = varadhi_cli("jobs", "launcher")
    assert (code, out) == (0, jobdefs.LAUNCHER_SOURCE)
    compile(out, jobdefs.LAUNCHER, "exec")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--target", "kubernetes"], "argument --target: invalid choice: 'kubernetes'"),
        (["--target", "databricks", "--workres", "3"], "unrecognized arguments: --workres 3"),
        (["--target", "emr", *EMR, "--node-type", "m5.xlarge"], "--node-type applies to"),
        (["--target", "databricks", "--workers", "0"], "workers: must be at least 1"),
        (["--target", "databricks", "--warehouse", "/tmp/wh"], "/tmp/wh is a local path"),
        (["--target", "emr", *EMR, "--emr-release", "emr-6.15.0"], "unknown EMR release"),
        (["--target", "emr"], "cluster_id: required for --target emr"),
        (["--target", "emr", *EMR, "--spark-extra", "s3"], "emr reads s3:// itself"),
        (["--target", "emr-serverless"], "application_id: required"),
        (["--target", "databricks", "--secret", "PASSWORD=hunter2"], "expected NAME or NAME="),
        (["--target", "databricks", "--spark-version", "13.3.x-scala2.12"], "Runtime 13.3"),
        (["--target", "emr", *EMR, "--backlog-seconds", "60"], "--backlog-seconds applies to"),
        (["--target", "databricks", "--notify-email", "ops"], "'ops' is not an e-mail"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    varadhi_cli, capsys, unique_name, tmp_path, flags, says
):
    """Refused before the catalog is read: the subscription need not exist."""
    out_file = tmp_path / "job.json"
    name = unique_name("never-read")
    try:
        code, out, err = varadhi_cli("jobs", "render", name, *flags, "-o", str(out_file))
    except SystemExit as e:  # argparse's refusals
        code = e.code
        out, err = capsys.readouterr()
    assert code == 2
    assert not out_file.exists()
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_unknown_subscription_exits_2_and_writes_nothing(varadhi_cli, unique_name, tmp_path):
    out_file = tmp_path / "job.json"
    code, out, err = varadhi_cli(
        "jobs", "render", unique_name("missing"), "--target", "databricks", "-o", str(out_file)
    )
    assert (code, out) == (2, "")
    assert "does not exist" in err
    assert not out_file.exists()
