"""`kafka.clients.end_transaction`: a transaction's commit or abort waited for at most its bound
(kafka-python's wait without one), with stand-in producers; the real broker that goes away inside
a transaction is tests/integration/test_transaction_broker_gone.py."""

from __future__ import annotations

import threading

import pytest
from kafka.errors import KafkaTimeoutError, ProducerFencedError

from varadhi.kafka.clients import end_transaction, transient


class Stuck:
    """A producer whose commit and abort never end until `release` (a broker gone)."""

    def __init__(self):
        self.release = threading.Event()

    def commit_transaction(self) -> None:
        self.release.wait()

    def abort_transaction(self) -> None:
        self.release.wait()


class Answers:
    """A producer whose commit and abort end at once, with `error` if one is given."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls: list[str] = []

    def commit_transaction(self) -> None:
        self.calls.append("commit")
        if self.error:
            raise self.error

    def abort_transaction(self) -> None:
        self.calls.append("abort")
        if self.error:
            raise self.error


@pytest.mark.parametrize("commit", [True, False])
def test_a_call_that_does_not_end_in_time_raises_a_retriable_timeout_naming_it(commit):
    producer = Stuck()
    try:
        with pytest.raises(KafkaTimeoutError) as raised:
            end_transaction(producer, commit=commit, timeout_s=0.05, what="shard 3")
    finally:
        producer.release.set()
    verb = "commit" if commit else "abort"
    assert str(raised.value).startswith(f"KafkaTimeoutError: shard 3: the transaction's {verb}")
    assert "did not end in 0.05 s" in str(raised.value)
    assert transient(raised.value)  # the shard's control loop rides it out


@pytest.mark.parametrize("commit", [True, False])
def test_a_call_that_ends_returns_or_raises_the_producers_own_error(commit):
    done = Answers()
    end_transaction(done, commit=commit, timeout_s=60, what="x")
    assert done.calls == ["commit" if commit else "abort"]
    fenced = Answers(ProducerFencedError())
    with pytest.raises(ProducerFencedError):
        end_transaction(fenced, commit=commit, timeout_s=60, what="x")
