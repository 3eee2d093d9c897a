"""Scraping a job's Prometheus exporter in tests (`scrape`, `value`): real HTTP, parsed with
prometheus_client's own text parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple], float]


def scrape(port: int, ignore: Iterable[str] = ("subscription", "shard")) -> Samples:
    """The exporter's samples at http://127.0.0.1:PORT/metrics: (name, sorted labels without
    those in `ignore`) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    skip = set(ignore)
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k not in skip}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample `name` with exactly `labels` (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str) -> float:
    """The sum of every sample of `name`, whatever its labels."""
    return sum(v for (n, _labels), v in samples.items() if n == name)
