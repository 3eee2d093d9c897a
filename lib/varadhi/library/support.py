"""What the library runtime supports of a subscription today, and its refusal of the rest (pure).

A subscription whose spec or state uses a feature the runtime does not implement yet is refused
at start with every such feature named (`unsupported`), never run with the feature silently
ignored. docs/library.md lists them and why.
"""

from __future__ import annotations

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
    sub: Subscription, main: CompositeTopic, rq: CompositeTopic, dlq: CompositeTopic
) -> list[str]:
    """Every feature of `sub` (and the state of its topics) the runtime cannot honour, each with
    what to change; empty when it can run it."""
    out = []
    if len(main.storage_topics) > 1:
        out.append(
            f"topic {main.name} has {len(main.storage_topics)} storage topics (reading across a"
            " storage topic switch in order)"
        )
    for queue, first in ((rq, sub.rq_from), (dlq, sub.dlq_from)):
        if len(queue.storage_topics) > 1 or first:
            out.append(f"{queue.name} has more than one storage topic (a shard-count change)")
    return out
