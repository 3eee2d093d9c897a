"""The Spark runtime: sessions, the state store, checkpoints and reader layouts, the records a
query reads, the executor-side delivery of a micro-batch and its journal, metrics.

`varadhi.spark.shard` is the shard job itself (its control loop, the batch-commit protocol and
its ports); operations use the modules here, never the shard job's internals."""
