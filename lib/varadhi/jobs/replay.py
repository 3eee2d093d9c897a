"""Re-deliver a time range of a subscription's main topic (a bounded job).

    varadhi-job replay --subscription NAME --from T [--to T]      (installed package)
    ./spark-submit.sh --job replay --subscription NAME --from T [--to T]     (a checkout)
    spark-submit .../varadhi/jobs/replay.py --subscription NAME --from T --cluster   (a cluster)

Times are ISO-8601 (UTC if no zone) or epoch ms; --from is inclusive, --to exclusive (default:
now, when the job starts). The subscription's offsets, GroupState, RQ and DLQ are not touched.
Prints the result (text or --output json) and records it in the catalog under
operation/<subscription>/replay-<id>. See varadhi.replay and docs/replay.md.

Exit codes: 0 every message delivered, 1 some failed (each stopped its group) or the job failed
or was interrupted (SIGINT or SIGTERM cancel the Spark job; the replay is recorded as failed),
2 refused before any side effect (unknown subscription, bad times, nothing in the range), 4 a
missing Kafka ACL (one line naming it).
"""

from __future__ import annotations

import argparse
import json
import sys

from varadhi import replay
from varadhi.catalog import Catalog
from varadhi.errors import VaradhiError
from varadhi.jobs.runner import refusal_of, refuse, run, setup_logging
from varadhi.settings import Settings
from varadhi.stop_signals import StopSignals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="varadhi-job replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--subscription", required=True)
    parser.add_argument("--from", dest="from_", required=True, metavar="TIME", help="inclusive")
    parser.add_argument("--to", metavar="TIME", help="exclusive (default: now)")
    parser.add_argument("--parallelism", type=int, metavar="N", help="delivery tasks")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (default: $VARADHI_BOOTSTRAP)")
    parser.add_argument("--output", choices=["text", "json"], default="text")
    parser.add_argument(
        "--cluster", action="store_true", help="use the cluster's Spark (no local jars)"
    )
    args = parser.parse_args(argv)
    setup_logging()
    try:  # a bad Kafka client configuration ($VARADHI_KAFKA_CONFIG) is one line
        catalog = Catalog(Settings.from_env(bootstrap=args.bootstrap))
    except VaradhiError as e:
        return refuse(e)
    signals: list[StopSignals] = []

    def spark():
        from varadhi.spark import get_spark

        session = get_spark(f"varadhi-replay-{args.subscription}", local=not args.cluster)
        signals.append(StopSignals.cancelling(session))  # SIGINT/SIGTERM: the job fails
        signals[0].install()
        return session

    try:
        result = replay.run_replay(
            catalog, args.subscription, args.from_, args.to, spark, args.parallelism
        )
    except VaradhiError as e:
        why = f"interrupted by {signals[0].received}: " if signals and signals[0].received else ""
        e = refusal_of(e) or e  # a missing ACL met by the Spark job
        print(f"varadhi: {why}{e}", file=sys.stderr)
        return e.exit_code
    finally:
        for s in signals:
            s.restore()
        catalog.close()
    doc = result.to_dict()
    if args.output == "json":
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(replay.render_text(doc))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
