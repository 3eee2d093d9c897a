"""A shard's micro-batch rows as pandas frames: what Spark's Arrow conversion hands the driver and
the executors (`state_rows.STATE_COLUMNS`, `RESULT_COLUMNS`), and the typed rows read back from
them.

Apart from `varadhi.core.state_rows` because it imports pandas (with numpy and pyarrow, ~0.45 s of
CPU here): the Spark runtime and the operations that run Spark use it; the library runtime and the
command line must not (tests/unit/test_start_imports.py).
"""

from __future__ import annotations

import math
from dataclasses import fields

import pandas as pd

from varadhi.core.state_rows import (
    COLUMN_NAMES,
    STAT_COLUMNS,
    STATE_COLUMNS,
    Kind,
    OutRow,
    StateRow,
    TaskStats,
)

# -- rows out of frames -------------------------------------------------------------------------


def out_rows(frame: pd.DataFrame) -> list[OutRow]:
    """The `out` rows of a state-columns frame (`StateStore.outs`), typed (`state_rows`)."""
    return [OutRow.of(row) for row in state_rows(frame)]


def task_stats(result: pd.DataFrame) -> list[TaskStats]:
    """The `stat` rows of an executor result (pure)."""
    rows = result[result["kind"] == Kind.STAT]
    out = []
    for values in zip(*(rows[c].tolist() for c, _ in STAT_COLUMNS), strict=True):
        named = dict(zip((f.name for f in fields(TaskStats)), values, strict=True))
        http = named.pop("http")
        seconds = named.pop("seconds")
        out.append(
            TaskStats(
                **{k: _int(v) or 0 for k, v in named.items()},
                seconds=0.0 if _missing(seconds) else float(seconds),
                http={str(k): int(n) for k, n in _pairs(http)},
            )
        )
    return out


def delivered_ids(result: pd.DataFrame) -> list[tuple[str, int]]:
    """(dedup id, delivered at) of the `done` rows of an executor result (pure)."""
    done = result[result["kind"] == Kind.DONE]
    return [(str(i), int(t)) for i, t in zip(done["msg_id"], done["delivered_ms"], strict=True)]


def _pairs(v) -> list[tuple[str, int]]:
    """A map column's value as pairs: Spark gives a dict, or Arrow a list of pairs."""
    if isinstance(v, dict):
        return list(v.items())
    if isinstance(v, list | tuple):
        return list(v)
    return []


# -- frames ---------------------------------------------------------------------------------------

_INT_TYPES = {"int": "Int32", "bigint": "Int64"}


def frame_of(rows: list, columns: list[tuple[str, str]] = STATE_COLUMNS) -> pd.DataFrame:
    """Rows (`StateRow`s, or dicts of column values) as a frame Arrow converts to `columns`:
    text, binary and map columns are object columns holding None for a missing value (an
    all-missing column would otherwise be float NaN, which pyspark's Arrow conversion rejects).
    """
    names = [name for name, _ in columns]
    frame = pd.DataFrame.from_records(
        [r._asdict() if isinstance(r, tuple) else r for r in rows], columns=names
    )
    return none_for_missing(frame, columns)


def none_for_missing(
    frame: pd.DataFrame, columns: list[tuple[str, str]] = STATE_COLUMNS
) -> pd.DataFrame:
    """Make `frame`'s text, binary and map columns object columns holding None for missing
    values (in place; returns `frame`)."""
    for name, kind in columns:
        if kind in ("string", "binary") or kind.startswith("map<"):
            column = frame[name].astype(object)
            frame[name] = column.where(column.notna(), None)
    return frame


def normalise(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with exactly the state columns (others dropped, missing ones added), in types that
    convert to STATE_SCHEMA exactly: nullable ints, text and binary as object columns holding
    None (vectorised: this runs on every state commit)."""
    frame = none_for_missing(frame.reindex(columns=COLUMN_NAMES).reset_index(drop=True))
    return nullable_ints(frame)


def nullable_ints(
    frame: pd.DataFrame, columns: list[tuple[str, str]] = STATE_COLUMNS
) -> pd.DataFrame:
    """Make `frame`'s int and bigint columns nullable ints (Int32, Int64: a missing value is NA,
    not a float NaN) (in place; returns `frame`)."""
    for name, kind in columns:
        if kind in _INT_TYPES:
            frame[name] = pd.array(frame[name], dtype=_INT_TYPES[kind])
    return frame


def state_rows(frame: pd.DataFrame) -> list[StateRow]:
    """A frame's rows as typed `StateRow`s (columns it lacks are None): missing numbers (NaN,
    NA) become None, ints become Python ints, bodies bytes."""
    n = len(frame)
    values = []
    for name, kind in STATE_COLUMNS:
        if name not in frame.columns:
            values.append([None] * n)
            continue
        column = frame[name].tolist()
        if kind in _INT_TYPES:
            values.append([_int(v) for v in column])
        elif kind == "binary":
            values.append([None if _missing(v) else bytes(v) for v in column])
        else:
            values.append([v if isinstance(v, str) else None for v in column])
    return [StateRow._make(r) for r in zip(*values, strict=True)] if n else []


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def _int(v) -> int | None:
    return None if _missing(v) else int(v)
