"""The shard driver's module boundaries (docs/architecture.md, "The shard driver, module by
module"), read from the source without importing it: the driver (`varadhi.shard`) uses its
parts, never the reverse, and the batch-commit protocol knows only its ports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lib" / "varadhi"
PARTS = ["shard_ends", "shard_journal", "shard_lease", "shard_query", "shard_reading",
         "shard_sender", "shard_stats", "shard_ticks", "batch_commit"]  # fmt: skip


def imports(module: str) -> set[str]:
    """The modules `varadhi.<module>` imports directly (relative imports made absolute; for
    `from . import x`, `varadhi.x`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ("varadhi." + (node.module or "")).rstrip(".") if node.level else node.module
            found.add(base)
            if node.level and not node.module:
                found.update(f"varadhi.{a.name}" for a in node.names)
    return found


@pytest.mark.parametrize("part", PARTS)
def test_no_part_of_the_driver_imports_the_driver(part):
    assert "varadhi.shard" not in imports(part)


def test_the_batch_commit_protocol_imports_no_spark_kafka_or_other_varadhi_module():
    found = imports("batch_commit")
    assert not {m for m in found if m.split(".")[0] in ("pyspark", "kafka", "py4j")}
    assert {m for m in found if m.startswith("varadhi.")} <= {
        "varadhi.faults",
        "varadhi.state_rows",
    }


def test_the_driver_uses_its_parts_and_the_walk_sees_relative_imports():
    assert {f"varadhi.{p}" for p in PARTS} <= imports("shard")


@pytest.mark.parametrize("module", ["shard_ends", "catalog_kinds"])
def test_the_driver_s_decisions_and_the_catalog_kinds_import_no_spark_or_kafka(module):
    """`shard_ends` is pure (the query's end, verdicts, catalog changes, idleness);
    `catalog_kinds` imports nothing at all, so any module (executors' too) may name a kind."""
    found = imports(module)
    assert not {m for m in found if m.split(".")[0] in ("pyspark", "kafka", "py4j")}
    if module == "catalog_kinds":
        assert found <= {"__future__", "enum"}
