"""A librdkafka producer whose writes are acknowledged through `Ack`s: the library member's
writer of RQ, DLQ, GroupState and dedup records.

Why. kafka-python's producer builds record batches and runs its network loop in Python: with
10% of attempts failing it was about a fifth of a member's CPU (py-spy, `bench/library.py`).
librdkafka does both in C on its own threads.

Contract.
- `send(topic, key, value, partition, headers)` returns an `Ack` at once (it never raises for a
  write): `add_callback(fn)` runs `fn(None)` once the broker acknowledged the record (at once
  if it already did), `add_errback(fn)` runs `fn(error)` if it is refused; `get(timeout)`
  waits, raises the error, or `TimeoutError`. Records of one partition are written in the
  order sent, each once (`enable.idempotence`).
- The error of a refused write is typed (`write_error`): a missing ACL is `NotAuthorized`
  (Write on the topic), what the client cannot get past by retrying (credentials, TLS,
  `clients.permanent`) or a write that found no broker within `message.timeout.ms` is
  `KafkaUnavailable` with `clients.explain`'s line, a broker's error code the kafka-python
  error of that code, any other (an unknown partition, say) a kafka-python `KafkaError`
  naming the topic and librdkafka's error.
- A permanent failure that librdkafka reports only to its error callback (the credentials
  refused, say: it would retry them without end) fails every write not yet acknowledged,
  and every later one, with that error.
- `flush(timeout)` waits until every write sent so far was acknowledged or refused, else
  raises `TimeoutError`; `close(timeout)` flushes what it can in `timeout` and closes. A write
  still unacknowledged at `close` calls neither of its callbacks.

Hazards. Callbacks run on the producer's I/O thread (one per producer, serving librdkafka's
delivery reports, error and log callbacks and OAUTHBEARER token requests): they must be
thread-safe and must not block. `flush` must not be called from a callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import confluent_kafka
import kafka.errors

from varadhi.core.errors import NotAuthorized
from varadhi.kafka import clients

log = logging.getLogger(__name__)

#: How long the I/O thread waits for librdkafka's next event before it looks whether it is
#: closing or a permanent failure was reported.
POLL_S = 0.1
#: How long `send` waits for room in librdkafka's queue (full: 100,000 records or 1 GiB by
#: default) before the write counts as refused, as kafka-python's `max_block_ms`.
MAX_BLOCK_S = 60.0
#: The most bytes of records librdkafka gathers into one batch of a partition (kafka-python's
#: default; librdkafka's is 1 MB). A topic's `max.message.bytes` bounds a whole batch, and a
#: writer fits each record to that limit (`queue_records.out_record`): a record near it must go
#: in a batch of its own, as it does here (a larger record is always sent alone).
BATCH_BYTES = 16_384
#: How long a record may wait for a broker's acknowledgement, retries included (kafka-python's
#: `delivery_timeout_ms` default; librdkafka's own is 5 minutes).
MESSAGE_TIMEOUT_MS = 120_000


#: librdkafka's errors of a write that found no broker to take it in time.
_NO_BROKER = frozenset(
    {
        confluent_kafka.KafkaError._MSG_TIMED_OUT,
        confluent_kafka.KafkaError._TIMED_OUT,
        confluent_kafka.KafkaError._TRANSPORT,
        confluent_kafka.KafkaError._ALL_BROKERS_DOWN,
    }
)


class Ack:
    """One write's acknowledgement (the module docstring's contract)."""

    __slots__ = ("_lock", "_done", "_error", "_callbacks", "_errbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Any], None]] = []
        self._errbacks: list[Callable[[BaseException], None]] = []

    def add_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        if self._error is None:
            fn(None)

    def add_errback(self, fn: Callable[[BaseException], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._errbacks.append(fn)
                return
        if self._error is not None:
            fn(self._error)

    def get(self, timeout: float | None = None) -> None:
        """Wait for the acknowledgement; raise the write's error, or `TimeoutError`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"a write was not acknowledged within {timeout} s")
        if self._error is not None:
            raise self._error

    def resolve(self, error: BaseException | None) -> None:
        """Acknowledged (`error` None) or refused: run the callbacks once, in this thread."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, errbacks = self._callbacks, self._errbacks
            self._callbacks, self._errbacks = [], []
        if error is None:
            for fn in callbacks:
                fn(None)
        else:
            for fn in errbacks:
                fn(error)


def write_error(settings: clients.HasKafka, topic: str, error: confluent_kafka.KafkaError):
    """The typed error of a write to `topic` that librdkafka refused (module docstring)."""
    code = error.code()
    if code == confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED:
        return NotAuthorized("Write", "Topic", topic, clients.principal(settings))
    if code == confluent_kafka.KafkaError.CLUSTER_AUTHORIZATION_FAILED:
        return NotAuthorized(
            "IdempotentWrite", "Cluster", "kafka-cluster", clients.principal(settings)
        )
    if clients.permanent(error) or code in _NO_BROKER:
        return clients.unavailable(settings, error)
    if code > 0:  # a broker's answer: Kafka's own error code
        return kafka.errors.for_code(code)(f"{topic}: {error.str()}")
    return kafka.errors.KafkaError(f"{topic}: {error.name()}: {error.str()}")


class AckedProducer:
    """See the module docstring. Made by `acked_producer`."""

    def __init__(self, settings: clients.HasKafka, config: dict[str, Any]) -> None:
        self._settings = settings
        self._lock = threading.Condition()
        self._pending: set[Ack] = set()
        self._failure: BaseException | None = None
        self._reported: confluent_kafka.KafkaError | None = None
        self._closing = threading.Event()
        self._closed = False
        try:
            self._producer = confluent_kafka.Producer({**config, "error_cb": self._on_error})
        except confluent_kafka.KafkaException as e:
            raise clients.unavailable(settings, e.args[0]) from None
        self._thread = threading.Thread(target=self._serve, name="varadhi-producer", daemon=True)
        self._thread.start()

    def send(
        self,
        topic: str,
        key: bytes | None = None,
        value: bytes | None = None,
        partition: int | None = None,
        headers: Iterable[tuple[str, bytes]] | None = None,
    ) -> Ack:
        ack = Ack()
        with self._lock:
            failure = self._failure
            if failure is None:
                self._pending.add(ack)
        if failure is not None:
            ack.resolve(failure)
            return ack
        deadline = time.monotonic() + MAX_BLOCK_S
        while True:
            try:
                self._producer.produce(
                    topic,
                    value=value,
                    key=key,
                    partition=-1 if partition is None else partition,
                    headers=list(headers) if headers else None,
                    on_delivery=lambda error, _msg: self._delivered(ack, topic, error),
                )
                return ack
            except BufferError:  # librdkafka's queue is full: the I/O thread drains it
                if time.monotonic() >= deadline:
                    self._finish(ack, TimeoutError(f"no room to write to {topic}"))
                    return ack
                time.sleep(0.01)
            except confluent_kafka.KafkaException as e:
                self._finish(ack, write_error(self._settings, topic, e.args[0]))
                return ack

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write sent so far was acknowledged or refused."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"{len(self._pending)} writes not acknowledged within {timeout} s"
                    )
                self._lock.wait(left)

    def close(self, timeout: float | None = None) -> None:
        """Flush what can be in `timeout`, then stop the I/O thread and close the client. What
        librdkafka still holds is purged first: its close would otherwise wait for it, up to
        `message.timeout.ms` (a cluster that refuses the login or is gone: 2 minutes)."""
        if self._closed:
            return
        try:
            self.flush(timeout)
        except TimeoutError as e:
            log.warning("producer closed with writes unacknowledged: %s", e)
        self._closing.set()
        self._thread.join()
        self._producer.purge(in_queue=True, in_flight=True, blocking=False)
        self._producer.close()
        self._closed = True

    # -- the I/O thread -------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closing.is_set():
            self._producer.poll(POLL_S)
            if self._reported is not None and self._failure is None:
                self._fail_all(clients.unavailable(self._settings, self._reported))

    def _on_error(self, error: confluent_kafka.KafkaError) -> None:
        if self._reported is None and clients.permanent(error):
            self._reported = error  # explained by `_serve`, not in librdkafka's callback

    def _delivered(self, ack: Ack, topic: str, error: confluent_kafka.KafkaError | None) -> None:
        self._finish(ack, None if error is None else write_error(self._settings, topic, error))

    def _finish(self, ack: Ack, error: BaseException | None) -> None:
        ack.resolve(error)
        with self._lock:
            self._pending.discard(ack)
            if not self._pending:
                self._lock.notify_all()

    def _fail_all(self, failure: BaseException) -> None:
        with self._lock:
            self._failure = failure
            pending, self._pending = self._pending, set()
            self._lock.notify_all()
        log.error("the producer cannot write: %s", failure)
        for ack in pending:
            ack.resolve(failure)


def acked_producer(settings: clients.HasKafka, **config: Any) -> AckedProducer:
    """A librdkafka producer of the cluster (`AckedProducer`): the bootstrap servers, the
    security properties of `KafkaConfig.librdkafka_config()`, idempotent writes, a record's
    acknowledgement awaited up to `MESSAGE_TIMEOUT_MS`, batches of `BATCH_BYTES`, then the caller's librdkafka properties
    (`linger.ms`, `message.max.bytes`, ...; dotted names as `**{"linger.ms": 10}`). An
    OAUTHBEARER provider is asked for its first token here, so that its own typed error is
    raised; a producer librdkafka cannot create raises `KafkaUnavailable` with `explain`'s
    line. Nothing connects here."""
    if "error_cb" in config:
        raise TypeError("acked_producer's error_cb is its own")
    merged = {
        "enable.idempotence": True,
        "message.timeout.ms": MESSAGE_TIMEOUT_MS,
        "batch.size": BATCH_BYTES,
        **clients.librdkafka_base(settings),
        **config,
    }
    return AckedProducer(settings, merged)
