"""The transactional outbox's relay (seed 004): sends the rows applications committed to their
outbox tables (`varadhi.outbox.tables`) to their composite topics, and deletes them once Kafka has
them.

    Relay(connector(sqlite="app.db")).run_forever()   # or: varadhi outbox relay --sqlite app.db

The relay, per table it owns: read up to `batch_size` rows in id order, send them to the composite
topic's produce topic (partition from `producer.plan`, headers from `producer.kafka_headers`), wait
for Kafka's acknowledgement (`acks=all`), then delete the acknowledged rows. The next batch is read
while Kafka works on the current one, and is sent before the current one is deleted (see
`Relay.pump`). Guarantees:

- At least once. A crash between send and delete re-sends the batch (duplicates, same message ids);
  a row is deleted only after Kafka acknowledged it, so nothing is lost.
- Order per group within a shard: a group lives in one table, whose rows are sent in id order by one
  relay at a time, with at most one batch per Kafka partition in flight and nothing sent behind a
  batch that failed. Rows of one group written by *concurrent* transactions have no defined order
  (PostgreSQL may commit id 11 before id 10; the relay may then send 11 first, and sends 10 at its
  next pass over the table, within about a second). An application that needs order writes a
  group's messages from one transaction at a time, as it does anyway for any ordered stream.
- One poller per table across processes. PostgreSQL: a session-level `pg_try_advisory_lock` per
  table, held on the connection that also reads and deletes, so a relay that dies (or loses its
  connection) releases its tables at once and can no longer delete. SQLite: a lease row per table in
  `outbox_leases` (owner, expiry), taken and renewed in `BEGIN IMMEDIATE` transactions and checked in
  the same transaction as every delete; a crashed relay's tables are taken over once its lease
  expires (`lease_ttl_s`, 10 s by default). A send waits at most `send_timeout_s`, under half the
  lease, and starts only after a renewal, so a live relay does not send while another owns its
  table.

Hazard: a row whose topic does not exist in the catalog (or whose value Kafka refuses) stops its
table at that row - later rows of the table wait, because they may be of the same group. The relay
logs it on every attempt; create the topic (or delete the row) to go on.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kafka import errors as kafka_errors
from kafka.errors import KafkaError
from kafka.net.compat import KafkaNetClient
from kafka.protocol.producer import ProduceRequest
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.structs import TopicPartition

from varadhi.core.errors import InvalidArgument, KafkaUnavailable, VaradhiError
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.producer import Record, kafka_headers, plan
from varadhi.kafka.settings import Settings
from varadhi.outbox.tables import (
    LEASE_TABLE,
    Clock,
    Dialect,
    Outbox,
    dialect_of,
    lease_table_ddl,
)

log = logging.getLogger(__name__)

# The first key of every advisory lock the relay takes ("vard"); the second is the table's CRC-32.
ADVISORY_LOCK_CLASS = 0x76617264
_COLUMNS = "id, topic, group_id, message_id, headers, value, created_ms"

# A record batch stays below Kafka's default `message.max.bytes` (1 MiB + 12 bytes); a larger
# record travels alone in its batch (and fails there if the broker's limit is lower).
MAX_BATCH_BYTES = 900_000


class OutboxError(VaradhiError):
    """The outbox database could not be used (connection lost, table missing, locked too long)."""


def advisory_lock_key(table: str) -> tuple[int, int]:
    """The two int4 keys of the PostgreSQL advisory lock that guards `table`."""
    crc = zlib.crc32(table.encode("utf-8"))
    return ADVISORY_LOCK_CLASS, crc - (1 << 32) if crc >= 1 << 31 else crc


# -- connections --------------------------------------------------------------------------


def connector(dsn: str | None = None, sqlite: str | None = None) -> Callable[[], Any]:
    """A factory of relay connections: PostgreSQL from a libpq DSN/URL, or a SQLite file."""
    if (dsn is None) == (sqlite is None):
        raise InvalidArgument("give exactly one of a PostgreSQL DSN or a SQLite path", "database")
    if dsn is not None:

        def connect_postgres():
            try:
                import psycopg
            except ImportError as e:  # the `postgres` extra
                raise OutboxError(
                    "PostgreSQL needs psycopg 3: pip install 'varadhi-spark[postgres]'"
                ) from e
            try:
                return psycopg.connect(dsn, autocommit=True, connect_timeout=10)
            except psycopg.Error as e:
                raise OutboxError(f"cannot connect to PostgreSQL: {e}") from e

        return connect_postgres

    def connect_sqlite():
        if not os.path.exists(sqlite):
            raise OutboxError(f"no SQLite database at {sqlite}: create the tables first")
        return sqlite3.connect(sqlite, isolation_level=None, timeout=30, check_same_thread=False)

    return connect_sqlite


# -- sending ------------------------------------------------------------------------------

# (storage topic, partition, key, value, headers, timestamp ms)
Item = tuple[str, int, bytes | None, bytes, list[tuple[str, bytes]], int]


@dataclass
class _Flight:
    """Record batches on their way to Kafka (see `BatchSender.start`)."""

    tps: list[tuple[str, int]]
    wave_of: list[int]
    waves: list[dict[tuple[str, int], list]]
    sent: tuple[list, str | None] = ([], None)


class BatchSender:
    """The relay's Kafka writer: one record batch per partition, one produce request per leader,
    `acks=all`, and a wait for the responses. Measured on this project's 2-core machine with
    1 KiB records: about 3 us per record, against about 25 us through `KafkaProducer.send`,
    whose per-record futures and locking the relay does not need (it waits for whole rounds).

    It speaks Kafka through kafka-python's network client and record-batch builder. It is not
    idempotent: a batch retried after a lost response may be written twice (the relay is
    at-least-once anyway, and the copy keeps its message id). Order holds: each partition has at
    most one batch in flight, and when a batch fails no later batch of the round is sent.
    """

    def __init__(
        self,
        bootstrap: str,
        client_id: str,
        timeout_s: float,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        **client_config: Any,
    ):
        self.timeout_ms = int(timeout_s * 1000)
        self.max_batch_bytes = max_batch_bytes
        try:
            self.client = KafkaNetClient(
                bootstrap_servers=bootstrap,
                client_id=client_id,
                request_timeout_ms=self.timeout_ms,
                **client_config,
            )
            self.client.check_version(timeout_ms=self.timeout_ms)
        except KafkaError as e:
            raise KafkaUnavailable(f"cannot reach Kafka at {bootstrap}: {e}") from None

    def partitions(self, topic: str) -> set[int] | None:
        """The partitions Kafka knows for `topic` (fetching its metadata on first use)."""
        cluster = self.client.cluster
        known = cluster.partitions_for_topic(topic)
        if known is None:
            future = cluster.add_topic(topic)
            self.client.poll(timeout_ms=self.timeout_ms, future=future)
            known = cluster.partitions_for_topic(topic)
        return known

    def send(self, items: Sequence[Item]) -> tuple[list[bool], str | None]:
        """Write `items` in order and wait; returns which were acknowledged, and the first error."""
        return self.wait(self.start(items))

    def start(self, items: Sequence[Item]) -> _Flight:
        """Build the record batches of `items` and send the first wave without waiting for it.

        A wave holds at most one batch per partition; a partition whose batch is full continues
        in the next wave, which `wait` sends once the previous wave is acknowledged."""
        waves: list[dict[tuple[str, int], list]] = []
        wave_of: list[int] = []
        current: dict[tuple[str, int], int] = {}
        for topic, partition, key, value, headers, ts in items:
            tp = (topic, partition)
            w = current.get(tp, 0)
            while True:
                if w == len(waves):
                    waves.append({})
                entry = waves[w].get(tp)
                if entry is None:
                    builder = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, self.max_batch_bytes)
                    entry = waves[w][tp] = [builder, 0]
                if entry[0].append(entry[1], ts, key, value, headers) is not None:
                    entry[1] += 1
                    break
                w += 1  # full: this record (and the partition's later ones) go in the next wave
            current[tp] = w
            wave_of.append(w)
        flight = _Flight([(it[0], it[1]) for it in items], wave_of, waves)
        if waves:
            flight.sent = self._send_wave(waves[0])
        return flight

    def wait(self, flight: _Flight) -> tuple[list[bool], str | None]:
        """Wait for `flight`'s acknowledgements (sending its later waves one by one); returns
        which items were acknowledged and the first error. Nothing after a failed wave is sent."""
        acked: set[tuple[int, tuple[str, int]]] = set()
        error = None
        for w in range(len(flight.waves)):
            sent = flight.sent if w == 0 else self._send_wave(flight.waves[w])
            good, error = self._await_wave(sent)
            acked.update((w, tp) for tp in good)
            if error is not None:
                break  # later waves would overtake the failed batches
        return [(w, tp) in acked for w, tp in zip(flight.wave_of, flight.tps, strict=True)], error

    def _send_wave(self, wave: dict[tuple[str, int], list]) -> tuple[list, str | None]:
        """Send one produce request per leader; returns the futures and any error so far."""
        cluster = self.client.cluster
        by_leader: dict[int, dict[str, list]] = {}
        error = None
        for (topic, partition), (builder, _) in wave.items():
            leader = cluster.leader_for_partition(TopicPartition(topic, partition))
            if leader is None or leader == -1:
                error = error or f"no leader for {topic}[{partition}]"
                continue
            part = ProduceRequest.TopicProduceData.PartitionProduceData(
                index=partition, records=bytes(builder.build())
            )
            by_leader.setdefault(leader, {}).setdefault(topic, []).append(part)
        futures = []
        for leader, data in by_leader.items():
            request = ProduceRequest(
                transactional_id=None,
                acks=-1,
                timeout_ms=self.timeout_ms,
                topic_data=[
                    ProduceRequest.TopicProduceData(name=t, partition_data=parts)
                    for t, parts in data.items()
                ],
                max_version=9,
            )
            try:
                futures.append(self.client.send(leader, request))
            except KafkaError as e:
                error = error or f"broker {leader}: {e!r}"
        return futures, error

    def _await_wave(self, sent: tuple[list, str | None]) -> tuple[set, str | None]:
        futures, error = sent
        deadline = time.monotonic() + self.timeout_ms / 1000
        good = set()
        for future in futures:
            remaining = max(0, int((deadline - time.monotonic()) * 1000))
            if not future.is_done:
                self.client.poll(timeout_ms=remaining, future=future)
            if not future.is_done:
                error = error or f"no acknowledgement within {self.timeout_ms} ms"
                continue
            if future.failed():
                error = error or repr(future.exception)
                continue
            for topic_response in future.value.responses:
                for pr in topic_response.partition_responses:
                    if pr.error_code == 0:
                        good.add((topic_response.name, pr.index))
                        continue
                    exc = kafka_errors.for_code(pr.error_code)
                    error = error or (
                        f"{topic_response.name}[{pr.index}]: {exc.__name__}"
                        + (f" ({pr.error_message})" if pr.error_message else "")
                    )
        if error is not None:
            self.client.cluster.request_update()  # most failures: a moved leader, a new topic
        return good, error

    def close(self) -> None:
        self.client.close()


# -- relaying -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One outbox row as the relay read it."""

    id: int
    topic: str
    group_id: str | None
    message_id: str
    headers: str | None  # JSON object of strings, or NULL
    value: bytes
    created_ms: int


