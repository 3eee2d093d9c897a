"""Batch mode of delivery (`delivery.mode: batch`): the request body that carries several
messages, and what the endpoint's answer means for each of them. Pure functions, no I/O; the
HTTP engine (`varadhi.core.delivery.HttpDeliverer`) gathers the messages and calls these.

Request. One entry per message, as NDJSON (one JSON object a line, `application/x-ndjson`) or
as a JSON array (`application/json`), with the header `X-Varadhi-Batch-Size: <n>`:

    {"id": "5f0c...", "group": "customer-42", "attempt": 1,
     "source": {"topic": "orders.0", "partition": 3, "offset": 1017},
     "produced_at": 1764160000000, "value": "{\\"order\\": 1}"}

`value` is the message body as text when it is UTF-8; otherwise the entry has `value_base64`
instead. `group` is null for an ungrouped subscription; `produced_at` is left out when the
producer did not set it; `redriven` (the id of the DLQ re-drive that put the message back, as
single mode's `X-Varadhi-Redriven` header) only on a re-driven message. No two entries of one
request have the same id.

Answer. Any 2xx but 207: every message of the request was accepted. A non-2xx status, a timeout
or a connection error: every message gets that outcome (and follows its own retry/DLQ path with
it). 207: a multi-status body, a JSON array with exactly one object per message of the request:

    [{"id": "5f0c...", "status": 200},
     {"id": "77a1...", "status": 503, "retry_after": 5, "detail": "shard busy"}]

`status` (200-599) is matched against the retry policy's response table like a single request's
status; `retry_after` (seconds, or an HTTP-date string) counts as that message's Retry-After
header; `detail` (text) is kept on the message's dead letter as the endpoint's answer. Other
keys are ignored. A 207 whose body is not such an array (not JSON, cut off at `MAX_ANSWER_BYTES`,
an entry without a string id or an integer status, an id the request did not carry, one listed
twice, one left out, or nesting too deep to parse) is a failure of the whole request: every message gets the pseudo code
`invalid_response` (default: retry) with the reason, never a success.

Order. A request carries at most one message per group: the engine asks each group (a `Stream`)
for its next message only after the outcome of the previous one was handed back, exactly as in
single mode. So a group's failed message is never overtaken by a later one of its group, and a
207 cannot report a later message accepted while an earlier one failed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from varadhi.core import messages as m
from varadhi.core.policies import BatchFormat

MULTI_STATUS = 207
# The most of a 207 answer the engine reads; a longer one is an `invalid_response`. 1,000
# results with 100-character ids take about 130 kB.
MAX_ANSWER_BYTES = 1_048_576
MAX_BATCH_MESSAGES = 1_000
MIN_BATCH_BYTES = 1_024
MAX_BATCH_BYTES = 16_777_216
BATCH_SIZE_HEADER = "X-Varadhi-Batch-Size"
INVALID = "invalid_response"

CONTENT_TYPES: Mapping[str, str] = {
    "ndjson": "application/x-ndjson",
    "json_array": "application/json",
}


@dataclass(frozen=True, slots=True)
class Entry:
    """One message as a batch entry: its id and its JSON text (UTF-8, no newline)."""

    id: str
    data: bytes


@dataclass(frozen=True, slots=True)
class Result:
    """What one message of a batch request got, in the terms of `varadhi.core.delivery.Outcome`:
    exactly one of `status` and `error` is set; `body` is what a dead letter keeps of the
    answer."""

    status: int | None
    error: str | None
    detail: str
    retry_after: str | None
    body: bytes


class InvalidAnswer(ValueError):
    """A 207 answer that does not say what became of each message; the text says why."""


def encode_entry(body: bytes, headers: Mapping[str, str]) -> Entry:
    """The batch entry of a single-mode request (`varadhi.core.group_state.http_headers`): its id,
    group, attempt, produced time, source and re-drive come from the request's headers, its
    value from the body. Raises KeyError or ValueError for a request without a message id or
    attempt number (every request a shard builds has them)."""
    msg_id = headers[m.HTTP_MESSAGE_ID]
    entry: dict[str, object] = {
        "id": msg_id,
        "group": headers.get(m.HTTP_GROUP_ID),
        "attempt": int(headers[m.HTTP_ATTEMPT]),
        "source": _source(headers.get(m.HTTP_SOURCE, "")),
    }
    produced = headers.get(m.HTTP_PRODUCED_AT)
    if produced:
        entry["produced_at"] = int(produced)
    redriven = headers.get(m.HTTP_REDRIVEN)
    if redriven:
        entry["redriven"] = redriven
    try:
        entry["value"] = body.decode("utf-8")
    except UnicodeDecodeError:
        entry["value_base64"] = base64.b64encode(body).decode("ascii")
    # ASCII JSON: any id or value (lone surrogates included) encodes.
    return Entry(msg_id, json.dumps(entry, separators=(",", ":")).encode("ascii"))


def _source(text: str) -> dict[str, object] | None:
    """`"orders.0/3/1017"` as `{"topic": "orders.0", "partition": 3, "offset": 1017}`."""
    parts = text.rsplit("/", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return {"topic": parts[0], "partition": int(parts[1]), "offset": int(parts[2])}


def body_size(entries: int, data_bytes: int) -> int:
    """The size of a body of `entries` entries of `data_bytes` in all, in either format (an
    upper bound: one separator byte per entry, plus the array's brackets)."""
    return data_bytes + entries + 2


def encode_body(entries: Sequence[bytes], format: BatchFormat) -> bytes:
    """The request body of these entries (in this order)."""
    if format == "ndjson":
        return b"\n".join(entries) + b"\n"
    return b"[" + b",".join(entries) + b"]"


def split_answer(
    status: int | None,
    error: str | None,
    detail: str,
    retry_after: str | None,
    body: bytes,
    truncated: bool,
    ids: Sequence[str],
    snippet_bytes: int,
) -> list[Result]:
    """The outcome of each message (`ids`, in request order) of a batch request that ended so.

    A 207 is read as a multi-status body (`parse_multi_status`); a malformed one gives every
    message the error `invalid_response` and a reason. Any other answer applies to every
    message as it is. `body` is what the engine read of the answer (`truncated`: there was
    more); a dead letter keeps at most `snippet_bytes` of it."""
    if error is None and status == MULTI_STATUS:
        try:
            return parse_multi_status(body, truncated, ids, snippet_bytes)
        except InvalidAnswer as e:
            text = f"HTTP 207 multi-status answer {e}"
            return [Result(None, INVALID, text, None, body[:snippet_bytes])] * len(ids)
    return [Result(status, error, detail, retry_after, body[:snippet_bytes])] * len(ids)


def parse_multi_status(
    body: bytes, truncated: bool, ids: Sequence[str], snippet_bytes: int
) -> list[Result]:
    """The per-message results of a 207 body, in the order of `ids`, or InvalidAnswer saying
    what is wrong (see the module docstring)."""
    if truncated:
        raise InvalidAnswer(f"is larger than {MAX_ANSWER_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise InvalidAnswer(f"is not JSON ({e})") from None
    except RecursionError:  # `[[[[...` a million deep: json's parser recurses per level
        raise InvalidAnswer("is nested too deeply to be a multi-status array") from None
    if not isinstance(doc, list):
        raise InvalidAnswer(f"is not a JSON array (a {type(doc).__name__})")
    wanted = set(ids)
    found: dict[str, Result] = {}
    for i, item in enumerate(doc):
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise InvalidAnswer(f"entry {i} has no string id")
        msg_id, code = item["id"], item.get("status")
        if msg_id not in wanted:
            raise InvalidAnswer(f"lists id {_show(msg_id)}, which the request did not carry")
        if msg_id in found:
            raise InvalidAnswer(f"lists id {_show(msg_id)} twice")
        if isinstance(code, bool) or not isinstance(code, int) or not 200 <= code <= 599:
            raise InvalidAnswer(f"entry {i} (id {_show(msg_id)}): status must be 200-599")
        found[msg_id] = _result(i, msg_id, code, item, snippet_bytes)
    missing = [i for i in ids if i not in found]
    if missing:
        raise InvalidAnswer(
            f"leaves out {len(missing)} of {len(ids)} ids (first: {_show(missing[0])})"
        )
    return [found[i] for i in ids]


def _result(i: int, msg_id: str, code: int, item: dict, snippet_bytes: int) -> Result:
    after = item.get("retry_after")
    if after is not None:
        if isinstance(after, int) and not isinstance(after, bool) and after >= 0:
            after = str(after)
        elif not isinstance(after, str):
            raise InvalidAnswer(
                f"entry {i} (id {_show(msg_id)}): retry_after must be seconds or an HTTP-date"
            )
    text = item.get("detail")
    if text is not None and not isinstance(text, str):
        raise InvalidAnswer(f"entry {i} (id {_show(msg_id)}): detail must be text")
    body = text.encode("utf-8", "replace")[:snippet_bytes] if text else b""
    return Result(code, None, f"HTTP {code} (207 entry)", after, body)


def _show(msg_id: str) -> str:
    return repr(msg_id if len(msg_id) <= 64 else msg_id[:61] + "...")
