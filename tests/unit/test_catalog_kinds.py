"""The catalog's document and operation kinds (`varadhi.core.catalog_kinds`): persisted values that
never change, written as before, and spelled nowhere else in the package."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.jobs import definitions as jobdefs
from varadhi.kafka import dlq, leases, subscriptions, topics
from varadhi.kafka.catalog import key
from varadhi.ops import change_shards_plan, lifecycle, offsets, replay
from varadhi.spark import journal, layouts

PACKAGE = Path(__file__).resolve().parents[2] / "lib" / "varadhi"


def test_the_persisted_values_are_those_earlier_versions_wrote():
    assert {k.name: k.value for k in DocKind} == {
        "TOPIC": "topic",
        "SUBSCRIPTION": "subscription",
        "LEASE": "lease",
        "READER": "reader",
        "OPERATION": "operation",
        "HANDOVER": "handover",
    }
    assert {k.name: k.value for k in OpKind} == {
        "REPLAY": "replay",
        "DELETE": "delete",
        "OFFSET_RESET": "offset-reset",
        "UNSIDELINE": "unsideline",
        "CHANGE_SHARDS": "change-shards",
    }
    # A key and a document are the bytes plain strings gave.
    assert key(DocKind.OPERATION, "orders/offset-reset") == "operation/orders/offset-reset"
    doc = {"kind": OpKind.OFFSET_RESET, "step": "plan"}
    assert json.dumps(doc) == '{"kind": "offset-reset", "step": "plan"}'


def test_each_module_s_kind_is_the_one_enum_member():
    assert topics.KIND is DocKind.TOPIC and subscriptions.KIND is DocKind.SUBSCRIPTION
    assert leases.KIND is DocKind.LEASE and layouts.READER_KIND is DocKind.READER
    assert journal.HANDOVER_KIND is DocKind.HANDOVER
    for module in (dlq, lifecycle, offsets, replay, change_shards_plan):
        assert module.OPERATION is DocKind.OPERATION
    assert jobdefs.OPERATION_KIND is DocKind.OPERATION
    assert change_shards_plan.KIND is jobdefs.CHANGE_SHARDS is OpKind.CHANGE_SHARDS


CATALOGS = ("catalog", "snapshot", "snap")  # what the package names a catalog or a snapshot


def literal_kinds(path: Path) -> list[str]:
    """Where `path` spells a kind as a string: the first argument of `key(...)` or of a catalog
    or snapshot call (`catalog.get`, `snap.items`, ...), a `<kind>/...` f-string, an operation
    document's `"kind"`."""
    docs, ops = {k.value for k in DocKind}, {k.value for k in OpKind}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            on = getattr(func, "value", None)
            owner = getattr(on, "id", None) or getattr(on, "attr", None)
            of_catalog = isinstance(func, ast.Name) and func.id == "key" or owner in CATALOGS
            if of_catalog and isinstance(first, ast.Constant) and first.value in docs:
                found.append(f"{path.name}:{node.lineno} {first.value!r}")
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                kind = isinstance(k, ast.Constant) and k.value == "kind"
                if kind and isinstance(v, ast.Constant) and v.value in ops:
                    found.append(f"{path.name}:{node.lineno} kind {v.value!r}")
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            text = str(head.value) if isinstance(head, ast.Constant) else ""
            if "/" in text and text.split("/")[0] in docs:
                found.append(f"{path.name}:{node.lineno} f'{text}...'")
    return found


def test_no_module_spells_a_catalog_kind_itself():
    spelled = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "catalog_kinds.py"
        for hit in literal_kinds(path)
    ]
    assert spelled == []
