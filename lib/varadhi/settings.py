"""Where things live: the Kafka bootstrap servers, the catalog topic and the warehouse path.

Read from the environment so that the CLI, jobs and tests agree without passing flags around:
`VARADHI_BOOTSTRAP` (default 127.0.0.1:19092, the broker `scripts/kafka start` runs),
`VARADHI_CATALOG_TOPIC` (default `__varadhi_catalog`), `VARADHI_WAREHOUSE` (default
`.varadhi/warehouse` under the working directory: Delta tables and Spark checkpoints).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"
DEFAULT_CATALOG_TOPIC = "__varadhi_catalog"


@dataclass(frozen=True)
class Settings:
    bootstrap: str = DEFAULT_BOOTSTRAP
    catalog_topic: str = DEFAULT_CATALOG_TOPIC
    warehouse: str = ".varadhi/warehouse"

    @classmethod
    def from_env(cls, **overrides: str | None) -> Settings:
        base = cls(
            bootstrap=os.environ.get("VARADHI_BOOTSTRAP", DEFAULT_BOOTSTRAP),
            catalog_topic=os.environ.get("VARADHI_CATALOG_TOPIC", DEFAULT_CATALOG_TOPIC),
            warehouse=_path(os.environ.get("VARADHI_WAREHOUSE", ".varadhi/warehouse")),
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _path(location: str) -> str:
    """Absolute for local paths; URIs (dbfs:/, s3://, abfss://, file:/) are kept as given."""
    return (
        location if "://" in location or location.startswith("dbfs:") else os.path.abspath(location)
    )
