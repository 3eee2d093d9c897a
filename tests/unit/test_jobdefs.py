"""Job definitions from hand-made catalog documents: structure of the Databricks Jobs API 2.2
create request and of EMR steps, spark-submit commands, and feeders only while needed."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from varadhi import jobdefs
from varadhi.errors import InvalidArgument
from varadhi.subscriptions import Subscription, parse_spec

ROOT = Path(__file__).resolve().parents[2]

CFG = jobdefs.DeployConfig(
    bootstrap_servers="kafka-1:9092,kafka-2:9092",
    catalog_topic="__varadhi_catalog",
    code_path="/Workspace/Shared/varadhi/jobs",
    warehouse="dbfs:/varadhi/warehouse",
    wheel="/Volumes/main/varadhi/artifacts/varadhi_spark-0.1.0-py3-none-any.whl",
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
    """An `operation/<sub>/change-shards` document as varadhi.resharding records it."""
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


# -- structural checks (the contract of the APIs the definitions are sent to) ----------------

# JobSettings fields of a Jobs API 2.2 create request (the ones a definition may use).
JOB_SETTINGS = {
    "name",
    "description",
    "tags",
    "continuous",
    "schedule",
    "trigger",
    "max_concurrent_runs",
    "job_clusters",
    "tasks",
    "environments",
    "email_notifications",
    "webhook_notifications",
    "notification_settings",
    "timeout_seconds",
    "health",
    "queue",
    "parameters",
    "run_as",
    "access_control_list",
    "git_source",
    "format",
    "edit_mode",
    "deployment",
}
TASK_KEY_RE = re.compile(r"^[\w\-.]{1,100}$")
COMPUTE_KEYS = ("job_cluster_key", "environment_key", "existing_cluster_id", "new_cluster")
LIBRARY_KINDS = {"whl", "jar", "egg", "pypi", "maven", "cran", "requirements"}


def assert_str_map(d, what):
    assert isinstance(d, dict), what
    for k, v in d.items():
        assert isinstance(k, str) and isinstance(v, str), f"{what}: {k!r}: {v!r}"


def check_jobs_create(body: dict, paused: bool) -> None:
    """Raise AssertionError unless `body` is a valid continuous-job create request."""
    assert json.loads(json.dumps(body)) == body, "only JSON types"
    assert set(body) <= JOB_SETTINGS, set(body) - JOB_SETTINGS
    assert isinstance(body["name"], str) and body["name"]
    assert_str_map(body.get("tags", {}), "tags")
    assert body["continuous"]["pause_status"] == ("PAUSED" if paused else "UNPAUSED")
    assert body["continuous"].get("task_retry_mode", "NEVER") in ("NEVER", "ON_FAILURE")
    assert "schedule" not in body and "trigger" not in body  # one of continuous/schedule/trigger
    assert body["max_concurrent_runs"] == 1
    clusters = body.get("job_clusters", [])
    cluster_keys = [c["job_cluster_key"] for c in clusters]
    assert len(set(cluster_keys)) == len(cluster_keys)
    for c in clusters:
        nc = c["new_cluster"]
        assert isinstance(nc["spark_version"], str) and nc["spark_version"]
        assert isinstance(nc["node_type_id"], str) and nc["node_type_id"]
        assert isinstance(nc["num_workers"], int) and nc["num_workers"] >= 0
        assert_str_map(nc.get("spark_conf", {}), "spark_conf")
        assert_str_map(nc.get("spark_env_vars", {}), "spark_env_vars")
    env_keys = {e["environment_key"] for e in body.get("environments", [])}
    tasks = body["tasks"]
    assert isinstance(tasks, list) and tasks
    keys = [t["task_key"] for t in tasks]
    assert len(set(keys)) == len(keys), "task_key must be unique"
    for t in tasks:
        assert TASK_KEY_RE.fullmatch(t["task_key"]), t["task_key"]
        assert "depends_on" not in t, "continuous jobs take no task dependencies"
        assert "max_retries" not in t, "continuous jobs take no retry policies"
        compute = [k for k in COMPUTE_KEYS if k in t]
        assert len(compute) == 1, compute
        if "job_cluster_key" in t:
            assert t["job_cluster_key"] in cluster_keys
        if "environment_key" in t:
            assert t["environment_key"] in env_keys
        py = t["spark_python_task"]
        assert isinstance(py["python_file"], str) and py["python_file"].endswith(".py")
        assert (
            py["python_file"].startswith("/")
            or "://" in py["python_file"]
            or ":/" in py["python_file"]
        ), "absolute workspace path or a cloud URI"
        assert all(isinstance(a, str) for a in py["parameters"]), py["parameters"]
        for lib in t.get("libraries", []):
            assert len(lib) == 1 and set(lib) <= LIBRARY_KINDS, lib
            if "pypi" in lib:
                assert isinstance(lib["pypi"]["package"], str)
            else:
                assert all(isinstance(v, str) for v in lib.values())


STEP_KEYS = {"Name", "ActionOnFailure", "HadoopJarStep"}
JAR_STEP_KEYS = {"Properties", "Jar", "MainClass", "Args"}
ACTIONS = {"TERMINATE_JOB_FLOW", "TERMINATE_CLUSTER", "CANCEL_AND_WAIT", "CONTINUE"}


def check_emr_steps(steps: list) -> None:
    """Raise AssertionError unless `steps` are valid AddJobFlowSteps StepConfigs."""
    assert isinstance(steps, list) and steps
    assert len(steps) <= 256, "at most 256 steps per cluster"
    for s in steps:
        assert set(s) == STEP_KEYS, set(s) ^ STEP_KEYS
        assert isinstance(s["Name"], str) and 0 < len(s["Name"]) <= 256
        assert s["ActionOnFailure"] == "CONTINUE"
        jar = s["HadoopJarStep"]
        assert set(jar) <= JAR_STEP_KEYS and isinstance(jar["Jar"], str) and jar["Jar"]
        assert all(isinstance(a, str) for a in jar["Args"]), jar["Args"]
        assert len(jar["Jar"]) + sum(map(len, jar["Args"])) <= 10_240, "HadoopJarStep limit"


def python_file_and_params(args: list[str]) -> tuple[str, list[str]]:
    i = next(i for i, a in enumerate(args) if a.endswith(".py"))
    return args[i], args[i + 1 :]


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
    assert "keep the shards stopped" in jobdefs.spark_submit_script(p, CFG)
    assert "keep the shards stopped" in jobdefs.databricks_job(p, CFG)["description"]
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


@pytest.mark.parametrize("paused", [False, True])
def test_databricks_job_is_a_valid_continuous_create_request(paused):
    p = jobdefs.plan(sub_doc(shards=3, paused=paused))
    body = jobdefs.databricks_job(p, CFG)
    check_jobs_create(body, paused=paused)
    assert body["name"] == "varadhi-orders-http"
    assert [t["task_key"] for t in body["tasks"]] == ["shard-0", "shard-1", "shard-2"]
    for shard, task in enumerate(body["tasks"]):
        py = task["spark_python_task"]
        assert py["python_file"] == "/Workspace/Shared/varadhi/jobs/subscription_shard.py"
        assert py["parameters"] == [
            "--subscription",
            "orders-http",
            "--shard",
            str(shard),
            "--cluster",
            "--bootstrap",
            "kafka-1:9092,kafka-2:9092",
            "--warehouse",
            "dbfs:/varadhi/warehouse",
        ]
        libs = task["libraries"]
        assert libs[0] == {"whl": CFG.wheel}
        assert {lib["pypi"]["package"].split("==")[0] for lib in libs[1:]} == {
            "kafka-python",
            "mmh3",
            "pycurl",
            "crc32c",
        }
    cluster = body["job_clusters"][0]["new_cluster"]
    assert cluster["spark_version"].startswith("17.") and cluster["num_workers"] == 2
    assert (
        cluster["spark_conf"]["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    )
    assert cluster["spark_env_vars"] == {"VARADHI_CATALOG_TOPIC": "__varadhi_catalog"}
    assert body["continuous"]["task_retry_mode"] == "ON_FAILURE"


def test_databricks_cluster_settings_come_from_the_config():
    cfg = replace(CFG, node_type="Standard_DS3_v2", workers=5, spark_version="17.3.x-scala2.13")
    cluster = jobdefs.databricks_job(jobdefs.plan(sub_doc()), cfg)["job_clusters"][0]
    assert cluster["new_cluster"]["node_type_id"] == "Standard_DS3_v2"
    assert cluster["new_cluster"]["num_workers"] == 5


def test_databricks_feeder_tasks_only_while_the_operation_needs_them():
    doc = sub_doc(shards=2, shard_count=4)
    feeding = jobdefs.databricks_job(jobdefs.plan(doc, change_shards()), CFG)
    check_jobs_create(feeding, paused=False)
    keys = [t["task_key"] for t in feeding["tasks"]]
    assert keys == ["shard-0", "shard-1", "shard-2", "shard-3", "feeder-0", "feeder-1"]
    feeders = [t["spark_python_task"] for t in feeding["tasks"][4:]]
    assert [f["python_file"] for f in feeders] == ["/Workspace/Shared/varadhi/jobs/feeder.py"] * 2
    cluster = ["--cluster", "--bootstrap", "kafka-1:9092,kafka-2:9092"]  # feeders keep no state
    assert [f["parameters"] for f in feeders] == [
        ["--subscription", "orders-http", "--source", "orders-http.rq.0", *cluster],
        ["--subscription", "orders-http", "--source", "orders-http.dlq.0", *cluster],
    ]
    assert "change-shards 2 -> 4" in feeding["description"]
    done = jobdefs.databricks_job(jobdefs.plan(doc, change_shards(step="done")), CFG)
    assert [t["task_key"] for t in done["tasks"]] == keys[:4]


def test_databricks_credential_is_a_secret_reference_never_a_value():
    doc = sub_doc(endpoint={"url": "https://example.test/x", "auth_env": "ORDERS_TOKEN"})
    cfg = replace(CFG, secret_scope="prod")
    body = jobdefs.databricks_job(jobdefs.plan(doc), cfg)
    env = body["job_clusters"][0]["new_cluster"]["spark_env_vars"]
    assert env["ORDERS_TOKEN"] == "{{secrets/prod/ORDERS_TOKEN}}"


# -- EMR ---------------------------------------------------------------------------------------


def test_emr_steps_are_valid_step_configs_per_shard():
    cfg = replace(CFG, code_path="s3://bucket/jobs", warehouse="s3://bucket/warehouse")
    steps = jobdefs.emr_steps(jobdefs.plan(sub_doc(shards=2)), cfg)
    check_emr_steps(steps)
    assert [s["Name"] for s in steps] == [
        "varadhi-orders-http-shard-0",
        "varadhi-orders-http-shard-1",
    ]
    for shard, step in enumerate(steps):
        args = step["HadoopJarStep"]["Args"]
        assert step["HadoopJarStep"]["Jar"] == "command-runner.jar"
        assert args[:3] == ["spark-submit", "--deploy-mode", "cluster"]
        assert args[args.index("--packages") + 1] == ",".join(jobdefs.SPARK_PACKAGES)
        confs = [args[i + 1] for i, a in enumerate(args) if a == "--conf"]
        assert "spark.yarn.submit.waitAppCompletion=false" in confs  # streaming steps never end
        assert "spark.yarn.appMasterEnv.VARADHI_CATALOG_TOPIC=__varadhi_catalog" in confs
        path, params = python_file_and_params(args)
        assert path == "s3://bucket/jobs/subscription_shard.py"
        assert params[:4] == ["--subscription", "orders-http", "--shard", str(shard)]
        assert params[params.index("--warehouse") + 1] == "s3://bucket/warehouse"


def test_emr_feeder_steps_only_while_the_operation_needs_them():
    doc = sub_doc(shards=2)
    feeding = jobdefs.emr_steps(jobdefs.plan(doc, change_shards()), CFG)
    check_emr_steps(feeding)
    assert [s["Name"].rsplit("-", 2)[1:] for s in feeding] == [
        ["shard", "0"],
        ["shard", "1"],
        ["feeder", "0"],
        ["feeder", "1"],
    ]
    path, params = python_file_and_params(feeding[3]["HadoopJarStep"]["Args"])
    assert path.endswith("/feeder.py")
    assert params[:4] == ["--subscription", "orders-http", "--source", "orders-http.dlq.0"]
    assert len(jobdefs.emr_steps(jobdefs.plan(doc, change_shards(step="done")), CFG)) == 2
    assert len(jobdefs.emr_steps(jobdefs.plan(doc, None), CFG)) == 2


def test_emr_credential_is_never_in_the_steps():
    doc = sub_doc(endpoint={"url": "https://example.test/x", "auth_env": "ORDERS_TOKEN"})
    steps = jobdefs.emr_steps(jobdefs.plan(doc), CFG)
    assert "ORDERS_TOKEN" not in json.dumps(steps)


def test_emr_cli_shape_carries_the_same_steps():
    steps = jobdefs.emr_steps(jobdefs.plan(sub_doc(), change_shards()), CFG)
    cli = jobdefs.emr_cli_steps(steps)
    assert len(cli) == len(steps)
    for api, c in zip(steps, cli, strict=True):
        assert set(c) == {"Type", "Name", "ActionOnFailure", "Jar", "Args"}
        assert c["Type"] == "CUSTOM_JAR"
        assert (c["Name"], c["ActionOnFailure"]) == (api["Name"], api["ActionOnFailure"])
        assert (c["Jar"], c["Args"]) == (api["HadoopJarStep"]["Jar"], api["HadoopJarStep"]["Args"])


# -- spark-submit ------------------------------------------------------------------------------


def commands(script: str) -> list[list[str]]:
    return [shlex.split(line) for line in script.splitlines() if line and not line.startswith("#")]


def test_spark_submit_script_has_local_and_cluster_commands_per_shard():
    cfg = replace(CFG, code_path="jobs", warehouse="hdfs:///varadhi/warehouse")
    script = jobdefs.spark_submit_script(jobdefs.plan(sub_doc(shards=2)), cfg)
    cmds = commands(script)
    assert cmds[:2] == [
        ["export", "VARADHI_BOOTSTRAP=kafka-1:9092,kafka-2:9092"],
        ["export", "VARADHI_CATALOG_TOPIC=__varadhi_catalog"],
    ]
    assert cmds[2:4] == [
        ["./spark-submit.sh", "orders-http", "0"],
        ["./spark-submit.sh", "orders-http", "1"],
    ]
    cluster = cmds[4:]
    assert len(cluster) == 2
    for shard, c in enumerate(cluster):
        assert c[:3] == ["spark-submit", "--packages", ",".join(jobdefs.SPARK_PACKAGES)]
        path, params = python_file_and_params(c)
        assert path == "jobs/subscription_shard.py"
        assert params == [
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
    assert "paused" not in script and "feeder" not in script
    assert "# ./spark-submit.sh orders-http 1 --standby" in script.splitlines()


def test_spark_submit_feeders_and_pause_note():
    doc = sub_doc(shards=2, paused=True)
    script = jobdefs.spark_submit_script(jobdefs.plan(doc, change_shards()), CFG)
    cmds = commands(script)
    assert [
        "./spark-submit.sh",
        "--job",
        "feeder",
        "--subscription",
        "orders-http",
        "--source",
        "orders-http.rq.0",
    ] in cmds
    assert [
        "./spark-submit.sh",
        "--job",
        "feeder",
        "--subscription",
        "orders-http",
        "--source",
        "orders-http.dlq.0",
    ] in cmds
    cluster_feeders = [
        python_file_and_params(c)
        for c in cmds
        if c[0] == "spark-submit" and python_file_and_params(c)[0].endswith("/feeder.py")
    ]
    assert [params[:4] for _path, params in cluster_feeders] == [
        ["--subscription", "orders-http", "--source", "orders-http.rq.0"],
        ["--subscription", "orders-http", "--source", "orders-http.dlq.0"],
    ]
    assert all("--cluster" in params for _path, params in cluster_feeders)
    assert "# the subscription is paused" in script
    assert "feeder" not in jobdefs.spark_submit_script(
        jobdefs.plan(doc, change_shards(step="done")), CFG
    )


def test_spark_submit_quotes_what_the_shell_would_split():
    cfg = replace(CFG, warehouse="/mnt/shared drive/warehouse", catalog_topic="cat$alog")
    script = jobdefs.spark_submit_script(jobdefs.plan(sub_doc()), cfg)
    cmds = commands(script)
    assert ["export", "VARADHI_CATALOG_TOPIC=cat$alog"] in cmds
    assert all(c[-1] == "/mnt/shared drive/warehouse" for c in cmds if c[0] == "spark-submit")


# -- agreement with the job scripts and the pinned versions --------------------------------------


def job_flags(script: Path) -> set[str]:
    """The long options a job script's argparse accepts (from its --help)."""
    out = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"--[a-z][a-z-]*", out.stdout))


