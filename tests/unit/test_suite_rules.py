"""The suite's own rules, checked by running pytest on a throw-away tree that has this suite's
root conftest: a skip that `ALLOWED_SKIPS` does not list fails the run (a service that did not
start must not leave a green run), a listed one does not, a misspelt marker is an error, and the
tests of one `GROUPS` entry run on one xdist worker."""

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


GROUPED = """
import os

import pytest


@pytest.mark.parametrize("i", range(8))
def test_shares_a_fixture(i, tmp_path_factory):
    with open(os.environ["WORKERS_FILE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_the_tests_of_a_group_run_on_one_worker(tmp_path, monkeypatch):
    conftest = CONFTEST.read_text().replace(
        "GROUPS: dict[str, str] = {",
        'GROUPS: dict[str, str] = {\n    "test_probe.py": "one fixture",',
    )
    assert conftest != CONFTEST.read_text(), "GROUPS is no longer written as expected"
    workers = tmp_path / "workers.txt"
    monkeypatch.setenv("WORKERS_FILE", str(workers))
    done = run_pytest(tmp_path, GROUPED, "-n", "3", conftest=conftest)
    assert done.returncode == 0, done.stdout + done.stderr
    ran_on = workers.read_text().split()
    assert len(ran_on) == 8 and len(set(ran_on)) == 1, ran_on


def test_ungrouped_tests_spread_over_the_workers(tmp_path, monkeypatch):
    """The check above can fail: without the entry, the same tests go to several workers."""
    workers = tmp_path / "workers.txt"
    monkeypatch.setenv("WORKERS_FILE", str(workers))
    done = run_pytest(tmp_path, GROUPED.replace("range(8)", "range(40)"), "-n", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(set(workers.read_text().split())) > 1
