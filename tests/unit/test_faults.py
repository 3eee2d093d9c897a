"""The test-only crash points (`varadhi.core.faults`): a process that reaches the named point
the n-th time ends at once, exit 137, with nothing after it run; other points, and no
`VARADHI_CRASH_AT`, change nothing. Each case runs a small Python process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
from varadhi.core.faults import crash_point
for step in ("a", "b", "a", "b"):
    print("before", step, flush=True)
    crash_point(step)
print("end", flush=True)
"""


def run(crash_at: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VARADHI_CRASH_AT"}
    if crash_at is not None:
        env["VARADHI_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "crash_at,printed",
    [("b", ["a", "b"]), ("b@1", ["a", "b"]), ("a@2", ["a", "b", "a"]), ("b@2", list("abab"))],
)
def test_the_nth_time_at_the_point_ends_the_process_there(crash_at, printed):
    done = run(crash_at)
    assert done.returncode == 137, done.stderr
    assert done.stdout.split() == [w for step in printed for w in ("before", step)]
    assert f"crashing at {crash_at.partition('@')[0]}" in done.stderr


@pytest.mark.parametrize("crash_at", [None, "", "c", "a@3"])
def test_another_point_or_none_changes_nothing(crash_at):
    done = run(crash_at)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "end"
