"""What the command line prints of what other programs wrote (message and group ids, reasons,
an endpoint's answer) reaches a terminal escaped: no control character, so no ANSI escape
sequence a forged DLQ record carries can rewrite the operator's screen (issue 30). The Client is
a fake; no service starts."""

from __future__ import annotations

from contextlib import contextmanager

from varadhi.cli import common
from varadhi.cli import main as cli

ESC = "\x1b"
FORGED = {
    "msg_id": f"m-1{ESC}[2J",
    "group_id": f"g{ESC}]0;pwned\x07",
    "attempts": 3,
    "status": 500,
    "state": "parked",
    "redriven_by": f"redrive-1{ESC}[2J",
    "reason": f"HTTP 500{ESC}[31m red\r\nfake line\x9b",
}


class FakeClient:
    def dlq_messages(self, name, group_id, limit):
        return [FORGED]


def test_dlq_list_prints_control_characters_escaped(monkeypatch, capsys):
    @contextmanager
    def client(_args):
        yield FakeClient()

    monkeypatch.setattr(common, "client", client)
    assert cli(["dlq", "list", "orders-http"]) == 0
    out = capsys.readouterr().out
    assert ESC not in out and "\x07" not in out and "\x9b" not in out and "\r" not in out
    assert "\\x1b[31m red\\x0d\\x0afake line" in out
    assert out.count("\n") == 2  # the heading and one row: a CR/LF in a reason is no new line
