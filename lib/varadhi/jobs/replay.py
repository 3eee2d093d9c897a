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
"""

from __future__ import annotations

import json
import sys

from varadhi.core.errors import VaradhiError
from varadhi.jobs import runner
from varadhi.kafka.catalog import Catalog
from varadhi.ops import replay


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
    args = parser.parse_args(argv)
    runner.setup_logging()
    catalog = Catalog(runner.settings(args))
    # SIGINT/SIGTERM cancel the Spark job: the replay fails, recorded as failed
    spark = runner.SparkRun(args, f"varadhi-replay-{args.subscription}")
    try:
        result = replay.run_replay(
            catalog, args.subscription, args.from_, args.to, spark.start, args.parallelism
        )
    except VaradhiError as e:
        why = f"interrupted by {spark.received}: " if spark.received else ""
        e = runner.refusal_of(e) or e  # a missing ACL met by the Spark job
        print(f"varadhi: {why}{e}", file=sys.stderr)
        return e.exit_code
    finally:
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
