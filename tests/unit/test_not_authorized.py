"""A refusal by the cluster's ACLs as one line naming principal, operation and resource: from
kafka-python's errors and from the text of a failed Spark query (docs/kafka-acls.md)."""

from __future__ import annotations

import pytest
from kafka.errors import TopicAuthorizationFailedError, TransactionalIdAuthorizationFailedError

from varadhi.core.errors import NotAuthorized, VaradhiError
from varadhi.jobs import runner
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import config as kafka_config
from varadhi.kafka.settings import Settings

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
  File "/x/varadhi/spark/shard/job.py", line 1024, in _send_outs
  File "/x/site-packages/kafka/producer/future.py", line 108, in get
kafka.errors.TopicAuthorizationFailedError: [Error 29] TopicAuthorizationFailedError: {'s.dlq.0'}
"""

SOURCE_READ = (
    "Caused by: org.apache.spark.SparkException: Job aborted due to stage failure: ...\n"
    "Caused by: org.apache.kafka.common.errors.TopicAuthorizationException: Not authorized to "
    "access topics: [t.0]\n\tat org.apache.kafka.clients.consumer..."
)

# Spark's Kafka sink refused Write on a feeder's new RQ storage topic: the Py4JJavaError of its
# save() against the secured broker (shortened). The task's error has no frames; the driver's
# name the Kafka sink also when a read in the same job is what was refused.
SINK_WRITE = (
    "An error occurred while calling o1576.save.\n: org.apache.spark.SparkException: Job aborted "
    "due to stage failure: Task 0 in stage 29.0 failed 1 times, most recent failure: Lost task "
    "0.0 in stage 29.0 (TID 46) (localhost executor driver): org.apache.kafka.common.errors."
    "TopicAuthorizationException: Not authorized to access topics: [s.rq.1]\n\nDriver stacktrace:"
    "\n\tat org.apache.spark.scheduler.DAGScheduler.$anonfun$abortStage$3(DAGScheduler.scala:3122)"
    "\n\tat org.apache.spark.sql.kafka010.KafkaWriter$.write(KafkaWriter.scala:72)\n"
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


def test_a_refused_write_by_spark_s_kafka_sink_is_named_write_by_its_caller():
    """The Java client's text is the same for a refused read and write; the caller says which
    topics its failed action only wrote (the feeder: the new storage topic)."""
    e = kafka_clients.refused_in(CAROL, SINK_WRITE, writes={"s.rq.1"})
    assert (e.operation, e.resource_type, e.name) == ("Write", "Topic", "s.rq.1")
    assert "--operation Write --topic s.rq.1)" in str(e)
    assert kafka_clients.refused_in(CAROL, SINK_WRITE).operation == "Describe or Read"
    assert kafka_clients.refused_in(CAROL, SINK_WRITE, {"s.rq.0"}).operation == "Describe or Read"


def test_a_line_the_product_raised_inside_a_query_is_kept():
    """A NotAuthorized raised in a foreachBatch function reaches the caller as text."""
    named = NotAuthorized("Write", "TransactionalId", "varadhi-delta-outbox-o", "User:carol")
    text = f"StreamingQueryException: ... varadhi.core.errors.NotAuthorized: {named}\n  at ..."
    e = kafka_clients.refused_in(CAROL, text)
    assert str(e) == str(named) and e.principal == "User:carol"
    anonymous = NotAuthorized("Describe or Read", "Topic", "t.0", None)
    assert str(kafka_clients.refused_in(CAROL, f"x: {anonymous}")) == str(anonymous)


class _Py4JError(Exception):
    """Stands for py4j's Py4JJavaError: its text is the Java exception's, with its causes."""


def test_refusal_reads_the_error_and_what_it_was_raised_from():
    try:
        try:
            raise _Py4JError(SINK_WRITE)
        except _Py4JError as java:
            raise VaradhiError("replay r1 failed: see the Spark job") from java
    except VaradhiError as wrapped:
        e = kafka_clients.refusal(CAROL, wrapped)
    assert (e.operation, e.name) == ("Describe or Read", "s.rq.1")
    assert kafka_clients.refusal(CAROL, VaradhiError("query failed: Connection refused")) is None
    assert kafka_clients.refusal(CAROL, NotAuthorized("Read", "Topic", "t", None)) is None


def test_a_job_ends_a_missing_acl_in_one_line_with_exit_code_4(tmp_path, monkeypatch, capsys):
    """Every job's errors go through `runner.run` (varadhi-job, python -m, spark-submit)."""
    config = tmp_path / "carol.properties"
    config.write_text(
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        'username="carol" password="not-shown";\n'
    )
    monkeypatch.setenv("VARADHI_KAFKA_CONFIG", str(config))

    def spark_job(argv):
        raise _Py4JError(SINK_WRITE)

    def failing(argv):
        raise VaradhiError("replay r1 failed") from _Py4JError(SOURCE_READ)

    assert runner.run(spark_job, []) == 4
    assert capsys.readouterr().err == (
        "varadhi: not authorized: User:carol lacks Describe or Read on Topic s.rq.1 (kafka-acls.sh"
        " --add --allow-principal User:carol --operation Describe --operation Read --topic s.rq.1)\n"
    )
    assert runner.run(failing, []) == 4
    assert "lacks Describe or Read on Topic t.0 " in capsys.readouterr().err
    assert runner.run(lambda argv: 0, []) == 0

    def broken(argv):
        raise RuntimeError("not about Kafka")

    with pytest.raises(RuntimeError):
        runner.run(broken, [])
