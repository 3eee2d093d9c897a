"""varadhi-spark: Kafka to HTTP delivery with per-group order, retry and dead-letter queues."""

__version__ = "0.1.0"
