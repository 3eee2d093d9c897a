"""`varadhi produce NAME ...`: send one message, or a JSON-lines file of them, to a composite topic.

A file has one JSON object per line (blank lines are skipped):

    {"value": "text or any JSON", "group_id": "g1", "headers": {"k": "v"}, "message_id": "m1"}

Only `value` is required. A string value is sent as its UTF-8 bytes; any other JSON value
(object, array, number, boolean) as its compact JSON text. Every line is checked before anything
is sent; the first bad one is reported with its line number.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import replace

from varadhi.cli import common
from varadhi.core.errors import InvalidArgument
from varadhi.kafka.producer import Message, Producer, RecordMetadata, new_message_id, validate

FIELDS = {"value", "group_id", "headers", "message_id"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "produce",
        help="send messages to a composite topic",
        description="Send one message (--value) or a JSON-lines file (--file) to a composite "
        "topic, routed to the partition of its group; prints where each message landed.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", help="composite topic")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--value", help="the message value (UTF-8 text)")
    source.add_argument("--file", help="JSON-lines file of messages ('-' reads stdin)")
    p.add_argument("--group-id", help="group id of --value (omit for an ungrouped message)")
    p.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a header of --value (repeatable)",
    )
    p.add_argument("--message-id", help="message id of --value (default: a random uuid)")
    p.add_argument(
        "--transactional",
        action="store_true",
        help="send all messages in one Kafka transaction: all are committed or none",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=1_048_576,
        help="refuse values larger than this (default: 1 MiB)",
    )
    common.add_output(p)
    p.set_defaults(func=_produce)


def parse_line(text: str, line_no: int) -> Message | None:
    """The message on one line of a JSON-lines file (None for a blank line)."""
    if not text.strip():
        return None

    def bad(why: str) -> InvalidArgument:
        return InvalidArgument(why, field=f"line {line_no}")

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(doc, dict):
        raise bad(f"expected a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(FIELDS))}")
    value = doc.get("value")
    if value is None:
        raise bad("'value' is required")
    if not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    headers = doc.get("headers") or {}
    if not isinstance(headers, dict):
        raise bad("'headers' must be an object of strings")
    return Message(value, doc.get("group_id"), headers, doc.get("message_id"))


def read_messages(lines: Iterable[str], max_message_bytes: int) -> list[Message]:
    """Parse and validate every line; `InvalidArgument` names the first bad line."""
    messages = []
    for line_no, text in enumerate(lines, start=1):
        message = parse_line(text, line_no)
        if message is None:
            continue
        try:
            validate(message, max_message_bytes)
        except InvalidArgument as e:
            raise InvalidArgument(str(e), field=f"line {line_no}") from None
        messages.append(message)
    return messages


def parse_headers(pairs: list[str]) -> dict[str, str]:
    headers = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise InvalidArgument(f"expected KEY=VALUE, got {pair!r}", field="--header")
        headers[name] = value
    return headers


def _produce(args: argparse.Namespace) -> int:
    if args.file is not None:
        if args.group_id is not None or args.header or args.message_id is not None:
            raise InvalidArgument(
                "--group-id, --header and --message-id apply to --value; put them in the file"
            )
        messages = _read_file(args.file, args.max_message_bytes)
    else:
        message = Message(args.value, args.group_id, parse_headers(args.header), args.message_id)
        validate(message, args.max_message_bytes)
        messages = [message]
    # Ids are fixed here, so that every output row names its message (send_many returns only
    # Kafka's metadata).
    messages = [replace(m, message_id=m.message_id or new_message_id()) for m in messages]
    with Producer(
        args.name, common.settings(args), max_message_bytes=args.max_message_bytes
    ) as producer:
        if args.transactional:
            metadata = producer.send_many(messages)
        else:
            results = [
                producer.send(m.value, m.group_id, m.headers, m.message_id) for m in messages
            ]
            producer.flush()
            metadata = [r.get() for r in results]
    rows = [_row(m, md) for m, md in zip(messages, metadata, strict=True)]
    if args.output == "json":
        common.emit_json(rows)
    else:
        for row in rows:
            group = row["group_id"] if row["group_id"] is not None else "(ungrouped)"
            print(
                f"{row['storage_topic']} partition {row['partition']} offset {row['offset']}"
                f"  group {group}  id {row['message_id']}"
            )
    return 0


def _read_file(path: str, max_message_bytes: int) -> list[Message]:
    if path == "-":
        return read_messages(sys.stdin, max_message_bytes)
    try:
        with open(path, encoding="utf-8") as f:
            return read_messages(f, max_message_bytes)
    except OSError as e:
        raise InvalidArgument(f"cannot read {path}: {e.strerror}", field="--file") from None
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"{path} is not UTF-8: {e}", field="--file") from None


def _row(message: Message, metadata: RecordMetadata) -> dict:
    return {
        "storage_topic": metadata.topic,
        "partition": metadata.partition,
        "offset": metadata.offset,
        "group_id": message.group_id,
        "message_id": message.message_id,
    }