def _row(t: tuple) -> Row:
    value = t[5]
    return Row(t[0], t[1], t[2], t[3], t[4], value if type(value) is bytes else bytes(value), t[6])


class _PostgresStore:
    """Reads, deletes and advisory locks on one autocommit session.

    The locks are session-level: they live exactly as long as this connection. Reads and deletes
    use the same connection, so once it is gone (relay crash, network cut) this relay can neither
    hold the table nor delete from it, and another relay takes the table at its next claim.
    """

    dialect: Dialect = "postgres"

    def __init__(self, conn: Any):
        conn.autocommit = True
        self.conn = conn

    def acquire(self, table: str) -> bool:
        cur = self.conn.execute("SELECT pg_try_advisory_lock(%s, %s)", advisory_lock_key(table))
        return bool(cur.fetchone()[0])

    def renew(self, table: str) -> bool:
        return True  # a session lock needs no renewal; a dead session fails the next statement

    def read(self, table: str, limit: int, after: int = 0) -> list[Row]:
        with self.conn.cursor(binary=True) as cur:
            cur.execute(
                f"SELECT {_COLUMNS} FROM {table} WHERE id > %s ORDER BY id LIMIT %s",
                (after, limit),
            )
            return [_row(t) for t in cur.fetchall()]

    def delete(self, table: str, rows: Sequence[Row]) -> bool:
        # By id list, never by range: with concurrent writers an id inside the range may commit
        # after our read, and a range delete would drop it unsent.
        self.conn.execute(
            f"DELETE FROM {table} WHERE id = ANY(%s::bigint[])", ([r.id for r in rows],)
        )
        return True

    def release(self, table: str) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", advisory_lock_key(table))

    def close(self) -> None:
        self.conn.close()


