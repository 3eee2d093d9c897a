"""Py4J/JVM/pyspark errors read in one place (`varadhi.kafka.jvm_errors`), on exceptions built here
without a JVM: py4j's `Py4JJavaError` on a stand-in gateway, pyspark's captured exceptions as
`StreamingQuery.exception()` returns them (4.x and 3.5 attribute names), stack trace text."""

from __future__ import annotations

import pytest
from py4j.protocol import Py4JJavaError, escape_new_line
from pyspark.errors.exceptions.captured import StreamingQueryException, UnknownException

from varadhi.core.errors import StopRequested as StopRequestedError
from varadhi.kafka import jvm_errors
from varadhi.kafka.jvm_errors import (
    Denied,
    Fenced,
    KafkaMetricsNPE,
    Link,
    StopRequested,
    ZombieCheckpointWriter,
)

NPE_FRAMES = [
    ("org.apache.spark.sql.kafka010.KafkaMicroBatchStream", "metrics"),
    ("org.apache.spark.sql.execution.streaming.ProgressReporter", "extractSourceProgress"),
]
# Utils.exceptionString of the NullPointerException of SPARK-55271 (Spark 4.1.1, shortened)
NPE_TRACE = (
    'java.lang.NullPointerException: Cannot invoke "scala.collection.immutable.Map.get(Object)"'
    ' because "latestPartitionOffsets" is null\n'
    "\tat org.apache.spark.sql.kafka010.KafkaMicroBatchStream.metrics(KafkaMicroBatchStream.scala:"
    "330)\n\tat org.apache.spark.sql.execution.streaming.ProgressReporter.extractSourceProgress"
    "(ProgressReporter.scala:411)\n\t... 12 more\n"
)
STREAM_FAILED = (
    "[STREAM_FAILED] Query [id = 5f1, runId = 9a2] terminated with exception: "
    "java.lang.NullPointerException"
)
# A Python error of a foreachBatch function comes back as the text of the Java PythonException
# that carried it (the shard's own StopRequested, as Spark 4.1 reports it, shortened).
STOPPED = (
    "[STREAM_FAILED] Query [id = 5f1] terminated with exception: An exception was raised by the"
    ' Python Proxy. Return Message: Traceback (most recent call last):\n  File "/x/py4j/'
    'clientserver.py", line 644, in _call_proxy\n  File "/x/varadhi/spark/shard/job.py", line 781, in '
    "_on_batch\nvaradhi.core.errors.StopRequested\n"
)


class JavaObject:
    """Stands for py4j's proxy of a Java throwable (the methods `jvm_errors` calls)."""

    def __init__(self, cls, message=None, frames=(), cause=None, gone=False):
        self.cls, self.message, self.frames, self.cause, self.gone = (
            cls,
            message,
            frames,
            cause,
            gone,
        )
        self._target_id = "o42"
        self._gateway_client = Gateway(self)

    def _ask(self, value):
        if self.gone:
            raise ConnectionError("the Java gateway is gone")
        return value

    def getClass(self):
        return self._ask(Named(self.cls))

    def getMessage(self):
        return self._ask(self.message)

    def getStackTrace(self):
        return self._ask([Frame(c, m) for c, m in self.frames])

    def getCause(self):
        return self._ask(self.cause)

    def toString(self):
        return self._ask(self.cls + (f": {self.message}" if self.message else ""))

    def trace(self) -> str:
        lines, t = [], self
        while t is not None:
            lines.append(("Caused by: " if t is not self else "") + t.toString())
            lines += [f"\tat {c}.{m}(X.java:1)" for c, m in t.frames]
            t = t.cause
        return "\n".join(lines)


class Named:
    def __init__(self, name):
        self.name = name

    def getName(self):
        return self.name


class Frame:
    def __init__(self, cls, method):
        self.cls, self.method = cls, method

    def getClassName(self):
        return self.cls

    def getMethodName(self):
        return self.method


class Gateway:
    """py4j's client as `str(Py4JJavaError)` uses it: the answer to the exception command is the
    Java stack trace as a py4j string value ("ys..."), or an error when the JVM is gone."""

    def __init__(self, throwable):
        self.throwable = throwable

    def send_command(self, command):
        return "ys" + escape_new_line(self.throwable._ask(self.throwable.trace()))


