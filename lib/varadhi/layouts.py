"""Reader layouts: what one run of a shard's query reads, and where its files live.

A shard reads one main-topic storage topic at a time (`mq_index`) plus its RQ partitions
(DESIGN hazard 3). Each layout has its own checkpoint and idempotency id, because batch ids
restart at 0 in a new checkpoint (hazard 7); it starts from `starting_offsets` (storage topic ->
partition -> offset; -2 = earliest), which may also name storage topics the layout does not read
yet: later layouts start there instead of at the beginning (a shard-count change carries the old
shards' positions over that way).

The layout of shard `i` of `S` is recorded in the catalog under `reader/<sub>/s<S>/<i>`; a new
generation (offset reset) starts layouts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

READER_KIND = "reader"


@dataclass(frozen=True)
class Layout:
    generation: int
    seq: int
    mq_index: int
    starting_offsets: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "seq": self.seq,
            "mq_index": self.mq_index,
            "starting_offsets": self.starting_offsets,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(
            int(d["generation"]), int(d["seq"]), int(d["mq_index"]), d.get("starting_offsets") or {}
        )


def current(snapshot, name: str, shard_count: int, shard: int, generation: int) -> Layout:
    """The shard's recorded layout if it belongs to `generation`, else a fresh one (seq 0, first
    storage topic, earliest offsets): a new generation starts layouts afresh."""
    doc = snapshot.get(READER_KIND, owner(name, shard_count, shard))
    if doc is not None:
        layout = Layout.from_dict(doc)
        if layout.generation == generation:
            return layout
    return Layout(generation, 0, 0, {})


def owner(name: str, shard_count: int, shard: int) -> str:
    """The catalog name of a shard's reader layout and lease."""
    return f"{name}/s{shard_count}/{shard}"


def state_path(warehouse: str, name: str, shard_count: int, shard: int) -> str:
    return f"{warehouse}/{name}/state/s{shard_count}/shard-{shard}"


def checkpoint_path(warehouse: str, name: str, shard_count: int, shard: int, layout: Layout) -> str:
    return f"{warehouse}/{name}/checkpoints/g{layout.generation}/s{shard_count}/shard-{shard}/L{layout.seq}"


def app_id(name: str, shard_count: int, shard: int, layout: Layout) -> str:
    """Delta's txnAppId for the shard's GroupState commits in this layout."""
    return f"{name}.g{layout.generation}.s{shard_count}.{shard}.L{layout.seq}"


def merged(
    base: dict[str, dict[str, int]], newer: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`base` offsets overridden by `newer` ones, per topic and partition (pure)."""
    out = {t: dict(p) for t, p in base.items()}
    for topic, parts in newer.items():
        out.setdefault(topic, {}).update(parts)
    return out


def drained(consumed: dict[int, int], ends: dict[int, int]) -> bool:
    """Every partition consumed up to its log end (pure)."""
    return all(consumed.get(p, 0) >= end for p, end in ends.items())


def next_layout(
    layout: Layout, consumed: dict[str, dict[str, int]], next_topic: str, partitions: list[int]
) -> Layout:
    """The layout after `layout` drained its main storage topic: the next storage topic from a
    known position (or its beginning), every other source from where this layout stopped (pure)."""
    starting = merged(layout.starting_offsets, consumed)
    known = layout.starting_offsets.get(next_topic, {})
    starting[next_topic] = {str(p): int(known.get(str(p), -2)) for p in partitions}
    return Layout(layout.generation, layout.seq + 1, layout.mq_index + 1, starting)
