"""The transactional outbox against real databases (SQLite files, the PostgreSQL of
`scripts/postgres`) and the real local Kafka broker: commit/rollback, order per group, crashes
between send and delete, and takeover of a killed relay process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from varadhi.core import routing
from varadhi.core.messages import H_GROUP_ID, H_MSG_ID, H_PRODUCED_MS, headers_to_dict
from varadhi.kafka.producer import Message
from varadhi.outbox.relay import ADVISORY_LOCK_CLASS, Relay, advisory_lock_key, connector
from varadhi.outbox.tables import LEASE_TABLE, Outbox
from varadhi.testing.prometheus import scrape, total, value

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
NO_POSTGRES = (
    "VARADHI_TEST_POSTGRES_DSN is unset: start PostgreSQL with "
    'eval "$(scripts/postgres start)" (scripts/test does this)'
)


class Db:
    """One outbox database for one test: a SQLite file, or unique tables in the test PostgreSQL."""

    def __init__(self, dialect: str, *, path: str | None = None, dsn: str | None = None):
        self.dialect = dialect
        self.path = path
        self.dsn = dsn
        self.prefix = f"obx_{uuid.uuid4().hex[:10]}"
        self._conns: list = []
        self._outboxes: list[Outbox] = []
        self._probe = None

    def probe(self):
        """A connection of the test's own, for looking (autocommit: every query sees the latest)."""
        if self._probe is None:
            if self.dialect == "sqlite":
                self._probe = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            else:
                import psycopg

                self._probe = psycopg.connect(self.dsn, autocommit=True)
            self._conns.append(self._probe)
        return self._probe

    def outbox(self, **kwargs) -> Outbox:
        outbox = Outbox(table_prefix=self.prefix, **kwargs)
        conn = self.connect()
        outbox.create_tables(conn)
        self._outboxes.append(outbox)
        return outbox

    def connect(self):
        """An application connection (transactions as usual: commit / rollback)."""
        if self.dialect == "sqlite":
            conn = sqlite3.connect(self.path, timeout=30)
        else:
            import psycopg

            conn = psycopg.connect(self.dsn)
        self._conns.append(conn)
        return conn

    def connector(self, application_name: str | None = None):
        if self.dialect == "sqlite":
            return connector(sqlite=self.path)
        return connector(dsn=self._dsn(application_name))

    def cli_args(self, application_name: str | None = None) -> list[str]:
        if self.dialect == "sqlite":
            return ["--sqlite", self.path, "--table-prefix", self.prefix]
        return ["--dsn", self._dsn(application_name), "--table-prefix", self.prefix]

    def _dsn(self, application_name: str | None) -> str:
        if application_name is None:
            return self.dsn
        return f"{self.dsn}{'&' if '?' in self.dsn else '?'}application_name={application_name}"

    def holders(self, outbox: Outbox) -> set[str]:
        """Who holds the tables: SQLite lease owners, or PostgreSQL application names."""
        conn = self.probe()
        if self.dialect == "sqlite":
            now_ms = int(time.time() * 1000)
            rows = conn.execute(
                f"SELECT owner FROM {LEASE_TABLE} WHERE expires_ms > ? AND table_name LIKE ?",
                (now_ms, f"{self.prefix}%"),
            ).fetchall()
            return {r[0] for r in rows}
        objids = [advisory_lock_key(t)[1] & 0xFFFFFFFF for t in outbox.tables()]
        rows = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = ANY(%s)",
            (ADVISORY_LOCK_CLASS, objids),
        ).fetchall()
        return {r[0] for r in rows}

    @contextlib.contextmanager
    def transaction(self, conn):
        if self.dialect == "sqlite":
            with conn:
                yield conn
        else:
            with conn.transaction():
                yield conn
            conn.commit()

    def pending(self, outbox: Outbox) -> int:
        return sum(outbox.pending(self.probe()).values())

    def close(self) -> None:
        if self.dialect == "postgres":
            conn = self.probe()
            for outbox in self._outboxes:
                for table in outbox.tables():
                    conn.execute(f"DROP TABLE IF EXISTS {table}")
        for conn in self._conns:
            conn.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db(request, tmp_path):
    if request.param == "postgres":
        dsn = os.environ.get("VARADHI_TEST_POSTGRES_DSN")
        if not dsn:
            pytest.skip(NO_POSTGRES)
        database = Db("postgres", dsn=dsn)
    else:
        database = Db("sqlite", path=str(tmp_path / "app.db"))
    yield database
    database.close()


