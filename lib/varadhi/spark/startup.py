"""Start-up phases of a job, one INFO line each, so that a slow start says where its time went.

    2026-11-26 14:02:11,482 INFO varadhi.spark.startup: orders shard 0: lease taken in 212 ms
    (5,931 ms since launch)

`since launch` counts from the start of the process that launched the job: under `spark-submit`
the driver JVM (this Python process's parent, which Python starts only once the JVM is up), so a
line also shows what came before Python; otherwise this process (`varadhi-job`, `python -m`),
which then starts the JVM itself. `in` is the time since the previous phase.
`bench/startup.py` turns these lines into a timeline. Phases that run side by side (a shard's
lease writer connected in a thread of its own while the Spark session starts, `Ahead`) are each
logged as they end, so `in` is the time since whichever phase ended before.

Hazard: the launch time comes from `/proc` (Linux, 10 ms steps); elsewhere, and when `/proc`
cannot be read, it is the time this module was first imported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("varadhi.spark.startup")
T = TypeVar("T")

_IMPORTED_S = time.time()
LINE_PREFIX = "start-up: "  # what bench/startup.py looks for


def process_start_s(pid: int, proc: str = "/proc", now_s: float | None = None) -> float | None:
    """When process `pid` started (epoch seconds): its start in clock ticks after boot
    (`/proc/<pid>/stat`) against the time since boot (`/proc/uptime`, 10 ms steps; the boot
    time in `/proc/stat` is whole seconds). None when they cannot be read (not Linux, the
    process is gone)."""
    now_s = time.time() if now_s is None else now_s
    try:
        with open(f"{proc}/{pid}/stat") as f:
            stat = f.read()
        with open(f"{proc}/uptime") as f:
            uptime_s = float(f.read().split()[0])
        # Field 22 (starttime) counts from after the command name, which may hold spaces and
        # parentheses: split after its closing one.
        ticks = int(stat[stat.rfind(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return now_s - uptime_s + ticks / os.sysconf("SC_CLK_TCK")


def launch_start_s(env: dict[str, str] | None = None) -> float:
    """When the job was launched (epoch seconds): the parent JVM's start under spark-submit
    (`PYSPARK_GATEWAY_PORT` set: the JVM started this process), else this process's start;
    the first import of this module when `/proc` says nothing."""
    env = dict(os.environ) if env is None else env
    pid = os.getppid() if env.get("PYSPARK_GATEWAY_PORT") else os.getpid()
    return process_start_s(pid) or _IMPORTED_S


def phase_line(what: str, phase: str, step_ms: float, total_ms: float) -> str:
    """One phase's log line (pure): `<what>: <phase> in N ms (M ms since launch)`."""
    return f"{LINE_PREFIX}{what}: {phase} in {step_ms:,.0f} ms ({total_ms:,.0f} ms since launch)"


class StartupClock:
    """Logs each start-up phase of one job as it ends (`mark`), until `done`. Marks after
    `done` (a query restarted later in the job's life) log nothing. Thread-safe: the driver's
    main thread marks, a start-up step in a thread of its own (`Ahead`) meanwhile, and the
    first batch's thread once the query runs."""

    def __init__(self, what: str, launched_s: float | None = None):
        self.what = what
        self.launched_s = launch_start_s() if launched_s is None else launched_s
        self._last_s = self.launched_s
        self._lock = threading.Lock()
        self.done = False
        python_s = process_start_s(os.getpid())
        if python_s is not None and python_s > self.launched_s + 0.005:  # the JVM launched it
            self.mark("JVM up, Python started", at_s=python_s)
        self.mark("job set up (imports, settings)")

    def mark(self, phase: str, at_s: float | None = None) -> None:
        """Log that `phase` ended now (or at `at_s`, epoch seconds); a no-op once the start-up
        is done."""
        with self._lock:
            if self.done:
                return
            now = time.time() if at_s is None else at_s
            step_ms, total_ms = (now - self._last_s) * 1000, (now - self.launched_s) * 1000
            self._last_s = now
            log.info(phase_line(self.what, phase, step_ms, total_ms))

    def finish(self, phase: str) -> None:
        """Mark the last phase and end the start-up."""
        self.mark(phase)
        with self._lock:
            self.done = True


class Ahead(Generic[T]):
    """`call()` started now in a thread of its own (a daemon: it never holds up the process's
    exit), its result taken later with `result()`, which waits for it and raises what it
    raised. For start-up steps that only read or connect (Kafka round trips) while the main
    thread does something else (starts the Spark session): the caller decides when the result
    is used, so nothing it decides is acted on earlier than before."""

    def __init__(self, call: Callable[[], T], name: str):
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self._value = call()
        except BaseException as e:  # noqa: BLE001 - handed to `result()`'s caller
            self._error = e

    def wait(self) -> None:
        """Wait for `call()` to end (its value or error stays for `result()`)."""
        self._thread.join()

    def result(self) -> T:
        """Wait for `call()` and return its value, or raise its error."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
