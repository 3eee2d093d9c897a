"""What a failed query means for the shard (`varadhi.spark.shard.ends.judge`, pure), on failures read
by `varadhi.kafka.jvm_errors` from constructed cause chains and texts (no JVM)."""

from __future__ import annotations

from varadhi.kafka import jvm_errors
from varadhi.kafka.jvm_errors import Link
from varadhi.kafka.subscriptions import Suspension
from varadhi.spark.shard.ends import (
    QueryEnd,
    RunEnd,
    Verdict,
    catalog_change,
    idle,
    judge,
    waits_on_suspension,
)

NPE_FRAMES = (("org.apache.spark.sql.kafka010.KafkaMicroBatchStream", "metrics"),)
# A batch function's own error, as it comes back inside the Java PythonException (shortened).
PYTHON = (
    "An exception was raised by the Python Proxy. Return Message: Traceback (most recent call "
    'last):\n  File "/x/varadhi/spark/shard/job.py", line 781, in _on_batch\n{}\n'
)


def failure(*chain: Link, text: str = "") -> jvm_errors.Diagnosis:
    error = RuntimeError("the query failed")
    text = "\n".join([text, *(f"{c.class_name}: {c.message}" for c in chain)])
    return jvm_errors.Diagnosis(error, chain, text, jvm_errors.facts(chain, text))


def job_aborted(cause: Link) -> tuple[Link, Link]:
    return Link("org.apache.spark.SparkException", "Job aborted"), cause


def test_a_leader_change_in_a_query_failure_is_a_failure_not_a_fence():
    # Kafka's FencedLeaderEpochException: a partition's leader moved (retriable). Before, any
    # text containing "Fenced" made it a fence and the shard ended with exit 3.
    epoch = Link(
        "org.apache.kafka.common.errors.FencedLeaderEpochException",
        "The leader epoch in the request is older than the epoch on the broker.",
    )
    assert judge(failure(*job_aborted(epoch)), replayed=True) is Verdict.FAILED
    # kafka-python's error of that name in a batch function: retriable, so ridden out (below).
    python = PYTHON.format("kafka.errors.FencedLeaderEpochError: [Error 74] FencedLeaderEpochError")
    assert judge(failure(text=python), replayed=False) is Verdict.KAFKA_AWAY


def test_the_shard_s_own_fence_and_a_fenced_producer_are_fences():
    own = PYTHON.format(
        "varadhi.core.errors.Fenced: lease s/2/0: fenced (my epoch 3, current epoch 4)"
    )
    assert judge(failure(text=own), replayed=False) is Verdict.FENCED
    producer = Link("org.apache.kafka.common.errors.ProducerFencedException", "newer producer")
    assert judge(failure(*job_aborted(producer)), replayed=False) is Verdict.FENCED


def test_a_lease_found_expired_by_a_batch_is_waited_for_not_a_fence():
    """A batch that found the lease not renewed for its TTL (Kafka away) committed nothing;
    the control loop waits for the lease. Before, any failure after expiry was a fence."""
    expired = PYTHON.format(
        "varadhi.core.errors.LeaseExpired: lease s/2/0 not renewed for 15000 ms (Kafka does "
        "not answer): delivering nothing until it is renewed or another instance is seen to "
        "hold it"
    )
    assert judge(failure(text=expired), replayed=False) is Verdict.LEASE_EXPIRED
    word = failure(text=PYTHON.format("RuntimeError: HTTP 500 LeaseExpired"))
    assert judge(word, replayed=False) is Verdict.FAILED


def test_a_refused_batch_or_no_failure_is_no_verdict():
    assert judge(None, replayed=True) is None
    stopped = failure(text=PYTHON.format("varadhi.core.errors.StopRequested"))
    assert judge(stopped, replayed=True) is None
    # The word in a message is no stop (it was matched as a substring of any text before).
    word = failure(text=PYTHON.format("RuntimeError: HTTP 500 StopRequested"))
    assert judge(word, replayed=True) is Verdict.FAILED


def test_restarts_and_the_other_failures():
    zombie = Link("java.util.ConcurrentModificationException", "Multiple streaming jobs detected")
    assert judge(failure(zombie), replayed=False) is Verdict.ZOMBIE
    npe = Link("java.lang.NullPointerException", "", NPE_FRAMES)
    assert judge(failure(npe), replayed=True) is Verdict.SPARK_55271
    assert judge(failure(npe), replayed=False) is Verdict.FAILED  # no batch re-ran: a real NPE
    refused = Link(
        "org.apache.kafka.common.errors.TopicAuthorizationException",
        "Not authorized to access topics: [s.rq.1]",
    )
    assert judge(failure(*job_aborted(refused)), replayed=False) is Verdict.DENIED
    assert judge(failure(Link("java.io.IOException", "disk full")), replayed=True) is (
        Verdict.FAILED
    )


