"""`varadhi.spark.zip_imports`: a task start (`importlib.invalidate_caches()`) reads an unchanged zip
archive on the path no more, and a changed one still, in a Python process of its own (the
replacement changes a standard-library class for the whole process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    sys.version_info[:2] not in ((3, 10), (3, 11)), reason="only 3.10 and 3.11 re-read eagerly"
)

SCRIPT = textwrap.dedent(
    """
    import importlib, sys, zipfile, zipimport
    sys.path.insert(0, sys.argv[1])
    import pkg.sub.leaf  # three importers of the archive: its root, pkg, pkg/sub

    reads = []
    read_directory = zipimport._read_directory
    zipimport._read_directory = lambda archive: reads.append(archive) or read_directory(archive)

    def task_start():
        reads.clear()
        importlib.invalidate_caches()
        return len(reads)

    if sys.argv[2] == "keep":
        from varadhi.spark.zip_imports import keep_unchanged_zip_directories
        assert keep_unchanged_zip_directories() and keep_unchanged_zip_directories()
    first, second = task_start(), task_start()
    with zipfile.ZipFile(sys.argv[1], "a") as z:  # the archive changes: a new module
        z.writestr("pkg/sub/added.py", "VALUE = 42\\n")
    changed, after = task_start(), task_start()
    import pkg.sub.added
    print(first, second, changed, after, pkg.sub.added.VALUE)
    """
)


def run(tmp_path: Path, mode: str) -> list[int]:
    archive = tmp_path / "packages.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/sub/__init__.py", "")
        z.writestr("pkg/sub/leaf.py", "")
    lib = str(Path(__file__).resolve().parents[2] / "lib")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.append({lib!r})\n" + SCRIPT,
            str(archive),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [int(x) for x in out.stdout.split()]


def test_an_unchanged_archive_is_not_read_again_at_each_task_start(tmp_path):
    first, second, changed, after, value = run(tmp_path, "keep")
    assert (first, second) == (1, 0)  # once in the process, then never while unchanged
    assert (changed, after) == (1, 0)  # a changed archive is read again, once
    assert value == 42  # and what it gained imports


def test_without_it_every_importer_reads_the_whole_archive_at_each_task_start(tmp_path):
    """What the replacement is for: Python 3.10 and 3.11 as they are."""
    first, second, changed, after, value = run(tmp_path, "plain")
    assert first == second == changed == after >= 3
    assert value == 42
