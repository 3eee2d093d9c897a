"""Every Kafka client of the product is built here, from `Settings` (bootstrap servers and the
`KafkaConfig` of `lib/varadhi/kafka/config.py`).

`consumer`, `producer` and `admin` return kafka-python clients with the configured security
(TLS, SASL); `fetch_consumer` a librdkafka (confluent-kafka) consumer with the same security,
for the library runtime's fetching; `spark_options` gives the Spark Kafka sink's `kafka.*`
options and `spark_source_options` the source's. A client that cannot be created (nothing
listens, TLS refused, wrong credentials) raises `KafkaUnavailable` with one line saying which,
within the client's timeout, secrets never included (librdkafka's client connects later:
`FetchConsumer.failure` gives that line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Protocol

import confluent_kafka
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.errors import (
    AuthorizationError,
    BrokerResponseError,
    IllegalSaslStateError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailedError,
    TopicAuthorizationFailedError,
    UnknownTopicOrPartitionError,
    UnsupportedSaslMechanismError,
)

from varadhi.core.errors import KafkaUnavailable, NotAuthorized, NotFound
from varadhi.kafka import jvm_errors
from varadhi.kafka.config import PLAINTEXT, KafkaConfig

#: How long a client waits for the cluster's first answer (its bootstrap).
CONNECT_TIMEOUT_MS = 10_000
#: What a client's bootstrap failures say when the cause is authentication, not the network.
_AUTH_FAILURE = r"Authentication|Authorization|UnsupportedSaslMechanism"
#: TLS alerts of a broker refusing the client's certificate (or its absence): mutual TLS.
#: Python's ssl names them `SSLV3_ALERT_BAD_CERTIFICATE`, OpenSSL's text (librdkafka's errors)
#: `ssl/tls alert bad certificate`.
_CERT_REFUSED = re.compile(
    r"ALERT[_ ](BAD[_ ]CERTIFICATE|CERTIFICATE[_ ]REQUIRED|CERTIFICATE[_ ]UNKNOWN|UNKNOWN[_ ]CA)",
    re.IGNORECASE,
)
#: A broker's refusal of the SASL credentials: kafka-python's error, librdkafka's text.
_SASL_REFUSED = re.compile(r"SaslAuthenticationFailed|SASL authentication error")


class HasKafka(Protocol):
    bootstrap: str
    kafka: KafkaConfig


def transient(error: BaseException) -> bool:
    """Whether a Kafka error may pass by itself, so that a caller may try again: the product's
    timeout (`KafkaUnavailable`) or an error the client marks retriable (a timeout, a connection
    lost or refused, a leader moving). Not an authorization or configuration error (pure)."""
    if isinstance(error, KafkaUnavailable):
        return True
    return isinstance(error, KafkaError) and bool(getattr(error, "retriable", False))


def config_of(settings: HasKafka) -> KafkaConfig:
    return getattr(settings, "kafka", None) or PLAINTEXT


def connection_kwargs(settings: HasKafka) -> dict[str, Any]:
    """bootstrap_servers and the security arguments of kafka-python's clients."""
    return {"bootstrap_servers": settings.bootstrap, **config_of(settings).python_kwargs()}


def spark_options(settings: HasKafka) -> dict[str, str]:
    """The Spark Kafka source/sink options: kafka.bootstrap.servers and the security ones."""
    return {"kafka.bootstrap.servers": settings.bootstrap, **config_of(settings).spark_options()}


