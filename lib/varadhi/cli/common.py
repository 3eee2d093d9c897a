"""Helpers shared by the command modules: settings and the `Client` from flags, JSON output."""

from __future__ import annotations

import argparse
import json
from typing import Any

from varadhi.client import Client
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings


def settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(
        command_config=getattr(args, "command_config", None),
        bootstrap=getattr(args, "bootstrap", None),
    )


def catalog(args: argparse.Namespace) -> Catalog:
    return Catalog(settings(args))


def client(args: argparse.Namespace) -> Client:
    """The `Client` every command goes through (settings from --bootstrap, --command-config)."""
    return Client(settings(args))


def silent(_line: str) -> None:
    """The step log of a command whose output is JSON, or of a dry run: nothing."""


def add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", choices=["text", "json"], default="text", help="output format")


def emit_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
