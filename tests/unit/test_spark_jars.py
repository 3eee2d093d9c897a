"""Where a local Spark session's jars come from (`varadhi.spark.session`), and the `varadhi-job` runner.
Pure decisions and files in tmp_path; no JVM is started."""

from __future__ import annotations

import pytest

from varadhi.core.errors import InvalidArgument, UnsupportedSparkVersion
from varadhi.jobs import runner
from varadhi.spark import session as spark

PACKAGES = (
    "org.apache.spark:spark-sql-kafka-0-10_2.13:4.1.1",
    "io.delta:delta-spark_4.1_2.13:4.1.0",
)
DEV = ["/checkout/.jars/spark/a.jar", "/checkout/.jars/spark/b.jar"]


def settings(env=None, launch=None, dev=(), running=False):
    return spark.jar_settings(env or {}, launch or {}, list(dev), PACKAGES, running)


def test_configured_jars_win_over_the_checkouts_and_add_to_the_launchs():
    env = {spark.JARS_ENV: "/opt/k.jar,/opt/d.jar"}
    assert settings(env, dev=DEV) == {"spark.jars": "/opt/k.jar,/opt/d.jar"}
    assert settings(env, {"spark.jars": "/x/jdbc.jar,/opt/k.jar"}) == {
        "spark.jars": "/x/jdbc.jar,/opt/k.jar,/opt/d.jar"
    }


def test_configured_packages_and_auto():
    assert settings({spark.PACKAGES_ENV: "auto"}, dev=DEV) == {
        "spark.jars.packages": ",".join(PACKAGES)
    }
    env = {spark.PACKAGES_ENV: "auto, org.apache.hadoop:hadoop-aws:3.4.2"}
    got = settings(env, {"spark.jars.packages": PACKAGES[0]})["spark.jars.packages"]
    assert got.split(",") == [*PACKAGES, "org.apache.hadoop:hadoop-aws:3.4.2"]


def test_what_the_launch_names_is_used_as_it_is():
    assert settings(launch={"spark.jars.packages": "g:a:1"}, dev=DEV) == {}
    assert settings(launch={"spark.jars": "/x.jar"}) == {}


def test_the_checkout_jars_are_only_the_last_resort_and_none_is_one_line():
    assert settings(dev=DEV) == {"spark.jars": ",".join(DEV)}
    with pytest.raises(InvalidArgument) as e:
        settings()
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    assert f"{spark.JARS_ENV}" in str(e.value) and ",".join(PACKAGES) in str(e.value)


def test_under_spark_submit_only_the_launchs_jars_count():
    assert settings({spark.JARS_ENV: "/opt/k.jar"}, {"spark.jars": "/x.jar"}, running=True) == {}
    for env, dev in (({spark.JARS_ENV: "/opt/k.jar"}, ()), ({}, DEV)):
        with pytest.raises(InvalidArgument, match="spark-submit started Spark without"):
            settings(env, dev=dev, running=True)


def test_expand_jars_lists_folders_and_refuses_what_is_missing(tmp_path):
    (tmp_path / "b.jar").touch()
    (tmp_path / "a.jar").touch()
    (tmp_path / "notes.txt").touch()
    single = tmp_path / "one" / "c.jar"
    single.parent.mkdir()
    single.touch()
    assert spark.expand_jars(f"{tmp_path}, {single}").split(",") == [
        str(tmp_path / "a.jar"),
        str(tmp_path / "b.jar"),
        str(single),
    ]
    with pytest.raises(InvalidArgument, match="does not exist"):
        spark.expand_jars(str(tmp_path / "nope.jar"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument, match="holds no"):
        spark.expand_jars(str(tmp_path / "empty"))


def test_launch_settings_without_a_jvm(tmp_path):
    (tmp_path / "spark-defaults.conf").write_text(
        "# comment\nspark.jars.packages   g:a:1,g:b:2\nspark.executor.memory 2g\n"
    )
    env = {"SPARK_CONF_DIR": str(tmp_path), "PYSPARK_SUBMIT_ARGS": "--jars /x.jar pyspark-shell"}
    assert spark.launch_settings(env) == {
        "spark.jars.packages": "g:a:1,g:b:2",
        "spark.jars": "/x.jar",
    }
    assert spark.launch_settings({}) == {}


def test_packages_match_the_spark_version():
    assert spark.spark_packages("4.1.1") == PACKAGES
    assert spark.spark_packages("3.5.2-amzn-1", ["s3"]) == (
        "org.apache.spark:spark-sql-kafka-0-10_2.12:3.5.2",
        "io.delta:delta-spark_2.12:3.3.2",
        "org.apache.hadoop:hadoop-aws:3.3.4",
    )
    with pytest.raises(UnsupportedSparkVersion):
        spark.spark_packages("3.4.1")


def test_runner_lists_the_jobs_and_refuses_an_unknown_one(capsys):
    assert runner.main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line[:2] == "  "]
    assert listed == list(runner.JOBS)
    assert runner.main(["shrad"]) == 2
    assert "unknown job 'shrad'" in capsys.readouterr().err


def test_runner_returns_the_jobs_exit_code_and_one_line(tmp_path, capsys):
    code = runner.main(["outbox_relay", "--sqlite", str(tmp_path / "app.db"), "--once"])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no SQLite database" in err[0]
