"""`varadhi jobs render` against the real broker: definitions follow the catalog's current state
(shard count, paused flag, a change-shards operation's feeders); refusals exit 2."""

from __future__ import annotations

import json
import shlex

import pytest

from varadhi import jobdefs
from varadhi.catalog import key
from varadhi.subscriptions import SubscriptionService, parse_spec
from varadhi.topics import TopicService

pytestmark = pytest.mark.kafka


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


def test_databricks_job_follows_shards_and_pause(varadhi_cli, catalog, settings, subscription):
    body = json.loads(render(varadhi_cli, subscription, "databricks", "--workers", "3"))
    assert body["name"] == f"varadhi-{subscription}"
    assert [t["task_key"] for t in body["tasks"]] == ["shard-0", "shard-1"]
    assert body["continuous"]["pause_status"] == "UNPAUSED"
    assert body["job_clusters"][0]["new_cluster"]["num_workers"] == 3
    params = body["tasks"][1]["spark_python_task"]["parameters"]
    assert params[:4] == ["--subscription", subscription, "--shard", "1"]
    # The jobs use the Kafka and the catalog this command read (unless told otherwise).
    assert params[params.index("--bootstrap") + 1] == settings.bootstrap
    env = body["job_clusters"][0]["new_cluster"]["spark_env_vars"]
    assert env["VARADHI_CATALOG_TOPIC"] == settings.catalog_topic

    SubscriptionService(catalog).set_paused(subscription, True)
    paused = json.loads(render(varadhi_cli, subscription, "databricks"))
    assert paused["continuous"]["pause_status"] == "PAUSED"


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
    steps = json.loads(render(varadhi_cli, subscription, "emr", "--code-path", "s3://b/jobs"))
    assert [s["Name"] for s in steps] == [
        f"varadhi-{subscription}-shard-0",
        f"varadhi-{subscription}-shard-1",
        f"varadhi-{subscription}-feeder-0",
    ]
    assert "s3://b/jobs/feeder.py" in steps[2]["HadoopJarStep"]["Args"]
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
    script = render(varadhi_cli, subscription, "spark-submit")
    lines = [shlex.split(x) for x in script.splitlines() if x.startswith("./spark-submit.sh")]
    assert lines == [
        ["./spark-submit.sh", subscription, "0"],
        ["./spark-submit.sh", subscription, "1"],
    ]
    cluster = [x for x in script.splitlines() if x.startswith("spark-submit ")]
    assert len(cluster) == 2 and all("--cluster" in x for x in cluster)
    assert all(",".join(jobdefs.SPARK_PACKAGES) in x for x in cluster)


def test_refusals_exit_2_and_write_nothing(varadhi_cli, subscription, unique_name, tmp_path):
    out_file = tmp_path / "job.json"
    code, out, err = varadhi_cli(
        "jobs", "render", unique_name("missing"), "--target", "databricks", "-o", str(out_file)
    )
    assert (code, out) == (2, "")
    assert "does not exist" in err
    assert not out_file.exists()
    code, _, err = varadhi_cli(
        "jobs", "render", subscription, "--target", "emr", "--node-type", "m5.xlarge"
    )
    assert code == 2 and "--node-type applies to --target databricks only" in err
    code, _, err = varadhi_cli(
        "jobs", "render", subscription, "--target", "databricks", "--workers", "0"
    )
    assert code == 2 and "workers" in err
