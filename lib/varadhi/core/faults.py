"""Crash points for testing crash safety (DESIGN hazard 4), off unless asked for.

`VARADHI_CRASH_AT=<point>[@<n>]` makes the process exit abruptly (`os._exit(137)`, as SIGKILL
would) the n-th time (default: first) it reaches `<point>`. The shard's points, in the order a
micro-batch reaches them:

- `after_delivery`:     endpoint calls made, nothing recorded;
- `after_state_commit`: GroupState and the batch's RQ/DLQ records committed to Delta, not sent;
- `after_send`:         RQ/DLQ records committed to Kafka, the batch not yet committed by Spark.

Elsewhere: `catalog_in_transaction`, a catalog write's records acknowledged by the broker and
its transaction not yet committed (`varadhi.kafka.catalog`).

The operations' steps, each reached right after the step's work and its record in the catalog
(`tests/integration/test_offset_reset.py` and `test_change_shards_crash.py` end a real
`varadhi` process at each and run the command again):

- `offset_reset_recorded`, `offset_reset_state_advanced`, `offset_reset_done`
  (`varadhi.ops.offsets.OffsetReset.execute`); for a `runtime: library` subscription,
  `library_offset_reset_recorded` (the plan recorded) and `library_offset_reset_committed` (the
  group's new offsets committed, the commits the plan drops not yet removed)
  (`varadhi.ops.library_offsets.execute`; `tests/integration/test_library_storage.py`);
- `change_shards_recorded` (the plan written, nothing done), then `change_shards_<step>` after
  each of the steps `fence`, `queues`, `state`, `layouts` and `activate`
  (`varadhi.ops.change_shards`); inside the state step, `change_shards_state_tables`: the new
  GroupState tables written, the last-batch records not yet re-sent;
- `feeder_copied` (a feeder's records copied, the feeder not marked done) and `feeder_marked`
  (`varadhi.ops.feeders`).

Test-only: nothing sets `VARADHI_CRASH_AT` but tests.
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
