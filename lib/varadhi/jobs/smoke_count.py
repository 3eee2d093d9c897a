"""Read a Kafka (storage) topic with Spark's Kafka source and print per-partition counts: a
check that the Kafka connector jars and the broker work.

    varadhi-job smoke_count --topic orders.0
    ./spark-submit.sh --job smoke_count --topic orders.0     (a checkout)
"""

from __future__ import annotations

import sys

from varadhi.jobs import runner
from varadhi.kafka import clients as kafka_clients


@runner.entry_point()
def main(argv: list[str]) -> int:
    parser = runner.job_parser("smoke_count", __doc__)
    parser.add_argument("--topic", required=True, help="a Kafka (storage) topic")
    runner.add_options(parser, "bootstrap")
    args = parser.parse_args(argv)
    settings = runner.settings(args)
    from varadhi.spark.session import get_spark

    spark = get_spark("varadhi-smoke-count")
    counts = (
        spark.read.format("kafka")
        .options(**kafka_clients.spark_source_options(settings))
        .option("subscribe", args.topic)
        .load()
        .groupBy("partition")
        .count()
        .orderBy("partition")
        .collect()
    )
    for row in counts:
        print(f"{args.topic} partition {row['partition']}: {row['count']}")
    print(f"{args.topic} total: {sum(r['count'] for r in counts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
