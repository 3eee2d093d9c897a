"""Spark entry point: run one shard of a subscription until stopped, fenced or failed.

    spark-submit.sh SUBSCRIPTION SHARD            (local, with the project's jars and venv)
    spark-submit jobs/subscription_shard.py --subscription NAME --shard N   (a cluster)

Exit codes: 0 stopped (SIGINT or SIGTERM, after the micro-batch in flight; or idle with
--stop-when-idle), 3 fenced by a newer instance of the same shard, 1 failed, 2 refused (unknown
subscription or shard).
"""

from __future__ import annotations

import argparse
import logging
import sys

from varadhi.errors import VaradhiError
from varadhi.settings import Settings
from varadhi.shard import ShardJob


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--subscription", required=True)
    parser.add_argument("--shard", type=int, required=True)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP)")
    parser.add_argument(
        "--warehouse", help="Delta tables and checkpoints (default: $VARADHI_WAREHOUSE)"
    )
    parser.add_argument(
        "--stop-when-idle",
        type=float,
        metavar="SECONDS",
        help="stop once everything readable is delivered and nothing is parked for this long",
    )
    parser.add_argument(
        "--cluster", action="store_true", help="use the cluster's Spark (no local jars)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    settings = Settings.from_env(bootstrap=args.bootstrap, warehouse=args.warehouse)
    spark = None
    if args.cluster:
        from varadhi.spark import get_spark

        spark = get_spark(f"varadhi-{args.subscription}-{args.shard}", local=False)
    try:
        job = ShardJob(
            args.subscription,
            args.shard,
            settings,
            spark=spark,
            stop_when_idle_s=args.stop_when_idle,
        )
        return job.run()
    except VaradhiError as e:
        print(f"varadhi: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
