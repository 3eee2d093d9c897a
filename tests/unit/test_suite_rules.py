"""The suite's own rules, checked by running pytest on a throw-away tree that has this suite's
root conftest: a skip that `ALLOWED_SKIPS` does not list fails the run (a service that did not
start must not leave a green run), a listed one does not, and a misspelt marker is an error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def run_pytest(
    tmp_path: Path, test_source: str, *args: str, conftest: str | None = None
) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(conftest or CONFTEST.read_text())
    shutil.copy(PYPROJECT, tmp_path / "pyproject.toml")  # the markers, addopts
    (tmp_path / "test_probe.py").write_text(test_source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         "-c", str(tmp_path / "pyproject.toml"), str(tmp_path / "test_probe.py"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


SKIPPING = """
import pytest

def test_passes():
    pass

def test_needs_a_service():
    pytest.skip("no PostgreSQL")
"""


def test_an_unlisted_skip_fails_the_run(tmp_path):
    done = run_pytest(tmp_path, SKIPPING)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "unexpected skips" in done.stdout
    assert "test_probe.py::test_needs_a_service: no PostgreSQL" in done.stdout


def test_an_unlisted_skip_fails_a_parallel_run_too(tmp_path):
    done = run_pytest(tmp_path, SKIPPING, "-n", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_probe.py::test_needs_a_service: no PostgreSQL" in done.stdout


def test_a_listed_skip_passes(tmp_path):
    conftest = CONFTEST.read_text().replace(
        "ALLOWED_SKIPS: dict[str, str] = {}",
        'ALLOWED_SKIPS: dict[str, str] = {"test_probe.py::test_needs_a_service": "a reason"}',
    )
    assert conftest != CONFTEST.read_text(), "ALLOWED_SKIPS is no longer written as expected"
    done = run_pytest(tmp_path, SKIPPING, conftest=conftest)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_misspelt_marker_is_an_error(tmp_path):
    done = run_pytest(tmp_path, "import pytest\n\n@pytest.mark.compatt\ndef test_x():\n    pass\n")
    assert done.returncode != 0
    assert "'compatt' not found in `markers`" in done.stdout + done.stderr
