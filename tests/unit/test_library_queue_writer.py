"""Where a library member's failed attempt goes, and the queues' record limits
(`varadhi.library.queue_writer`; pure, no services)."""

from __future__ import annotations

from varadhi.core.group_state import Entry, out_bytes
from varadhi.core.messages import Origin
from varadhi.kafka.topics import StorageTopic
from varadhi.library.queue_writer import Queues, retry_target


def test_a_retry_goes_to_the_rq_while_its_record_fits_the_rqs_limit():
    assert retry_target(1_000, 1_000) == ("rq", None)
    assert retry_target(10, 1_000) == ("rq", None)


def test_a_retry_whose_record_may_exceed_the_rqs_limit_is_dead_lettered_saying_why():
    target, why = retry_target(1_001, 1_000)
    assert target == "dlq"
    assert why == "not retried: a record of about 1001 bytes exceeds the retry queue's 1000"


def test_the_size_judged_is_the_entrys_record_bound_and_the_limit_the_rqs():
    entry = Entry(Origin(0, 0, 1), "m1", "g1", "new", b"x" * 500, {"h": "v"}, reason="500")
    queues = Queues(
        StorageTopic("s.rq.0", 2, 1),
        StorageTopic("s.dlq.0", 1, 1),
        {"s.rq.0": 600, "s.dlq.0": 9_000},
        2,
    )
    assert queues.rq_limit == 600
    assert out_bytes(entry) > 600  # the headers' reserve on top of the body
    assert retry_target(out_bytes(entry), queues.rq_limit)[0] == "dlq"
