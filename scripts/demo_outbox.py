"""The outbox step of `scripts/demo`: messages written in a database transaction reach Kafka
through the relay; a rolled-back transaction sends nothing.

    .venv/bin/python scripts/demo_outbox.py TOPIC
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from varadhi.kafka.catalog import Catalog
from varadhi.kafka.topics import TopicService
from varadhi.outbox.tables import Outbox

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    topic = sys.argv[1]
    catalog = Catalog()
    before = TopicService(catalog).describe(topic)
    db = Path(tempfile.mkdtemp()) / "app.db"
    outbox = Outbox()
    conn = sqlite3.connect(db)
    outbox.create_tables(conn)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT)")
    with conn:  # committed: the order and its three messages
        conn.execute("INSERT INTO orders (customer) VALUES ('erin')")
        for n in range(3):
            outbox.add(
                conn, topic, f'{{"customer": "erin", "event": {n}}}'.encode(), group_id="erin"
            )
    try:
        with conn:  # rolled back: neither the order nor its message exist
            conn.execute("INSERT INTO orders (customer) VALUES ('frank')")
            outbox.add(conn, topic, b'{"customer": "frank"}', group_id="frank")
            raise RuntimeError("the application gives up")
    except RuntimeError:
        pass
    conn.close()
    print(f"outbox {db}: 3 messages committed with their order, 1 rolled back")
    relay = [
        str(ROOT / ".venv" / "bin" / "varadhi"),
        "outbox",
        "relay",
        "--sqlite",
        str(db),
        "--once",
    ]
    subprocess.run(relay, check=True)
    after = TopicService(catalog).describe(topic)
    sent = sum(st["messages"] for st in after["storage_topics"]) - sum(
        st["messages"] for st in before["storage_topics"]
    )
    print(f"the relay sent {sent} messages to {topic} and deleted them from the outbox")
    catalog.close()
    return 0 if sent == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
