"""A shard's GroupState as the driver holds it: the copy of its state table (pure, pandas).

`StateCopy` holds the table's rows (`state_rows.STATE_SCHEMA`: `pending`, `out`, `meta`,
`redrive`; kinds and columns in `varadhi.core.state_rows`) and answers what the batch-commit
protocol and the delivery plan ask of the state: the last batch committed (`meta`), the pending
groups (`pending`), parked bodies (`held_groups`, `held_rows`), a batch's RQ/DLQ records
(`outs`), re-drives applied (`redrives_applied`) and rate-capped ones under way
(`redrives_in_progress`); it changes in memory (`record_redrives`, `forget_redrives`,
`redrive`, `hold_back`), and `committed` is the table a commit of a batch writes.

Where the table lives is the subclass's business: `varadhi.spark.state_store.StateStore` keeps it
in Delta; `varadhi.testing.micro_batch.MemoryState` in memory, for tests that run a whole
micro-batch without Spark. Not thread-safe (the shard's batch gate guards it).
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from varadhi.core.state_frames import frame_of, normalise, state_rows
from varadhi.core.state_rows import (
    COLUMN_NAMES,
    Kind,
    RedriveProgress,
    Scanned,
    StateRow,
    decode_progress,
    decode_scanned,
    meta_row,
    redrive_row,
)


class StateCopy:
    """The rows of one shard's state table (`frame`, in `STATE_COLUMNS`' types)."""

    def __init__(self, frame: pd.DataFrame | None = None):
        self.frame = normalise(pd.DataFrame(columns=COLUMN_NAMES) if frame is None else frame)
        self._pending: tuple[pd.DataFrame, dict[str, list[StateRow]]] | None = None

    # -- reading --------------------------------------------------------------------------
    def meta(self) -> tuple[str | None, int | None]:
        rows = self.frame[self.frame["kind"] == Kind.META]
        if not len(rows):
            return None, None
        row = rows.iloc[0]
        return row["app_id"], (None if pd.isna(row["batch_id"]) else int(row["batch_id"]))

    def pending(self) -> dict[str, list[StateRow]]:
        """Group key -> its pending rows, without bodies (what executors need to decide).
        Decoded once per content of the copy: do not change the rows returned."""
        if self._pending is not None and self._pending[0] is self.frame:
            return self._pending[1]
        rows = self.frame[self.frame["kind"] == Kind.PENDING].drop(columns=["value"])
        out: dict[str, list[StateRow]] = {}
        for row in state_rows(rows):
            out.setdefault(row.group_key, []).append(row)
        self._pending = (self.frame, out)
        return out

    def held_groups(self) -> set[str]:
        f = self.frame
        return set(f.loc[(f["kind"] == Kind.PENDING) & (f["location"] == "held"), "group_key"])

    def held_rows(self, keys: Iterable[str]) -> pd.DataFrame:
        f = self.frame
        rows = f[
            (f["kind"] == Kind.PENDING) & (f["location"] == "held") & f["group_key"].isin(set(keys))
        ]
        return rows.assign(kind=Kind.HELD)

    def outs(self, app_id: str, batch_id: int) -> pd.DataFrame:
        f = self.frame
        return f[(f["kind"] == Kind.OUT) & (f["app_id"] == app_id) & (f["batch_id"] == batch_id)]

    def redrives_applied(self) -> dict[str, Scanned]:
        """Re-drive operation id -> the DLQ end offsets its scan covered, for the `redrive`
        rows of the copy of re-drives applied completely."""
        f = self.frame
        rows = f[(f["kind"] == Kind.REDRIVE) & f["source"].isna()]
        return {
            str(op_id): decode_scanned(scanned)
            for op_id, scanned in zip(rows["msg_id"], rows["headers"], strict=True)
        }

    def redrives_in_progress(self) -> dict[str, tuple[Scanned, RedriveProgress]]:
        """Rate-capped re-drives part-way through: operation id -> (the end offsets it started
        with, its progress)."""
        f = self.frame
        rows = f[(f["kind"] == Kind.REDRIVE) & f["source"].notna()]
        return {
            str(op_id): (decode_scanned(ends), decode_progress(progress))
            for op_id, ends, progress in zip(
                rows["msg_id"], rows["headers"], rows["source"], strict=True
            )
        }

    # -- writing --------------------------------------------------------------------------
    def record_redrives(
        self, scanned: dict[str, Scanned], progress: dict[str, RedriveProgress] | None = None
    ) -> None:
        """Set a `redrive` row per operation, replacing its earlier one (in memory; the next
        `commit` persists them): applied completely, or part-way with its `progress`."""
        if not scanned:
            return
        progress = progress or {}
        self.forget_redrives(scanned)
        rows = [redrive_row(op_id, sc, progress.get(op_id)) for op_id, sc in scanned.items()]
        self.frame = normalise(
            pd.concat([self.frame, normalise(frame_of(rows))], ignore_index=True)
        )

    def hold_back(self, rows: list[StateRow]) -> int:
        """Add `dlq` entries that stop their groups (a rate-capped re-drive's barriers,
        `varadhi.core.redrive_pace`) where no entry of the group is pending at that origin yet
        (in memory; the next `commit`). Returns how many were added."""
        f = self.frame
        pending = f[f["kind"] == Kind.PENDING]
        at = set(
            zip(
                pending["group_key"],
                pending["origin_index"],
                pending["origin_partition"],
                pending["origin_offset"],
                strict=True,
            )
        )
        add = [
            r
            for r in rows
            if (r.group_key, r.origin_index, r.origin_partition, r.origin_offset) not in at
        ]
        if add:
            self.frame = normalise(pd.concat([f, normalise(frame_of(add))], ignore_index=True))
        return len(add)

    def forget_redrives(self, op_ids: Iterable[str]) -> None:
        """Drop the `redrive` rows of these operations (in memory; the next `commit`)."""
        ids = set(op_ids)
        f = self.frame
        gone = (f["kind"] == Kind.REDRIVE) & f["msg_id"].isin(ids)
        if ids and gone.any():
            self.frame = normalise(f[~gone])

    def redrive(self, rows: list[StateRow]) -> int:
        """Put re-driven DLQ messages back as `held` entries (in memory; the next `commit`
        persists them). A `dlq` entry at the same origin is replaced; a message that is pending
        anyway is left alone. Returns how many entries were added or replaced."""
        if not rows:
            return 0
        f = self.frame
        pending = f["kind"] == Kind.PENDING
        at = {
            (g, i, p, o): idx
            for idx, g, i, p, o in zip(
                f.index[pending],
                f.loc[pending, "group_key"],
                f.loc[pending, "origin_index"],
                f.loc[pending, "origin_partition"],
                f.loc[pending, "origin_offset"],
                strict=True,
            )
        }
        drop, add = [], []
        for row in rows:
            idx = at.get((row.group_key, row.origin_index, row.origin_partition, row.origin_offset))
            if idx is None:
                add.append(row)
            elif f.at[idx, "location"] == "dlq":
                drop.append(idx)
                add.append(row)
        self.frame = normalise(
            pd.concat([f.drop(index=drop), normalise(frame_of(add))], ignore_index=True)
        )
        return len(add)

    def committed(
        self, touched: set[str], new_rows: pd.DataFrame, app_id: str, batch_id: int
    ) -> pd.DataFrame:
        """The table a commit of batch (`app_id`, `batch_id`) writes (pure): pending rows of
        untouched groups, the `redrive` rows, `new_rows` (the touched groups' new pending rows
        and the batch's outs) and a meta row."""
        f = self.frame
        kept = f[
            ((f["kind"] == Kind.PENDING) & ~f["group_key"].isin(touched))
            | (f["kind"] == Kind.REDRIVE)
        ]
        # Every part in the copy's column types (here and above): pandas warns of (and will
        # change) concatenating all-null columns of other types.
        meta = normalise(frame_of([meta_row(app_id, batch_id)]))
        parts = [p for p in (kept, normalise(new_rows), meta) if len(p)]
        return normalise(pd.concat(parts, ignore_index=True))