@pytest.fixture
def make_relay(catalog):
    """make_relay(db, outbox, **options) -> an in-process Relay, closed after the test."""
    relays: list[Relay] = []

    def make(db: Db, outbox: Outbox, **options) -> Relay:
        relay = Relay(db.connector(), outbox, catalog=catalog, **options)
        relays.append(relay)
        return relay

    yield make
    for relay in relays:
        relay.close()


def by_group(records) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = defaultdict(list)
    for r in records:
        out[r.key.decode()].append(r.value)
    return out


def first_occurrences(values: list[bytes]) -> list[bytes]:
    seen: set[bytes] = set()
    return [v for v in values if not (v in seen or seen.add(v))]


# -- in-process relays ----------------------------------------------------------------------


def test_committed_messages_are_sent_and_rolled_back_ones_are_not(
    db, make_topic, read_records, make_relay, topic_service
):
    name = make_topic(4)
    outbox = db.outbox()
    app = db.connect()
    with db.transaction(app):
        a = outbox.add(app, name, b"first", group_id="customer-a", headers={"trace": "t1"})
        b = outbox.add(app, name, b"second", group_id="customer-b")
        c = outbox.add(app, name, b"ungrouped")
    with pytest.raises(RuntimeError), db.transaction(app):
        outbox.add(app, name, b"rolled back", group_id="customer-a")
        outbox.add(app, name, b"rolled back too")
        raise RuntimeError("the business transaction failed")

    relay = make_relay(db, outbox)
    assert relay.run_once() == 3
    assert db.pending(outbox) == 0

    records = read_records(f"{name}.0")
    assert sorted(r.value for r in records) == [b"first", b"second", b"ungrouped"]
    by_id = {headers_to_dict(r.headers)[H_MSG_ID]: r for r in records}
    assert set(by_id) == {a, b, c}
    for mid, group in ((a, "customer-a"), (b, "customer-b")):
        record = by_id[mid]
        headers = headers_to_dict(record.headers)
        assert record.key == group.encode()
        assert headers[H_GROUP_ID] == group
        assert int(headers[H_PRODUCED_MS]) == record.timestamp
        assert record.partition == routing.route_group(group, 4, 1)
    assert headers_to_dict(by_id[a].headers)["trace"] == "t1"
    assert by_id[c].key is None and H_GROUP_ID not in headers_to_dict(by_id[c].headers)
    assert relay.run_once() == 0  # nothing is sent twice


def test_order_per_group_holds_across_tables_batches_and_shards(
    db, make_topic, read_records, make_relay
):
    name = make_topic(4)
    outbox = db.outbox(shards=2, partitions=3)
    app = db.connect()
    groups = [f"group-{i}" for i in range(12)]
    sent: dict[str, list[bytes]] = defaultdict(list)
    for txn in range(5):  # several transactions, groups interleaved within each
        with db.transaction(app):
            for i in range(10):
                for g in groups:
                    value = f"{g}/{txn}/{i}".encode()
                    shard = 1 if g == "group-0" else 0  # a whole group may live on the spare
                    outbox.add(app, name, value, group_id=g, shard=shard)
                    sent[g].append(value)
    relay = make_relay(db, outbox, batch_size=16)
    assert relay.run_once() == 600
    records = read_records(f"{name}.0")
    assert len(records) == 600
    received = by_group(records)
    for g in groups:
        assert received[g] == sent[g], g
        assert {r.partition for r in records if r.key == g.encode()} == {
            routing.route_group(g, 4, 1)
        }


class Crash(Exception):
    pass