class _SqliteStore:
    """Leases in `outbox_leases`, taken, renewed and checked in `BEGIN IMMEDIATE` transactions.

    SQLite serialises writers and an AUTOINCREMENT id is never reused, so the rows a read returns
    are exactly those with ids in [first, last]: a range delete is safe here (unlike PostgreSQL).
    """

    dialect: Dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, owner: str, ttl_s: float, clock: Clock):
        conn.isolation_level = None  # we issue BEGIN IMMEDIATE / COMMIT ourselves
        self.conn = conn
        self.owner = owner
        self.ttl_ms = int(ttl_s * 1000)
        self.clock = clock
        self._expires: dict[str, int] = {}
        conn.execute(lease_table_ddl())

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _immediate(self, fn: Callable[[], Any]) -> Any:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return result

    def _holder(self, table: str) -> tuple[str, int] | None:
        return self.conn.execute(
            f"SELECT owner, expires_ms FROM {LEASE_TABLE} WHERE table_name = ?", (table,)
        ).fetchone()

    def _extend(self, table: str, now: int) -> None:
        self.conn.execute(
            f"INSERT INTO {LEASE_TABLE} (table_name, owner, expires_ms) VALUES (?, ?, ?) "
            "ON CONFLICT (table_name) DO UPDATE SET owner = excluded.owner, "
            "expires_ms = excluded.expires_ms",
            (table, self.owner, now + self.ttl_ms),
        )
        self._expires[table] = now + self.ttl_ms

    def acquire(self, table: str) -> bool:
        def take() -> bool:
            now = self._now_ms()
            holder = self._holder(table)
            if holder is None or holder[0] == self.owner or holder[1] <= now:
                self._extend(table, now)
                return True
            return False

        return self._immediate(take)

    def renew(self, table: str) -> bool:
        """Extend the lease when less than half of it is left; False when another relay has it."""
        if self._expires.get(table, 0) - self._now_ms() > self.ttl_ms // 2:
            return True

        def extend() -> bool:
            holder = self._holder(table)
            if holder is None or holder[0] != self.owner:
                return False
            self._extend(table, self._now_ms())
            return True

        return self._immediate(extend)

    def read(self, table: str, limit: int, after: int = 0) -> list[Row]:
        cur = self.conn.execute(
            f"SELECT {_COLUMNS} FROM {table} WHERE id > ? ORDER BY id LIMIT ?", (after, limit)
        )
        return [_row(t) for t in cur.fetchall()]

    def delete(self, table: str, rows: Sequence[Row]) -> bool:
        def delete_if_owner() -> bool:
            holder = self._holder(table)
            if holder is None or holder[0] != self.owner:
                return False  # another relay took over: it re-sends these rows and deletes them
            self.conn.execute(
                f"DELETE FROM {table} WHERE id >= ? AND id <= ?", (rows[0].id, rows[-1].id)
            )
            self._extend(table, self._now_ms())
            return True

        return self._immediate(delete_if_owner)

    def release(self, table: str) -> None:
        self._immediate(
            lambda: self.conn.execute(
                f"DELETE FROM {LEASE_TABLE} WHERE table_name = ? AND owner = ?",
                (table, self.owner),
            )
        )
        self._expires.pop(table, None)

    def close(self) -> None:
        self.conn.close()


