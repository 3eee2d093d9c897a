"""What the benchmarks share: where Debian's nginx is, the machine a run was measured on, and the
results file (JSON, pretty-printed). Imported by the scripts next to it (`from common import`)."""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path


def nginx_binary() -> str | None:
    """nginx on PATH, else where Debian puts it (/usr/sbin is not on every user's PATH)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def machine(load_at_start: tuple[float, float, float], **facts: object) -> dict:
    """CPU count, Python version, any `facts` of the run, and the load averages when it started
    (other work on the machine lowers every row: compare rows of one run)."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **facts,
        "load_average_at_start": [round(x, 2) for x in load_at_start],
    }


def write_results(path: Path, doc: dict) -> None:
    """Write `doc` to `path` (creating its folder) and say so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
