"""The transactional outbox's tables (seed 004): what an application writes in its own database
transaction. The relay (`varadhi.outbox.relay`) sends the committed rows to their composite topics
afterwards and deletes them.

    outbox = Outbox()                        # 2 shards (shard 1 is a spare), 1 partition each
    outbox.create_tables(conn)               # once
    with conn:                               # the application's transaction
        conn.execute("UPDATE accounts ...")
        outbox.add(conn, "orders", b'{"id": 1}', group_id="customer-42")
    # commit: the message is stored and will be sent; rollback: neither stored nor sent

Tables. Every (shard, partition) pair has its own table `outgoing_message_<shard>_<partition>`
with the primary-key index only (`id` autoincrement, `topic`, `group_id`, `message_id`, `headers`
as JSON text, `value` bytes, `created_ms`): no status column, no secondary index, so an insert and
a delete each touch one heap row and one index entry. A message's partition is a stable hash of
its group id, so one group always uses one table of its shard; ungrouped messages are spread by a
hash of their message id. The message id is fixed when the row is written, so a re-sent row carries
the same idempotency key as the first copy.

Writing needs no relay and no Kafka: `add` and `add_many` validate everything first (raising
`InvalidArgument` before a row is written), insert rows on the caller's connection (psycopg 3 or
sqlite3) in the caller's transaction, and never commit. A committed row will be sent at least once;
a rolled-back one never is.

Hazards:

- Rows of one group written by *concurrent* transactions have no defined order (PostgreSQL may
  commit id 11 before id 10, and the relay may then send 11 first). An application that needs order
  writes a group's messages from one transaction at a time, as it does anyway for any ordered
  stream.
- `add` checks the topic's name, not that the topic exists: a row whose topic is not in the catalog
  stops its table at the relay (later rows of the table wait, as they may be of the same group)
  until the topic is created or the row deleted.
- On SQLite, `create_tables` switches the database file to WAL journaling (a property of the file,
  so that the relay's reads never wait for the application's writers) and also creates the relay's
  lease table `outbox_leases`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import mmh3

from varadhi.core import names, routing
from varadhi.core.errors import InvalidArgument
from varadhi.kafka.producer import Message, validate

Dialect = Literal["postgres", "sqlite"]
Clock = Callable[[], float]

DEFAULT_SHARDS = 2
DEFAULT_PARTITIONS = 1
DEFAULT_TABLE_PREFIX = "outgoing_message"
LEASE_TABLE = "outbox_leases"
_PREFIX_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_")
_INSERT_COLUMNS = "topic, group_id, message_id, headers, value, created_ms"


# -- pure decisions ---------------------------------------------------------------------------


def table_name(shard: int, partition: int, prefix: str = DEFAULT_TABLE_PREFIX) -> str:
    """`<prefix>_<shard>_<partition>`, e.g. `outgoing_message_0_0`."""
    return f"{prefix}_{shard}_{partition}"


def partition_for(group_id: str | None, message_id: str, partitions: int) -> int:
    """The outbox partition (table) of a message: by group id, so one group uses one table of its
    shard (its order is kept); an ungrouped message by its message id (spread evenly)."""
    if partitions < 1:
        raise ValueError(f"partitions must be positive, got {partitions}")
    if group_id is not None:
        return routing.group_hash(group_id) % partitions
    return mmh3.hash(message_id.encode("utf-8"), 0, signed=False) % partitions


def dialect_of(conn_or_cursor: Any) -> Dialect:
    """`postgres` for a psycopg 3 connection or cursor, `sqlite` for a sqlite3 one."""
    module = type(conn_or_cursor).__module__
    if module.startswith("psycopg"):
        return "postgres"
    if module.startswith("sqlite3"):
        return "sqlite"
    raise InvalidArgument(
        f"unsupported connection type {type(conn_or_cursor).__qualname__} from {module}: "
        "use a psycopg 3 (PostgreSQL) or sqlite3 connection or cursor",
        field="connection",
    )


def create_statements(dialect: Dialect, table: str) -> list[str]:
    """DDL of one outbox table (idempotent). PostgreSQL tables vacuum after a fixed number of
    deleted rows rather than a fraction of the table: a queue table is mostly dead rows, and index
    scans in id order slow down while they pile up."""
    if dialect == "postgres":
        return [
            f"CREATE TABLE IF NOT EXISTS {table} ("
            "id bigserial PRIMARY KEY, topic text NOT NULL, group_id text, "
            "message_id text NOT NULL, headers text, value bytea NOT NULL, "
            "created_ms bigint NOT NULL) WITH (autovacuum_vacuum_scale_factor = 0, "
            "autovacuum_vacuum_threshold = 10000, autovacuum_vacuum_insert_scale_factor = 0, "
            "autovacuum_vacuum_insert_threshold = 100000)"
        ]
    return [
        f"CREATE TABLE IF NOT EXISTS {table} ("
        "id INTEGER PRIMARY KEY AUTOINCREMENT, topic TEXT NOT NULL, group_id TEXT, "
        "message_id TEXT NOT NULL, headers TEXT, value BLOB NOT NULL, "
        "created_ms INTEGER NOT NULL)"
    ]


def lease_table_ddl() -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (table_name TEXT PRIMARY KEY, "
        "owner TEXT NOT NULL, expires_ms INTEGER NOT NULL)"
    )


# -- writing (inside the application's transaction) -------------------------------------------


class Outbox:
    """The outbox tables: `shards` x `partitions` of them (defaults 2 x 1, shard 1 a spare).

    Writing needs no relay and no Kafka: `add` and `add_many` only insert rows, in the caller's
    transaction, on the caller's connection (psycopg 3 or sqlite3), and never commit.
    """

    def __init__(
        self,
        shards: int = DEFAULT_SHARDS,
        partitions: int = DEFAULT_PARTITIONS,
        *,
        table_prefix: str = DEFAULT_TABLE_PREFIX,
        max_message_bytes: int = 1_048_576,
        clock: Clock = time.time,
    ):
        for name, n in (("shards", shards), ("partitions", partitions)):
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 1000:
                raise InvalidArgument(f"must be an integer in 1..1000, got {n!r}", field=name)
        if not table_prefix or not set(table_prefix) <= _PREFIX_CHARS or table_prefix[0].isdigit():
            raise InvalidArgument(
                f"must be lower-case letters, digits and '_', not starting with a digit: "
                f"{table_prefix!r}",
                field="table_prefix",
            )
        if max_message_bytes < 1:
            raise InvalidArgument(
                f"must be positive, got {max_message_bytes}", field="max_message_bytes"
            )
        self.shards = shards
        self.partitions = partitions
        self.table_prefix = table_prefix
        self.max_message_bytes = max_message_bytes
        self._clock = clock

    def table(self, shard: int, partition: int) -> str:
        self._check_shard(shard)
        if not 0 <= partition < self.partitions:
            raise InvalidArgument(
                f"{partition} is outside 0..{self.partitions - 1}", field="partition"
            )
        return table_name(shard, partition, self.table_prefix)

    def tables(self, shards: Iterable[int] | None = None) -> list[str]:
        """Every table name, shard by shard (or only those of `shards`)."""
        wanted = range(self.shards) if shards is None else sorted(set(shards))
        return [self.table(s, p) for s in wanted for p in range(self.partitions)]

    def create_tables(self, conn: Any) -> None:
        """Create the outbox tables (and, on SQLite, the lease table) if missing, and commit.

        On SQLite this also switches the database file to WAL journaling, so that the relay's
        reads never wait for the application's writers (it is a property of the file)."""
        dialect = dialect_of(conn)
        if dialect == "sqlite":
            conn.execute("PRAGMA journal_mode=WAL")
        statements = [s for t in self.tables() for s in create_statements(dialect, t)]
        if dialect == "sqlite":
            statements.append(lease_table_ddl())
        cur = conn.cursor()
        for statement in statements:
            cur.execute(statement)
        conn.commit()

    def add(
        self,
        conn_or_cursor: Any,
        topic: str,
        value: bytes | str,
        group_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
        shard: int = 0,
    ) -> str:
        """Insert one message in the caller's open transaction; returns its message id.

        Validation is `producer.validate`'s (value size, group id, headers outside `varadhi-`,
        message id) plus the topic name; it raises `InvalidArgument` before anything is written.
        Commit or roll back as usual: the relay sees the row only once it is committed.
        """
        return self.add_many(
            conn_or_cursor, topic, [Message(value, group_id, headers or {}, message_id)], shard
        )[0]

    def add_many(
        self, conn_or_cursor: Any, topic: str, messages: Iterable[Message], shard: int = 0
    ) -> list[str]:
        """Insert many messages to `topic` in the caller's transaction (in order); returns their
        message ids. Everything is validated first. PostgreSQL rows go in with one binary `COPY`
        per table, SQLite rows with `executemany`."""
        self._check_topic(topic)
        self._check_shard(shard)
        by_table: dict[str, list[tuple]] = {}
        ids: list[str] = []
        now_ms = int(self._clock() * 1000)
        for i, message in enumerate(messages):
            if not isinstance(message, Message):
                raise InvalidArgument(
                    f"must be a producer.Message, got {type(message).__name__}", f"messages[{i}]"
                )
            try:
                record = validate(message, self.max_message_bytes)
            except InvalidArgument as e:
                raise InvalidArgument(str(e), field=f"messages[{i}]") from None
            partition = partition_for(record.group_id, record.message_id, self.partitions)
            headers = (
                json.dumps(dict(message.headers), separators=(",", ":"))
                if message.headers
                else None
            )
            row = (topic, record.group_id, record.message_id, headers, record.value, now_ms)
            by_table.setdefault(table_name(shard, partition, self.table_prefix), []).append(row)
            ids.append(record.message_id)
        if not ids:
            return ids
        dialect = dialect_of(conn_or_cursor)
        cur = conn_or_cursor.cursor() if hasattr(conn_or_cursor, "cursor") else conn_or_cursor
        for table, rows in by_table.items():
            if dialect == "postgres":
                if len(rows) == 1:
                    cur.execute(
                        f"INSERT INTO {table} ({_INSERT_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s)",
                        rows[0],
                    )
                    continue
                with cur.copy(f"COPY {table} ({_INSERT_COLUMNS}) FROM STDIN (FORMAT BINARY)") as cp:
                    cp.set_types(["text", "text", "text", "text", "bytea", "int8"])
                    for row in rows:
                        cp.write_row(row)
            else:
                cur.executemany(
                    f"INSERT INTO {table} ({_INSERT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", rows
                )
        return ids

    def pending(self, conn: Any) -> dict[str, int]:
        """Rows waiting in each table (a full count: for operators and tests, not hot paths)."""
        cur = conn.cursor()
        out = {}
        for table in self.tables():
            cur.execute(f"SELECT count(*) FROM {table}")
            out[table] = int(cur.fetchone()[0])
        return out

    def missing_tables(self, conn: Any) -> list[str]:
        """The outbox tables that do not exist in this database (any DB-API connection)."""
        missing = []
        for table in self.tables():
            try:
                conn.cursor().execute(f"SELECT 1 FROM {table} WHERE 1 = 0")
            except Exception:  # noqa: BLE001 - sqlite3 and psycopg raise different error types
                missing.append(table)
                conn.rollback()  # PostgreSQL aborts the transaction on an error
        return missing

    def _check_shard(self, shard: int) -> None:
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < self.shards:
            raise InvalidArgument(f"{shard!r} is outside 0..{self.shards - 1}", field="shard")

    @staticmethod
    def _check_topic(topic: str) -> None:
        if isinstance(topic, str) and names.INTERNAL_NAME_RE.match(topic):
            raise InvalidArgument(
                f"{topic} is a subscription's internal queue; it cannot be produced to",
                field="topic",
            )
        names.validate_name(topic)
