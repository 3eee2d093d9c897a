"""What a start of the command line and of `varadhi-consumer` imports: neither pandas (with numpy
and pyarrow, ~0.5 s of CPU) nor pyspark nor prometheus_client. Every `varadhi` command, every
`--help` and every library member paid for them, and the test suite starts hundreds of such
processes. The Spark runtime imports them where it needs them (`varadhi.core.state_frames`,
`varadhi.spark.*`). Each check runs in a fresh interpreter: this one has imported them already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import varadhi

LIB = str(Path(varadhi.__file__).resolve().parents[1])
HEAVY = ("pandas", "numpy", "pyarrow", "pyspark", "prometheus_client")

#: The `--help` of the command line, of each command group and of a few commands.
CLI_HELP = [
    [],
    ["topic"],
    ["subscription"],
    ["subscription", "create"],
    ["status"],
    ["dlq", "unsideline"],
    ["offsets", "reset"],
    ["replay"],
    ["outbox", "relay"],
    ["jobs", "render"],
]


def heavy_modules_after(code: str) -> list[str]:
    """The modules of `HEAVY` that a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    child = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": LIB},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "entry",
    [
        "from varadhi.cli import main",  # the `varadhi` console script
        "from varadhi.library.console import main",  # `varadhi-consumer`
        "from varadhi import Client",  # the Python API
    ],
)
def test_a_start_imports_no_pandas_pyarrow_pyspark_or_prometheus(entry):
    assert heavy_modules_after(entry) == []


def test_every_help_prints_and_imports_none_of_them():
    code = f"""
from varadhi.cli import main
from varadhi.library.console import main as consumer_main

for run, argv in [(main, a) for a in {CLI_HELP!r}] + [(consumer_main, [])]:
    try:
        run([*argv, "--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    else:
        raise AssertionError(f"{{argv}} --help did not exit")
"""
    assert heavy_modules_after(code) == []
