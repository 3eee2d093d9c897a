"""The notebook tier: the Databricks notebooks (notebooks/*.py) run end to end, locally, against
the local stack: the test run's Kafka broker and catalog, a real HTTP endpoint
(`TestEndpoint`), shards run in this process on the one SparkSession, and the warehouse of the
test run.

A notebook runs the way Databricks runs it: its cells in order, in one namespace. Widgets take
their local fallback, the environment variables `VARADHI_NB_<WIDGET>` (set here with
monkeypatch), and `dbutils`/`display` are absent, as on a laptop. A test may stop between cells
(`run(until=...)`) to do what a user would do meanwhile, e.g. let a shard run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = "# Databricks notebook source\n"
SEPARATOR = "\n# COMMAND ----------\n"


class Notebook:
    """A Databricks source-format notebook executed cell by cell in one namespace."""

    def __init__(self, path: Path):
        text = path.read_text()
        if not text.startswith(HEADER):
            raise AssertionError(f"{path.name} is not a Databricks notebook (no header line)")
        self.name = path.name
        self.cells = text[len(HEADER) :].split(SEPARATOR)
        self.namespace: dict[str, Any] = {"__name__": "__main__"}
        self.next = 0

    def run(self, until: str | None = None) -> Notebook:
        """Execute the following cells in order; with `until`, stop before the first cell whose
        text contains it (it must exist)."""
        stop = len(self.cells)
        if until is not None:
            stop = next(
                (i for i in range(self.next, len(self.cells)) if until in self.cells[i]), -1
            )
            if stop < 0:
                raise AssertionError(f"{self.name}: no cell after cell {self.next} has {until!r}")
        for i in range(self.next, stop):
            code = compile(self.cells[i], f"{self.name}[cell {i}]", "exec")
            exec(code, self.namespace)  # noqa: S102 - running the notebook is the test
        self.next = stop
        return self

    def __getitem__(self, name: str) -> Any:
        return self.namespace[name]


@pytest.fixture
def notebook(monkeypatch, settings):
    """notebook("status.py", subscription=..., ...) -> a `Notebook` whose widgets read the given
    values (everything else takes the notebook's defaults: the test run's broker, catalog and
    warehouse from the environment)."""

    def make(name: str, **widgets: str) -> Notebook:
        for key, value in widgets.items():
            monkeypatch.setenv(f"VARADHI_NB_{key.upper()}", str(value))
        return Notebook(ROOT / "notebooks" / name)

    return make


@pytest.fixture
def failing_subscription(settings, spark, catalog, unique_name):
    """failing_subscription(endpoint, messages, **spec) -> spec of a fresh one-shard grouped
    subscription of a fresh 2-partition topic delivering to `endpoint`, after `messages` ((group,
    id) pairs) were produced and a shard ran until idle (the endpoint's script decides which
    fail); `spec` overrides fields of the subscription document."""
    from varadhi.kafka.subscriptions import SubscriptionService
    from varadhi.core.subscription_spec import parse_spec
    from varadhi.testing.harness import produce, run_until_idle
    from varadhi.kafka.topics import TopicService

    def make(endpoint, messages: list[tuple[str, str]], **overrides: Any):
        topic = unique_name("nb")
        TopicService(catalog).create(topic, 2)
        spec = parse_spec(
            {
                "name": unique_name("nb-sub"),
                "topic": topic,
                "endpoint": {"url": endpoint.url},
                "shards": 1,
                "retry": {
                    "max_attempts": 2,
                    "min_backoff": "100ms",
                    "max_backoff": "200ms",
                    "jitter": 0,
                },
                "consumption": {"trigger_interval": "100ms"},
            }
            | overrides
        )
        SubscriptionService(catalog).create(spec)
        produce(settings, spec.topic, messages)
        run_until_idle(settings, spark, spec.name)
        return spec

    return make