def rendered_flags(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("--")}


def test_rendered_shard_arguments_are_flags_of_subscription_shard_py():
    body = jobdefs.databricks_job(jobdefs.plan(sub_doc()), CFG)
    used = rendered_flags(body["tasks"][0]["spark_python_task"]["parameters"])
    assert used <= job_flags(ROOT / "jobs" / jobdefs.SHARD_JOB)


def test_rendered_feeder_arguments_are_flags_of_feeder_py():
    script = ROOT / "jobs" / jobdefs.FEEDER_JOB
    if not script.exists():
        pytest.skip("jobs/feeder.py is not written yet")
    body = jobdefs.databricks_job(jobdefs.plan(sub_doc(), change_shards()), CFG)
    feeder = next(t for t in body["tasks"] if t["task_key"].startswith("feeder-"))
    assert rendered_flags(feeder["spark_python_task"]["parameters"]) <= job_flags(script)


def test_packages_and_pypi_pins_match_the_project():
    lines = (ROOT / "constraints.txt").read_text().splitlines()  # pyproject.toml holds ranges
    pins = dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))
    kafka, delta = jobdefs.SPARK_PACKAGES
    assert kafka.endswith(f"_2.13:{pins['pyspark']}")
    spark_minor = ".".join(pins["pyspark"].split(".")[:2])
    assert delta == f"io.delta:delta-spark_{spark_minor}_2.13:{pins['delta-spark']}"
    assert set(jobdefs.RUNTIME_PYPI) <= {f"{name}=={pin}" for name, pin in pins.items()}
