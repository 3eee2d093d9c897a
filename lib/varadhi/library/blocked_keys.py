"""What blocks a key in `on_dead_letter: block` mode, and how each event changes it (pure).

A key's *blocks* are the origins of its messages that lie in the DLQ and that its later messages
must wait for: the dead letter that blocked it, and at most one *mark*. A blocked key's later
main-topic messages are not held (the shards keep up to `blocked.max_held` of them in their
state; a member keeps none, as a shard with `max_held: 0`): each is *sidelined*, dead-lettered
with the shards' reason `group_state.OVER_LIMIT`, and the first of them becomes the mark, so the
key stays blocked behind it even when only the dead letter is re-driven, as a shard's overflow
mark keeps its group blocked (`group_state.over_limit`). A block is lifted when the re-driven
copy of its message is delivered (`delivered`); one dead-lettered again stays.

A rate-capped re-drive holds a key whose remaining messages a later portion puts back at the
first of them (a *barrier*, as a shard's `waiting for re-drive`): a block too, not a mark.

The blocks of a key are one record of the GroupState topic (`varadhi.library.group_state_topic`):
`encode` / `decode`, the empty tuple a tombstone.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass

from varadhi.core import messages as m


@dataclass(frozen=True, order=True)
class Block:
    """A message of the key that lies in the DLQ: its origin and id; `mark`: sidelined behind
    a dead letter (not a failure of its own)."""

    origin: m.Origin
    msg_id: str
    mark: bool = False


Blocks = tuple[Block, ...]


def dead_lettered(blocks: Blocks, origin: m.Origin, msg_id: str) -> Blocks:
    """The key's head at `origin` was dead-lettered (again, for a re-driven one: no longer a
    mark)."""
    return _with(blocks, Block(origin, msg_id))


def held_back(blocks: Blocks, origin: m.Origin, msg_id: str) -> Blocks:
    """A rate-capped re-drive holds the key at `origin` (a barrier) until it puts it back."""
    return _with(blocks, Block(origin, msg_id))


def sidelined(
    blocks: Blocks, origin: m.Origin, msg_id: str, redriving: Container[m.Origin] = ()
) -> Blocks:
    """A later message at `origin` was sidelined behind the key's blocks: it becomes the mark,
    unless a mark that no re-drive is putting back (`redriving`) lies before it (the key stays
    blocked there anyway)."""
    if any(b.mark and b.origin < origin and b.origin not in redriving for b in blocks):
        return blocks
    return _with(blocks, Block(origin, msg_id, mark=True))


def delivered(blocks: Blocks, origin: m.Origin) -> Blocks:
    """The message at `origin` was delivered (its re-driven copy): no block there any more."""
    return tuple(b for b in blocks if b.origin != origin)


def _with(blocks: Blocks, block: Block) -> Blocks:
    return tuple(sorted([*delivered(blocks, block.origin), block]))


def encode(blocks: Blocks) -> bytes | None:
    """A key's GroupState record value; None (a tombstone) when nothing blocks it."""
    if not blocks:
        return None
    rows = [[b.origin.encode(), b.msg_id, b.mark] for b in blocks]
    return json.dumps({"v": 1, "blocks": rows}, separators=(",", ":")).encode()


def decode(value: bytes | None) -> Blocks:
    """The blocks of a GroupState record value (a tombstone: none). Raises ValueError for a
    value no member wrote."""
    if value is None:
        return ()
    try:
        doc = json.loads(value)
        return tuple(
            sorted(Block(m.Origin.decode(o), str(i), bool(mark)) for o, i, mark in doc["blocks"])
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a GroupState record: {e}") from e


def key_bytes(key: str) -> bytes:
    """A key's GroupState record key (any ordering key's text, lone surrogates included)."""
    return key.encode("utf-8", "surrogatepass")


def key_text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")
