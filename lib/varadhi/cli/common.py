"""Helpers shared by the command modules: settings and the `Client` from flags, JSON output."""

from __future__ import annotations

import argparse
import json
import re
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


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(value: object) -> str:
    """`value` as text safe to print on a terminal: control characters (C0, DEL, C1: the start
    of ANSI escape sequences among them) as `\\xNN`. For what other programs wrote: message and
    group ids, reasons, endpoints' answers (`--output json` escapes by itself)."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))