#: The Spark Kafka source's `fetch.max.wait.ms` (a consumer property; a configuration cannot
#: set it, it is not one of `varadhi.kafka.config.KNOWN`): 0, the broker answers a fetch at once.
#: - After every poll, Spark's consumer asks the broker for the partition's offset range
#:   (`InternalKafkaConsumer.getAvailableOffsetRange`). By then the consumer has already sent its
#:   next fetch, which the broker holds until new records arrive or this time passes, and a broker
#:   answers one connection's requests in order.
#: - With Kafka's default (500 ms), a task waited up to 500 ms for each partition it read when no
#:   new record came in meanwhile: every batch of a quiet subscription, and the last batch before
#:   traffic stops (2.2 s for 4 partitions in one task, in `bench/delivery.py --only latency`).
#: - With traffic, it waits for the next record: at 1,000 msg/s over 4 partitions, a task's
#:   first records reached Python 41 ms after it started with a 10 ms wait, 19 ms with 1 ms and
#:   13 ms with 0 (docs/benchmarks.md, "Latency").
#: - Spark polls only for offsets it planned (the latest under read_committed), so an immediate
#:   answer adds no polling loop: at most one empty fetch answered sooner, per poll. Hazard: a
#:   fetch of offsets the broker cannot serve yet (a follower behind its leader, with `client.rack`)
#:   is asked again at once, for as long as that lasts, rather than once per wait.
SOURCE_FETCH_MAX_WAIT_MS = 0


def spark_source_options(settings: HasKafka) -> dict[str, str]:
    """The Spark Kafka source's options: `spark_options` and `kafka.fetch.max.wait.ms`
    (`SOURCE_FETCH_MAX_WAIT_MS`). Not for the sink: its producer would warn about a consumer
    property."""
    return {**spark_options(settings), "kafka.fetch.max.wait.ms": str(SOURCE_FETCH_MAX_WAIT_MS)}


class _Failures(logging.Handler):
    """Collects kafka-python's connection failures while a client bootstraps (it retries them
    until its timeout and then reports only the timeout)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.args and isinstance(record.args, tuple):
            for arg in record.args:
                if isinstance(arg, BaseException):
                    self.seen.append(f"{type(arg).__name__}: {arg}")
        # The broker's answer to the SASL handshake (e.g. UnsupportedSaslMechanismError) is only
        # logged by the connection; the broker then closes it, and the manager's own failure
        # may be just "socket disconnected".
        if isinstance(record.msg, str) and "SaslHandshake failed" in record.msg:
            self.seen.append(record.getMessage())


@contextlib.contextmanager
def _watching() -> Iterator[_Failures]:
    logger = logging.getLogger("kafka.net.manager")
    network = logging.getLogger("kafka.net")
    handler, quiet = _Failures(), logging.NullHandler()
    level, propagate = logger.level, network.propagate
    network.addHandler(handler)  # kafka.net.manager's and kafka.net.connection's records
    if logger.getEffectiveLevel() >= logging.WARNING:  # not --verbose
        logger.setLevel(logging.WARNING)
        # Collected, not logged: they end in the client's one-line error (KafkaUnavailable).
        # Hazard: kafka.net records of other clients of this process are not logged meanwhile.
        network.propagate = False
        network.addHandler(quiet)
    try:
        yield handler
    finally:
        network.removeHandler(handler)
        logger.setLevel(level)
        network.removeHandler(quiet)
        network.propagate = propagate


#: How often a client is built when a SASL connection closes with no answer read (`_build`).
SASL_CLOSE_TRIES = 4


def _build(cls: type, settings: HasKafka, kwargs: dict[str, Any]) -> Any:
    """A kafka-python client, or `KafkaUnavailable` with one line saying why not.

    A broker that refuses SASL credentials answers, then closes the connection (after
    `connection.failed.authentication.delay.ms`, 100 ms by default); a client whose event loop
    is held up that long sees the close first and reports only "socket disconnected"; a broker
    refusing a mechanism its listener does not offer may close before its answer is read, too
    (seen about once in eight tries on a quiet machine); and on a client held up for seconds (a
    CI run on an overloaded machine) the TLS and SASL exchanges outlasted the bootstrap's
    `CONNECT_TIMEOUT_MS`, "SASL Authentication timed out", where the broker would have refused
    the password. Such a failure on a SASL connection is therefore tried up to
    `SASL_CLOSE_TRIES` times before it is reported."""
    args = {"bootstrap_timeout_ms": CONNECT_TIMEOUT_MS, **connection_kwargs(settings)}
    args.update(kwargs)
    for attempt in range(1, SASL_CLOSE_TRIES + 1):
        with _watching() as failures:
            try:
                return cls(**args)
            except KafkaError as e:
                # a broker's refusal; not "SASL Authentication timed out", which is no answer
                auth = [
                    f for f in failures.seen if re.search(_AUTH_FAILURE, f) and "timed out" not in f
                ]
                # the last entry is often the bootstrap timeout itself: the one before says why
                why = [
                    f
                    for f in failures.seen
                    if not f.startswith("KafkaTimeoutError") or "SASL Authentication" in f
                ]
                # the broker refusing the client's certificate, in any try: a later try's
                # connection error (a refused connect, seen in CI while the broker answered)
                # would hide it
                cert = [f for f in failures.seen if _CERT_REFUSED.search(f)]
                cut_short = _sasl_cut_short(settings, failures.seen)
                if attempt < SASL_CLOSE_TRIES and not auth and cut_short:
                    continue
                cause = (auth or cert or why or [None])[-1]
                raise KafkaUnavailable(explain(settings, cause or e)) from None
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _sasl_cut_short(settings: HasKafka, failures: list[str]) -> bool:
    """A SASL exchange ended without an answer the client read: the broker closed the
    connection first, or the exchange outlasted the bootstrap's time (see `_build`)."""
    return config_of(settings).mechanism is not None and any(
        "socket disconnected" in f or "SASL Authentication timed out" in f for f in failures
    )


