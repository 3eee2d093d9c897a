"""varadhi-spark: Kafka to HTTP delivery with per-group order, retry and dead-letter queues.

The public Python API is `Client` (see `varadhi.client`): topics, subscriptions, status, offset
resets, the DLQ, replay, shard-count changes and deletes, from `Settings`.
"""

from varadhi.client import Client, OffsetResetResult, RedriveProgress
from varadhi.core.errors import VaradhiError
from varadhi.core.version import __version__ as __version__
from varadhi.kafka.settings import Settings

__all__ = ["Client", "OffsetResetResult", "RedriveProgress", "Settings", "VaradhiError"]
