"""Py4J, JVM and pyspark errors recognised in one place: what a raised exception says, as facts.

A Spark action or query that fails reaches Python as one of several exception types, depending on
the Spark line and on where it failed: py4j's `Py4JJavaError` (the Java throwable is its
`java_exception`; `str()` is the Java stack trace with its causes), one of pyspark's captured
exceptions (`StreamingQueryException` and the like: a message, the Java stack trace as text, and a
converted cause; pyspark 3.5 names these attributes `desc`/`stackTrace`/`cause`, 4.x
`_desc`/`_stackTrace`/`_cause`, and only some keep the Java object as `_origin`), or a Spark
Connect exception (a message and, when the server sends it, its stack trace as text). An error the
product raises inside a `foreachBatch` function comes back as text too: its Python traceback inside
the message of the Java `PythonException` that carried it.

`classify(error)` reads all of them into a `Diagnosis`: the cause chain as `Link`s (Java class,
message, top stack frames), the text everything says, and the typed facts found in them:

- `Denied`: a missing Kafka ACL (`kafka_clients.refusal` makes the `NotAuthorized` error of it);
- `StopRequested`: the shard's own exception (`varadhi.core.errors.StopRequested`), raised by a batch
  function, by its class's qualified name (`_named`);
- `Fenced`: the shard's lease fence raised by a batch function, or its transactional producer
  fenced, by exact exception class (`fenced`; Kafka's `FencedLeaderEpochException` is not one);
- `LeaseExpired`: the shard's lease was not renewed for its TTL when a batch function checked it
  (`varadhi.core.errors.LeaseExpired`, by class): Kafka away, nobody known to hold the shard;
- `ZombieCheckpointWriter`: another query wrote the checkpoint's offset or commit log first;
- `KafkaMetricsNPE`: SPARK-55271, Spark 4.1's Kafka source failing after a re-run batch;
- `KafkaAway`: a Kafka call of a batch function failed with an error that may pass by itself
  (kafka-python's retriable errors, the product's `KafkaUnavailable`), by class: a broker away
  or restarting in the middle of a batch.

The product's own exceptions come back from a batch function as the text of a Python traceback,
so they are recognised there by their fully qualified class name as a whole word (taken from the
classes, not spelled here), never by a substring a message may hold ("StopRequested" in a
record's error text is no stop).

Contracts: `classify` never raises (a JVM that is gone leaves only the text Python already has) and
needs no JVM for errors built without one; the facts are pure functions of the links and text, so
they are unit-tested on constructed exceptions. Hazard: a Java client's message is the only source
of some facts (the Kafka client's refusal names topics, not the operation), so a change of its
wording in a new release turns a fact into an unrecognised failure (the error is then raised as
it is, not misread); the unit tests hold the wordings relied on.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import kafka.errors
from kafka.errors import KafkaError, ProducerFencedError

from varadhi.core import errors

#: Stack frames read per Java throwable through Py4J (one round trip each): the frames that
#: identify a failure are at the top.
MAX_FRAMES = 32
#: Causes followed per chain (Java or Python): a bound against cycles.
MAX_CAUSES = 16


@dataclass(frozen=True)
class Link:
    """One throwable of a cause chain: its Java class ("" when only Python's type is known: then
    `python_type`), message and top frames as (class, method)."""

    class_name: str
    message: str
    frames: tuple[tuple[str, str], ...] = ()
    python_type: str = ""


@dataclass(frozen=True)
class Denied:
    """The cluster's ACLs refused a Kafka request. `by` says who reported it:
    "varadhi" (a `NotAuthorized` line the product raised inside a query: `operation` and
    `principal` as it named them, principal None for "this principal"), "kafka-python" (the
    operation is the raising client's: Write for a producer, Read for a consumer, Describe
    otherwise) or "java" (Kafka's Java client in Spark's source or sink: `operation` None for a
    topic, as the client says only which topics; the caller knows whether it wrote them)."""

    by: str
    resource_type: str  # Topic, Group, TransactionalId, Cluster
    name: str  # a comma-separated list for several topics
    operation: str | None = None
    principal: str | None = None


@dataclass(frozen=True)
class StopRequested:
    """The shard's batch function refused a batch planned after it was asked to stop
    (`varadhi.core.errors.StopRequested`): the query ended on purpose."""


@dataclass(frozen=True)
class Fenced:
    """A batch met a newer instance of the same shard: the product's `Fenced` error, or a Kafka
    producer fenced by a newer transactional producer (`fenced`: by exact exception class)."""


@dataclass(frozen=True)
class LeaseExpired:
    """A batch found the shard's lease not renewed for its TTL (Kafka did not answer) and
    committed nothing; nobody is known to hold the shard."""


@dataclass(frozen=True)
class ZombieCheckpointWriter:
    """Another query wrote this query's checkpoint offset or commit log first (Spark's
    "Concurrent update to the ... log" / "Multiple streaming jobs detected"): a fenced instance of
    the shard that has not noticed yet. The files it wrote are valid, so the holder restarts."""


@dataclass(frozen=True)
class KafkaMetricsNPE:
    """SPARK-55271: Spark 4.1's Kafka source throws a NullPointerException in
    `KafkaMicroBatchStream.metrics` when it reports the progress of the first batch of a query
    that re-runs a batch planned (not committed) by an earlier run, as after any crash, kill or
    stop in the middle of a batch. The re-run batch itself completed and was committed; a new
    query on the same checkpoint goes on normally."""


@dataclass(frozen=True)
class KafkaAway:
    """A batch function's Kafka call failed with an error that may pass by itself: one that
    kafka-python marks retriable (a timeout, a connection refused, a leader moving) or the
    product's `KafkaUnavailable` (`kafka_clients.transient`), named in the batch function's
    Python traceback. The batch ended there, so nothing after that call was committed; the
    shard may ride the outage out and run the batch again. `error`: the traceback's line of it
    (class and message, at most 300 characters)."""

    error: str


Fact = (
    Denied
    | StopRequested
    | Fenced
    | LeaseExpired
    | ZombieCheckpointWriter
    | KafkaMetricsNPE
    | KafkaAway
)
F = TypeVar(
    "F",
    Denied,
    StopRequested,
    Fenced,
    LeaseExpired,
    ZombieCheckpointWriter,
    KafkaMetricsNPE,
    KafkaAway,
)


@dataclass(frozen=True)
class Diagnosis:
    """What `error` says: its cause chain, the text of it all, and the facts found in them."""

    error: BaseException
    chain: tuple[Link, ...]
    text: str
    facts: tuple[Fact, ...]

    def of(self, kind: type[F]) -> F | None:
        """The first fact of `kind`, or None."""
        return next((f for f in self.facts if isinstance(f, kind)), None)

    def __contains__(self, kind: type) -> bool:
        return any(isinstance(f, kind) for f in self.facts)


def classify(error: BaseException, java: Any = None) -> Diagnosis:
    """The `Diagnosis` of `error` and of what it was raised from (never raises); `java`: the
    Java throwable `error` stands for, where the caller has it and `error` does not keep it."""
    chain = (*(_java_links(java) if java is not None else ()), *links(error))
    text = "\n".join([_python_text(error), *(f"{c.class_name}: {c.message}" for c in chain)])
    return Diagnosis(error, chain, text, facts(chain, text))


def query_failure(query: Any) -> Diagnosis | None:
    """The `Diagnosis` of a terminated streaming query's failure (its `exception()`, pyspark's
    classic or Spark Connect query), or None when it ended without one."""
    error = query.exception()
    if error is None:
        return None
    return classify(error, _query_java_exception(query))


def _query_java_exception(query: Any) -> Any:
    """A classic query's Java `StreamingQueryException` (pyspark's `exception()` keeps only its
    text and a converted cause); None for Spark Connect, or when the JVM cannot be asked."""
    try:
        held = query._jsq.exception()
        return held.get() if held.isDefined() else None
    except Exception:  # noqa: BLE001 - no `_jsq` (Spark Connect), or the JVM is gone
        return None


def headline(error: BaseException) -> str:
    """The first line of what `error` reports, at most 300 characters: a JVM exception's own
    `toString` (class and message), not the Py4J dump around it; else `str(error)` or the
    type's name."""
    java = getattr(error, "java_exception", None)
    text = None
    if java is not None:
        try:
            text = str(java.toString())
        except Exception:  # noqa: BLE001 - the JVM is gone: Python's text below
            text = None
    if text is None:  # str() of a Py4J error asks the JVM too: then its own first argument
        text = _safe(lambda: str(error))
        if text is None:
            text = str(error.args[0]) if error.args else ""
    return (text.strip() or type(error).__name__).splitlines()[0][:300]


