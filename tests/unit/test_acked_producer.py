"""`varadhi.kafka.acked_producer`'s pure parts: an `Ack`'s callbacks and the typed error of a
refused write (the producer against a real broker: tests/integration/test_acked_producer.py)."""

from __future__ import annotations

import confluent_kafka
import kafka.errors
import pytest

from varadhi.core.errors import KafkaUnavailable, NotAuthorized
from varadhi.kafka.acked_producer import Ack, write_error
from varadhi.kafka.config import from_properties
from varadhi.kafka.settings import Settings

#: Nothing listens there: `explain` says so at once (loopback, refused).
SETTINGS = Settings(bootstrap="127.0.0.1:9")


def test_callbacks_added_before_or_after_the_acknowledgement_run_once():
    ack, seen = Ack(), []
    ack.add_callback(lambda meta: seen.append(("before", meta)))
    ack.add_errback(lambda e: seen.append(("error", e)))
    ack.resolve(None)
    ack.resolve(RuntimeError("late"))  # a second outcome is ignored
    ack.add_callback(lambda meta: seen.append(("after", meta)))
    ack.add_errback(lambda e: seen.append(("error", e)))
    assert seen == [("before", None), ("after", None)]
    ack.get(0)


def test_a_refused_write_calls_the_errbacks_and_get_raises_it():
    ack, seen = Ack(), []
    error = RuntimeError("refused")
    ack.add_errback(seen.append)
    ack.add_callback(lambda _meta: seen.append("acknowledged"))
    ack.resolve(error)
    ack.add_errback(seen.append)
    assert seen == [error, error]
    with pytest.raises(RuntimeError, match="refused"):
        ack.get(0)


def test_get_times_out_while_nothing_came():
    with pytest.raises(TimeoutError, match="not acknowledged within 0.01 s"):
        Ack().get(0.01)


def test_a_missing_write_acl_is_named_with_the_topic_and_the_user():
    settings = Settings(
        bootstrap="127.0.0.1:9",
        kafka=from_properties(
            {
                "security.protocol": "SASL_PLAINTEXT",
                "sasl.mechanism": "PLAIN",
                "sasl.jaas.config": "org.apache.kafka.common.security.plain.PlainLoginModule "
                'required username="member" password="secret";',
            }
        ),
    )
    error = write_error(
        settings,
        "s.rq.0",
        confluent_kafka.KafkaError(confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED),
    )
    assert isinstance(error, NotAuthorized) and error.exit_code == 4
    assert "User:member lacks Write on Topic s.rq.0" in str(error)


def test_a_brokers_error_code_is_kafka_pythons_error_of_that_code():
    error = write_error(
        SETTINGS,
        "s.dlq.0",
        confluent_kafka.KafkaError(confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE),
    )
    assert isinstance(error, kafka.errors.MessageSizeTooLargeError)
    assert "s.dlq.0" in str(error)


def test_a_write_that_found_no_broker_is_the_cluster_unavailable_with_its_cause():
    error = write_error(
        SETTINGS, "s.rq.0", confluent_kafka.KafkaError(confluent_kafka.KafkaError._MSG_TIMED_OUT)
    )
    assert isinstance(error, KafkaUnavailable)
    assert "cannot connect to Kafka at 127.0.0.1:9" in str(error) and "nothing answers" in str(
        error
    )


def test_another_local_error_names_the_topic_and_librdkafkas_error():
    error = write_error(
        SETTINGS,
        "s.rq.0",
        confluent_kafka.KafkaError(confluent_kafka.KafkaError._UNKNOWN_PARTITION),
    )
    assert type(error) is kafka.errors.KafkaError
    assert "s.rq.0: _UNKNOWN_PARTITION: Local: Unknown partition" in str(error)
