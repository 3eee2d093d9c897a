"""Fixtures of the Spark tier: one local SparkSession for the whole test run.

`varadhi.spark.session.get_spark` returns the active session when there is one, so every module that
asks for a session (here, or the in-process shard runs of tests/integration) shares this one:
a local session costs about 5 s to start (DESIGN section 6).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from varadhi.spark.session import get_spark

    return get_spark("varadhi-tests")