def end_transaction(producer: Any, *, commit: bool, timeout_s: float, what: str) -> None:
    """Commit (`commit`) or abort `producer`'s open transaction, waiting `timeout_s` at most;
    raises the producer's error, or `KafkaTimeoutError` (retriable: `transient`) when the call
    did not end in time. `what` names the transaction in that error.

    kafka-python's `commit_transaction` and `abort_transaction` wait without a limit (Java's end
    at `max.block.ms`): a broker gone inside the transaction held the caller for ever (a shard's
    catalog write in a three-node run with a broker killed). After a timeout the outcome is
    unknown, so the caller must discard the producer (it is stuck in the call) and must not say
    that nothing was committed; a new producer with the same transactional id waits in
    `init_transactions` for the broker's verdict on the old transaction.

    Hazard: the thread that made the call stays blocked until kafka-python ends it, if ever: one
    idle daemon thread for each transaction lost so."""
    done = threading.Event()
    failure: list[BaseException] = []
    verb = "commit" if commit else "abort"

    def end() -> None:
        try:
            producer.commit_transaction() if commit else producer.abort_transaction()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=end, name=f"varadhi-{verb}-transaction", daemon=True).start()
    if not done.wait(timeout_s):
        raise KafkaTimeoutError(
            f"{what}: the transaction's {verb} did not end in {timeout_s:g} s; whether it "
            "committed is the broker's to say"
        )
    if failure:
        raise failure[0]


def consumer(settings: HasKafka, **kwargs: Any) -> KafkaConsumer:
    return _build(KafkaConsumer, settings, kwargs)


def producer(settings: HasKafka, **kwargs: Any) -> KafkaProducer:
    made = _build(_Producer, settings, kwargs)
    made._settings = settings
    return made


_process_producers: dict[tuple[int, str, KafkaConfig, str], KafkaProducer] = {}
_process_producers_lock = threading.Lock()


def process_producer(settings: HasKafka, client_id: str, **kwargs: Any) -> KafkaProducer:
    """The process's one producer for this cluster and `client_id`, made with `kwargs` on first
    use. For writers made per task (the delivery journal, the trace): a Spark worker runs many
    tasks one after another, and a new producer costs a connection and a metadata round trip.
    Keyed by pid, so a forked worker never uses its parent's. Hazard: `kwargs` of a later call
    with the same key are ignored."""
    with _process_producers_lock:
        key = (os.getpid(), settings.bootstrap, config_of(settings), client_id)
        made = _process_producers.get(key)
        if made is None:
            made = producer(settings, client_id=client_id, **kwargs)
            _process_producers[key] = made
        return made