# -- the facts (pure) -------------------------------------------------------------------------


def facts(chain: tuple[Link, ...], text: str) -> tuple[Fact, ...]:
    """The facts that `chain` and `text` report, each once, in a fixed order."""
    found: list[Fact] = []
    if _STOP_TEXT.search(text):
        found.append(StopRequested())
    if fenced(chain, text):
        found.append(Fenced())
    if _LEASE_EXPIRED_TEXT.search(text):
        found.append(LeaseExpired())
    if "Concurrent update to the" in text or "Multiple streaming jobs detected" in text:
        found.append(ZombieCheckpointWriter())
    if any(_is_kafka_metrics_npe(c) for c in chain):
        found.append(KafkaMetricsNPE())
    denied = denied_in(text)
    if denied is not None:
        found.append(denied)
    away = _KAFKA_AWAY_TEXT.search(text)
    if away is not None:
        found.append(KafkaAway(away.group(0)[:300]))
    return tuple(found)


def _named(*classes: type) -> str:
    """A pattern of the fully qualified names of `classes` as a whole word: as a Python
    traceback's `module.Class[: message]` line or a Java trace names them; not inside a longer
    name (`varadhi.core.errors.FencedLater`, `x.varadhi.errors.Fenced`)."""
    names = "|".join(re.escape(f"{c.__module__}.{c.__qualname__}") for c in classes)
    return rf"(?<![\w.])(?:{names})(?!\w)"


