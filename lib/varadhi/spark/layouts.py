"""Reader layouts: what one run of a shard's query reads, and where its files live.

A shard reads one main-topic storage topic at a time (`mq_index`) plus its RQ partitions
(DESIGN hazard 3). Each layout has its own checkpoint and idempotency id, because batch ids
restart at 0 in a new checkpoint (hazard 7); it starts from `starting_offsets` (storage topic ->
partition -> offset; -2 = earliest), which may also name storage topics the layout does not read
yet: later layouts start there instead of at the beginning (a shard-count change carries the old
shards' positions over that way).

The layout of shard `i` of `S` is recorded in the catalog under `reader/<sub>/s<S>/<i>`; a new
generation (offset reset) starts layouts afresh.

Crossing a storage-topic boundary. Moving from T_i to T_i+1 keeps every group on its shard when
both share a routing run and the shard count splits it along the run's base partitions
(`routing.keeps_groups`). A storage topic added with K = 1 (a partition change) starts a new run: a
group's T_i+1 messages may belong to another shard than its T_i messages, which may still wait
in its old shard's RQ or DLQ (DESIGN hazard 3 across shards). A shard of a grouped subscription
that drained T_i then waits at the boundary (its reader document says so: `waiting`) and moves
on only when `may_cross`: every shard of the count has drained T_i and none has a pending group
(nothing of T_i or before waits anywhere), or after a shard-count change, which moves the
pending groups to the shards that read their next messages and starts the new shards past the
boundary (`varadhi.ops.change_shards`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from varadhi.core.catalog_kinds import DocKind

READER_KIND = DocKind.READER


class _Storage(Protocol):
    partitions: int
    k: int


class _Named(_Storage, Protocol):
    name: str


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


# -- crossing a storage-topic boundary ----------------------------------------------------


def waiting(doc: Mapping[str, Any] | None, layout: Layout) -> dict[str, Any] | None:
    """The boundary marker of a reader document, if it belongs to `layout` (pure)."""
    if not doc or "waiting" not in doc:
        return None
    if int(doc.get("generation", -1)) != layout.generation or int(doc.get("seq", -1)) != layout.seq:
        return None
    return doc["waiting"]


def may_cross(
    docs: Mapping[int, Mapping[str, Any] | None], shard_count: int, generation: int, index: int
) -> bool:
    """Whether the shards of a count may move past main-topic storage topic `index` to one that
    does not keep groups on their shards (pure). `docs` are the reader documents of shards
    0..shard_count-1 (missing: never started). Each must have moved past `index` already, or
    wait at its end with nothing pending (`quiet`): then every message of `index` and before
    is done, and no group's later message can overtake one of them on another shard."""
    for shard in range(shard_count):
        doc = docs.get(shard)
        if not doc or int(doc.get("generation", -1)) != generation:
            return False
        if int(doc["mq_index"]) > index:
            continue
        mark = doc.get("waiting") or {}
        if int(doc["mq_index"]) != index or mark.get("index") != index or not mark.get("quiet"):
            return False
    return True


def shard_counts_for(partitions: int, limit: int = 12) -> list[int]:
    """Shard counts that read a storage topic of `partitions` evenly: its divisors (the first
    `limit` and the largest), for hints (pure)."""
    divisors = [d for d in range(1, partitions + 1) if partitions % d == 0]
    return divisors if len(divisors) <= limit else divisors[: limit - 1] + divisors[-1:]


def boundary_wait(
    name: str, at: _Named, nxt: _Named, shard_count: int, pending_groups: int
) -> dict[str, Any]:
    """What a shard's progress document says while it waits at the end of storage topic `at`
    (pure): the topics, its own pending groups, and `text` for `varadhi status`."""
    counts = [c for c in shard_counts_for(nxt.partitions) if c != shard_count]
    own = f"this shard has {pending_groups}" if pending_groups else "this shard has none"
    return {
        "at": at.name,
        "next": nxt.name,
        "pending_groups": pending_groups,
        "text": (
            f"waits at the end of {at.name}: {nxt.name} ({nxt.partitions} partitions, K={nxt.k}) "
            f"would give groups other shards; the shards move on together once none of them "
            f"has a pending group ({own}), or after `varadhi subscription change-shards {name} "
            f"--to N` (N: {', '.join(map(str, counts))})"
        ),
    }
