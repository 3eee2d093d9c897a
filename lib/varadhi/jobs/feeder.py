"""One feeder of a shard-count change (see `varadhi.ops.feeders`).

    varadhi-job feeder --subscription NAME --source STORAGE_TOPIC     (installed package)
    ./spark-submit.sh --job feeder --subscription NAME --source STORAGE_TOPIC     (a checkout)
    spark-submit .../varadhi/jobs/feeder.py --subscription NAME --source STORAGE_TOPIC --cluster

A bounded batch job: it copies every record of an old RQ or DLQ storage topic into the new one,
to the partitions of each record's new shard, and marks itself done in the operation document
`operation/<sub>/change-shards` (the change is done when its last feeder is). Run it for each
feeder `varadhi subscription change-shards NAME --to S --feeders external` lists; re-running a
feeder is safe (the shards drop the duplicates).

--metrics-port serves the feeder's metrics while it runs (`FEEDER_METRICS`: the source's size,
the Spark tasks of the copy, then what it copied; docs/operations.md, "Metrics and logs");
--log-format json writes its log, Spark's driver lines too, as JSON lines.

Exit codes: 0 copied, 2 refused (no such change in progress, or the source is not one of its
feeders), 4 a missing Kafka ACL (one line naming it: Write on the new storage topic for a refused
write), 1 failed or interrupted (SIGINT or SIGTERM cancel the copy; run the feeder again).
"""

from __future__ import annotations

import sys

from varadhi.core.errors import VaradhiError
from varadhi.jobs import runner
from varadhi.kafka.catalog import Catalog
from varadhi.ops.feeders import check_feeder, feed, feed_if_empty, source_records
from varadhi.spark.telemetry import JobInfo, JobMetrics, SparkTasks, Spec, serve

FEEDER_METRICS = (
    Spec("feeder_source_records", "gauge", "records the old storage topic holds (before the copy)"),
    Spec(
        "feeder_records",
        "counter",
        "distinct records of the source now in the new storage topic (once the copy ended)",
    ),
    Spec("feeder_done", "gauge", "1 once the feeder is marked done in the operation document"),
)


@runner.entry_point()
def main(argv: list[str]) -> int:
    parser = runner.job_parser("feeder", __doc__)
    runner.add_options(parser, "subscription")
    parser.add_argument("--source", required=True, help="the old RQ/DLQ storage topic to drain")
    runner.add_options(parser, "bootstrap", "cluster")
    runner.add_telemetry_options(parser)
    args = parser.parse_args(argv)
    runner.setup_logging()
    options = runner.telemetry(args)
    catalog = Catalog(runner.settings(args))
    spark = runner.SparkRun(args, f"varadhi-{args.subscription}-feeder")
    labels = {"subscription": args.subscription, "source": args.source}
    metrics = JobMetrics(FEEDER_METRICS, labels)
    tasks = SparkTasks(labels)
    exporter = None
    try:
        check_feeder(catalog, args.subscription, args.source)
        what = f"{args.subscription} feeder of {args.source}"
        exporter = serve([JobInfo("feeder", labels), metrics, tasks], options, what)
        held = source_records(catalog, args.subscription, args.source)
        metrics.set("feeder_source_records", held)
        metrics.set("feeder_done", 0)
        if feed_if_empty(catalog, args.subscription, args.source, held):  # no Spark for nothing
            metrics.set("feeder_done", 1)
            print(f"fed 0 records from {args.source} (it holds none)")
            return 0
        tasks.spark = spark.start()
        # SIGINT/SIGTERM cancel the copy: it fails, and is not marked done
        n = feed(tasks.spark, catalog, args.subscription, args.source)
        metrics.inc("feeder_records", n)
        metrics.set("feeder_done", 1)
        print(f"fed {n} records from {args.source}")
        return 0
    except VaradhiError:
        raise  # one line (`runner.run`)
    except Exception as e:  # noqa: BLE001 - the Spark job, cancelled by a signal
        if spark.received is None:
            raise
        print(
            f"varadhi: interrupted by {spark.received} ({type(e).__name__}); the feeder is not"
            " marked done: run it again (the shards drop what it copied twice)",
            file=sys.stderr,
        )
        return 1
    finally:
        if exporter is not None:
            exporter.close()
        spark.restore()
        catalog.close()


if __name__ == "__main__":
    sys.exit(main())
