"""SIGINT and SIGTERM as a request to stop, for the drivers of the Spark jobs.

Run with spark-submit (`spark-submit.sh`), a job's Python driver is a child of the driver JVM and
in its process group, so a terminal's Ctrl-C (SIGINT to the foreground process group) or a
SIGTERM to the group reaches both. Left to their defaults:

- the JVM runs its shutdown hooks: the SparkContext stops under the running job (a micro-batch in
  flight is lost and delivered again), the driver's py4j calls fail, and spark-submit exits with
  130 or 143, or 134 with "Fatal Python error: PyGILState_Release" when the interpreter ends while
  a py4j callback thread (`foreachBatch`) still runs;
- PySpark's SparkContext installs its own SIGINT handler in the driver, which cancels every Spark
  job and raises KeyboardInterrupt in the main thread (a signal to the Python process alone).

`StopSignals` replaces both for as long as a job runs: SIGINT and SIGTERM, to the process group,
to the Python driver or to the JVM alone, call `on_signal(signum)` once each, and the job decides
what stopping means (a shard finishes its micro-batch in flight, a bounded job cancels its Spark
job). The JVM's handlers are replaced (by one that relays the signal to Python through py4j) only
when the JVM is this process's parent started by spark-submit, a JVM that lives for this driver
alone; a cluster's shared driver JVM (Databricks) keeps its own.

Hazard: CPython runs a signal handler in the main thread between two bytecodes of whatever it was
doing, also inside a lock it holds or inside the handler itself (a signal every few ms: a held
Ctrl-C, a SIGTERM loop). A handler that takes a lock (`threading.Event.set` takes its Condition's)
then waits for itself: one signal while the main thread is inside `Event.wait` or `set` hung it
for good, and each further signal nested the handler once more until RecursionError. So the
handler only puts the signal's number on a reentrant queue (`queue.SimpleQueue.put`), and one
thread of ours calls `on_signal`, one signal after the other, never in a signal handler.

A driver that spark-submit started for this job alone ends when the job does, so a stop asked for
is final there: from the first signal on, its JVM ignores INT and TERM (a relay per signal of a
storm is a JVM thread calling into Python, and one still under way when Python has exited prints
a py4j "Connection refused" stack trace), and `restore()` leaves them ignored in Python too, so
that signals in its last seconds (a Ctrl-C held down) cannot turn the clean stop into exit 130 or
143.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("varadhi.signals")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Install with `install()` (in the main thread, once the SparkSession exists: creating the
    SparkContext installs PySpark's SIGINT handler) and undo with `restore()`; also a context
    manager. `spark` may be None (no JVM to guard). `on_signal(signum)` runs in a thread of its
    own (`varadhi-stop-signals`), once per signal and never two at once; it may take locks."""

    def __init__(self, spark, on_signal: Callable[[int], None]):
        self._spark = spark
        self._on_signal = on_signal
        self._saved: dict[int, object] = {}
        self._jvm_saved: list[tuple[object, object]] = []
        self.received: str | None = None  # the first signal's name, once one came
        self._cancelling = threading.Event()
        self._restored = threading.Event()
        self._canceller: threading.Thread | None = None
        self._pending: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._dispatcher: threading.Thread | None = None

    @classmethod
    def cancelling(cls, spark) -> StopSignals:
        """For a bounded job: a signal cancels its Spark jobs, the running one and any it starts
        later (until `restore()`; a signal between two jobs must not be lost), so the job ends
        through its own error handling."""
        signals = cls(spark, lambda _signum: signals._cancel_jobs())
        return signals

    def _cancel_jobs(self) -> None:
        if self._cancelling.is_set():
            return
        self._cancelling.set()
        # From a thread of its own: the main thread's py4j connection is busy waiting for the job.
        self._canceller = threading.Thread(
            target=self._cancel_until_restored, name="varadhi-cancel-jobs", daemon=True
        )
        self._canceller.start()

    def _cancel_until_restored(self) -> None:
        sc = self._spark.sparkContext
        while not self._restored.is_set():
            try:
                sc.cancelAllJobs()
            except Exception:  # noqa: BLE001 - the context is gone: nothing left to cancel
                return
            self._restored.wait(0.25)

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, _frame: object) -> None:
        """The Python signal handler (see the module's hazard): a reentrant put, nothing else."""
        self._pending.put(signum)

    def _dispatch(self) -> None:
        """The `varadhi-stop-signals` thread: each signal's `on_signal`, until `restore()`."""
        while (signum := self._pending.get()) is not None:
            if self.received is None:  # a signal to the group comes twice: to Python and the JVM
                self.received = signal.Signals(signum).name
                log.info("%s received: stopping", self.received)
                self._set_jvm_handlers(ignore=True)  # final (see the module)
            self._on_signal(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread can set handlers (a job run in a test's thread)
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="varadhi-stop-signals", daemon=True
        )
        self._dispatcher.start()
        for sig in SIGNALS:
            self._saved[sig] = signal.signal(sig, self._handle)
        if self._spark is not None:
            self._relay_jvm_signals()

    def restore(self) -> None:
        """Put the handlers back, once every signal received so far has had its `on_signal`;
        a signal from here on is dropped. A spark-submit driver of this job alone (see the module)
        that was asked to stop ignores INT and TERM from now on instead."""
        self._restored.set()
        if self._canceller is not None:
            self._canceller.join(5)
        if self._dispatcher is not None:
            self._pending.put(None)
            self._dispatcher.join(5)
            self._dispatcher = None
        final = self.received is not None and bool(self._jvm_saved)
        for sig, handler in self._saved.items():
            signal.signal(sig, signal.SIG_IGN if final else handler)
        self._saved.clear()
        if not final:
            self._set_jvm_handlers(ignore=False)
        self._jvm_saved.clear()

    def _set_jvm_handlers(self, ignore: bool) -> None:
        """The JVM's INT and TERM handlers, where ours relay them (`_relay_jvm_signals`): ignored,
        or the ones from before."""
        for jsig, previous in self._jvm_saved:
            try:
                jvm = self._spark.sparkContext._jvm
                handler = jvm.sun.misc.SignalHandler.SIG_IGN if ignore else previous
                jvm.sun.misc.Signal.handle(jsig, handler)
            except Exception:  # noqa: BLE001 - the gateway may be gone; the JVM ends with us
                pass

    def _relay_jvm_signals(self) -> None:
        sc = self._spark.sparkContext
        jvm = sc._jvm
        try:
            command = jvm.java.lang.System.getProperty("sun.java.command") or ""
            ours = command.startswith("org.apache.spark.deploy.SparkSubmit") and (
                jvm.java.lang.ProcessHandle.current().pid() == os.getppid()
            )
        except Exception:  # noqa: BLE001 - not a JVM we can ask: leave it alone
            return
        if not ours:
            return
        from pyspark.java_gateway import ensure_callback_server_started

        ensure_callback_server_started(sc._gateway)
        for sig in SIGNALS:
            name = signal.Signals(sig).name.removeprefix("SIG")
            jsig = jvm.sun.misc.Signal(name)
            previous = jvm.sun.misc.Signal.handle(jsig, _JvmRelay(sig, self._pending.put))
            self._jvm_saved.append((jsig, previous))


class _JvmRelay:
    """A `sun.misc.SignalHandler` implemented in Python: the JVM calls it (through py4j's callback
    server) instead of shutting down."""

    def __init__(self, signum: int, received: Callable[[int], None]):
        self._signum = signum
        self._received = received

    def handle(self, _signal) -> None:
        self._received(self._signum)

    class Java:
        implements = ["sun.misc.SignalHandler"]