def admin(settings: HasKafka, **kwargs: Any) -> KafkaAdminClient:
    return _build(KafkaAdminClient, settings, kwargs)


#: librdkafka's error codes of a broker refusing the client's credentials (retried without end).
_RDKAFKA_REFUSED = frozenset(
    {
        confluent_kafka.KafkaError._AUTHENTICATION,
        confluent_kafka.KafkaError.SASL_AUTHENTICATION_FAILED,
    }
)
#: librdkafka's text of a TLS handshake that can never succeed: the broker's certificate not
#: trusted, or the broker refusing the client's (`_CERT_REFUSED`).
_TLS_REFUSED = re.compile(f"certificate verify failed|{_CERT_REFUSED.pattern}", re.IGNORECASE)
#: librdkafka's `_AUTHENTICATION` text when the `oauth_cb` raised (the token endpoint not
#: answering, say): librdkafka keeps its session and asks again later, as kafka-python would.
_TOKEN_NOT_HAD = "Failed to acquire SASL OAUTHBEARER token"
#: The tail of librdkafka's connection errors: `(after 302ms in state AUTH_REQ)`.
_RDKAFKA_STATE = re.compile(r" \(after \d+ms in state \w+\)$")


def permanent(error: confluent_kafka.KafkaError) -> bool:
    """Whether a librdkafka error reports what its retrying will not get past: fatal, the
    credentials refused, or a TLS handshake refused by either side. Not an unreachable or
    restarting broker (`_TRANSPORT`, `_ALL_BROKERS_DOWN` without a TLS refusal), nor a token
    the OAUTHBEARER provider could not get this time (pure)."""
    text = error.str() or ""
    return (
        error.fatal()
        or (error.code() in _RDKAFKA_REFUSED and _TOKEN_NOT_HAD not in text)
        or bool(_TLS_REFUSED.search(text))
    )


def unavailable(settings: HasKafka, error: confluent_kafka.KafkaError) -> KafkaUnavailable:
    """The typed error for what librdkafka reported (`_AUTHENTICATION`,
    `SASL_AUTHENTICATION_FAILED`, `_TRANSPORT`, `_ALL_BROKERS_DOWN`, ...): `KafkaUnavailable`
    with `explain`'s line, as for kafka-python's clients (probes the first bootstrap server)."""
    text = _RDKAFKA_STATE.sub("", error.str() or "")
    return KafkaUnavailable(explain(settings, f"{error.name()}: {text}"))


#: The Python logger of librdkafka's log lines (served by a fetch consumer's poll/consume).
RDKAFKA_LOGGER = "varadhi.kafka.rdkafka"


class FetchConsumer(confluent_kafka.Consumer):
    """A librdkafka consumer (`fetch_consumer`) that remembers the first failure its client
    cannot get past by retrying (`permanent`), which librdkafka reports only to `error_cb`
    and otherwise retries without end: a consume loop calls `failure()` and raises it.

    Hazard: librdkafka reports errors, and asks for OAUTHBEARER tokens, only from the
    consumer's `poll`/`consume` calls; a consumer not polled notices nothing."""

    def __init__(self, settings: HasKafka, config: dict[str, Any]) -> None:
        self._settings = settings
        self._failed: confluent_kafka.KafkaError | None = None
        self._failure: KafkaUnavailable | None = None
        super().__init__({**config, "error_cb": self._on_error})

    def _on_error(self, error: confluent_kafka.KafkaError) -> None:
        if self._failed is None and permanent(error):
            self._failed = error  # explained in `failure`, not in librdkafka's callback

    def failure(self) -> KafkaUnavailable | None:
        """The typed error of the first permanent failure librdkafka reported (`unavailable`'s
        line, made on the first call after it: `explain` probes the cluster), or None."""
        if self._failed is not None and self._failure is None:
            self._failure = unavailable(self._settings, self._failed)
        return self._failure


