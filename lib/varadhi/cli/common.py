"""Helpers shared by the command modules: settings from flags, JSON or table output."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..catalog import Catalog
from ..settings import Settings


def settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(
        command_config=getattr(args, "command_config", None),
        bootstrap=getattr(args, "bootstrap", None),
    )


def catalog(args: argparse.Namespace) -> Catalog:
    return Catalog(settings(args))


def add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", choices=["text", "json"], default="text", help="output format")


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