def py4j_error(throwable: JavaObject) -> Py4JJavaError:
    return Py4JJavaError("An error occurred while calling o1576.save.\n", throwable)


def captured(kind, desc, trace, cause=None):
    """A pyspark 4.x captured exception as built from text (no `_origin`): what
    `StreamingQuery.exception()` returns (kind StreamingQueryException) and its converted
    causes (UnknownException)."""
    e = kind.__new__(kind)
    e._desc, e._stackTrace, e._cause, e._origin = desc, trace, cause, None
    return e


class Query:
    """A terminated query: pyspark's `exception()`, and the JVM's through `_jsq` when given."""

    def __init__(self, error, java=None):
        self.error, self._jsq = error, (Jsq(java) if java is not None else None)

    def exception(self):
        return self.error


class Jsq:
    def __init__(self, java):
        self.java = java

    def exception(self):
        return self

    def isDefined(self):
        return True

    def get(self):
        return self.java


def test_the_kafka_metrics_npe_through_py4j_s_java_chain():
    npe = JavaObject("java.lang.NullPointerException", None, NPE_FRAMES)
    java = JavaObject("org.apache.spark.sql.streaming.StreamingQueryException", "x", (), npe)
    failure = jvm_errors.classify(py4j_error(java))
    assert KafkaMetricsNPE in failure
    assert failure.chain[1] == Link("java.lang.NullPointerException", "", tuple(NPE_FRAMES))
    # the same exception class thrown elsewhere, or another one in `metrics`, is not that failure
    elsewhere = JavaObject("java.lang.NullPointerException", None, NPE_FRAMES[1:])
    assert KafkaMetricsNPE not in jvm_errors.classify(py4j_error(elsewhere))
    other = JavaObject("java.lang.IllegalStateException", "x", NPE_FRAMES)
    assert KafkaMetricsNPE not in jvm_errors.classify(py4j_error(other))


def test_the_kafka_metrics_npe_of_a_query_s_exception_in_each_form():
    """pyspark 4.x keeps the cause's trace as text; 3.5 names the attributes without the
    underscore; a classic query also has the JVM's exception, read through Py4J."""
    cause = captured(UnknownException, "java.lang.NullPointerException", NPE_TRACE)
    error = captured(StreamingQueryException, STREAM_FAILED, "org.apache.X.run(X.scala:1)", cause)
    assert KafkaMetricsNPE in jvm_errors.query_failure(Query(error))

    class Captured35(Exception):
        def __init__(self, desc, stackTrace, cause=None):
            self.desc, self.stackTrace, self.cause = desc, stackTrace, cause

    old = Captured35(STREAM_FAILED, "", Captured35("java.lang.NullPointerException", NPE_TRACE))
    assert KafkaMetricsNPE in jvm_errors.classify(old)

    bare = captured(StreamingQueryException, STREAM_FAILED, "org.apache.X.run(X.scala:1)")
    npe = JavaObject("java.lang.NullPointerException", None, NPE_FRAMES)
    java = JavaObject("org.apache.spark.sql.streaming.StreamingQueryException", "x", (), npe)
    assert KafkaMetricsNPE not in jvm_errors.query_failure(Query(bare))
    assert KafkaMetricsNPE in jvm_errors.query_failure(Query(bare, java))
    assert jvm_errors.query_failure(Query(None)) is None


def test_a_spark_connect_error_is_read_from_the_server_s_stack_trace():
    class ConnectError(Exception):  # pyspark.errors.exceptions.connect's attributes
        def __init__(self, message, server_stacktrace):
            super().__init__(message)
            self._message, self._stacktrace = message, server_stacktrace

        def getStackTrace(self):
            return self._stacktrace

    failure = jvm_errors.classify(ConnectError(STREAM_FAILED, NPE_TRACE))
    assert KafkaMetricsNPE in failure
    assert jvm_errors.classify(ConnectError(STREAM_FAILED, None)).facts == ()


