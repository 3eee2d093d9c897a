"""Smoke job: read a storage topic with the Kafka source and print per-partition counts.

./spark-submit.sh --job smoke_count --topic orders.0
"""

from __future__ import annotations

import argparse
import os
import sys

from varadhi import kafka_clients
from varadhi.settings import Settings
from varadhi.spark import get_spark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--topic", required=True, help="a Kafka (storage) topic")
    parser.add_argument(
        "--bootstrap", default=os.environ.get("VARADHI_BOOTSTRAP", "127.0.0.1:19092")
    )
    args = parser.parse_args(argv)
    spark = get_spark("varadhi-smoke-count")
    counts = (
        spark.read.format("kafka")
        .options(**kafka_clients.spark_options(Settings.from_env(bootstrap=args.bootstrap)))
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
