"""The text forms of record ids (`varadhi.core.record_ids.text_id`) and binary-safe headers."""

from __future__ import annotations

import base64
import hashlib

import pytest

from varadhi.core import messages as m
from varadhi.core.record_ids import B64_MAX_BYTES, TEXT_MAX_BYTES, header_value, text_id

AVRO_KEY = b"\x00\x00\x00\x00\x07\x06abc"  # Schema Registry frame: magic 0, schema id 7


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (None, None),
        (b"", None),
        (b"customer-42", "customer-42"),
        ("größe-日本".encode(), "größe-日本"),
        (b"\xff\xfe", "b64:" + base64.b64encode(b"\xff\xfe").decode()),
        (AVRO_KEY, "b64:" + base64.b64encode(AVRO_KEY).decode()),
        (b"a\r\nX-Evil: 1", "b64:" + base64.b64encode(b"a\r\nX-Evil: 1").decode()),
        (b"tab\there", "b64:" + base64.b64encode(b"tab\there").decode()),
        (b"del\x7f", "b64:" + base64.b64encode(b"del\x7f").decode()),
        (b"\xed\xa0\x80", "b64:7aCA"),  # an encoded surrogate is not UTF-8
        (b"x" * TEXT_MAX_BYTES, "x" * TEXT_MAX_BYTES),
        (b"x" * (TEXT_MAX_BYTES + 1), "sha256:" + hashlib.sha256(b"x" * 1025).hexdigest()),
        (b"\xff" * B64_MAX_BYTES, "b64:" + base64.b64encode(b"\xff" * B64_MAX_BYTES).decode()),
        (b"\xff" * 257, "sha256:" + hashlib.sha256(b"\xff" * 257).hexdigest()),
    ],
)
def test_text_form(data, expected):
    assert text_id(data) == expected


@pytest.mark.parametrize(
    "data", [b"plain", b"\xff\xfe", AVRO_KEY, b"\x00" * 300, b"y" * 5000, "é".encode() * 600]
)
def test_a_text_form_is_its_own_text_form(data):
    """RQ/DLQ copies carry text forms; read back, they must give the same group key."""
    once = text_id(data)
    assert once.isprintable() and len(once.encode()) <= TEXT_MAX_BYTES
    assert text_id(once.encode()) == once


def test_headers_to_dict_never_raises_and_keeps_the_first_of_a_repeated_header():
    headers = [("a", b"1"), ("bin", b"\xff\x00"), ("a", b"2"), ("none", None), ("e", b"")]
    assert m.headers_to_dict(headers) == {"a": "1", "bin": "b64:/wA=", "none": "", "e": ""}
    assert header_value(headers, "a") == b"1"
    assert header_value(headers, "missing") is None
