"""What `scripts/test` starts for a given argument list (VARADHI_TEST_PLAN=1 prints its decision
and exits before setting anything up): no service for tests of pure logic, PostgreSQL only for a
run covering the SQL outbox relay's tests, none of it on an older Spark line. And, in copies of
the script whose services and programs are stubs: a PostgreSQL that does not start stops the
run; a whole run runs the older lines' compatibility tiers next to the main suite, shows their
output and fails when one fails; an interrupted run leaves no tier running."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from varadhi.testing.harness import wait_for

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test"


def plan(*args: str) -> dict[str, str]:
    done = subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, "VARADHI_TEST_PLAN": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    words = done.stdout.split()
    return dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("paths="))


@pytest.mark.parametrize(
    ("args", "services", "postgres"),
    [
        ((), "1", "1"),
        (("-x",), "1", "1"),
        (("tests/unit",), "0", "0"),
        (("tests/unit/test_retry.py::test_x", "-q"), "0", "0"),
        ((f"{SCRIPT.parents[1]}/tests/unit/",), "0", "0"),
        (("./tests/unit", "-k", "retry"), "0", "0"),
        (("tests/integration",), "1", "1"),
        (("tests/integration/test_outbox_relay.py::test_x",), "1", "1"),
        (("tests/integration/test_shard_delivery.py",), "1", "0"),
        (("tests/unit", "tests/integration/test_secure_kafka.py"), "1", "1"),
        (("--spark-line", "3.5"), "1", "0"),
        (("--spark-line", "3.5", "tests/compat"), "1", "0"),
    ],
)
def test_what_a_run_starts(args, services, postgres):
    got = plan(*args)
    assert (got["services"], got["postgres"]) == (services, postgres), args


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def _checkout(root: Path, python: str, postgres: str = 'echo "export X=1"') -> Path:
    """A copy of `scripts/test` in `root` whose services and programs are stubs (`python`: the
    body of .venv/bin/python); returns the script's path."""
    (root / "scripts").mkdir()
    (root / "scripts" / "test").write_text(SCRIPT.read_text())
    _stub(root / "scripts" / "setup", "exit 0")
    _stub(root / "scripts" / "kafka", 'echo "running 127.0.0.1:1"')
    _stub(root / "scripts" / "postgres", postgres)
    _stub(root / ".venv" / "bin" / "ruff", "exit 0")
    _stub(root / ".venv" / "bin" / "python", python)
    return root / "scripts" / "test"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VARADHI_TEST_PLAN"}
    return {**env, **extra}