def test_the_shard_s_own_errors_raised_in_a_batch():
    stopped = jvm_errors.classify(captured(StreamingQueryException, STOPPED, ""))
    assert StopRequested in stopped and Fenced not in stopped
    fenced = STOPPED.replace("varadhi.core.errors.StopRequested", "varadhi.core.errors.Fenced: lease s/0: "
                             "fenced (my epoch 3, current epoch 4)")  # fmt: skip
    assert jvm_errors.classify(captured(StreamingQueryException, fenced, "")).facts == (Fenced(),)
    producer = JavaObject("org.apache.kafka.common.errors.ProducerFencedException", "epoch")
    assert Fenced in jvm_errors.classify(py4j_error(producer))


def test_a_stop_is_recognised_by_its_class_not_by_a_word_in_a_message():
    # Raised here (as the batch function does), and as the cause of another error.
    try:
        raise StopRequestedError()
    except StopRequestedError as e:
        raised = e
    assert jvm_errors.classify(raised).facts == (StopRequested(),)
    try:
        raise RuntimeError("the batch ended") from raised
    except RuntimeError as e:
        assert StopRequested in jvm_errors.classify(e)
    # The Java chain of a Py4J error whose PythonException carries the batch function's traceback.
    carried = JavaObject("org.apache.spark.api.python.PythonException", STOPPED)
    job = JavaObject("org.apache.spark.SparkException", "Job aborted", (), carried)
    assert StopRequested in jvm_errors.classify(py4j_error(job))
    # The word alone, in an endpoint's answer or a record's error text, or a longer class name,
    # is a failure: the query did not end on purpose.
    for text in (
        "HTTP 500: StopRequested by upstream",
        "java.lang.IllegalStateException: StopRequested",
        "varadhi.core.errors.StopRequestedLater: x",
        "my.varadhi.errors.StopRequested",
    ):
        assert StopRequested not in jvm_errors.classify(RuntimeError(text)), text
        answer = STOPPED.replace("varadhi.core.errors.StopRequested", f"RuntimeError: {text}")
        assert StopRequested not in jvm_errors.classify(
            captured(StreamingQueryException, answer, "")
        )


class ServerError(Exception):
    """A Spark Connect error with the server's stack trace (its attributes, as above)."""

    def __init__(self, message, server_stacktrace):
        super().__init__(message)
        self._message, self._stacktrace = message, server_stacktrace

    def getStackTrace(self):
        return self._stacktrace


def test_kafka_s_other_fenced_errors_are_not_a_fence_of_the_shard():
    # A leader change while the query reads (Java client, through Py4J and as text only), and
    # kafka-python's errors of the same names in a batch function's traceback: retriable or
    # about someone else, never "a newer instance holds this shard" (exit 3).
    epoch = JavaObject(
        "org.apache.kafka.common.errors.FencedLeaderEpochException",
        "The leader epoch in the request is older than the epoch on the broker.",
    )
    job = JavaObject("org.apache.spark.SparkException", "Job aborted", (), epoch)
    assert jvm_errors.classify(py4j_error(job)).facts == ()
    assert jvm_errors.classify(ServerError(STREAM_FAILED, job.trace())).facts == ()
    for name in ("FencedLeaderEpochError", "FencedInstanceIdError",
                 "TransactionCoordinatorFencedError"):  # fmt: skip
        python = STOPPED.replace(
            "varadhi.core.errors.StopRequested", f"kafka.errors.{name}: [Error 74]"
        )
        assert Fenced not in jvm_errors.classify(captured(StreamingQueryException, python, ""))


def test_a_fenced_kafka_python_producer_in_each_form():
    from kafka.errors import KafkaError, ProducerFencedError

    assert Fenced in jvm_errors.classify(ProducerFencedError())
    # What kafka-python raises for every transactional call after it was fenced.
    refused = KafkaError("Cannot execute transactional method because we are in an error state: "
                         f"{ProducerFencedError()}")  # fmt: skip
    assert Fenced in jvm_errors.classify(refused)
    text_only = ServerError(STREAM_FAILED, "Caused by: org.apache.kafka.common.errors."
                             "ProducerFencedException: There is a newer producer")  # fmt: skip
    assert Fenced in jvm_errors.classify(text_only)
    # Wherever a message puts the qualified name (not only at the start of a line), and never
    # a longer name that starts with it.
    inline = "terminated with exception: varadhi.core.errors.Fenced: lease s/0: fenced"
    assert Fenced in jvm_errors.classify(RuntimeError(inline))
    assert Fenced not in jvm_errors.classify(RuntimeError("varadhi.core.errors.FencedLater: x"))


