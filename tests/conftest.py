"""Shared fixtures. Every test run uses its own catalog topic, so runs never see each other's state.

Tiers: tests/unit (pure logic), tests/spark (one reused local SparkSession), tests/integration
(the real local Kafka broker from `scripts/kafka start`, real HTTP servers, real Delta tables).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

# Every skip of a run must be listed here (test id prefix -> why that skip is expected), or the run
# fails at its end: a test that skips because a service did not start, or a condition that is
# always true in the full run, would otherwise leave a green run that proved nothing. Empty: no
# test of the suite may skip.
ALLOWED_SKIPS: dict[str, str] = {}

RUN_ID = uuid.uuid4().hex[:8]
os.environ.setdefault("VARADHI_BOOTSTRAP", "127.0.0.1:19092")
os.environ["VARADHI_CATALOG_TOPIC"] = f"__varadhi_catalog_test_{RUN_ID}"


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
    from varadhi.settings import Settings

    warehouse = str(tmp_path_factory.mktemp("warehouse"))
    os.environ["VARADHI_WAREHOUSE"] = warehouse  # the CLI, called in-process, must agree
    return Settings(
        bootstrap=bootstrap,
        catalog_topic=os.environ["VARADHI_CATALOG_TOPIC"],
        warehouse=warehouse,
    )


@pytest.fixture(scope="session")
def catalog(settings):
    from varadhi.catalog import Catalog

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
    from varadhi.spark import get_spark

    session = get_spark("varadhi-tests")
    yield session
    session.stop()


_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report):
    """Note each test's duration, and each skip that ALLOWED_SKIPS does not list (on xdist's
    controller, every worker's reports)."""
    _durations[_GROUP_SUFFIX.sub("", report.nodeid)] += report.duration
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


# Longest first. xdist hands out tests (and xdist_group groups, each to one worker) in collection
# order; a long test handed out last would run alone at the end while the other workers idle.
# tests/durations.json holds each test's measured seconds (setup + call + teardown), written by
# `--store-durations FILE` (scripts/test writes one for every full run; copy it over to refresh).
# A test it does not know yet weighs one second.
DURATIONS = Path(__file__).with_name("durations.json")
_GROUP_SUFFIX = re.compile(r"@[A-Za-z0-9_.-]+$")  # xdist's loadgroup adds `@group` to node ids


def pytest_addoption(parser):
    parser.addoption(
        "--store-durations",
        metavar="FILE",
        help="write each test's seconds (setup + call + teardown) to FILE as JSON",
    )


def _xdist_scope(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid
    return "group:" + (mark.args[0] if mark.args else mark.kwargs["name"])


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # a run in one process keeps the files' order
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    weight: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        scope = _xdist_scope(item)
        weight[scope] += known.get(_GROUP_SUFFIX.sub("", item.nodeid), 1.0)
        first.setdefault(scope, i)
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (-weight[_xdist_scope(it)], first[_xdist_scope(it)], order[id(it)]))


_durations: dict[str, float] = defaultdict(float)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    path = config.getoption("--store-durations", None)
    if path and _durations and not hasattr(config, "workerinput"):
        rounded = {k: round(v, 1) for k, v in sorted(_durations.items())}
        Path(path).write_text(json.dumps(rounded, indent=0) + "\n")
