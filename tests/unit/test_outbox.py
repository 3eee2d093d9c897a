"""Outbox decisions and the SQLite side of the outbox, on real SQLite files (no Kafka)."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter

import pytest

from varadhi.core.errors import InvalidArgument
from varadhi.outbox.relay import ADVISORY_LOCK_CLASS, _SqliteStore, advisory_lock_key
from varadhi.outbox.tables import LEASE_TABLE, Outbox, dialect_of, partition_for, table_name


class FakeClock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sqlite_db(tmp_path):
    """make(outbox) -> path of a fresh SQLite file with `outbox`'s tables."""

    def make(outbox: Outbox) -> str:
        path = str(tmp_path / "app.db")
        conn = sqlite3.connect(path)
        outbox.create_tables(conn)
        conn.close()
        return path

    return make


@pytest.fixture
def kafka_free_relay():
    """make(path, outbox, clock) -> a Relay on a SQLite file that has not touched Kafka yet (it
    connects to Kafka only when it has rows to send)."""
    from varadhi.kafka.catalog import Catalog
    from varadhi.kafka.settings import Settings
    from varadhi.outbox.relay import Relay, connector

    relays = []

    def make(path: str, outbox: Outbox, clock: FakeClock):
        relay = Relay(
            connector(sqlite=path), outbox, catalog=Catalog(Settings()), clock=clock, lease_ttl_s=10
        )
        relays.append(relay)
        return relay

    yield make
    for relay in relays:
        relay.close()


def rows(path: str, table: str) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            f"SELECT id, topic, group_id, message_id, headers, value FROM {table} ORDER BY id"
        ).fetchall()


# -- naming and partition choice --------------------------------------------------------------


def test_table_names_follow_shard_and_partition():
    assert table_name(0, 0) == "outgoing_message_0_0"
    assert table_name(1, 3, "orders_outbox") == "orders_outbox_1_3"
    outbox = Outbox(shards=2, partitions=3)
    assert outbox.tables() == [
        "outgoing_message_0_0",
        "outgoing_message_0_1",
        "outgoing_message_0_2",
        "outgoing_message_1_0",
        "outgoing_message_1_1",
        "outgoing_message_1_2",
    ]
    assert outbox.tables([1]) == [
        "outgoing_message_1_0",
        "outgoing_message_1_1",
        "outgoing_message_1_2",
    ]


def test_defaults_are_two_shards_of_one_partition():
    assert Outbox().tables() == ["outgoing_message_0_0", "outgoing_message_1_0"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shards": 0},
        {"partitions": 0},
        {"shards": True},
        {"table_prefix": "Outgoing"},
        {"table_prefix": "x; DROP TABLE users"},
        {"table_prefix": "9lives"},
    ],
)
def test_bad_outbox_configuration_is_refused(kwargs):
    with pytest.raises(InvalidArgument):
        Outbox(**kwargs)


# Known outbox partitions, computed without varadhi or mmh3: murmur3_x86_32 (seed 0) of the key's
# UTF-8 bytes from three Java implementations that agreed (Guava 33.4.8
# `Hashing.murmur3_32_fixed(0)`, Commons Codec 1.19 `MurmurHash3.hash32x86`, hash4j 0.22
# `Hashing.murmur3_32()`; as for tests/unit/test_routing.py's table), read unsigned, modulo the
# partition count: docs/outbox.md's `murmur3(group id) % partitions`, and the message id's hash for
# an ungrouped message. (Not Kafka's murmur2 partitioner: `Utils.toPositive(Utils.murmur2(b)) % 8`
# is 1, 7 and 0 for "customer-42", "g" and "message-7", where the outbox's tables are 5, 6 and 3.)
PARTITION_COUNTS = (1, 2, 3, 4, 8, 16)
KNOWN_GROUP_PARTITIONS = {
    "customer-42": (0, 1, 1, 1, 5, 5),
    "g": (0, 0, 2, 2, 6, 6),
    "ü-ñ": (0, 1, 0, 1, 5, 13),
    "größe": (0, 1, 0, 3, 7, 15),
    "東京": (0, 0, 1, 2, 2, 2),
    "🦊": (0, 1, 2, 3, 3, 3),
    "m1": (0, 0, 2, 0, 0, 8),
}
KNOWN_MESSAGE_PARTITIONS = {
    "message-7": (0, 1, 2, 3, 3, 11),
    "m1": (0, 0, 2, 0, 0, 8),
    "01J9Z0N1QXKZ8V6T2Y4R3W5E7A": (0, 1, 1, 1, 1, 9),
    "größe": (0, 1, 0, 3, 7, 15),
    "🦊": (0, 1, 2, 3, 3, 3),
}


@pytest.mark.parametrize("group", KNOWN_GROUP_PARTITIONS)
def test_a_groups_partition_is_the_known_one_whatever_its_message_id(group):
    for n, known in zip(PARTITION_COUNTS, KNOWN_GROUP_PARTITIONS[group], strict=True):
        # independent of the message id and of repetition: a group always uses one table
        assert {partition_for(group, f"m{i}", n) for i in range(50)} == {known}, n