def librdkafka_base(settings: HasKafka) -> dict[str, Any]:
    """The properties every librdkafka client of the cluster starts from: the bootstrap
    servers, the `RDKAFKA_LOGGER` logger and the security properties of
    `KafkaConfig.librdkafka_config()`. An OAUTHBEARER provider is asked for its first token
    here, so that its own typed error (`TokenError`, `KafkaConfigError`) is raised, not
    confluent-kafka's."""
    security = config_of(settings).librdkafka_config()
    if "oauth_cb" in security:
        security["oauth_cb"](None)
    return {
        "bootstrap.servers": settings.bootstrap,
        "logger": logging.getLogger(RDKAFKA_LOGGER),
        **security,
    }


def fetch_consumer(settings: HasKafka, **config: Any) -> FetchConsumer:
    """A librdkafka consumer of the cluster: the bootstrap servers, the security properties of
    `KafkaConfig.librdkafka_config()`, then the caller's librdkafka properties (`group.id`,
    `isolation.level`, `enable.auto.commit`, ...; pass dotted names as `**{"group.id": g}`).
    Its `error_cb` is its own (`FetchConsumer.failure`); librdkafka's log lines go to the
    `RDKAFKA_LOGGER` Python logger unless the caller names a `logger`.

    Nothing connects here (librdkafka connects in the background); an OAUTHBEARER provider is
    asked for its first token here, so that its own typed error (`TokenError`,
    `KafkaConfigError`) is raised, not confluent-kafka's. A consumer librdkafka cannot create
    (a key it cannot decrypt, a property it does not know) raises `KafkaUnavailable` with
    `explain`'s line. Hazard: with OAUTHBEARER, confluent-kafka's construction waits about
    a second for librdkafka to take the token."""
    if "error_cb" in config:
        raise TypeError("fetch_consumer's error_cb is its own: read FetchConsumer.failure()")
    try:
        return FetchConsumer(settings, {**librdkafka_base(settings), **config})
    except confluent_kafka.KafkaException as e:
        raise unavailable(settings, e.args[0]) from None


def explain(settings: HasKafka, error: BaseException | str) -> str:
    """One line: what failed connecting to the cluster (probes the first bootstrap server)."""
    cfg = config_of(settings)
    where = f"Kafka at {settings.bootstrap} ({cfg.summary()})"
    cause = probe(settings)
    if cause is None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        cause = cfg.redact(text)
        offered = offered_mechanisms(settings) if cfg.mechanism else None
        if offered is not None and cfg.mechanism not in offered:
            cause = _not_offered(cfg.mechanism, offered)
        elif _SASL_REFUSED.search(text):
            cause = (
                "authentication failed (wrong user name, password or mechanism): "
                + re.split(r"(?i)error: ", cause)[-1]
            )
        elif "UnsupportedSaslMechanism" in text:
            cause = _not_offered(cfg.mechanism, offered)
        elif _CERT_REFUSED.search(text):
            cause = (
                "the broker requires a client certificate (mutual TLS) and none is configured: "
                "set ssl.keystore.location to a PEM file with the client's key and certificate"
                if not cfg.get("ssl.keystore.location")
                else "the broker did not accept the client certificate in ssl.keystore.location "
                "(not signed by a CA the broker trusts, or expired)"
            ) + f" ({cause.rsplit('] ', 1)[-1]})"
    return f"cannot connect to {where}: {cause}"


#: Broker answers that belong to a login: `explain` tells them (they stop a client as a failing
#: connection does), not `failure`'s "refused".
_LOGIN_ANSWERS = (
    SaslAuthenticationFailedError,
    UnsupportedSaslMechanismError,
    IllegalSaslStateError,
)


