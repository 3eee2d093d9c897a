"""The Databricks notebooks: their source format, that they are Python, and that every `varadhi`
command they run parses with the real command line (`varadhi.cli.build_parser`).

Notebooks run commands as `cli([...])` with a literal list: string constants for commands and
flags, variables only for values. A variable is replaced by a value its option accepts (a choice,
a number or a word); `"--execute" if x else "--dry-run"` is checked both ways. Shell forms
(`%sh varadhi ...`, `!varadhi ...`) are checked too. Commands of the `offsets` group are skipped
only while that group is not registered (it is written alongside); once it is, they are checked.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import shlex
from pathlib import Path

import pytest

from varadhi.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = ROOT / "notebooks"
EXPECTED = ("dlq_inspection.py", "offset_reset.py", "status.py")
HEADER = "# Databricks notebook source\n"
SEPARATOR = "\n# COMMAND ----------\n"
PENDING_GROUPS = {"offsets"}  # may be skipped while not registered, never otherwise


class Var:
    """A value the notebook computes at run time."""

    def __repr__(self) -> str:
        return "<var>"


VAR = Var()


def notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.py"))


def python_source(text: str) -> str:
    """The notebook without its MAGIC lines (markdown, %pip, %sh)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("# MAGIC"))


def _element(node: ast.expr, where: str) -> list[str | Var]:
    """The alternatives one list element can take."""
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, str):
            raise AssertionError(f"{where}: CLI arguments must be strings, got {node.value!r}")
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _element(node.body, where) + _element(node.orelse, where)
    if isinstance(node, ast.Starred):
        raise AssertionError(f"{where}: no *unpacking in a CLI call; list the arguments")
    return [VAR]


def cli_invocations(path: Path) -> list[tuple[str, list[str | Var]]]:
    """(where, argument list) of every varadhi invocation in a notebook, alternatives expanded."""
    text = path.read_text()
    found: list[tuple[str, list[str | Var]]] = []
    for node in ast.walk(ast.parse(python_source(text))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cli"):
            continue
        where = f"{path.name}:{node.lineno}"
        if len(node.args) != 1 or not isinstance(node.args[0], ast.List):
            raise AssertionError(f"{where}: cli(...) must be called with one literal list")
        options = [_element(e, where) for e in node.args[0].elts]
        for i, argv in enumerate(itertools.product(*options)):
            found.append((f"{where}#{i}" if i else where, list(argv)))
    shell = re.compile(r"^(?:# MAGIC )?\s*(?:%sh\s+|!)varadhi\s+(.*)$")
    for n, line in enumerate(text.splitlines(), 1):
        match = shell.match(line)
        if match:
            argv = [VAR if tok.startswith("$") else tok for tok in shlex.split(match.group(1))]
            found.append((f"{path.name}:{n}", argv))
    return found


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _sample(action: argparse.Action | None) -> str:
    if action is not None and action.choices:
        return str(next(iter(action.choices)))
    if action is not None and action.type in (int, float):
        return "1"
    return "x"


def concrete(parser: argparse.ArgumentParser, argv: list[str | Var]) -> list[str]:
    """`argv` with each variable replaced by a value the option (or positional) before it takes."""
    out: list[str] = []
    current = parser
    expecting: argparse.Action | None = None
    for tok in argv:
        if isinstance(tok, Var):
            out.append(_sample(expecting))
            if expecting is not None and expecting.nargs not in ("+", "*"):
                expecting = None
            continue
        out.append(tok)
        subs = _subparsers(current)
        if tok.startswith("-"):
            action = current._option_string_actions.get(tok.split("=", 1)[0])
            takes_value = action is not None and action.nargs != 0 and "=" not in tok
            expecting = action if takes_value else None
        elif subs is not None and tok in subs.choices:
            current = subs.choices[tok]
            expecting = None
        elif expecting is not None and expecting.nargs not in ("+", "*"):
            expecting = None
    return out


def registered_groups() -> set[str]:
    return set(_subparsers(build_parser()).choices)


def all_invocations() -> list[tuple[str, list[str | Var]]]:
    return [inv for path in notebooks() for inv in cli_invocations(path)]


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
    assert re.search(r'widget\(\s*"bootstrap"', text), "Kafka comes from a widget"
    assert "dbutils.widgets.text(" in text


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_parses_as_python(path):
    ast.parse(python_source(path.read_text()), filename=str(path))
    # The MAGIC lines are comments, so the file itself runs as a Python script as well.
    ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", notebooks(), ids=lambda p: p.name)
def test_every_notebook_runs_the_cli(path):
    assert cli_invocations(path), "the extraction below found no `varadhi` invocation"


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where,argv", all_invocations(), ids=[where for where, _ in all_invocations()]
)
def test_cli_invocation_parses(where, argv, capsys):
    group = argv[0] if argv and isinstance(argv[0], str) else None
    if group in PENDING_GROUPS and group not in registered_groups():
        pytest.skip(f"`varadhi {group}` is not registered yet")
    parser = build_parser()
    args = concrete(parser, ["--bootstrap", "127.0.0.1:19092", *argv])
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        pytest.fail(
            f"{where}: `varadhi {shlex.join(args)}` does not parse: {capsys.readouterr().err}"
        )
    assert callable(getattr(parsed, "func", None)), f"{where}: {args} selects no command"


def test_the_checker_rejects_what_the_cli_rejects():
    """The check above can fail: an unknown flag, a bad choice or a missing argument."""
    parser = build_parser()
    for bad in (
        ["dlq", "list", VAR, "--no-such-flag"],
        ["status"],
        ["subscription", "describe", VAR, "--output", "yaml"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(concrete(parser, bad))
    assert concrete(parser, ["dlq", "list", VAR, "--limit", VAR]) == [
        "dlq",
        "list",
        "x",
        "--limit",
        "1",
    ]
    assert concrete(parser, ["subscription", "describe", VAR, "--output", VAR])[-1] in (
        "text",
        "json",
    )