@pytest.mark.parametrize(
    "message",
    [
        "Concurrent update to the commit log. Multiple streaming jobs detected for 7",
        "Multiple streaming jobs detected for 7",
    ],
)
def test_another_writer_of_the_checkpoint(message):
    java = JavaObject("java.util.ConcurrentModificationException", message)
    assert jvm_errors.classify(py4j_error(java)).facts == (ZombieCheckpointWriter(),)


def test_a_missing_acl_in_the_java_chain_of_a_py4j_error():
    refused = JavaObject(
        "org.apache.kafka.common.errors.TopicAuthorizationException",
        "Not authorized to access topics: [s.rq.1]",
    )
    job = JavaObject("org.apache.spark.SparkException", "Job aborted", (), refused)
    failure = jvm_errors.classify(py4j_error(job))
    assert failure.of(Denied) == Denied("java", "Topic", "s.rq.1")
    group = JavaObject(
        "org.apache.kafka.common.errors.GroupAuthorizationException",
        "Not authorized to access group: spark-kafka-source-1",
    )
    assert jvm_errors.classify(py4j_error(group)).of(Denied) == Denied(
        "java", "Group", "spark-kafka-source-1", "Read"
    )
    assert jvm_errors.classify(RuntimeError("Connection refused")).of(Denied) is None


def test_a_gone_jvm_leaves_what_python_has_and_raises_nothing():
    npe = JavaObject("java.lang.NullPointerException", None, NPE_FRAMES)
    gone = JavaObject("org.apache.spark.SparkException", "Job aborted", (), npe, gone=True)
    failure = jvm_errors.classify(py4j_error(gone))
    assert failure.chain == () and failure.facts == ()
    assert "Py4JJavaError" in failure.text
    assert jvm_errors.headline(py4j_error(gone)).startswith("An error occurred while calling")


def test_the_headline_is_the_java_exception_s_own_first_line():
    java = JavaObject("java.nio.file.AccessDeniedException", "/wh/_varadhi/x: Permission denied")
    assert jvm_errors.headline(py4j_error(java)) == (
        "java.nio.file.AccessDeniedException: /wh/_varadhi/x: Permission denied"
    )
    assert jvm_errors.headline(PermissionError("denied\nsecond line")) == "denied"
    assert jvm_errors.headline(OSError()) == "OSError"
    assert len(jvm_errors.headline(ValueError("x" * 1000))) == 300


def test_python_causes_are_followed():
    try:
        try:
            raise py4j_error(JavaObject("java.util.ConcurrentModificationException",
                                        "Multiple streaming jobs detected for 7"))  # fmt: skip
        except Py4JJavaError as java:
            raise RuntimeError("the query failed") from java
    except RuntimeError as wrapped:
        failure = jvm_errors.classify(wrapped)
    assert ZombieCheckpointWriter in failure
    assert [c.python_type or c.class_name for c in failure.chain] == [
        "RuntimeError",
        "java.util.ConcurrentModificationException",
    ]


def test_stack_trace_text_as_links():
    text = (
        "org.apache.spark.SparkException: Job aborted\nsecond line of the message\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.abortStage(DAGScheduler.scala:3122)\n"
        "\t... 3 more\nCaused by: " + NPE_TRACE
    )
    first, second = jvm_errors.trace_links(text)
    assert first == Link(
        "org.apache.spark.SparkException",
        "Job aborted\nsecond line of the message",
        (("org.apache.spark.scheduler.DAGScheduler", "abortStage"),),
    )
    assert second.class_name == "java.lang.NullPointerException"
    assert second.message.startswith('Cannot invoke "scala.collection')
    assert second.frames == tuple(NPE_FRAMES)
    frames_only = list(jvm_errors.trace_links("org.apache.X.run(X.scala:1)\n\t at a.B.c(B.java:2)"))
    assert frames_only == [Link("", "org.apache.X.run(X.scala:1)", (("a.B", "c"),))]
