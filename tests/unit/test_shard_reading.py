"""How far a shard's query has read and whether it has caught up (`varadhi.spark.shard.reading`,
pure parts). The layout moves themselves run against Kafka and the catalog in
tests/integration/test_storage_switch.py and test_storage_boundary.py."""

from __future__ import annotations

import json

from varadhi.spark.shard.reading import caught_up, consumed


class Progress:
    """pyspark's `StreamingQueryProgress` as `lastProgress` gives it (its `json`)."""

    def __init__(self, doc):
        self.json = json.dumps(doc)


def test_what_the_last_batch_read_in_each_form_spark_reports_it():
    end = {"orders.1": {"0": 17, "1": 4}, "s.rq.0": {"2": 0}}
    want = {"orders.1": {"0": 17, "1": 4}, "s.rq.0": {"2": 0}}
    assert consumed(Progress({"sources": [{"endOffset": end}]})) == want
    assert consumed({"sources": [{"endOffset": json.dumps(end)}]}) == want  # a dict, as text
    assert consumed(None) is None  # no batch completed yet
    assert consumed({"sources": []}) is None
    assert consumed({"sources": [{"endOffset": None}]}) is None


def test_caught_up_means_every_assigned_partition_read_to_its_end():
    assign = {"orders.1": [0, 1]}
    ends = {"orders.1": {0: 17, 1: 4}}
    assert caught_up({"orders.1": {"0": 17, "1": 4}}, assign, ends)
    assert not caught_up({"orders.1": {"0": 17, "1": 3}}, assign, ends)
    assert not caught_up({"orders.1": {"0": 17}}, assign, ends)  # partition 1 not read yet
    # Before the first batch: only when there is nothing to read.
    assert caught_up(None, assign, {"orders.1": {0: 0, 1: 0}})
    assert not caught_up(None, assign, ends)