def _store(conn: Any, owner: str, ttl_s: float, clock: Clock) -> _PostgresStore | _SqliteStore:
    if dialect_of(conn) == "postgres":
        return _PostgresStore(conn)
    return _SqliteStore(conn, owner, ttl_s, clock)


@dataclass(frozen=True)
class PumpResult:
    """What one `Relay.pump` did: rows sent and deleted per table, and tables that are stuck."""

    relayed: dict[str, int]
    stuck: dict[str, str]  # table -> why its next row cannot be sent now

    @property
    def total(self) -> int:
        return sum(self.relayed.values())


class RelayStats:
    """What a relay did since it started, for its metrics (`varadhi.jobs.outbox_relay`):
    rows relayed per table, rounds sent, errors retried by kind (`database`, `kafka`), and per
    table the age of its oldest row not yet relayed, as of the last read of the table's head (0
    when it was empty). Thread-safe: the relay's thread writes, an exporter's reads
    (`snapshot`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.relayed: dict[str, int] = {}
        self.rounds = 0
        self.errors: dict[str, int] = {}
        self.head_age_s: dict[str, float] = {}

    def add_relayed(self, table: str, n: int) -> None:
        with self._lock:
            self.relayed[table] = self.relayed.get(table, 0) + n

    def add_round(self) -> None:
        with self._lock:
            self.rounds += 1

    def add_error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def set_head_age(self, table: str, seconds: float) -> None:
        with self._lock:
            self.head_age_s[table] = seconds

    def snapshot(self) -> dict[str, Any]:
        """A copy: `relayed`, `rounds`, `errors`, `head_age_s`."""
        with self._lock:
            return {
                "relayed": dict(self.relayed),
                "rounds": self.rounds,
                "errors": dict(self.errors),
                "head_age_s": dict(self.head_age_s),
            }


@dataclass
class _Round:
    """Rows of one round per table, and their batches in flight."""

    rows: dict[str, list[Row]]
    flight: _Flight
    spans: dict[str, tuple[int, int]]  # table -> its items' [start, end) in the flight


class Relay:
    """Polls the outbox tables it can claim and relays their rows to Kafka (see the module doc).

    `connect` makes a database connection (see `connector`); the relay keeps one for its whole
    life and makes a new one after a database error (losing, and then re-claiming, its tables).
    `shards` limits the relay to some shards (e.g. a low-latency shard with its own relay).
    `after_send(table, rows)` is called after Kafka acknowledged `rows` and before they are deleted
    (a test hook for crashes between the two). `stats` (`RelayStats`) counts what it does.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        outbox: Outbox | None = None,
        *,
        settings: Settings | None = None,
        catalog: Catalog | None = None,
        shards: Sequence[int] | None = None,
        batch_size: int = 1000,
        poll_interval_s: float = 0.05,
        claim_interval_s: float = 1.0,
        lease_ttl_s: float = 10.0,
        send_timeout_s: float | None = None,
        refresh_interval_s: float = 1.0,
        owner: str | None = None,
        clock: Clock = time.time,
        after_send: Callable[[str, list[Row]], None] | None = None,
        **kafka_config: Any,
    ):
        if batch_size < 1:
            raise InvalidArgument(f"must be positive, got {batch_size}", field="batch_size")
        if lease_ttl_s <= 0:
            raise InvalidArgument(f"must be positive, got {lease_ttl_s}", field="lease_ttl_s")
        send_timeout_s = lease_ttl_s * 0.4 if send_timeout_s is None else send_timeout_s
        if not 0 < send_timeout_s < lease_ttl_s / 2:
            raise InvalidArgument(
                f"must be positive and less than half the lease ({lease_ttl_s} s), got "
                f"{send_timeout_s}: a send may not outlive the lease it runs under",
                field="send_timeout_s",
            )
        self.outbox = outbox or Outbox()
        self.tables = self.outbox.tables(shards)
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.claim_interval_s = claim_interval_s
        self.lease_ttl_s = lease_ttl_s
        self.send_timeout_s = send_timeout_s
        self.refresh_interval_s = refresh_interval_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._connect = connect
        self._clock = clock
        self._after_send = after_send
        self._owns_catalog = catalog is None
        self.catalog = catalog or Catalog(settings)
        self.settings = settings or self.catalog.settings
        self._kafka_config = kafka_config
        self._store: _PostgresStore | _SqliteStore | None = None
        self._sender: BatchSender | None = None
        self._owned: list[str] = []
        self._topics: dict[str, topics.CompositeTopic] = {}
        self._topics_read_at = float("-inf")
        self._next_claim = float("-inf")
        self._closed = False
        self.stats = RelayStats()
        self._stuck: dict[str, str] = {}

    # -- public API --------------------------------------------------------------------------
    @property
    def owned(self) -> list[str]:
        """The tables this relay holds now."""
        return list(self._owned)

    @property
    def stuck(self) -> dict[str, str]:
        """The tables the last `pump` left waiting at a row, and why."""
        return dict(self._stuck)

    def claim(self) -> list[str]:
        """Try to take every table not held yet; returns the tables held afterwards."""
        store = self._store_or_connect()
        for table in self.tables:
            if table not in self._owned and store.acquire(table):
                log.info("outbox relay %s: claimed %s", self.owner, table)
                self._owned.append(table)
        self._owned.sort(key=self.tables.index)
        self._next_claim = time.monotonic() + self.claim_interval_s
        return self.owned

    def run_once(self) -> int:
        """Claim what is free, then relay every held table until it is empty (or stuck).
        Returns how many rows were sent and deleted."""
        self.claim()
        total = 0
        while True:
            result = self.pump()
            total += result.total
            if not result.relayed:
                return total

    def run_forever(self, stop: threading.Event | None = None) -> None:
        """Relay until `stop` is set. Database and Kafka errors are logged and retried with a
        growing pause (at most 5 s); a database error drops the connection and every table."""
        stop = stop or threading.Event()
        failures = 0
        while not stop.is_set():
            try:
                if time.monotonic() >= self._next_claim:
                    self.claim()
                result = self.pump(stop)
                failures = 0
            except (OutboxError, sqlite3.Error, _psycopg_error()) as e:
                failures += 1
                pause = min(5.0, 0.1 * 2**failures)
                log.warning(
                    "outbox relay %s: database: %s; retrying in %.1f s", self.owner, e, pause
                )
                self.stats.add_error("database")
                self._drop_store()
                stop.wait(pause)
                continue
            except (KafkaUnavailable, KafkaError) as e:
                failures += 1
                pause = min(5.0, 0.1 * 2**failures)
                log.warning("outbox relay %s: Kafka: %s; retrying in %.1f s", self.owner, e, pause)
                self.stats.add_error("kafka")
                self._drop_sender()
                stop.wait(pause)
                continue
            if not result.relayed or result.stuck:
                stop.wait(self.poll_interval_s)

    def pump(self, stop: threading.Event | None = None) -> PumpResult:
        """Relay rounds back to back until the held tables have nothing new (at most about
        `claim_interval_s`, so that claims and re-reads from the head of each table go on).

        A round reads up to `batch_size` rows of each table, in id order after the previous
        round's, and sends them. Round N+1 is read while round N waits for Kafka, and is sent
        before round N's rows are deleted, so the database and Kafka work side by side; but it
        is sent only once round N is acknowledged (a partition never has two batches in flight,
        and nothing is sent behind a failure). Rows are deleted only once acknowledged.
        """
        store = self._store_or_connect()
        deadline = time.monotonic() + self.claim_interval_s
        cursors: dict[str, int] = {}
        relayed: dict[str, int] = {}
        stuck: dict[str, str] = {}
        current: _Round | None = None
        while True:
            reading = time.monotonic() < deadline and not (stop is not None and stop.is_set())
            rows: dict[str, list[Row]] = {}
            for table in list(self._owned) if reading else ():
                if table in stuck:
                    continue
                if not store.renew(table):  # SQLite: keeps an idle relay's leases alive too
                    self._lose(table)
                    continue
                batch = store.read(table, self.batch_size, cursors.get(table, 0))
                if table not in cursors:  # the table's head: its oldest row not yet relayed
                    age = self._clock() - batch[0].created_ms / 1000 if batch else 0.0
                    self.stats.set_head_age(table, max(age, 0.0))
                if batch:
                    rows[table] = batch
                    cursors[table] = batch[-1].id
            acked: dict[str, list[Row]] = {}
            if current is not None:
                acked = self._wait(current, stuck)
                for table in stuck:
                    rows.pop(table, None)  # never send behind a row that did not go out
            following = self._start(rows, store, stuck) if rows else None
            if current is not None:
                self._delete(acked, store, relayed)
            if following is None:
                break
            self.stats.add_round()
            current = following
        for table, why in stuck.items():
            log.warning("outbox relay %s: %s is waiting at %s", self.owner, table, why)
        self._stuck = dict(stuck)
        return PumpResult(relayed, stuck)

    def close(self) -> None:
        """Release the tables (another relay may take them at once) and close the clients."""
        if self._closed:
            return
        self._closed = True
        if self._store is not None:
            try:
                for table in self._owned:
                    self._store.release(table)
            except Exception as e:  # noqa: BLE001 - the leases expire (SQLite) or die with the session
                log.info("outbox relay %s: releasing the tables failed: %s", self.owner, e)
            self._drop_store()
        self._drop_sender()
        if self._owns_catalog:
            self.catalog.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _start(
        self, rows: dict[str, list[Row]], store: _PostgresStore | _SqliteStore, stuck: dict
    ) -> _Round | None:
        """Turn rows into Kafka records and send them (not waiting). A table stops at its first
        row that cannot be sent (`stuck`); a table whose lease is gone is dropped."""
        sender = self._sender_or_create()
        items: list[Item] = []
        spans: dict[str, tuple[int, int]] = {}
        partitions: dict[str, set[int] | None] = {}
        for table, batch in rows.items():
            if not store.renew(table):  # the send below must run under a live lease
                self._lose(table)
                continue
            start = len(items)
            for row in batch:
                topic = self._topic(row.topic)
                if topic is None:
                    stuck[table] = f"row {row.id}: topic {row.topic!r} does not exist"
                    break
                storage, partition = plan(topic, row.group_id, row.id)
                if storage not in partitions:
                    partitions[storage] = sender.partitions(storage)
                known = partitions[storage]
                if not known or partition not in known:
                    stuck[table] = f"row {row.id}: Kafka has no partition {partition} of {storage}"
                    break
                user = json.loads(row.headers).items() if row.headers else ()
                key = None if row.group_id is None else row.group_id.encode("utf-8")
                record = Record(
                    row.value,
                    key,
                    row.group_id,
                    row.message_id,
                    tuple((k, v.encode("utf-8")) for k, v in user),
                )
                headers = kafka_headers(record, row.created_ms)
                items.append((storage, partition, key, row.value, headers, row.created_ms))
            if len(items) > start:
                spans[table] = (start, len(items))
        if not items:
            return None
        return _Round(rows, sender.start(items), spans)

    def _wait(self, current: _Round, stuck: dict[str, str]) -> dict[str, list[Row]]:
        """Wait for a round's acknowledgements; returns each table's acknowledged rows (a prefix
        of its batch) and marks a table whose batch did not fully go out as stuck."""
        ok, error = self._sender_or_create().wait(current.flight)
        acked = {}
        for table, (start, end) in current.spans.items():
            n = 0
            while start + n < end and ok[start + n]:
                n += 1
            acked[table] = current.rows[table][:n]
            if start + n < end:
                stuck.setdefault(table, f"row {current.rows[table][n].id}: {error}")
        return acked

    def _delete(
        self,
        acked: dict[str, list[Row]],
        store: _PostgresStore | _SqliteStore,
        relayed: dict[str, int],
    ) -> None:
        for table, done in acked.items():
            if not done:
                continue
            if self._after_send is not None:
                self._after_send(table, done)
            if store.delete(table, done):
                relayed[table] = relayed.get(table, 0) + len(done)
                self.stats.add_relayed(table, len(done))
            elif table in self._owned:
                self._lose(table)

    def _topic(self, name: str) -> topics.CompositeTopic | None:
        """The composite topic `name` from the catalog, re-read every `refresh_interval_s` (so a
        `switch-produce` reaches the relay within about that), and at most every 0.2 s while a
        row names a topic the relay does not know."""
        age = time.monotonic() - self._topics_read_at
        if age >= self.refresh_interval_s or (name not in self._topics and age >= 0.2):
            snapshot = self.catalog.snapshot()
            self._topics = {
                n: topics.CompositeTopic.from_dict(d)
                for n, d in snapshot.items(topics.KIND).items()
            }
            self._topics_read_at = time.monotonic()
        return self._topics.get(name)

    def _sender_or_create(self) -> BatchSender:
        if self._sender is None:
            self._sender = BatchSender(
                self.settings.bootstrap,
                f"varadhi-outbox-relay-{self.owner}",
                self.send_timeout_s,
                **{**kafka_clients.config_of(self.settings).python_kwargs(), **self._kafka_config},
            )
        return self._sender

    def _drop_sender(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # noqa: BLE001 - the client is discarded either way
                log.info("outbox relay %s: closing the Kafka client: %s", self.owner, e)
            self._sender = None

    def _store_or_connect(self) -> _PostgresStore | _SqliteStore:
        if self._closed:
            raise OutboxError("the relay is closed")
        if self._store is None:
            self._store = _store(self._connect(), self.owner, self.lease_ttl_s, self._clock)
            self._owned = []
        return self._store

    def _drop_store(self) -> None:
        if self._store is not None:
            try:
                self._store.close()
            except Exception as e:  # noqa: BLE001 - a broken connection may fail to close
                log.info("outbox relay %s: closing the database connection: %s", self.owner, e)
            self._store = None
        self._owned = []
        self._next_claim = float("-inf")

    def _lose(self, table: str) -> None:
        log.warning("outbox relay %s: lost %s to another relay", self.owner, table)
        self._owned.remove(table)


def _psycopg_error() -> type[BaseException]:
    try:
        import psycopg
    except ImportError:
        return OutboxError
    return psycopg.Error
