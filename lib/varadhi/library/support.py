"""What the library runtime supports of a subscription today, and its refusal of the rest (pure).

A subscription whose spec or state uses a feature the runtime does not implement yet is refused
at start with every such feature named (`unsupported`), never run with the feature silently
ignored. docs/library.md lists them and why.

A main topic with several storage topics is read across its switches (`crossing`). An RQ or DLQ
with several storage topics (a shard-count change made on Spark shards: `sub.rq_from`,
`sub.dlq_from`) is read from `rq_from`/`dlq_from` on, when that is one storage topic, the
queue's produce topic, and the change is done: its feeders copied every record of the older
storage topics into it (in the current slots' partitions), so the members need not read those.
While the feeders still copy, a key's retry may reach the current RQ after the member of its slot
read that RQ to its end and delivered the key's later messages: the members keep no GroupState
that would hold the key (the shards' change moves their pending groups), so that is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from varadhi.core.errors import InvalidArgument
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import CompositeTopic


class Unsupported(InvalidArgument):
    """The subscription uses features the library runtime does not support (exit code 2)."""

    def __init__(self, name: str, features: list[str]):
        super().__init__(
            f"subscription {name} uses what the library runtime does not support yet: "
            + "; ".join(features)
            + " (docs/library.md)"
        )
        self.features = features


def unsupported(
    sub: Subscription,
    rq: CompositeTopic,
    dlq: CompositeTopic,
    change_shards: Mapping[str, Any] | None = None,
) -> list[str]:
    """Every feature of `sub` (and the state of its queues; `change_shards`: its shard-count
    change's operation document, if any) the runtime cannot honour, each with what to change;
    empty when it can run it."""
    out = []
    for queue, first in ((rq, sub.rq_from), (dlq, sub.dlq_from)):
        if first != queue.produce_pointer or first != len(queue.storage_topics) - 1:
            out.append(
                f"{queue.name} has storage topics after the one the subscription's shard count"
                f" uses ({queue.storage(first).name}; produce goes to {queue.produce_topic.name})"
            )
    if len(rq.storage_topics) + len(dlq.storage_topics) > 2 and change_shards is not None:
        step = change_shards.get("step")
        if step != "done":
            out.append(
                f"the shard-count change of {sub.name} is at step {step}: its feeders have not"
                " yet copied the older RQ/DLQ storage topics into the current ones (run"
                " `varadhi subscription change-shards` again to finish it)"
            )
    return out
