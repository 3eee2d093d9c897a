"""One feeder of a shard-count change (see `varadhi.resharding`).

    varadhi-job feeder --subscription NAME --source STORAGE_TOPIC     (installed package)
    ./spark-submit.sh --job feeder --subscription NAME --source STORAGE_TOPIC     (a checkout)
    spark-submit .../varadhi/jobs/feeder.py --subscription NAME --source STORAGE_TOPIC --cluster

A bounded batch job: it copies every record of an old RQ or DLQ storage topic into the new one,
to the partitions of each record's new shard, and marks itself done in the operation document
`operation/<sub>/change-shards` (the change is done when its last feeder is). Run it for each
feeder `varadhi subscription change-shards NAME --to S --feeders external` lists; re-running a
feeder is safe (the shards drop the duplicates).

Exit codes: 0 copied, 2 refused (no such change in progress, or the source is not one of its
feeders), 4 a missing Kafka ACL (one line naming it: Write on the new storage topic for a refused
write), 1 failed or interrupted (SIGINT or SIGTERM cancel the copy; run the feeder again).
"""

from __future__ import annotations

import argparse
import sys

from varadhi.catalog import Catalog
from varadhi.errors import VaradhiError
from varadhi.jobs.runner import refuse, run, setup_logging
from varadhi.resharding import check_feeder, feed, feed_if_empty
from varadhi.settings import Settings
from varadhi.stop_signals import StopSignals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="varadhi-job feeder",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--subscription", required=True)
    parser.add_argument("--source", required=True, help="the old RQ/DLQ storage topic to drain")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP)")
    parser.add_argument(
        "--cluster", action="store_true", help="use the cluster's Spark (no local jars)"
    )
    args = parser.parse_args(argv)
    setup_logging()
    try:  # a bad Kafka client configuration ($VARADHI_KAFKA_CONFIG) is one line
        catalog = Catalog(Settings.from_env(bootstrap=args.bootstrap))
    except VaradhiError as e:
        return refuse(e)
    signals: StopSignals | None = None
    try:
        check_feeder(catalog, args.subscription, args.source)
        if feed_if_empty(catalog, args.subscription, args.source):  # no Spark to copy nothing
            print(f"fed 0 records from {args.source} (it holds none)")
            return 0
        from varadhi.spark import get_spark

        spark = get_spark(f"varadhi-{args.subscription}-feeder", local=not args.cluster)
        signals = StopSignals.cancelling(spark)  # SIGINT/SIGTERM: the copy fails, not marked done
        signals.install()
        n = feed(spark, catalog, args.subscription, args.source)
        print(f"fed {n} records from {args.source}")
        return 0
    except VaradhiError as e:
        return refuse(e)
    except Exception as e:  # noqa: BLE001 - the Spark job, cancelled by a signal
        if signals is None or signals.received is None:
            raise
        print(
            f"varadhi: interrupted by {signals.received} ({type(e).__name__}); the feeder is not"
            " marked done: run it again (the shards drop what it copied twice)",
            file=sys.stderr,
        )
        return 1
    finally:
        if signals is not None:
            signals.restore()
        catalog.close()


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
