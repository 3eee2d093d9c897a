"""What the benchmarks share: where Debian's nginx is, the project's test endpoint in a process of
its own, the machine a run was measured on, and the results file (JSON, pretty-printed). Imported
by the scripts next to it (`from common import`); no Spark. The scaffolding of the benches that
run a shard in their own process is bench/harness.py."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def nginx_binary() -> str | None:
    """nginx on PATH, else where Debian puts it (/usr/sbin is not on every user's PATH)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
    )


@contextmanager
def endpoint_process(*options: str) -> Iterator[str]:
    """The project's test endpoint (`python -m varadhi.testing.endpoint`, `options` its command
    line's) in a process of its own: yields its URL, and stops it on the way out (SIGTERM, which
    closes its `--record` file; SIGKILL after 30 s). Refuses with one line (its last on stderr)
    if it printed no URL."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "varadhi.testing.endpoint", *options],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            if not url.startswith("http://127.0.0.1:"):
                proc.wait(30)
                err.seek(0)
                said = (err.read().strip().splitlines() or [repr(url)])[-1]
                raise SystemExit(f"the test endpoint did not start: {said}")
            yield url
        finally:
            stop_process(proc, 30)


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM `proc` and wait for it to end; SIGKILL it if it has not within `timeout` s."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def machine(load_at_start: tuple[float, float, float], **facts: object) -> dict:
    """CPU count, Python version, any `facts` of the run, and the load averages when it started
    (other work on the machine lowers every row: compare rows of one run)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **facts,
        "load_average_at_start": [round(x, 2) for x in load_at_start],
    }


def results_head(benchmark: str, argv: list[str] | None, machine_facts: dict) -> dict:
    """A results file's first keys: `benchmark`, the `command` that ran it (`python
    bench/<benchmark>.py` and `argv`, None: this process's arguments), the local `date` and
    `machine` (`machine(...)`'s)."""
    args = argv if argv is not None else sys.argv[1:]
    return {
        "benchmark": benchmark,
        "command": f"python bench/{benchmark}.py " + " ".join(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_facts,
    }


def print_table(rows: list[dict], columns: list[tuple[str, str, int, str]]) -> None:
    """Print `rows` as a table: a column per (header, key, width, format), right-aligned to
    `width`, each value with `format` (a format spec's type part, e.g. "," or ".0f")."""
    print(" ".join(f"{header:>{width}}" for header, _, width, _ in columns))
    for r in rows:
        print(" ".join(f"{r[key]:>{width}{fmt}}" for _, key, width, fmt in columns))


def write_results(path: Path, doc: dict) -> None:
    """Write `doc` to `path` (creating its folder) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