@pytest.mark.parametrize("message_id", KNOWN_MESSAGE_PARTITIONS)
def test_an_ungrouped_messages_partition_is_the_known_one_of_its_message_id(message_id):
    for n, known in zip(PARTITION_COUNTS, KNOWN_MESSAGE_PARTITIONS[message_id], strict=True):
        assert partition_for(None, message_id, n) == known, n


def test_groups_and_ungrouped_messages_spread_over_partitions():
    by_group = Counter(partition_for(f"group-{i}", "m", 4) for i in range(4000))
    assert set(by_group) == {0, 1, 2, 3}
    assert min(by_group.values()) > 800
    ungrouped = Counter(partition_for(None, f"message-{i}", 4) for i in range(4000))
    assert set(ungrouped) == {0, 1, 2, 3}
    assert min(ungrouped.values()) > 800


def test_advisory_lock_keys_are_int4_and_distinct_per_table():
    keys = {advisory_lock_key(table_name(s, p)) for s in range(10) for p in range(10)}
    assert len(keys) == 100
    for cls, key in keys:
        assert cls == ADVISORY_LOCK_CLASS
        assert -(2**31) <= key < 2**31


def test_dialect_detection(tmp_path):
    conn = sqlite3.connect(str(tmp_path / "x.db"))
    assert dialect_of(conn) == "sqlite"
    assert dialect_of(conn.cursor()) == "sqlite"
    with pytest.raises(InvalidArgument, match="unsupported connection"):
        dialect_of(object())


# -- writing in the caller's transaction ----------------------------------------------------


def test_add_commits_with_the_callers_transaction_and_rollback_stores_nothing(sqlite_db):
    outbox = Outbox(clock=FakeClock(1700000000.5))
    path = sqlite_db(outbox)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)")
    conn.commit()
    with conn:  # commits
        conn.execute("INSERT INTO accounts VALUES (1, 100)")
        mid = outbox.add(conn, "orders", b"paid", group_id="customer-1", headers={"k": "v"})
    with pytest.raises(RuntimeError), conn:  # rolls back
        conn.execute("INSERT INTO accounts VALUES (2, 5)")
        outbox.add(conn, "orders", b"never", group_id="customer-1")
        raise RuntimeError("business rule failed")
    assert rows(path, "outgoing_message_0_0") == [
        (1, "orders", "customer-1", mid, json.dumps({"k": "v"}, separators=(",", ":")), b"paid")
    ]
    assert rows(path, "outgoing_message_1_0") == []
    created = conn.execute("SELECT created_ms FROM outgoing_message_0_0").fetchone()[0]
    assert created == 1700000000500
    assert outbox.pending(conn) == {"outgoing_message_0_0": 1, "outgoing_message_1_0": 0}


def test_add_uses_the_shard_and_the_groups_partition(sqlite_db):
    outbox = Outbox(shards=2, partitions=4)
    path = sqlite_db(outbox)
    conn = sqlite3.connect(path)
    groups = list(KNOWN_GROUP_PARTITIONS)  # all four partitions
    with conn:
        for g in groups:
            outbox.add(conn.cursor(), "orders", g.encode(), group_id=g, shard=1)
    for g in groups:
        table = outbox.table(1, KNOWN_GROUP_PARTITIONS[g][PARTITION_COUNTS.index(4)])
        assert (g, g.encode()) in [(r[2], r[5]) for r in rows(path, table)]
    assert sum(outbox.pending(conn)[outbox.table(0, p)] for p in range(4)) == 0


def test_add_many_keeps_order_and_returns_message_ids(sqlite_db):
    from varadhi.kafka.producer import Message

    outbox = Outbox()
    path = sqlite_db(outbox)
    conn = sqlite3.connect(path)
    ids = outbox.add_many(
        conn,
        "orders",
        [Message(f"v{i}".encode(), "g", message_id=f"id-{i}") for i in range(5)]
        + [Message(b"auto")],
    )
    conn.commit()
    assert ids[:5] == [f"id-{i}" for i in range(5)]
    assert len(ids[5]) == 32  # generated: uuid4 hex
    stored = rows(path, "outgoing_message_0_0")
    assert [r[3] for r in stored] == ids
    assert [r[5] for r in stored] == [b"v0", b"v1", b"v2", b"v3", b"v4", b"auto"]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"topic": "orders.rq"}, "topic"),
        ({"topic": "bad name"}, "name"),
        ({"shard": 2}, "shard"),
        ({"value": 42}, "value"),
        ({"value": b"x" * 101}, "value"),
        ({"group_id": ""}, "group_id"),
        ({"headers": {"varadhi-msg-id": "spoofed"}}, "headers"),
        ({"headers": {"k": 1}}, "headers"),
        ({"message_id": ""}, "message_id"),
    ],
)
def test_add_refuses_bad_messages_before_writing(sqlite_db, kwargs, field):
    outbox = Outbox(max_message_bytes=100)
    path = sqlite_db(outbox)
    conn = sqlite3.connect(path)
    args = {"topic": "orders", "value": b"ok", **kwargs}
    with pytest.raises(InvalidArgument, match=field):
        outbox.add(conn, **args)
    conn.commit()
    assert sum(outbox.pending(conn).values()) == 0