#: The shard's refusal of a batch while it stops, by class.
_STOP_TEXT = re.compile(_named(errors.StopRequested))
#: The shard's lease found expired by a batch function, by class.
_LEASE_EXPIRED_TEXT = re.compile(_named(errors.LeaseExpired))
#: kafka-python's errors that may pass by itself (`retriable`, as `kafka_clients.transient`
#: reads a raised one) and the product's `KafkaUnavailable`, by class, with the rest of the
#: traceback's line (the message).
_RETRIABLE_KAFKA = tuple(
    c
    for c in vars(kafka.errors).values()
    if isinstance(c, type) and issubclass(c, KafkaError) and getattr(c, "retriable", False)
)
_KAFKA_AWAY_TEXT = re.compile(_named(errors.KafkaUnavailable, *_RETRIABLE_KAFKA) + r".*")

#: Java exceptions that say a newer instance holds the shard: its transactional producer's id was
#: taken over. Not Kafka's other "fenced" errors: `FencedLeaderEpochException` (a partition's
#: leader changed; the client retries), `FencedInstanceIdException`, `TransactionCoordinator-
#: FencedException` say nothing about this shard's instance.
FENCED_JAVA = frozenset({"org.apache.kafka.common.errors.ProducerFencedException"})
#: The same by fully qualified name, as a whole word of the text (a Python traceback's
#: `module.Class: message` line, as a batch function's error comes back inside the Java
#: `PythonException`; a Java trace's class): the product's lease fence (`varadhi.core.errors.Fenced`),
#: kafka-python's producer fence, which kafka-python also reports as the cause of a transactional
#: call refused afterwards ("in an error state: [Error 90] ProducerFencedError"; 90 is Kafka's
#: PRODUCER_FENCED), and the Java class.
_FENCED_TEXT = re.compile(
    _named(errors.Fenced, ProducerFencedError)
    + "".join(rf"|(?<![\w.]){re.escape(name)}(?!\w)" for name in sorted(FENCED_JAVA))
    + r"|in an error state: \[Error 90\] ProducerFencedError(?!\w)"
)


