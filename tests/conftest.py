"""Shared fixtures. Every test run uses its own catalog topic, so runs never see each other's state.

Tiers: tests/unit (pure logic), tests/spark (one reused local SparkSession), tests/integration
(the real local Kafka broker from `scripts/kafka start`, real HTTP servers, real Delta tables).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from varadhi.testing import endpoint as endpoint_keys
from varadhi.testing import oauth_server, tls

# Every skip of a run must be listed here (test id prefix -> why that skip is expected), or the run
# fails at its end: a test that skips because a service did not start, or a condition that is
# always true in the full run, would otherwise leave a green run that proved nothing. Empty: no
# test of the suite may skip.
ALLOWED_SKIPS: dict[str, str] = {}

RUN_ID = uuid.uuid4().hex[:8]
os.environ.setdefault("VARADHI_BOOTSTRAP", "127.0.0.1:19092")
os.environ["VARADHI_CATALOG_TOPIC"] = f"__varadhi_catalog_test_{RUN_ID}"
# The tests' signing keys, for every shard and executor (`endpoint.signing`)
os.environ[endpoint_keys.TEST_WHSEC_ENV] = endpoint_keys.TEST_WHSEC
os.environ[endpoint_keys.TEST_WHSK_ENV] = endpoint_keys.TEST_WHSK
# ... and the endpoint TLS material (`endpoint.tls`) and OAuth2 client secret (`endpoint.oauth2`)
tls.export(os.environ)
os.environ[oauth_server.TEST_CLIENT_SECRET_ENV] = oauth_server.TEST_CLIENT_SECRET


def _kafka_up(bootstrap: str, within_s: float = 60) -> bool:
    """Whether the broker accepts a connection within `within_s` (a busy machine's broker, just
    started by scripts/test, may take seconds)."""
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=5):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


@pytest.fixture(scope="session")
def bootstrap() -> str:
    servers = os.environ["VARADHI_BOOTSTRAP"]
    if not _kafka_up(servers):
        pytest.fail(
            f"no Kafka broker at {servers}: run the tests with scripts/test (it starts one)"
        )
    return servers


@pytest.fixture(scope="session")
def settings(bootstrap, tmp_path_factory):
    from varadhi.kafka.settings import Settings

    warehouse = str(tmp_path_factory.mktemp("warehouse"))
    os.environ["VARADHI_WAREHOUSE"] = warehouse  # the CLI, called in-process, must agree
    return Settings(
        bootstrap=bootstrap,
        catalog_topic=os.environ["VARADHI_CATALOG_TOPIC"],
        warehouse=warehouse,
    )


@pytest.fixture(scope="session")
def catalog(settings):
    from varadhi.kafka.catalog import Catalog

    cat = Catalog(settings)
    yield cat
    cat.close()


@pytest.fixture
def unique_name():
    """A factory of fresh, valid names: unique_name('orders') -> 'orders-1a2b3c4d'."""

    def make(prefix: str = "t") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession (Kafka and Delta jars, UI off) for the whole run."""
    from varadhi.spark.session import get_spark

    session = get_spark("varadhi-tests")
    yield session
    session.stop()


_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report):
    """Note each test's duration, and each skip that ALLOWED_SKIPS does not list (on xdist's
    controller, every worker's reports)."""
    _durations[report.nodeid] += report.duration
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    if not any(report.nodeid.startswith(prefix) for prefix in ALLOWED_SKIPS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _unexpected_skips.append(f"{report.nodeid}: {str(reason).removeprefix('Skipped: ')}")


def pytest_sessionfinish(session, exitstatus):
    """Fail a run that skipped a test that ALLOWED_SKIPS does not list (xdist's workers send
    their reports to the controller, which judges the run)."""
    worker = hasattr(session.config, "workerinput")
    if _unexpected_skips and not worker and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section("unexpected skips (not in tests/conftest.py ALLOWED_SKIPS)")
        for line in _unexpected_skips:
            terminalreporter.line(line, red=True)


# Tests that one xdist worker runs together (node id prefix -> why): they share something costly
# that a module or session fixture starts once per worker, or ports that are fixed. Every other
# test goes to whichever worker is free. (The scheduler below reads this table: with pytest 9,
# xdist 3.8's `xdist_group` marker no longer changes a test's node id, so it groups nothing.)
GROUPS: dict[str, str] = {
    "tests/integration/test_secure_kafka.py": "a secured broker of its own (secure_broker)",
    "tests/integration/test_kafka_mechanisms.py": "a secured broker of its own (broker)",
    "tests/integration/test_replicated_cluster.py": "a three-node cluster on fixed ports",
    "tests/integration/test_kafka_script.py": "brokers on fixed ports",
    "tests/integration/test_change_shards_crash.py": "the runs of `source` and `clean`",
    "tests/integration/test_replay.py": "the runs of `history`",
    **{
        f"tests/integration/test_shard_delivery.py::{name}": "the run of `timing`"
        for name in (
            "test_retries_wait_their_backoff_and_are_written_once",
            "test_retry_after_is_honoured",
            "test_a_fatal_answer_dead_letters_at_once_with_its_reason",
        )
    },
    "tests/objectstore/": "one SeaweedFS and one s3a session (tests/objectstore/conftest.py)",
    "tests/cluster/": "one standalone cluster (tests/cluster/conftest.py)",
}


def xdist_scope(nodeid: str) -> str:
    """The unit of work the scheduler hands to one worker: the test alone, or its group (the
    tests of one module whose `GROUPS` prefixes give the same reason)."""
    for prefix, why in GROUPS.items():
        if nodeid.startswith(prefix):
            return f"group: {prefix.split('::')[0]}: {why}"
    return nodeid


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler over `xdist_scope`, in collection order (longest first, below)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # keep the order by duration, not by group size
    return GroupScheduling(config, log)


# Longest first. The scheduler hands out tests (a group as one unit) in collection order; a long
# test handed out last would run alone at the end while the other workers idle.
# tests/durations.json holds each test's measured seconds (setup + call + teardown), written by
# `--store-durations FILE` (scripts/test writes one for every full run; copy it over to refresh).
# A test it does not know yet weighs one second.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations",
        metavar="FILE",
        help="write each test's seconds (setup + call + teardown) to FILE as JSON",
    )


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # a run in one process keeps the files' order
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    scopes = [xdist_scope(item.nodeid) for item in items]
    weight: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, (item, scope) in enumerate(zip(items, scopes, strict=True)):
        weight[scope] += known.get(item.nodeid, 1.0)
        first.setdefault(scope, i)
    ranked = sorted(range(len(items)), key=lambda i: (-weight[scopes[i]], first[scopes[i]], i))
    items[:] = [items[i] for i in ranked]


_durations: dict[str, float] = defaultdict(float)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    path = config.getoption("--store-durations", None)
    if path and _durations and not hasattr(config, "workerinput"):
        rounded = {k: round(v, 1) for k, v in sorted(_durations.items())}
        Path(path).write_text(json.dumps(rounded, indent=0) + "\n")
