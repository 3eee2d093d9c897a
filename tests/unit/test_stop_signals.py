"""`varadhi.spark.stop_signals` without Spark: SIGINT and SIGTERM, one or a storm of them, each reach
`on_signal` once, one after the other, also when a signal arrives while `on_signal` holds a lock
(as `threading.Event.set`, the shard's `on_signal`, does). The real shard's process group is
tests/integration/test_shard_crash.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import varadhi
from varadhi.spark.stop_signals import StopSignals

LIB = str(Path(varadhi.__file__).resolve().parents[1])

#: A driver whose `on_signal` takes a lock and, holding it, receives the next signal (sent by
#: itself, so it always does): a handler that called `on_signal` itself waited for its own lock
#: from then on (a hang; each further signal nested it once more, up to RecursionError).
STORM_WHILE_HELD = """
    import os, signal, threading
    from varadhi.spark.stop_signals import StopSignals

    lock, done, calls = threading.Lock(), threading.Event(), []

    def on_signal(signum):
        with lock:
            calls.append(signum)
            if len(calls) < 40:
                os.kill(os.getpid(), signal.SIGTERM if len(calls) % 2 else signal.SIGINT)
            else:
                done.set()

    with StopSignals(None, on_signal) as signals:
        os.kill(os.getpid(), signal.SIGINT)
        while not done.wait(0.01):
            pass
    names = {signal.Signals(s).name for s in calls}
    print(len(calls), signals.received, sorted(names))
"""


def test_a_signal_while_on_signal_holds_a_lock_neither_hangs_nor_recurses():
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STORM_WHILE_HELD)],
        env={**os.environ, "PYTHONPATH": LIB},
        capture_output=True,
        text=True,
        timeout=120,  # a guard: the code before this fix hung here for good
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split("\n")[0] == "40 SIGINT ['SIGINT', 'SIGTERM']", child.stderr


def test_restore_waits_for_the_signals_received_and_puts_the_handlers_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    calls: list[tuple[int, str]] = []
    signals = StopSignals(None, lambda s: calls.append((s, threading.current_thread().name)))
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signals.restore()
    assert calls == [(signal.SIGTERM, "varadhi-stop-signals")]  # not in a signal handler
    assert signals.received == "SIGTERM"
    assert {sig: signal.getsignal(sig) for sig in before} == before  # no JVM: not ignored
