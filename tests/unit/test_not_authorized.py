"""A refusal by the cluster's ACLs as one line naming principal, operation and resource: from
kafka-python's errors and from the text of a failed Spark query (docs/kafka-acls.md)."""

from __future__ import annotations

from kafka.errors import TopicAuthorizationFailedError, TransactionalIdAuthorizationFailedError

from varadhi import kafka_clients, kafka_config
from varadhi.errors import NotAuthorized
from varadhi.settings import Settings

CAROL = Settings(
    kafka=kafka_config.from_properties(
        {
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": "org.apache.kafka.common.security.scram.ScramLoginModule "
            'required username="carol" password="not-shown";',
        },
        environ={},
    )
)

DLQ_WRITE = """Traceback (most recent call last):
  File "/x/py4j/clientserver.py", line 644, in _call_proxy
  File "/x/varadhi/shard.py", line 1024, in _send_outs
  File "/x/site-packages/kafka/producer/future.py", line 108, in get
kafka.errors.TopicAuthorizationFailedError: [Error 29] TopicAuthorizationFailedError: {'s.dlq.0'}
"""

SOURCE_READ = (
    "Caused by: org.apache.spark.SparkException: Job aborted due to stage failure: ...\n"
    "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to "
    "access topics: [t.0]\n\tat org.apache.kafka.clients.consumer..."
)


def test_the_line_names_who_lacks_what_and_how_to_grant_it():
    e = NotAuthorized("Write", "TransactionalId", "varadhi.s.s1.shard-0", "User:carol")
    assert str(e) == (
        "not authorized: User:carol lacks Write on TransactionalId varadhi.s.s1.shard-0 "
        "(kafka-acls.sh --add --allow-principal User:carol --operation Write "
        "--transactional-id varadhi.s.s1.shard-0)"
    )
    assert e.exit_code == 4


def test_kafka_python_errors_name_their_resource():
    e = kafka_clients.refused(CAROL, TopicAuthorizationFailedError("t.0"), "Write")
    assert (e.operation, e.resource_type, e.name, e.principal) == ("Write", "Topic", "t.0",
                                                                   "User:carol")  # fmt: skip
    e = kafka_clients.refused(CAROL, TransactionalIdAuthorizationFailedError(), "Write", "tid")
    assert (e.resource_type, e.name) == ("TransactionalId", "tid")


def test_a_failed_query_names_the_resource_and_the_client_s_operation():
    e = kafka_clients.refused_in(CAROL, "query failed: " + DLQ_WRITE)
    assert (e.operation, e.resource_type, e.name) == ("Write", "Topic", "s.dlq.0")
    consumer = DLQ_WRITE.replace("kafka/producer/future.py", "kafka/consumer/fetcher.py")
    assert kafka_clients.refused_in(CAROL, consumer).operation == "Read"


def test_the_java_client_names_the_topic_but_not_the_operation():
    e = kafka_clients.refused_in(CAROL, SOURCE_READ)
    assert (e.operation, e.resource_type, e.name) == ("Describe or Read", "Topic", "t.0")
    assert "--operation Describe --operation Read --topic t.0" in str(e)


def test_other_failures_are_not_taken_for_refusals():
    assert kafka_clients.refused_in(CAROL, "query failed: Connection refused") is None
    assert "not-shown" not in str(kafka_clients.refused_in(CAROL, SOURCE_READ))
