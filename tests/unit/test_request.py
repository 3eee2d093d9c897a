"""`delivery.Request` refuses header injection whether or not it has seen the names before."""

from __future__ import annotations

import pytest

from varadhi.core import delivery
from varadhi.core.delivery import Request
from varadhi.core.errors import InvalidArgument


def test_a_name_seen_in_a_valid_request_still_refuses_a_bad_value():
    Request(b"", {"X-Seen-Name": "fine"})
    assert "X-Seen-Name" in delivery._TOKENS
    for value in ("a\r\nX-Evil: 1", "a\nb", "a\0"):
        with pytest.raises(InvalidArgument) as e:
            Request(b"", {"Other": "ok", "X-Seen-Name": value})
        assert e.value.field == "headers"


def test_a_bad_name_is_never_remembered_as_seen():
    for _ in range(2):
        with pytest.raises(InvalidArgument):
            Request(b"", {"Bad:Name": "v"})
    assert "Bad:Name" not in delivery._TOKENS


def test_the_names_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(delivery, "_TOKENS", set())
    monkeypatch.setattr(delivery, "_MAX_TOKENS", 3)
    for i in range(10):
        Request(b"", {f"X-Name-{i}": "v"})
    assert len(delivery._TOKENS) == 3
    Request(b"", {"X-Name-9": "v"})  # a name beyond the bound is checked every time, still valid
