"""A foreachBatch function's errors as a real streaming query reports them (Py4J, pyspark's
captured exceptions, the Python traceback inside Java's exception), read by
`varadhi.kafka.jvm_errors.query_failure` and judged by `varadhi.spark.shard.ends.judge`: the shard's stop
and fence by their classes, and a message that only holds their names as a failure."""

from __future__ import annotations

import pytest

from varadhi.core.errors import Fenced, StopRequested
from varadhi.kafka import jvm_errors
from varadhi.spark.shard.ends import Verdict, judge


def failures_of(spark, error: BaseException) -> list[jvm_errors.Diagnosis]:
    """Run a query whose first batch raises `error`; read how it ended in both forms the driver
    meets: what `awaitTermination` raised and the terminated query's `exception()`."""

    def batch(_df, _batch_id):
        raise error

    query = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 1)
        .load()
        .writeStream.foreachBatch(batch)
        .start()
    )
    try:
        query.awaitTermination(300)
        raised = None
    except Exception as e:  # noqa: BLE001 - pyspark's captured StreamingQueryException
        raised = e
    finally:
        query.stop()
    assert raised is not None, "the query did not fail"
    failure = jvm_errors.query_failure(query)
    assert failure is not None
    return [jvm_errors.classify(raised), failure]


@pytest.mark.parametrize(
    ("error", "verdict"),
    [
        (StopRequested(), None),
        (Fenced("lease orders-http/s1/0", 3, 4), Verdict.FENCED),
        (RuntimeError("HTTP 500: StopRequested by upstream"), Verdict.FAILED),
    ],
    ids=["stop", "fence", "the-word-in-a-message"],
)
def test_a_batch_function_s_error_as_the_query_reports_it(spark, error, verdict):
    for failure in failures_of(spark, error):
        assert judge(failure, replayed=False) is verdict
