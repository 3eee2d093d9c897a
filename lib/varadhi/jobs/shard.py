"""Run one shard of a subscription until stopped, fenced or failed.

    varadhi-job shard --subscription NAME --shard N [--standby]        (installed package)
    python -m varadhi.jobs.shard --subscription NAME --shard N
    ./spark-submit.sh SUBSCRIPTION SHARD [--standby]     (a checkout: its jars and venv)
    spark-submit .../varadhi/jobs/shard.py --subscription NAME --shard N --cluster   (a cluster)

Without --cluster the job builds a local Spark session (varadhi.spark.session: jars from
$VARADHI_SPARK_JARS or $VARADHI_SPARK_PACKAGES); with it, the session spark-submit or the cluster
configured. A shard holds a lease that it renews every TTL/3 (--lease-ttl, default 15 s or
$VARADHI_LEASE_TTL_MS). A normal start takes the lease at once (the instance running before is
fenced). With --standby the instance starts Spark and waits; once the active instance's lease
has not been renewed for its TTL (the process died or hangs) it takes the lease and runs the
shard. A shard stopped with SIGINT/SIGTERM is not taken over.

Operations (docs/operations.md, "Metrics and logs"): --metrics-port serves the shard's metrics as
Prometheus text at http://ADDR:PORT/metrics on the driver (0 picks a free port, logged; default
$VARADHI_METRICS_PORT, else off); --log-format json (or $VARADHI_LOG_FORMAT=json) writes every
log line as a JSON object, Spark's driver lines too, with one `"event": "batch"` line per
micro-batch.

Exit codes: 0 stopped (SIGINT or SIGTERM, after the micro-batch in flight; or idle with
--stop-when-idle; a standby stopped while waiting), 3 fenced by a newer instance of the same
shard (or its lease expired), 1 failed, 2 refused (unknown subscription or shard, or a
subscription of `runtime: library`, which `varadhi-consumer` delivers: before Spark starts; a
running shard that finds the runtime changed ends with it too), 4 a missing Kafka ACL (one line
naming it).
"""

from __future__ import annotations

import sys

from varadhi.jobs import runner
from varadhi.kafka.leases import ttl_from_env
from varadhi.spark.metrics import attach
from varadhi.spark.shard.job import ShardJob


@runner.entry_point()
def main(argv: list[str]) -> int:
    parser = runner.job_parser("shard", __doc__)
    runner.add_options(parser, "subscription")
    parser.add_argument("--shard", type=int, required=True)
    runner.add_options(parser, "bootstrap", "warehouse")
    parser.add_argument(
        "--stop-when-idle",
        type=float,
        metavar="SECONDS",
        help="stop once everything readable is delivered and nothing is parked for this long",
    )
    runner.add_options(parser, "cluster")
    parser.add_argument(
        "--standby",
        action="store_true",
        help="wait, Spark started, until the active instance's lease expires, then take over",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        metavar="SECONDS",
        help="lease TTL: renewed every third of it; a standby takes over a lease not renewed "
        "for it (default: $VARADHI_LEASE_TTL_MS ms, or 15)",
    )
    runner.add_telemetry_options(parser, ", and one line per micro-batch with its counts")
    args = parser.parse_args(argv)
    runner.setup_logging()
    settings = runner.settings(args)
    options = runner.telemetry(args)
    # The session (local, or the cluster's) is made by the job once the subscription was read
    # and accepted: an unknown subscription or shard, or one of `runtime: library`, is refused
    # (exit 2) before Spark starts.
    job = ShardJob(
        args.subscription,
        args.shard,
        settings,
        stop_when_idle_s=args.stop_when_idle,
        standby=args.standby,
        lease_ttl_ms=ttl_from_env(args.lease_ttl),
        cluster=args.cluster,
    )
    job.check()  # before `attach`, which may start the session
    telemetry = attach(job, options)
    try:
        return job.run()
    finally:
        if telemetry is not None:
            telemetry.close()


if __name__ == "__main__":
    sys.exit(main())
