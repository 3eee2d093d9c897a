"""What `get_spark` sets on a local session (`varadhi.spark.session`)."""

from __future__ import annotations

from varadhi.spark.session import LOCAL_EXECUTOR_SETTINGS


def test_a_local_sessions_executor_is_not_removed_for_heartbeats_a_starved_jvm_missed(spark):
    # Its executor is in the driver's JVM: see LOCAL_EXECUTOR_SETTINGS for the hang it caused.
    conf = spark.sparkContext.getConf()
    assert conf.get("spark.storage.blockManagerHeartbeatTimeoutMs") == "86400000"
    assert LOCAL_EXECUTOR_SETTINGS == {"spark.storage.blockManagerHeartbeatTimeoutMs": "86400000"}