def test_crash_between_send_and_delete_duplicates_but_loses_nothing(
    db, make_topic, read_records, make_relay
):
    name = make_topic(2)
    outbox = db.outbox()
    app = db.connect()
    groups = ["g1", "g2", "g3", "g4", "g5"]
    values = [f"{groups[i % 5]}:{i}".encode() for i in range(100)]
    with db.transaction(app):
        outbox.add_many(app, name, [Message(v, v.decode().split(":")[0]) for v in values])
    calls = []

    def crash_on_second_batch(table, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise Crash("relay died after Kafka acknowledged, before the delete")

    crashing = make_relay(db, outbox, batch_size=30, after_send=crash_on_second_batch)
    with pytest.raises(Crash):
        crashing.run_once()
    assert db.pending(outbox) == 70  # the second batch was sent but not deleted
    crashing.close()

    assert make_relay(db, outbox, batch_size=30).run_once() == 70
    assert db.pending(outbox) == 0
    records = read_records(f"{name}.0")
    got = [r.value for r in records]
    assert set(got) == set(values)  # nothing lost
    # Duplicates: the batch whose delete crashed, and the next one, which the relay had already
    # sent (it sends a batch before deleting the previous one)
    duplicates = {v for v in set(got) if got.count(v) == 2}
    assert set(values[30:60]) <= duplicates <= set(values[30:90])
    assert len(got) == 100 + len(duplicates)
    assert len({headers_to_dict(r.headers)[H_MSG_ID] for r in records}) == 100  # same ids
    received = by_group(records)
    for g in groups:
        assert first_occurrences(received[g]) == [v for v in values if v.startswith(g.encode())]


def test_a_row_for_an_unknown_topic_holds_back_its_table_until_the_topic_exists(
    db, make_topic, read_records, make_relay, topic_service, unique_name
):
    name = make_topic(1)
    missing = unique_name("later")
    outbox = db.outbox(shards=1)
    app = db.connect()
    with db.transaction(app):
        outbox.add(app, name, b"before", group_id="g")
        outbox.add(app, missing, b"to the missing topic", group_id="g")
        outbox.add(app, name, b"after", group_id="g")
    relay = make_relay(db, outbox)
    relay.claim()
    result = relay.pump()
    assert result.relayed == {outbox.tables()[0]: 1}
    assert "does not exist" in result.stuck[outbox.tables()[0]]
    assert [r.value for r in read_records(f"{name}.0")] == [b"before"]
    assert db.pending(outbox) == 2

    topic_service.create(missing, 1)
    time.sleep(0.25)
    assert relay.run_once() == 2
    assert [r.value for r in read_records(f"{name}.0")] == [b"before", b"after"]
    assert [r.value for r in read_records(f"{missing}.0")] == [b"to the missing topic"]


def test_relay_follows_switch_produce(db, make_topic, read_records, make_relay, topic_service):
    name = make_topic(2)
    outbox = db.outbox(shards=1)
    app = db.connect()
    relay = make_relay(db, outbox, refresh_interval_s=0.1)
    with db.transaction(app):
        outbox.add(app, name, b"old", group_id="g")
    assert relay.run_once() == 1
    topic_service.add_storage(name, 4)
    topic_service.switch_produce(name)
    time.sleep(0.2)
    with db.transaction(app):
        outbox.add(app, name, b"new", group_id="g")
    assert relay.run_once() == 1
    assert [r.value for r in read_records(f"{name}.0")] == [b"old"]
    new = read_records(f"{name}.1")
    assert [r.value for r in new] == [b"new"]
    assert new[0].partition == routing.route_group("g", 4, 2)


# -- relay processes ------------------------------------------------------------------------


def start_relay(db: Db, name: str, log_dir: Path, *options: str) -> subprocess.Popen:
    """A relay process (jobs/outbox_relay.py) with `options` added; its log goes to
    `log_dir/<name>.log`."""
    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "outbox_relay.py"),
        *db.cli_args(application_name=name),
        "--lease-ttl",
        "3",
        "--batch-size",
        "200",
        *options,
    ]
    log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def wait_for(condition, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metrics_port(log: Path) -> int | None:
    """The port a relay's exporter logged (`--metrics-port 0`), None before it did; the log is
    JSON lines (`--log-format json`), each of which must parse."""
    for line in log.read_text().splitlines():
        m = re.search(r"metrics at http://127\.0\.0\.1:(\d+)/metrics", json.loads(line)["message"])
        if m:
            return int(m[1])
    return None


def test_a_killed_relay_is_taken_over_without_loss(
    db, make_topic, read_records, bootstrap, tmp_path
):
    """... and the relay that took over reports it in its metrics (`--metrics-port`, scraped)."""
    name = make_topic(4)
    outbox = db.outbox()
    app = db.connect()
    groups = [f"g{i}" for i in range(20)]
    expected: dict[str, list[bytes]] = defaultdict(list)

    def insert(n: int, tag: str) -> None:
        messages = []
        for i in range(n):
            g = groups[i % len(groups)]
            value = f"{g}:{tag}:{i}".encode()
            messages.append(Message(value, g))
            expected[g].append(value)
        with db.transaction(app):
            outbox.add_many(app, name, messages)

    def is_a(holder: str) -> bool:
        return holder == "relay-a" or f":{a.pid}:" in holder

    def is_b(holder: str) -> bool:
        return holder == "relay-b" or f":{b.pid}:" in holder

    insert(20_000, "before")
    a = start_relay(db, "relay-a", tmp_path)
    b = None
    try:
        # a claims both tables and starts relaying
        wait_for(lambda: db.pending(outbox) < 20_000, 120, "relay a to start")
        b = start_relay(db, "relay-b", tmp_path, "--metrics-port", "0", "--log-format", "json")
        time.sleep(1.5)  # b is up and polling for free tables, but a holds them
        holders = db.holders(outbox)
        assert holders and all(is_a(h) for h in holders), holders
        a.send_signal(signal.SIGKILL)
        a.wait(60)
        insert(200, "after")
        # SQLite: a's leases expire after 3 s; PostgreSQL: a's session dies with it. The bounds
        # only say "it happens": how long it takes is not a test's business (no timed asserts).
        wait_for(
            lambda: (h := db.holders(outbox)) and all(is_b(x) for x in h) and len(h) == 1,
            60,
            "relay b to take the tables over",
        )
        wait_for(lambda: db.pending(outbox) == 0, 60, "relay b to drain the outbox")
        port = wait_for(lambda: metrics_port(tmp_path / "relay-b.log"), 60, "b's metrics port")
        # its next read of each table's head finds it empty (no row waits), and it holds every
        # table (a's leases on them end one by one: a scrape may come between two claims)
        every = len(outbox.tables())

        def drained(m):
            return total(m, "varadhi_outbox_lag_seconds") == 0 and (
                value(m, "varadhi_outbox_tables") == every
            )

        got = wait_for(
            lambda: (m := scrape(port, ())) and drained(m) and m,
            60,
            "b to hold and read every drained table",
        )
        relayed_by_b = total(got, "varadhi_outbox_relayed_total")
        assert 200 <= relayed_by_b <= 20_200, got  # at least what came after a was killed
        assert value(got, "varadhi_outbox_stuck_tables") == 0
        assert total(got, "varadhi_outbox_batches_total") >= 1
        assert total(got, "varadhi_job_info") == 1
        b.send_signal(signal.SIGTERM)
        assert b.wait(60) == 0, (tmp_path / "relay-b.log").read_text()
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
    records = read_records(f"{name}.0")
    received = by_group(records)
    expected_total = sum(len(v) for v in expected.values())
    assert len({r.value for r in records}) == expected_total  # nothing lost
    assert len(records) - expected_total < 1000  # duplicates: at most what a had in flight
    for g in groups:
        assert first_occurrences(received[g]) == expected[g], g


def test_cli_init_status_and_relay_once(make_topic, read_records, varadhi_cli, tmp_path):
    name = make_topic(1)
    path = str(tmp_path / "cli.db")
    code, out, _ = varadhi_cli("outbox", "init", "--sqlite", path, "--partitions", "2")
    assert code == 0 and "outgoing_message_1_1" in out
    outbox = Outbox(partitions=2)
    with sqlite3.connect(path) as conn:
        for i in range(5):
            outbox.add(conn, name, f"v{i}".encode(), group_id=f"g{i}")
    code, out, _ = varadhi_cli(
        "outbox", "status", "--sqlite", path, "--partitions", "2", "--output", "json"
    )
    assert code == 0 and '"pending"' in out
    assert sum(int(x) for x in out.replace(",", " ").split() if x.isdigit()) == 5
    code, out, _ = varadhi_cli("outbox", "relay", "--sqlite", path, "--partitions", "2", "--once")
    assert code == 0, out
    assert "relayed 5 messages" in out
    assert sorted(r.value for r in read_records(f"{name}.0")) == [
        f"v{i}".encode() for i in range(5)
    ]
    code, _, err = varadhi_cli("outbox", "relay", "--once")
    assert code == 2 and "--dsn" in err