def failure(settings: HasKafka, error: BaseException) -> str:
    """One line for a Kafka error that stops a client. A broker that answered a request with an
    error (kafka-python's `BrokerResponseError`: a join asking for a session timeout outside the
    broker's range, a record too large) refused it: `Kafka at ... refused a request: <error>`,
    without probing the connection, which works. Anything else (no broker, a login or TLS
    refused) is a failure to connect: `explain`."""
    if isinstance(error, BrokerResponseError) and not isinstance(error, _LOGIN_ANSWERS):
        what = f"{type(error).__name__}: {getattr(error, 'description', '') or error}"
        return f"Kafka at {settings.bootstrap} refused a request: {what}"
    return explain(settings, error)


def _not_offered(mechanism: str | None, offered: Sequence[str] | None) -> str:
    listed = f" (it offers {', '.join(offered) or 'none'})" if offered is not None else ""
    return (
        f"the listener does not offer sasl.mechanism {mechanism}{listed}: check the mechanism, "
        f"and the port (clusters often have one port per mechanism)"
    )


def probe(settings: HasKafka, timeout: float = 5.0) -> str | None:
    """Why the first bootstrap server cannot be used, or None when TCP (and TLS) work: nothing
    listening, TLS refused or the broker's certificate not trusted (a SASL failure is reported
    by the caller's own error)."""
    opened = _open(settings, timeout)
    if isinstance(opened, str):
        return opened
    with opened as sock:
        if not config_of(settings).uses_tls:
            return _speaks_tls(sock, _first_server(settings)[1], timeout)
    return None


def _first_server(settings: HasKafka) -> tuple[str, str, str]:
    """The first bootstrap server: as written, its host, its port."""
    first = settings.bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    return first, host.strip("[]"), port


def _open(settings: HasKafka, timeout: float) -> socket.socket | str:
    """A connection to the first bootstrap server, in TLS when the configuration says so, or
    one line saying why there is none. The caller closes it."""
    cfg = config_of(settings)
    first, host, port = _first_server(settings)
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError) as e:
        return f"nothing answers at {first} ({getattr(e, 'strerror', None) or e})"
    if not cfg.uses_tls:
        return sock
    context = ssl.create_default_context(cafile=cfg.get("ssl.truststore.location"))
    context.check_hostname = bool(cfg.get("ssl.endpoint.identification.algorithm", "https"))
    if not context.check_hostname:
        context.verify_mode = ssl.CERT_REQUIRED
    try:
        tls = context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        sock.close()
        return (
            f"the broker's TLS certificate is not trusted: {e.verify_message} (check "
            f"ssl.truststore.location{' and the host name' if 'match' in str(e) else ''})"
        )
    except (ssl.SSLError, OSError) as e:
        sock.close()
        return f"TLS handshake failed ({e}); is this a TLS listener?"
    tls.settimeout(timeout)
    return tls


#: Kafka's SaslHandshake request (api key 17), version 1: answered with an error code and the
#: mechanisms the listener offers. Not flexible (no tagged fields), so its encoding is fixed.
_SASL_HANDSHAKE_KEY, _SASL_HANDSHAKE_VERSION = 17, 1


def offered_mechanisms(settings: HasKafka, timeout: float = 5.0) -> tuple[str, ...] | None:
    """The SASL mechanisms the first bootstrap server's listener offers, read from its answer to
    a SaslHandshake naming the configured mechanism; None when there is no such answer (nothing
    listens, TLS fails, not a SASL listener, a timeout).

    Why not kafka-python's own error: a broker refusing a mechanism answers and then closes the
    connection, and kafka-python sometimes sees the close before it reads the answer ("socket
    disconnected", seen in CI after four tries). A blocking read of the answer here gets it
    whenever it was sent."""
    mechanism = config_of(settings).mechanism or ""
    opened = _open(settings, timeout)
    if isinstance(opened, str):
        return None
    client_id, name = b"varadhi-probe", mechanism.encode()
    body = struct.pack(
        f">hhih{len(client_id)}sh{len(name)}s",
        _SASL_HANDSHAKE_KEY, _SASL_HANDSHAKE_VERSION, 1, len(client_id), client_id, len(name), name,
    )  # fmt: skip
    try:
        with opened as sock:
            sock.sendall(struct.pack(">i", len(body)) + body)
            (size,) = struct.unpack(">i", _read_exact(sock, 4))
            return _parse_handshake_answer(_read_exact(sock, size))
    except (OSError, ValueError, struct.error):
        return None


