"""A shard's counters and what its progress documents say of it (pure; no I/O).

- `ShardStats`: counters since the shard first ran (resumed from its last progress document),
  and the last batch's figures;
- `Rates`: delivered messages and failed attempts per second over the last minute;
- `summarize`: what status shows of the shard's GroupState (blocked groups, where messages wait);
- `where_reading`: what a progress document says of the query's reader layout and offsets;
- `parked_heads`/`due_heads`/`next_due`: groups whose head is parked in the state table, and
  when it falls due (the driver's ticks, the half-open circuit's probes).

`varadhi.spark.shard.job` publishes these (`varadhi.ops.status`); the progress documents' fields are read by
`varadhi status`, so renaming one is a format change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from varadhi.core.state_rows import StateRow
from varadhi.spark.layouts import Layout

# How many blocked groups a progress document lists by name (`summarize`); the count is exact.
LISTED_BLOCKED_GROUPS = 100

# The batch counters (the executors' `stat` rows) that `ShardStats.add_batch` adds up.
BATCH_COUNTERS = (
    "routed",
    "delivered",
    "retried",
    "retried_in_place",
    "waited_due",
    "dead_lettered",
    "duplicates",
    "deduplicated",
    "filtered",
    "attempts",
    "failures",
    "skipped_replayed",
)


@dataclass
class ShardStats:
    batches: int = 0
    records: int = 0
    routed: int = 0
    delivered: int = 0
    retried: int = 0
    retried_in_place: int = 0
    waited_due: int = 0  # RQ records read before due that waited for it in their task
    dead_lettered: int = 0
    duplicates: int = 0
    deduplicated: int = 0
    filtered: int = (
        0  # main-topic records the subscription's filter dropped (`varadhi.core.filters`)
    )
    attempts: int = 0
    failures: int = 0
    replays: int = 0
    skipped_replayed: int = 0
    last_batch: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def resumed(cls, progress: dict[str, Any] | None, shard_count: int) -> ShardStats:
        """Counters that go on from a shard's last progress document (`totals`), so they
        survive restarts; zero for a document of another shard count (a shard-count change
        starts the new shards' own counts) or none."""
        if not progress or progress.get("shard_count", shard_count) != shard_count:
            return cls()
        totals = progress.get("totals") or {}
        names = [f.name for f in fields(cls) if f.type in ("int", int)]
        return cls(**{n: int(totals[n]) for n in names if isinstance(totals.get(n), int)})

    def add_batch(
        self,
        batch_id: int,
        n_records: int,
        counts: dict[str, Any],
        seconds: float,
        phases: dict[str, float],
    ) -> None:
        """Count a completed batch: its `counts` (summed `stat` rows) go into the totals, and
        `last_batch` becomes its figures (`seconds` since it started, `phases` rounded)."""
        self.batches += 1
        self.records += n_records
        for k in BATCH_COUNTERS:
            setattr(self, k, getattr(self, k) + int(counts.get(k, 0)))
        self.last_batch = {
            "batch_id": batch_id,
            "records": n_records,
            "seconds": round(seconds, 3),
            **{k: round(v, 3) for k, v in phases.items()},
            **counts,
        }

    def totals(self) -> dict[str, int]:
        """Every counter by name (a progress document's `totals`)."""
        return {k: v for k, v in asdict(self).items() if isinstance(v, int)}


@dataclass
class Rates:
    """Delivered messages and failed attempts per second over the last minute, from the
    counters seen at each `update` (monotonic seconds)."""

    window: list[tuple[float, int, int]] = field(default_factory=list)

    def update(self, now: float, delivered: int, failures: int) -> dict[str, float]:
        """Record the counters at `now`; the rates since the oldest record of the last 60 s
        (0.0 until that is more than a second ago)."""
        self.window = [w for w in self.window if now - w[0] <= 60] + [(now, delivered, failures)]
        t0, d0, f0 = self.window[0]
        span = max(now - t0, 1e-9)
        return {
            "delivered_per_s": round((delivered - d0) / span, 2) if span > 1 else 0.0,
            "failures_per_s": round((failures - f0) / span, 2) if span > 1 else 0.0,
        }


def parked_heads(pending: dict[str, list[StateRow]]) -> dict[str, int]:
    """Group key -> due time, for groups whose head (smallest origin) is parked here (pure)."""
    out = {}
    for g, rows in pending.items():
        head = min(rows, key=_origin)
        if head.location == "held":
            out[g] = int(head.due_ms or 0)
    return out


def _origin(row: StateRow):
    return row.origin


def due_heads(pending: dict[str, list[StateRow]], now_ms: int) -> list[str]:
    """Groups whose head is a parked (held) message that is due now (pure)."""
    return [g for g, due in parked_heads(pending).items() if due <= now_ms]


def next_due(pending: dict[str, list[StateRow]]) -> int | None:
    """The earliest due time of a parked head (pure); None when nothing is parked."""
    return min(parked_heads(pending).values(), default=None)


def where_reading(
    before: dict[str, Any], shard_count: int, layout: Layout, assign: dict[str, list[int]]
) -> dict[str, Any]:
    """What a progress document says of a query that starts reading `assign` (pure). The
    offsets consumed so far (`consumed`, from the last completed batch) carry over from
    `before` (the previous query's, or the last document of an earlier run of this shard) when
    it read the same layout: until its first batch completes, a restarted query has consumed
    exactly that. Otherwise status counts lag from the layout's start."""
    where = {
        "generation": layout.generation,
        "shard_count": shard_count,
        "layout": layout.seq,
        "mq_index": layout.mq_index,
        "reading": assign,
    }
    same = all(before.get(k) == where[k] for k in ("generation", "shard_count", "layout"))
    if same and before.get("consumed"):
        where["consumed"] = before["consumed"]
    return where


def summarize(pending: dict[str, list[StateRow]]) -> dict[str, Any]:
    """What status shows of a shard's GroupState (pure): blocked groups and pending messages
    by where they wait, and the first `LISTED_BLOCKED_GROUPS` blocked groups (by key) with
    their head: its message id, where it waits (`rq`: a retry; `dlq`: a dead letter blocking
    the group; `held`: parked here), its reason and how many of the group's messages wait."""
    where = [r.location for rows in pending.values() for r in rows]
    listed = []
    for group in sorted(pending)[:LISTED_BLOCKED_GROUPS]:
        rows = pending[group]
        head = min(rows, key=_origin)
        listed.append(
            {
                "group": group,
                "head": head.msg_id,
                "where": head.location,
                "reason": head.reason,
                "waiting": len(rows),
            }
        )
    return {
        "blocked_groups": len(pending),
        "held": where.count("held"),
        "rq_pending": where.count("rq"),
        "dlq_pending": where.count("dlq"),
        "blocked": listed,
    }