def test_a_postgres_that_does_not_start_stops_the_run(tmp_path):
    """`scripts/test` in a copy of the checkout whose services are stubs: PostgreSQL fails to
    start, so the run must stop with an error before pytest runs (its tests would skip or fail
    for the wrong reason)."""
    ran = tmp_path / "pytest-ran"
    script = _checkout(
        tmp_path,
        python=f'touch "{ran}"; echo "pyspark 0"',
        postgres='echo "postgres: initdb failed" >&2; exit 1',
    )
    done = subprocess.run(
        ["bash", str(script)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "initdb failed" in done.stderr
    assert not ran.exists(), "pytest ran without the PostgreSQL its tests need"


# The stubs of a whole run: the main suite (.venv) and each older line's tier (.venv-sparkXY)
# print what they are and exit with the code in their file `<name>.code` (0 if none). The main
# suite passes only once the tiers of the lines in $TIERS_EXPECTED have started, within a
# generous deadline: the tiers run next to it, not after it.
MAIN_SUITE = """
case "$*" in
  *compileall*) exit 0 ;;
  *"spark.lines"*) echo "4.0 3.5"; exit 0 ;;
esac
started() { for line in $TIERS_EXPECTED; do [[ -e "$ROOT_DIR/tier-$line.started" ]] || return 1; done; }
for _ in $(seq 600); do started && break; sleep 0.1; done
started || exit 9
echo "main suite ran: $*"
exit "$(cat "$ROOT_DIR/main.code" 2>/dev/null || echo 0)"
"""
TIER = """
touch "$ROOT_DIR/tier-$VARADHI_SPARK_LINE.started"
echo "tier $VARADHI_SPARK_LINE ran at nice $(nice): $*"
exit "$(cat "$ROOT_DIR/tier-$VARADHI_SPARK_LINE.code" 2>/dev/null || echo 0)"
"""


def _whole_run(
    root: Path, codes: dict[str, int], lines: str | None = None
) -> subprocess.CompletedProcess:
    """A whole run of the stubs; `lines`: VARADHI_COMPAT_LINES (None: unset, every older line)."""
    script = _checkout(root, python=MAIN_SUITE)
    for line in ("4.0", "3.5"):
        _stub(root / f".venv-spark{line.replace('.', '')}" / "bin" / "python", TIER)
    for name, code in codes.items():
        (root / f"{name}.code").write_text(str(code))
    env = _env(
        ROOT_DIR=str(root), TMPDIR=str(root), TIERS_EXPECTED="4.0 3.5" if lines is None else lines
    )
    env.pop("VARADHI_COMPAT_LINES", None)
    if lines is not None:
        env["VARADHI_COMPAT_LINES"] = lines
    return subprocess.run(
        ["bash", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_whole_run_runs_the_tiers_next_to_the_main_suite_and_shows_them(tmp_path):
    done = _whole_run(tmp_path, {})
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    main = out.index("main suite ran: -m pytest -n")
    tiers = [
        out.index(f"tier {line} ran at nice 10: -m pytest -m compat") for line in ("4.0", "3.5")
    ]
    assert main < tiers[0] < tiers[1], out  # the main suite's output (its durations) first
    assert "--basetemp" in out and "tests/compat" in out
    assert "Spark 3.5: set-up and compatibility tier ended with exit code 0" in out
    assert not list(tmp_path.glob("varadhi-test.*")), "a passing run leaves its files"


@pytest.mark.parametrize(
    ("codes", "expected"),
    [({"tier-3.5": 1}, 1), ({"tier-4.0": 2, "tier-3.5": 1}, 1), ({"main": 3, "tier-4.0": 1}, 3)],
)
def test_a_failing_tier_fails_the_run_and_every_result_is_shown(tmp_path, codes, expected):
    done = _whole_run(tmp_path, codes)
    assert done.returncode == expected, done.stdout + done.stderr
    for line in ("4.0", "3.5"):
        assert f"tier {line} ran" in done.stdout
        code = codes.get(f"tier-{line}", 0)
        assert (
            f"Spark {line}: set-up and compatibility tier ended with exit code {code}"
            in done.stdout
        )
    failed = " ".join(line for line in ("4.0", "3.5") if codes.get(f"tier-{line}"))
    if expected == 1:
        assert f"the compatibility tier failed on Spark {failed}" in done.stderr
    assert list(tmp_path.glob("varadhi-test.*")), "a failed run's files are kept"


@pytest.mark.parametrize("lines", ["3.5", ""])
def test_the_compat_lines_variable_picks_the_tiers(tmp_path, lines):
    done = _whole_run(tmp_path, {}, lines=lines)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "main suite ran" in done.stdout
    ran = [line for line in ("4.0", "3.5") if f"tier {line} ran" in done.stdout]
    assert ran == lines.split(), done.stdout


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has ended (nothing may reap it in a container)


def test_an_interrupted_run_ends_the_tiers(tmp_path):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) during the main suite
    ends the run, and cleanup ends the background tiers, whose process groups Ctrl-C does not
    reach: no tier is left running."""
    script = _checkout(
        tmp_path,
        python="""
case "$*" in
  *compileall*) exit 0 ;;
  *"spark.lines"*) echo "4.0"; exit 0 ;;
esac
touch "$ROOT_DIR/main.started"
sleep 300
""",
    )
    _stub(
        tmp_path / ".venv-spark40" / "bin" / "python",
        'echo $$ > "$ROOT_DIR/tier.pid.tmp"; mv "$ROOT_DIR/tier.pid.tmp" "$ROOT_DIR/tier.pid"\n'
        "sleep 300",
    )
    run = subprocess.Popen(
        ["bash", str(script)],
        env=_env(ROOT_DIR=str(tmp_path), TMPDIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: (tmp_path / "main.started").exists() and (tmp_path / "tier.pid").exists(),
            60,
            "the main suite and the tier started",
        )
        tier = int((tmp_path / "tier.pid").read_text())
        os.killpg(run.pid, signal.SIGINT)
        out, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode != 0, out
    wait_for(lambda: _gone(tier), 60, "the tier's process ended")