def _parse_handshake_answer(answer: bytes) -> tuple[str, ...]:
    """The mechanisms of a SaslHandshake v1 answer (correlation id, error code, array of
    strings); `ValueError`/`struct.error` when it is not one (pure)."""
    _correlation, _error, count = struct.unpack_from(">ihi", answer)
    at, mechanisms = 10, []
    for _ in range(count):
        (size,) = struct.unpack_from(">h", answer, at)
        mechanisms.append(answer[at + 2 : at + 2 + size].decode())
        at += 2 + size
    if at != len(answer):
        raise ValueError(f"a SaslHandshake answer of {len(answer)} bytes, {at} read")
    return tuple(mechanisms)


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ValueError("the connection closed before the answer's end")
        data += chunk
    return data


def _speaks_tls(sock: socket.socket, host: str, timeout: float) -> str | None:
    """A plaintext client's hint: the listener answers a TLS handshake."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        sock.settimeout(timeout)
        with context.wrap_socket(sock, server_hostname=host):
            return "the listener speaks TLS: set security.protocol=SSL or SASL_SSL"
    except (ssl.SSLError, OSError):
        return None


#: How long `topic_configs` waits for a topic the broker does not describe yet (one just
#: created: the controller has it, the broker answering may not).
TOPIC_CONFIGS_WAIT_S = 10.0


def topic_configs(
    admin: KafkaAdminClient,
    settings: HasKafka | None,
    names: Sequence[str],
    keys: Sequence[str],
    wait_s: float = TOPIC_CONFIGS_WAIT_S,
) -> dict[str, dict[str, str]]:
    """Each topic's effective values of `keys` (its own or the broker's default):
    name -> key -> value.

    Hazard: kafka-python's `describe_configs` drops each resource's error code, so a topic the
    answering broker does not know yet, or may not describe, comes back with no configs at all.
    Such topics are asked again until `wait_s` has passed; then the cause is found with
    `describe_topics` and raised: `NotAuthorized` (Describe, or DescribeConfigs on the topic)
    or `NotFound` (`settings` only names the principal; None when unknown)."""
    found: dict[str, dict[str, str]] = {}
    missing = list(dict.fromkeys(names))
    deadline = time.monotonic() + wait_s
    while True:
        answer = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n, configs=list(keys)) for n in missing],
            config_filter="all",
        ).get("topic", {})
        for n in missing:
            configs = answer.get(n) or {}
            if all(k in configs for k in keys):
                found[n] = {k: configs[k]["value"] for k in keys}
        missing = [n for n in missing if n not in found]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for described in admin.describe_topics(missing) if missing else ():
        name, code = described["name"], described.get("error_code")
        if code == TopicAuthorizationFailedError.errno:
            raise NotAuthorized("Describe", "Topic", name, principal(settings))
        if code == UnknownTopicOrPartitionError.errno:
            raise NotFound("Kafka topic", name)
        raise NotAuthorized("DescribeConfigs", "Topic", name, principal(settings))
    return found


def principal(settings: HasKafka | None) -> str | None:
    """`User:<name>` of the configured SASL user (None without SASL)."""
    user = config_of(settings).username
    return f"User:{user}" if user else None


def refused(
    settings: HasKafka, error: BaseException, operation: str, name: str | None = None
) -> NotAuthorized:
    """The typed error for a kafka-python authorization failure met doing `operation` on `name`
    (default: the resource kafka-python names, e.g. the topic of a refused produce)."""
    kind = jvm_errors.resource_of(error)
    if name is None:
        args = [a for a in getattr(error, "args", ()) if a]
        first = args[0] if args else "?"
        name = ",".join(sorted(first)) if isinstance(first, (set, list, tuple)) else str(first)
    return NotAuthorized(operation, kind, "kafka-cluster" if kind == "Cluster" else name,
                         principal(settings))  # fmt: skip


def refused_in(settings: HasKafka, text: str, writes: Collection[str] = ()) -> NotAuthorized | None:
    """The typed error for an authorization failure reported in `text` (a failed Spark query's
    message, with its Python traceback and Java causes), or None when it reports none
    (`jvm_errors.denied_in` reads it).

    - A `NotAuthorized` line in `text` (raised by the product inside a Spark query, e.g. in a
      `foreachBatch` function) is taken as it is.
    - A kafka-python error in a traceback names its resource; its operation is taken from the
      client that raised it (a producer: Write, a consumer: Read).
    - Kafka's Java client (the Spark Kafka source and sink) names only the topics
      (`Not authorized to access topics: [...]`), and its error carries no stack of its own, so
      the text cannot tell a refused read from a refused write. `writes` are the topics the
      failed action wrote and did not read (its caller knows them): a refusal naming only such
      topics is Write; any other is "Describe or Read"."""
    denied = jvm_errors.denied_in(text)
    return None if denied is None else as_error(settings, denied, writes)


def refusal(
    settings: HasKafka, error: BaseException, writes: Collection[str] = ()
) -> NotAuthorized | None:
    """The missing ACL that `error` reports, itself or through the errors it was raised from
    (a Spark job's Py4J error with Kafka's Java message, a wrapped kafka-python error with its
    traceback), as the typed error; None when it reports none, and when `error` already is a
    `NotAuthorized`. `writes`: as for `refused_in`."""
    if isinstance(error, NotAuthorized):
        return None
    denied = jvm_errors.classify(error).of(jvm_errors.Denied)
    return None if denied is None else as_error(settings, denied, writes)


def as_error(
    settings: HasKafka, denied: jvm_errors.Denied, writes: Collection[str] = ()
) -> NotAuthorized:
    """The `NotAuthorized` error of a refusal found in a failure (`refused_in` tells the
    rules): the principal is the one `settings` configure, unless a product's line named one."""
    if denied.by == "varadhi":
        return NotAuthorized(denied.operation or "Describe or Read", denied.resource_type,
                             denied.name, denied.principal)  # fmt: skip
    operation = denied.operation
    if operation is None:  # the Java client's topics: written only, or maybe read
        refused_topics = {t.strip() for t in denied.name.split(",")}
        operation = "Write" if refused_topics <= set(writes) else "Describe or Read"
    return NotAuthorized(operation, denied.resource_type, denied.name, principal(settings))


class _Producer(KafkaProducer):
    """A KafkaProducer whose `init_transactions` names the refused transactional id."""

    _settings: HasKafka

    def init_transactions(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().init_transactions(*args, **kwargs)
        except AuthorizationError as e:
            raise refused(self._settings, e, "Write", self.config["transactional_id"]) from None


def not_authorized(error: BaseException) -> str:
    """One line for a Kafka authorization failure (a missing ACL): which kind, which request
    and resource, without the request's dump."""
    text = str(error)
    request = re.search(r"Request '(\w+?)Request", text)
    resource = re.search(r"name='([^']*)'", text)
    what = type(error).__name__.replace("AuthorizationFailedError", "").lower() or "resource"
    parts = [f"not authorized by the cluster's ACLs ({type(error).__name__})"]
    if request:
        parts.append(f"for {request.group(1)}")
    if resource:
        parts.append(f"on {what} {resource.group(1)}")
    return " ".join(parts)
