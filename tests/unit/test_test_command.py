"""What `scripts/test` starts for a given argument list (VARADHI_TEST_PLAN=1 prints its decision
and exits before setting anything up): no service for tests of pure logic, PostgreSQL only for a
run covering the SQL outbox relay's tests, none of it on an older Spark line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

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


def test_a_postgres_that_does_not_start_stops_the_run(tmp_path):
    """`scripts/test` in a copy of the checkout whose services are stubs: PostgreSQL fails to
    start, so the run must stop with an error before pytest runs (its tests would skip or fail
    for the wrong reason)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test").write_text(SCRIPT.read_text())
    ran = tmp_path / "pytest-ran"
    _stub(tmp_path / "scripts" / "setup", "exit 0")
    _stub(tmp_path / "scripts" / "kafka", 'echo "running 127.0.0.1:1"')
    _stub(tmp_path / "scripts" / "postgres", 'echo "postgres: initdb failed" >&2; exit 1')
    _stub(tmp_path / ".venv" / "bin" / "ruff", "exit 0")
    _stub(tmp_path / ".venv" / "bin" / "python", f'touch "{ran}"; echo "pyspark 0"')
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "test")],
        env={k: v for k, v in os.environ.items() if k != "VARADHI_TEST_PLAN"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "initdb failed" in done.stderr
    assert not ran.exists(), "pytest ran without the PostgreSQL its tests need"
