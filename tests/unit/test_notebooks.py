"""The Databricks notebooks: their source format, that they are Python, and that they work through
the public API (`varadhi.Client`) rather than the command line's parser: every `client.<method>`
they call exists on `Client`, and none imports `varadhi.cli`. tests/notebooks runs them end to
end against the local stack.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from varadhi import Client, Settings

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = ("dlq_inspection.py", "offset_reset.py", "status.py")
HEADER = "# Databricks notebook source\n"
SEPARATOR = "\n# COMMAND ----------\n"


def notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.py"))


def python_source(text: str) -> str:
    """The notebook without its MAGIC lines (markdown, %pip, %sh)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("# MAGIC"))


def client_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, method) of every `client.<method>` attribute used in a notebook."""
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "client"
    ]


def imported_modules(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


# -- format ------------------------------------------------------------------------------------


def test_the_notebooks_exist():
    assert {p.name for p in notebooks()} >= set(EXPECTED)


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_databricks_source_format(path):
    text = path.read_text()
    assert text.startswith(HEADER), (
        "Databricks reads a .py file as a notebook only with this header"
    )
    cells = text[len(HEADER) :].split(SEPARATOR)
    assert len(cells) >= 3, "cells are separated by `# COMMAND ----------` lines"
    assert all(cell.strip() for cell in cells), "no empty cells"
    markdown = [c for c in cells if c.strip().startswith("# MAGIC %md")]
    assert markdown, "at least one markdown cell"
    for cell in markdown:
        lines = [line for line in cell.strip().splitlines()]
        assert all(line == "# MAGIC" or line.startswith("# MAGIC ") for line in lines), cell[:80]
    assert any("%pip install" in c for c in cells), "installs the wheel"
    assert "nb = Notebook(globals())" in text, "widgets and display through varadhi.notebook"
    assert "client = nb.client(" in text, "Kafka and the warehouse come from the widgets"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_parses_as_python(path):
    ast.parse(python_source(path.read_text()), filename=str(path))
    # The MAGIC lines are comments, so the file itself runs as a Python script as well.
    ast.parse(path.read_text(), filename=str(path))


# -- the API ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_works_through_the_client_not_the_command_line(path):
    tree = ast.parse(python_source(path.read_text()), filename=str(path))
    modules = imported_modules(tree)
    assert "varadhi.notebook.Notebook" in modules, "makes its varadhi.Client with Notebook"
    assert not {m for m in modules if m == "varadhi.cli" or m.startswith("varadhi.cli.")}
    calls = client_calls(tree)
    assert calls, "calls the client"
    client = Client(Settings())  # connects to nothing until used
    missing = [
        f"{path.name}:{ln}: client.{name}" for ln, name in calls if not hasattr(client, name)
    ]
    assert not missing, f"not on varadhi.Client: {missing}"


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_every_widget_has_a_local_fallback(path):
    """Run outside Databricks, `Notebook.widget` reads $VARADHI_NB_<NAME>
    (tests/unit/test_notebook_widgets.py): every widget goes through it, none through dbutils."""
    assert "dbutils" not in python_source(path.read_text()).replace("`dbutils`", "")


def test_the_api_check_can_fail():
    tree = ast.parse("client.status(x)\nclient.no_such_method(x)\nfrom varadhi.cli import main")
    assert [name for _, name in client_calls(tree)] == ["status", "no_such_method"]
    assert not hasattr(Client, "no_such_method") and hasattr(Client, "status")
    assert "varadhi.cli" in imported_modules(tree)
