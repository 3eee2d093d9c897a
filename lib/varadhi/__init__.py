"""varadhi-spark: Kafka to HTTP delivery with per-group order, retry and dead-letter queues.

The public Python API is `Client` (see `varadhi.client`): topics, subscriptions, status, offset
resets, the DLQ, replay, shard-count changes and deletes, from `Settings`.
"""

__version__ = "0.1.0"

from .client import Client, OffsetResetResult, RedriveProgress
from .errors import VaradhiError
from .settings import Settings

__all__ = ["Client", "OffsetResetResult", "RedriveProgress", "Settings", "VaradhiError"]
