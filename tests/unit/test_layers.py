"""The package's layers (docs/architecture.md, "The map"), read from the source without importing
it. Every import counts, a function's lazy import too, so that a rule cannot be dodged by moving
an import into a function.

- `varadhi.core` imports no other layer and none of pyspark, py4j, delta, kafka or psycopg;
- `varadhi.kafka` imports only the core (and Kafka);
- `varadhi.spark` imports only the core and the Kafka layer;
- the library runtime (`varadhi.library`) imports only the core and the Kafka layer (never
  Spark, the operations, the outbox or the jobs);
- operations (`varadhi.ops`) and the outbox do not import the shard job's internals
  (`varadhi.spark.shard`);
- no import cycle anywhere, between modules or between a package and its modules;
- inside the shard job, the driver (`varadhi.spark.shard.job`) uses its parts, never the
  reverse, and the batch-commit protocol knows only its ports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "lib"
HEAVY = ("pyspark", "py4j", "delta", "kafka", "psycopg")


def module_name(path: Path) -> str:
    parts = path.relative_to(LIB).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((LIB / "varadhi").rglob("*.py"))}


def imports(module: str) -> set[str]:
    """Every module `module` imports, absolute, lazy imports included. `from p import x` counts
    as an import of `p.x` when that is a module of the package, else of `p` (the package whose
    `__init__` defines `x`); importing a submodule runs its parents' `__init__`, which the rules
    do not count (an `__init__` with imports of its own is a module like any other)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".rstrip(".")
            names = [f"{base}.{a.name}" for a in node.names]
            found.update(n for n in names if n in MODULES)
            if any(n not in MODULES for n in names):  # an attribute of `base` itself
                found.add(base)
    return found


def internal(module: str) -> set[str]:
    return {m for m in imports(module) if m in MODULES and m != module}


def external_roots(module: str) -> set[str]:
    return {m.split(".")[0] for m in imports(module) if not m.startswith("varadhi")}


def in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(layer + ".")


def of_layer(layer: str) -> list[str]:
    return [m for m in MODULES if in_layer(m, layer)]


def test_the_walk_sees_every_kind_of_import():
    """The rules below are only as good as `imports`: it must see absolute, relative and lazy
    imports (the shard job imports its parts; `varadhi.spark.session` imports pyspark lazily)."""
    assert {"varadhi.spark.shard.query_run", "varadhi.spark.shard.ends"} <= internal(
        "varadhi.spark.shard.job"
    )
    assert "pyspark" in external_roots("varadhi.spark.warehouse_fs")
    assert len(of_layer("varadhi.core")) >= 15 and len(of_layer("varadhi.kafka")) >= 8


@pytest.mark.parametrize("module", of_layer("varadhi.core"))
def test_the_core_imports_no_spark_no_kafka_and_no_other_layer(module):
    assert not external_roots(module) & set(HEAVY)
    assert {m for m in internal(module) if not in_layer(m, "varadhi.core")} == set()


@pytest.mark.parametrize("module", of_layer("varadhi.kafka"))
def test_the_kafka_layer_imports_only_the_core(module):
    assert not external_roots(module) & {"pyspark", "py4j", "delta", "psycopg"}
    others = {m for m in internal(module) if not in_layer(m, "varadhi.core")}
    assert {m for m in others if not in_layer(m, "varadhi.kafka")} == set()


@pytest.mark.parametrize("module", of_layer("varadhi.spark"))
def test_the_spark_runtime_imports_only_the_core_and_the_kafka_layer(module):
    allowed = ("varadhi.core", "varadhi.kafka", "varadhi.spark")
    assert {m for m in internal(module) if not any(in_layer(m, a) for a in allowed)} == set()


@pytest.mark.parametrize("module", of_layer("varadhi.library"))
def test_the_library_runtime_imports_only_the_core_and_the_kafka_layer(module):
    assert not external_roots(module) & {"pyspark", "py4j", "delta", "psycopg"}
    allowed = ("varadhi.core", "varadhi.kafka", "varadhi.library")
    assert {m for m in internal(module) if not any(in_layer(m, a) for a in allowed)} == set()


@pytest.mark.parametrize("module", of_layer("varadhi.ops") + of_layer("varadhi.outbox"))
def test_operations_and_the_outbox_do_not_import_the_shard_jobs_internals(module):
    assert {m for m in internal(module) if in_layer(m, "varadhi.spark.shard")} == set()


def test_no_import_cycle():
    graph = {m: internal(m) for m in MODULES}
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(path[path.index(n) :] + [n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


SHARD_PARTS = [m for m in of_layer("varadhi.spark.shard") if m != "varadhi.spark.shard.job"]


@pytest.mark.parametrize("part", SHARD_PARTS)
def test_no_part_of_the_shard_job_imports_its_driver(part):
    assert "varadhi.spark.shard.job" not in imports(part)


def test_the_batch_commit_protocol_imports_no_spark_kafka_or_other_varadhi_module():
    found = imports("varadhi.spark.shard.commit")
    assert not {m for m in found if m.split(".")[0] in HEAVY}
    assert internal("varadhi.spark.shard.commit") <= {
        "varadhi.core",
        "varadhi.core.faults",
        "varadhi.core.state_frames",
        "varadhi.core.state_rows",
    }


def test_the_shard_jobs_decisions_import_no_spark_or_kafka():
    """`ends` is pure: the query's end, verdicts, catalog changes, idleness."""
    assert not external_roots("varadhi.spark.shard.ends") & set(HEAVY)
