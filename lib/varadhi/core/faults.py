"""Crash points for testing crash safety (DESIGN hazard 4), off unless asked for.

`VARADHI_CRASH_AT=<point>[@<n>]` makes the process exit abruptly (`os._exit(137)`, as SIGKILL
would) the n-th time (default: first) it reaches `<point>`. The shard's points, in the order a
micro-batch reaches them:

- `after_delivery`:     endpoint calls made, nothing recorded;
- `after_state_commit`: GroupState and the batch's RQ/DLQ records committed to Delta, not sent;
- `after_send`:         RQ/DLQ records committed to Kafka, the batch not yet committed by Spark.

Elsewhere: `catalog_in_transaction`, a catalog write's records acknowledged by the broker and
its transaction not yet committed (`varadhi.kafka.catalog`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

_seen: Counter[str] = Counter()


def crash_point(point: str) -> None:
    spec = os.environ.get("VARADHI_CRASH_AT")
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name != point:
        return
    _seen[point] += 1
    if _seen[point] == int(nth or 1):
        print(
            f"varadhi: crashing at {point} (VARADHI_CRASH_AT={spec})", file=sys.stderr, flush=True
        )
        os._exit(137)
