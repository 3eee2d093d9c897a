"""Read a Kafka (storage) topic with Spark's Kafka source and print per-partition counts: a
check that the Kafka connector jars and the broker work.

    varadhi-job smoke_count --topic orders.0
    ./spark-submit.sh --job smoke_count --topic orders.0     (a checkout)
"""

from __future__ import annotations

import argparse
import os
import sys

from varadhi import kafka_clients
from varadhi.errors import VaradhiError
from varadhi.jobs.runner import refuse, run
from varadhi.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="varadhi-job smoke_count",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--topic", required=True, help="a Kafka (storage) topic")
    parser.add_argument(
        "--bootstrap", default=os.environ.get("VARADHI_BOOTSTRAP", "127.0.0.1:19092")
    )
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env(bootstrap=args.bootstrap)
        from varadhi.spark import get_spark

        spark = get_spark("varadhi-smoke-count")
    except VaradhiError as e:
        return refuse(e)
    counts = (
        spark.read.format("kafka")
        .options(**kafka_clients.spark_options(settings))
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
    sys.exit(run(main, sys.argv[1:]))