def test_the_catalog_ends_a_query_when_paused_suspended_or_reassigned():
    from types import SimpleNamespace as Sub

    def sub(paused=False, shard_count=2, generation=1, suspended=None):
        return Sub(
            paused=paused, shard_count=shard_count, generation=generation, suspended=suspended
        )

    started = sub()
    assert catalog_change(started, sub(), 0) is None
    assert catalog_change(started, sub(paused=True), 0) is QueryEnd.PAUSED
    assert catalog_change(started, sub(paused=True, shard_count=3), 0) is QueryEnd.PAUSED
    moved = catalog_change(started, sub(shard_count=3), 0)
    reset = catalog_change(started, sub(generation=2), 0)
    assert moved is reset is QueryEnd.CHANGED
    # A suspension stops every shard but the one that probes it.
    probing = Suspension("every attempt failed", 1, shard=1, resume="probe")
    assert catalog_change(started, sub(suspended=probing), 0) is QueryEnd.SUSPENDED
    assert catalog_change(started, sub(suspended=probing), 1) is None
    by_operator = Suspension("every attempt failed", 1, shard=1, resume="operator")
    assert catalog_change(started, sub(suspended=by_operator), 1) is QueryEnd.SUSPENDED
    assert not waits_on_suspension(sub(), 0)


def test_a_bounded_run_is_idle_only_when_all_holds_and_asks_kafka_last():
    asked = []

    def all_read(answer):
        return lambda: asked.append(answer) or answer

    quiet = dict(quiet_s=5.0, retry_waiting=False, batch_running=False)
    assert idle(2.0, **quiet, all_read=all_read(True))
    assert not idle(2.0, **quiet, all_read=all_read(False))
    assert asked == [True, False]
    for not_yet in (
        dict(quiet, quiet_s=2.0),  # the last batch ended too recently
        dict(quiet, retry_waiting=True),  # a parked retry waits for its tick
        dict(quiet, batch_running=True),
    ):
        assert not idle(2.0, **not_yet, all_read=all_read(True))
    assert not idle(None, **quiet, all_read=all_read(True))  # an unbounded run
    assert asked == [True, False]  # the end offsets were not asked for


def test_a_run_s_end_is_the_process_exit_code():
    # What supervisors and scripts read (docs/operations.md): 0 stopped, 3 fenced.
    assert (int(RunEnd.STOPPED), int(RunEnd.FENCED)) == (0, 3)


def test_a_batch_that_met_kafka_away_is_ridden_out():
    """A Kafka call of the batch function that failed with an error that may pass (kafka-python's
    retriable errors, the product's `KafkaUnavailable`): the control loop rides it out. Before,
    such a batch failed the shard (exit 1) although the same error between batches is ridden out."""
    for line in (
        "kafka.errors.KafkaTimeoutError: KafkaTimeoutError: Failed to get offsets by timestamps",
        "kafka.errors.KafkaConnectionError: 111 ECONNREFUSED",
        "kafka.errors.NotLeaderForPartitionError: [Error 6] NotLeaderForPartitionError",
        "varadhi.core.errors.KafkaUnavailable: timed out reading the catalog topic __varadhi",
    ):
        found = failure(text=PYTHON.format(line))
        assert judge(found, replayed=False) is Verdict.KAFKA_AWAY, line
        assert found.of(jvm_errors.KafkaAway) == jvm_errors.KafkaAway(line)
    # Not an error that passes by itself, or not the class itself: a failure.
    for line in (
        "kafka.errors.InvalidTopicError: [Error 17] InvalidTopicError",
        "RuntimeError: HTTP 500 KafkaTimeoutError",
        "my.kafka.errors.KafkaTimeoutError: x",
        "kafka.errors.KafkaTimeoutErrorLater: x",
    ):
        assert judge(failure(text=PYTHON.format(line)), replayed=False) is Verdict.FAILED, line
    # A fence, an expired lease or a missing ACL met with it (a traceback's chained causes) wins.
    timeout = "kafka.errors.KafkaTimeoutError: KafkaTimeoutError: commit"
    fenced = PYTHON.format(f"{timeout}\nvaradhi.core.errors.Fenced: lease s/2/0: fenced")
    assert judge(failure(text=fenced), replayed=False) is Verdict.FENCED
    expired = PYTHON.format(f"{timeout}\nvaradhi.core.errors.LeaseExpired: lease s/2/0")
    assert judge(failure(text=expired), replayed=False) is Verdict.LEASE_EXPIRED
    denied = PYTHON.format(
        f"{timeout}\nkafka.errors.TopicAuthorizationFailedError: [Error 29] "
        "TopicAuthorizationFailedError: s.rq.1"
    )
    assert judge(failure(text=denied), replayed=False) is Verdict.DENIED
