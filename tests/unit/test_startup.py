"""Start-up phase lines (`varadhi.spark.startup`) and the JVM class-data archive options
(`varadhi.spark.class_archive`). Pure functions and files in tmp_path; no JVM is started."""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import pytest

from varadhi.spark import class_archive, startup


def fake_proc(tmp_path, pid: int, start_ticks: int, uptime_s: float, comm: str = "java"):
    (tmp_path / str(pid)).mkdir()
    # Fields after the command: state, ppid, ... field 22 (starttime) is the 20th of these.
    rest = ["S", "1", *["0"] * 17, str(start_ticks), "0"]
    (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    (tmp_path / "uptime").write_text(f"{uptime_s:.2f} 12345.67\n")


def test_process_start_is_now_less_the_time_since_boot_plus_its_ticks(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    fake_proc(tmp_path, 42, start_ticks=250 * tick, uptime_s=300.5)
    assert startup.process_start_s(42, str(tmp_path), now_s=10_000.0) == 9_949.5


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path):
    tick = os.sysconf("SC_CLK_TCK")
    fake_proc(tmp_path, 7, start_ticks=3 * tick, uptime_s=4.0, comm="a (b) c")
    assert startup.process_start_s(7, str(tmp_path), now_s=100.0) == 99.0


def test_an_unreadable_process_has_no_start(tmp_path):
    assert startup.process_start_s(99, str(tmp_path)) is None


def test_the_launch_is_the_parent_jvm_under_spark_submit_and_this_process_otherwise(
    monkeypatch,
):
    mine = startup.process_start_s(os.getpid())
    parent = startup.process_start_s(os.getppid())
    assert mine is not None and parent is not None
    assert mine <= time.time() + 0.02  # /proc/uptime's 10 ms steps
    # Which process: by pid, not by comparing two readings of the clock (a loaded machine can
    # stall a call between its `time.time()` and its read of /proc/uptime).
    starts = {os.getpid(): 1_000.0, os.getppid(): 2_000.0}
    monkeypatch.setattr(startup, "process_start_s", lambda pid: starts[pid])
    assert startup.launch_start_s({}) == 1_000.0
    assert startup.launch_start_s({"PYSPARK_GATEWAY_PORT": "4242"}) == 2_000.0


def test_phase_line():
    line = startup.phase_line("orders shard 0", "lease taken", 212.4, 5931.0)
    assert line == "start-up: orders shard 0: lease taken in 212 ms (5,931 ms since launch)"


def phases(caplog) -> list[str]:
    prefix = startup.LINE_PREFIX + "orders shard 1: "
    return [
        r.getMessage()[len(prefix) :].split(" in ")[0]
        for r in caplog.records
        if r.name == "varadhi.spark.startup" and r.getMessage().startswith(prefix)
    ]


def test_each_phase_is_one_info_line_until_the_start_up_is_done(caplog):
    caplog.set_level(logging.INFO, logger="varadhi.spark.startup")
    clock = startup.StartupClock("orders shard 1", launched_s=startup.time.time() - 2.0)
    clock.mark("catalog read")
    clock.finish("first batch done")
    clock.mark("query started")  # a query started again later: not a start-up phase
    found = phases(caplog)
    assert found[-2:] == ["catalog read", "first batch done"]
    assert found[0] == "job set up (imports, settings)"
    assert "query started" not in found


def test_a_python_started_by_the_jvm_says_when(caplog):
    caplog.set_level(logging.INFO, logger="varadhi.spark.startup")
    python = startup.process_start_s(os.getpid())
    assert python is not None
    startup.StartupClock("orders shard 1", launched_s=python - 3.0)  # the JVM, 3 s earlier
    lines = [r.getMessage() for r in caplog.records if r.name == "varadhi.spark.startup"]
    found = re.search(
        r"JVM up, Python started in ([\d,]+) ms \(([\d,]+) ms since launch\)", lines[0]
    )
    assert found, lines[0]
    step, total = (int(g.replace(",", "")) for g in found.groups())
    assert step == total and abs(step - 3_000) <= 50  # /proc/uptime is read in 10 ms steps
    assert "job set up (imports, settings)" in lines[1]


def test_the_archive_is_used_only_when_its_file_exists(tmp_path):
    archive = class_archive.archive_path("4.1.1", tmp_path)
    assert archive.name == "spark-4.1.1.jsa"
    assert class_archive.java_options(archive) == ""  # a missing file would turn off the JDK's
    assert class_archive.with_archive("-Dx=1", archive) == "-Dx=1"
    archive.write_bytes(b"jsa")
    opts = class_archive.with_archive("-Dx=1", archive)
    assert opts.startswith(f"-Dx=1 -XX:SharedArchiveFile={archive} ")
    assert "-Xlog:all=warning:stderr" in opts  # a stale archive's warning never reaches stdout
    assert class_archive.with_archive(None, archive) == class_archive.java_options(archive)


def test_an_archive_already_named_is_kept(tmp_path):
    archive = tmp_path / "spark-4.1.1.jsa"
    archive.write_bytes(b"jsa")
    for opts in ("-XX:SharedArchiveFile=/mine.jsa", "-XX:ArchiveClassesAtExit=/new.jsa"):
        assert class_archive.with_archive(opts, archive) == opts


def test_each_spark_line_has_its_own_archive(tmp_path):
    assert class_archive.archive_path("3.5.7", tmp_path) != class_archive.archive_path(
        "4.1.1", tmp_path
    )


def test_the_launch_env_names_the_archive_only_within_the_block(tmp_path, monkeypatch):
    archive = tmp_path / "spark-4.1.1.jsa"
    archive.write_bytes(b"jsa")
    monkeypatch.delenv(class_archive.OPTS_ENV, raising=False)
    with class_archive.launch_env(archive):
        assert f"-XX:SharedArchiveFile={archive}" in os.environ[class_archive.OPTS_ENV]
    assert class_archive.OPTS_ENV not in os.environ  # nothing left for other programs
    monkeypatch.setenv(class_archive.OPTS_ENV, "-Dmine=1")
    with class_archive.launch_env(archive):
        assert os.environ[class_archive.OPTS_ENV].startswith("-Dmine=1 -XX:SharedArchiveFile=")
    assert os.environ[class_archive.OPTS_ENV] == "-Dmine=1"
    with class_archive.launch_env(None):  # a JVM already running, or a cluster's session
        assert os.environ[class_archive.OPTS_ENV] == "-Dmine=1"


def test_ahead_runs_in_a_thread_of_its_own_and_hands_back_its_value():
    release = threading.Event()
    ahead = startup.Ahead(lambda: release.wait(60) and "read", "test-reads")
    release.set()  # it waits for the caller: it cannot have run in the caller's thread
    assert ahead.result() == "read"


def test_ahead_raises_what_its_call_raised_when_the_result_is_taken():
    def refused():
        raise ValueError("shard 3 is outside 0..1")

    ahead = startup.Ahead(refused, "test-reads")
    with pytest.raises(ValueError, match="outside"):
        ahead.result()
