"""The shard job: the driver's control loop of one subscription shard and its micro-batches."""
