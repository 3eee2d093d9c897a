"""The Python workers of the sessions the project starts (`varadhi.spark.session.get_spark`, and
`./spark-submit.sh`, which sets the same) talk to the JVM over Unix domain sockets
(`spark.python.unix.domain.socket.enabled`, Spark 4.1+), not loopback TCP. Over TCP, the end
of a task's input (a few bytes after a large Arrow batch) often waited for the worker's delayed
ACK: 40 ms in about a third of the latency bench's micro-batches (docs/benchmarks.md,
"Latency")."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest


def test_the_python_workers_use_unix_domain_sockets(spark):
    major, minor = (int(part) for part in spark.version.split(".")[:2])
    if (major, minor) < (4, 1):
        pytest.skip(f"Spark {spark.version} has no Unix domain sockets for Python workers")

    def worker_socket(batches):
        for _ in batches:
            pass
        # What Spark's Python daemon reads to listen on a Unix domain socket (daemon.py).
        yield pa.RecordBatch.from_pydict({"uds": [os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED")]})

    rows = spark.range(1).coalesce(1).mapInArrow(worker_socket, "uds string").collect()
    assert [row.uds.lower() for row in rows] == ["true"]