def test_create_tables_is_idempotent_and_uses_wal(sqlite_db, tmp_path):
    outbox = Outbox(shards=1, partitions=2, table_prefix="ob")
    path = sqlite_db(outbox)
    conn = sqlite3.connect(path)
    outbox.create_tables(conn)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"ob_0_0", "ob_0_1", LEASE_TABLE} <= names
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # primary-key index only: no secondary index on the outbox tables
    assert (
        conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name LIKE 'ob_%'"
        ).fetchone()[0]
        == 0
    )


# -- SQLite leases ------------------------------------------------------------------------


def store(path: str, owner: str, clock: FakeClock, ttl_s: float = 10.0) -> _SqliteStore:
    conn = sqlite3.connect(path, isolation_level=None, timeout=60)  # busy: a loaded machine
    return _SqliteStore(conn, owner, ttl_s, clock)


def test_one_lease_holder_per_table_until_the_lease_expires(sqlite_db):
    outbox = Outbox()
    path = sqlite_db(outbox)
    clock = FakeClock()
    a, b = store(path, "a", clock), store(path, "b", clock)
    t0, t1 = outbox.tables()
    assert a.acquire(t0)
    assert not b.acquire(t0)  # held by a
    assert b.acquire(t1)
    assert a.acquire(t0)  # re-acquiring one's own lease is fine
    clock.now += 9.9
    assert not b.acquire(t0)
    clock.now += 0.2  # a's lease has expired: a crashed relay's table is taken over
    assert b.acquire(t0)
    assert not a.renew(t0)  # a finds out at its next renewal...
    with sqlite3.connect(path) as conn:
        outbox.add(conn, "orders", b"x", group_id="g")
    batch = a.read(t0, 10)
    assert len(batch) == 1
    assert not a.delete(t0, batch)  # ...or delete, which then deletes nothing
    assert len(b.read(t0, 10)) == 1
    assert b.delete(t0, batch)
    assert b.read(t0, 10) == []


def test_renewal_keeps_the_lease_alive(sqlite_db):
    outbox = Outbox()
    path = sqlite_db(outbox)
    clock = FakeClock()
    a, b = store(path, "a", clock, ttl_s=4), store(path, "b", clock, ttl_s=4)
    t0 = outbox.tables()[0]
    assert a.acquire(t0)
    for _ in range(10):
        clock.now += 1.5
        assert a.renew(t0)
        assert not b.acquire(t0)
    a.release(t0)
    assert b.acquire(t0)  # released: taken at once, no expiry wait


def test_delete_removes_exactly_the_rows_read(sqlite_db):
    outbox = Outbox()
    path = sqlite_db(outbox)
    clock = FakeClock()
    a = store(path, "a", clock)
    t0 = outbox.tables()[0]
    a.acquire(t0)
    with sqlite3.connect(path) as conn:
        outbox.add_many(conn, "orders", [_msg(i) for i in range(10)])
    first = a.read(t0, 4)
    with sqlite3.connect(path) as conn:  # committed after the read: must survive the delete
        outbox.add(conn, "orders", b"late", group_id="g")
    assert a.delete(t0, first)
    left = a.read(t0, 100)
    assert [r.value for r in left] == [f"v{i}".encode() for i in range(4, 10)] + [b"late"]


def _msg(i: int):
    from varadhi.kafka.producer import Message

    return Message(f"v{i}".encode(), "g")


def test_an_idle_relay_keeps_its_leases(sqlite_db, kafka_free_relay):
    outbox = Outbox()
    path = sqlite_db(outbox)
    clock = FakeClock()
    relay = kafka_free_relay(path, outbox, clock)
    assert relay.claim() == outbox.tables()
    other = store(path, "other", clock)
    for _ in range(10):  # 30 s of empty polls: the leases are renewed, not left to expire
        clock.now += 3
        assert relay.pump().relayed == {}
        assert not other.acquire(outbox.tables()[0])
    assert relay.owned == outbox.tables()


def test_relay_and_status_refuse_a_database_without_the_tables(tmp_path, capsys):
    import sqlite3

    from varadhi.cli import main as cli

    db = tmp_path / "app.db"
    sqlite3.connect(db).execute("CREATE TABLE unrelated (x)").connection.close()
    assert cli(["outbox", "relay", "--sqlite", str(db), "--once"]) == 2
    assert cli(["outbox", "status", "--sqlite", str(db)]) == 2
    err = capsys.readouterr().err
    assert err.count("outgoing_message_0_0, outgoing_message_1_0 do not exist") == 2
    assert "varadhi outbox init" in err
