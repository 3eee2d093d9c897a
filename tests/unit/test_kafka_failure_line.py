"""`varadhi.kafka.clients.failure`: the one line for a Kafka error that stops a client. Nothing
listens on 127.0.0.1:9, so a line that probed the connection would say it cannot connect."""

from __future__ import annotations

from kafka.errors import (
    InvalidSessionTimeoutError,
    KafkaConnectionError,
    MessageSizeTooLargeError,
    SaslAuthenticationFailedError,
)

from varadhi.kafka.clients import failure
from varadhi.kafka.settings import Settings

SETTINGS = Settings(bootstrap="127.0.0.1:9", catalog_topic="c", warehouse="/tmp/unused")


def test_a_brokers_refusal_is_told_as_one_with_its_error_and_not_as_a_connection_failing():
    line = failure(SETTINGS, InvalidSessionTimeoutError())
    assert line.startswith("Kafka at 127.0.0.1:9 refused a request: InvalidSessionTimeoutError: ")
    assert "session timeout is outside of the allowed range" in line
    assert "cannot connect" not in line
    assert "MessageSizeTooLargeError" in failure(SETTINGS, MessageSizeTooLargeError())


def test_a_login_refused_or_no_broker_is_a_failure_to_connect():
    for error in (SaslAuthenticationFailedError("wrong password"), KafkaConnectionError()):
        assert failure(SETTINGS, error).startswith("cannot connect to Kafka at 127.0.0.1:9")