def fenced(chain: tuple[Link, ...], text: str) -> bool:
    """Whether `chain` and `text` report this shard fenced, by the exact exception classes above
    (pure): a substring such as "Fenced" is not enough (a leader change's
    `FencedLeaderEpochException` is a retriable failure, not a fence)."""
    return any(c.class_name in FENCED_JAVA for c in chain) or bool(_FENCED_TEXT.search(text))


def _is_kafka_metrics_npe(link: Link) -> bool:
    return link.class_name == "java.lang.NullPointerException" and any(
        "KafkaMicroBatchStream" in cls and method == "metrics" for cls, method in link.frames
    )


_RESOURCE_OF = {
    "TopicAuthorizationFailedError": "Topic",
    "GroupAuthorizationFailedError": "Group",
    "TransactionalIdAuthorizationFailedError": "TransactionalId",
    "ClusterAuthorizationFailedError": "Cluster",
}

#: A `NotAuthorized` message (errors.py) inside a longer text.
_NAMED = re.compile(
    r"not authorized: (?P<who>User:\S+|this principal) lacks (?P<op>\w+(?: or \w+)*) on "
    r"(?P<kind>Topic|Group|TransactionalId|Cluster) (?P<name>\S+) \(kafka-acls\.sh "
)
_PYTHON = re.compile(r"kafka\.errors\.(\w+AuthorizationFailedError): \[Error \d+\] \w+: (.*)")
_JAVA_TOPICS = re.compile(
    r"TopicAuthorizationException: Not authorized to access topics: \[([^\]]*)\]"
)
_JAVA_GROUP = re.compile(r"GroupAuthorizationException: Not authorized to access group: (\S+)")


def denied_in(text: str) -> Denied | None:
    """The missing ACL reported in `text` (a failed Spark job's or query's message, with its
    Python traceback and Java causes), or None. A `NotAuthorized` line wins over a kafka-python
    error, which wins over the Java client's (whose text names the least)."""
    if "uthoriz" not in text:  # Authorization..., "not authorized"
        return None
    named = _NAMED.search(text)
    if named:
        who = named.group("who")
        return Denied("varadhi", named.group("kind"), named.group("name"), named.group("op"),
                      None if who == "this principal" else who)  # fmt: skip
    python = _PYTHON.search(text)
    if python:
        kind = _RESOURCE_OF.get(python.group(1), "Topic")
        name = re.sub(r"[{}'\[\]\s]", "", python.group(2))
        operation = (
            "Write" if kind == "TransactionalId" else _client_operation(text[: python.start()])
        )
        return Denied("kafka-python", kind, "kafka-cluster" if kind == "Cluster" else name,
                      operation)  # fmt: skip
    topics = _JAVA_TOPICS.search(text)
    if topics:
        return Denied("java", "Topic", topics.group(1))
    group = _JAVA_GROUP.search(text)
    if group:
        return Denied("java", "Group", group.group(1), "Read")
    return None


def resource_of(error: BaseException) -> str:
    """The resource type a kafka-python authorization error is about (Topic by default)."""
    return _RESOURCE_OF.get(type(error).__name__, "Topic")


def _client_operation(python_traceback: str) -> str:
    """Write or Read by the kafka-python client whose frame comes last in the traceback."""
    producer = python_traceback.rfind("kafka/producer/")
    consumer = python_traceback.rfind("kafka/consumer/")
    if producer < 0 and consumer < 0:
        return "Describe"
    return "Write" if producer > consumer else "Read"


# -- reading the chain --------------------------------------------------------------------------


def links(error: BaseException) -> Iterator[Link]:
    """The cause chain of `error`: each Python exception (following `__cause__`, else
    `__context__`) with, where it carries them, its Java throwable's chain (read through Py4J) or
    the Java stack trace text pyspark or Spark Connect kept, and pyspark's converted causes."""
    seen: set[int] = set()
    pending: list[Any] = [error]
    while pending and len(seen) < MAX_CAUSES:
        e = pending.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        java = getattr(e, "java_exception", None) or getattr(e, "_origin", None)
        if java is not None:
            yield from _java_links(java)
        else:
            yield from _captured_links(e)
        causes = (
            _attr(e, "_cause", "cause"),
            e.__cause__ or (None if e.__suppress_context__ else e.__context__),
        )
        pending.extend(c for c in causes if isinstance(c, BaseException))


