"""Where things live: the Kafka bootstrap servers, the catalog topic and the warehouse path.

Read from the environment so that the CLI, jobs and tests agree without passing flags around:
`VARADHI_BOOTSTRAP` (default 127.0.0.1:19092, the broker `scripts/kafka start` runs),
`VARADHI_CATALOG_TOPIC` (default `__varadhi_catalog`), `VARADHI_WAREHOUSE` (default
`.varadhi/warehouse` under the working directory: Delta tables and Spark checkpoints), and the
Kafka client configuration (`kafka`: `$VARADHI_KAFKA_CONFIG` or `varadhi --command-config`, plus
`VARADHI_KAFKA_<PROPERTY>` overrides; see `varadhi.kafka.config`). Without `VARADHI_BOOTSTRAP` the
configuration's `bootstrap.servers` is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from varadhi.kafka import config as kafka_config
from varadhi.kafka.config import KafkaConfig

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"
DEFAULT_CATALOG_TOPIC = "__varadhi_catalog"


@dataclass(frozen=True)
class Settings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    catalog_topic: str = DEFAULT_CATALOG_TOPIC
    warehouse: str = ".varadhi/warehouse"
    kafka: KafkaConfig = field(default=kafka_config.PLAINTEXT)

    @classmethod
    def from_env(cls, command_config: str | None = None, **overrides: str | None) -> Settings:
        """Raises `KafkaConfigError` (one line) when the Kafka client configuration is bad."""
        kafka = kafka_config.load(command_config)
        base = cls(
            bootstrap=os.environ.get("VARADHI_BOOTSTRAP") or kafka.bootstrap or DEFAULT_BOOTSTRAP,
            catalog_topic=os.environ.get("VARADHI_CATALOG_TOPIC", DEFAULT_CATALOG_TOPIC),
            warehouse=_path(os.environ.get("VARADHI_WAREHOUSE", ".varadhi/warehouse")),
            kafka=kafka,
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _path(location: str) -> str:
    """Absolute for local paths (a Unity Catalog volume `/Volumes/...` is one); URIs (`s3a://`,
    `abfss://`, `gs://`, `dbfs:/`, `file:/`, any scheme of two letters or more) are kept as given,
    for Spark and Hadoop to resolve."""
    return location if len(urlsplit(location).scheme) > 1 else os.path.abspath(location)
