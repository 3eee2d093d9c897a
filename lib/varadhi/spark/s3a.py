"""The object store's Hadoop settings: `hadoop_conf` turns `VARADHI_S3A_*` variables into the
`fs.s3a.*` settings `varadhi.spark.session.get_spark` gives every session it builds (an
S3-compatible store on a custom endpoint, static credentials); `configure` sets them on a session
started before they were known."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from varadhi.core.errors import InvalidArgument

S3A_PROVIDER = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"


def hadoop_conf(env: Mapping[str, str]) -> dict[str, str]:
    """`fs.s3a.*` Hadoop settings from `VARADHI_S3A_*` variables (pure), for an S3-compatible
    store on its own endpoint (SeaweedFS, MinIO, Ceph) or S3 with static keys:

    - `VARADHI_S3A_ENDPOINT` (`http://host:port` or `https://...`): `fs.s3a.endpoint`, path-style
      access (`VARADHI_S3A_PATH_STYLE`, default true with an endpoint), SSL off for `http://`,
      and the region `VARADHI_S3A_REGION` (default us-east-1; the AWS SDK needs one);
    - `VARADHI_S3A_ACCESS_KEY` and `VARADHI_S3A_SECRET_KEY`: static credentials
      (`SimpleAWSCredentialsProvider`). Without them the default AWS provider chain applies
      (instance profile, environment, ~/.aws).

    Nothing set: {} (Spark's and the cluster's own configuration rule)."""
    out: dict[str, str] = {}
    endpoint = env.get("VARADHI_S3A_ENDPOINT", "").strip()
    if endpoint:
        out["fs.s3a.endpoint"] = endpoint
        out["fs.s3a.endpoint.region"] = env.get("VARADHI_S3A_REGION") or "us-east-1"
        path_style = env.get("VARADHI_S3A_PATH_STYLE", "true").strip().lower()
        out["fs.s3a.path.style.access"] = str(path_style not in ("0", "false", "no")).lower()
        out["fs.s3a.connection.ssl.enabled"] = str(endpoint.startswith("https://")).lower()
    elif env.get("VARADHI_S3A_REGION"):
        out["fs.s3a.endpoint.region"] = env["VARADHI_S3A_REGION"]
    access, secret = env.get("VARADHI_S3A_ACCESS_KEY"), env.get("VARADHI_S3A_SECRET_KEY")
    if bool(access) != bool(secret):
        raise InvalidArgument(
            "set both VARADHI_S3A_ACCESS_KEY and VARADHI_S3A_SECRET_KEY, or neither",
            field="VARADHI_S3A_ACCESS_KEY",
        )
    if access and secret:
        out["fs.s3a.aws.credentials.provider"] = S3A_PROVIDER
        out["fs.s3a.access.key"] = access
        out["fs.s3a.secret.key"] = secret
    return out


def configure(spark: Any, conf: Mapping[str, str]) -> None:
    """Set Hadoop settings on a running session (its SparkContext's Hadoop configuration, which
    Spark's readers, writers and `HadoopFS` start from), for a session started before they were
    known. File systems already opened keep the settings they were opened with (Hadoop caches
    them per scheme and bucket)."""
    hadoop = spark.sparkContext._jsc.hadoopConfiguration()
    for k, v in conf.items():
        hadoop.set(k, v)