def _java_links(throwable: Any) -> Iterator[Link]:
    """A Java throwable's chain through Py4J: class, message, top frames per cause."""
    for _ in range(MAX_CAUSES):
        if throwable is None:
            return
        try:
            frames = []
            for i, frame in enumerate(throwable.getStackTrace()):
                if i >= MAX_FRAMES:
                    break
                frames.append((str(frame.getClassName()), str(frame.getMethodName())))
            yield Link(
                str(throwable.getClass().getName()),
                str(throwable.getMessage() or ""),
                tuple(frames),
            )
            throwable = throwable.getCause()
        except Exception:  # noqa: BLE001 - the JVM is gone: the Python text still tells
            return


def _captured_links(e: BaseException) -> Iterator[Link]:
    """The links of a pyspark captured or Spark Connect exception without a Java object: its
    Java stack trace text, when kept, else its message; any other exception as its type and
    message."""
    trace = _attr(e, "_stackTrace", "stackTrace")
    getter = getattr(e, "getStackTrace", None)  # Spark Connect: the server's, when it sent it
    if trace is None and callable(getter):
        trace = _safe(getter)
    parsed = list(trace_links(str(trace))) if trace else []
    if parsed and parsed[0].class_name:
        yield from parsed  # a whole trace (`Utils.exceptionString`), headed by its class
        return
    message = _attr(e, "_desc", "desc", "_message")
    if message is None:
        message = _safe(lambda: str(e)) or ""
    head = _header(str(message)) or ("", str(message))
    yield Link(head[0], head[1], parsed[0].frames if parsed else (), type(e).__name__)
    yield from parsed[1:]


def trace_links(trace: str) -> Iterator[Link]:
    """The links of a Java stack trace's text (`printStackTrace`, `Utils.exceptionString`, or
    frames alone): a header line `class: message` (the message may go on over several lines),
    its `at class.method(...)` frames, then each `Caused by: ...` the same way. Frames before any
    header form a link with no class."""
    current: tuple[str, list[str], list[tuple[str, str]]] | None = None
    for line in trace.splitlines():
        frame = _FRAME.match(line)
        if frame:
            if current is None:
                current = ("", [], [])
            current[2].append((frame.group(1), frame.group(2)))
        elif _ELIDED.match(line):
            continue
        elif current is None or line.startswith("Caused by: "):
            if current is not None:
                yield _link(current)
            rest = line.removeprefix("Caused by: ")
            name, message = _header(rest) or ("", rest)
            current = (name, [message], [])
        elif not current[2]:  # before the frames: the message goes on
            current[1].append(line)
    if current is not None:
        yield _link(current)


def _link(parts: tuple[str, list[str], list[tuple[str, str]]]) -> Link:
    return Link(parts[0], "\n".join(parts[1]), tuple(parts[2][:MAX_FRAMES]))


_FRAME = re.compile(r"^\s*at\s+([\w$.<>/]+)\.([\w$<>]+)\(")
_ELIDED = re.compile(r"^\s*\.\.\. \d+ more\s*$")
_CLASS = re.compile(r"^([a-z_][\w$]*(?:\.[\w$]+)+)(?::\s?(.*))?$")


def _header(line: str) -> tuple[str, str] | None:
    """(class, message) of a `java.lang.Foo: message` line, or None."""
    found = _CLASS.match(line.strip())
    if found is None:
        return None
    return found.group(1), found.group(2) or ""


def _python_text(error: BaseException) -> str:
    """Python's own report of `error`: its traceback with the errors it was raised from (a
    Py4J error's text is the Java stack trace with its causes)."""
    try:
        return "".join(traceback.format_exception(type(error), error, error.__traceback__))
    except Exception:  # noqa: BLE001 - str() of a Py4J error asks the JVM, which may be gone
        return f"{type(error).__name__}: {error.args!r}"


def _attr(e: object, *names: str) -> Any:
    for name in names:
        value = getattr(e, name, None)
        if value is not None:
            return value
    return None


def _safe(call: Any) -> Any:
    try:
        return call()
    except Exception:  # noqa: BLE001 - a getter that needs a JVM or a server that is gone
        return None
