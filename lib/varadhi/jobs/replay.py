"""Re-deliver a time range of a subscription's main topic (a bounded job).

    varadhi-job replay --subscription NAME --from T [--to T]      (installed package)
    ./spark-submit.sh --job replay --subscription NAME --from T [--to T]     (a checkout)
    spark-submit .../varadhi/jobs/replay.py --subscription NAME --from T --cluster   (a cluster)

Times are ISO-8601 (UTC if no zone) or epoch ms; --from is inclusive, --to exclusive (default:
now, when the job starts). The subscription's offsets, GroupState, RQ and DLQ are not touched.
Prints the result (text or --output json) and records it in the catalog under
operation/<subscription>/replay-<id>. See varadhi.ops.replay and docs/replay.md.

Exit codes: 0 every message delivered, 1 some failed (each stopped its group) or the job failed
or was interrupted (SIGINT or SIGTERM cancel the Spark job; the replay is recorded as failed),
2 refused before any side effect (unknown subscription, bad times, nothing in the range), 4 a
missing Kafka ACL (one line naming it).

--metrics-port serves the replay's metrics once its range is planned (`REPLAY_METRICS`: the
records in the range, the Spark tasks delivering them, then the counts; docs/operations.md,
"Metrics and logs"); --log-format json writes its log, Spark's driver lines too, as JSON lines.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from varadhi.core.errors import VaradhiError
from varadhi.jobs import runner
from varadhi.kafka.catalog import Catalog
from varadhi.ops import replay
from varadhi.spark.telemetry import (
    Exporter,
    JobInfo,
    JobMetrics,
    MetricsOptions,
    SparkTasks,
    Spec,
    serve,
)

# The result's counts (`replay.COUNTS`) as counters, set once the replay ended.
REPLAY_COUNTS = {
    "records": "records of the range read (the filter's dropped ones are `filtered`)",
    "delivered": "messages the endpoint accepted",
    "failed": "messages that failed, each stopping its group",
    "not_delivered": "messages not sent because an earlier one of their group failed",
    "filtered": "messages the subscription's filter did not match (not delivered)",
}
REPLAY_METRICS = (
    Spec("replay_range_records", "gauge", "records in the replay's offset ranges (planned)"),
    *(Spec(f"replay_{k}", "counter", doc) for k, doc in REPLAY_COUNTS.items()),
    Spec("replay_done", "gauge", "1 once the replay ended and its result is recorded"),
)


class ReplayTelemetry:
    """The replay job's exporter (`on_plan`: started once the range is planned, labelled with
    the replay's id) and metrics."""

    def __init__(self, options: MetricsOptions):
        self.options = options
        self.metrics: JobMetrics | None = None
        self.tasks: SparkTasks | None = None
        self.exporter: Exporter | None = None

    def on_plan(self, plan: replay.ReplayPlan) -> None:
        labels = {"subscription": plan.subscription, "replay": plan.replay_id}
        self.metrics = JobMetrics(REPLAY_METRICS, labels)
        self.metrics.set("replay_range_records", plan.max_messages)
        self.metrics.set("replay_done", 0)
        self.tasks = SparkTasks(labels)
        collectors = [JobInfo("replay", labels), self.metrics, self.tasks]
        self.exporter = serve(collectors, self.options, f"replay {plan.replay_id}")

    def started(self, spark: Any) -> Any:
        if self.tasks is not None:
            self.tasks.spark = spark
        return spark

    def ended(self, counts: dict[str, int]) -> None:
        if self.metrics is not None:
            for k in REPLAY_COUNTS:
                self.metrics.inc(f"replay_{k}", int(counts.get(k, 0)))
            self.metrics.set("replay_done", 1)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()


@runner.entry_point()
def main(argv: list[str]) -> int:
    parser = runner.job_parser("replay", __doc__)
    runner.add_options(parser, "subscription")
    parser.add_argument("--from", dest="from_", required=True, metavar="TIME", help="inclusive")
    parser.add_argument("--to", metavar="TIME", help="exclusive (default: now)")
    parser.add_argument("--parallelism", type=int, metavar="N", help="delivery tasks")
    runner.add_options(parser, "bootstrap")
    parser.add_argument("--output", choices=["text", "json"], default="text")
    runner.add_options(parser, "cluster")
    runner.add_telemetry_options(parser)
    args = parser.parse_args(argv)
    runner.setup_logging()
    telemetry = ReplayTelemetry(runner.telemetry(args))
    catalog = Catalog(runner.settings(args))
    # SIGINT/SIGTERM cancel the Spark job: the replay fails, recorded as failed
    spark = runner.SparkRun(args, f"varadhi-replay-{args.subscription}")
    try:
        result = replay.run_replay(
            catalog,
            args.subscription,
            args.from_,
            args.to,
            lambda: telemetry.started(spark.start()),
            args.parallelism,
            on_plan=telemetry.on_plan,
        )
        telemetry.ended(result.counts)
    except VaradhiError as e:
        why = f"interrupted by {spark.received}: " if spark.received else ""
        e = runner.refusal_of(e) or e  # a missing ACL met by the Spark job
        print(runner.one_line(f"varadhi: {why}{e}"), file=sys.stderr)
        return e.exit_code
    finally:
        telemetry.close()
        spark.restore()
        catalog.close()
    doc = result.to_dict()
    if args.output == "json":
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(replay.render_text(doc))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
