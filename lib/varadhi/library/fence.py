"""Fencing a member whose group session may have ended (it hung, or its heartbeats went
unanswered): it hands out nothing until the group answers it again.

Why. The group moves a member's slots to the others once it has not heard from the member for
the session timeout. A member that hung that long (SIGSTOP, a stalled VM, a long GC) and goes
on does not know it yet: until its next poll learns it left the group (`_lose`), its delivery
threads would hand out what it holds of slots that others own now, each a duplicate next to
the new owner's delivery. So a member whose group has not answered a heartbeat of it, nor
given it an assignment, for the session timeout (`lapsed`) hands out nothing; once it is
given an assignment again (its lost slots closed before), it goes on. (kafka-python's own
`Heartbeat.session_timeout_expired` does not serve: rediscovering the coordinator, the first
thing a member that went on does, resets it before the group has told the member it left.)

Hazards. Requests handed out before the hang are sent all the same (in flight at it: at least
once). A member whose heartbeat goes unanswered that long (a broker away, a starved heartbeat
thread on a loaded machine) pauses handing out until an answer or an assignment comes, as the
group would move its slots then anyway. It reads kafka-python internals (the coordinator's
`heartbeat`): `Fence(consumer)` raises `VaradhiError` before anything starts when the installed
kafka-python has not them (as `join_guard`).
"""

from __future__ import annotations

import time

from kafka import KafkaConsumer

from varadhi.core.errors import VaradhiError


def lapsed(now: float, last_heard: float, session_timeout_s: float) -> bool:
    """Whether a member last heard from its group at `last_heard` (an answered heartbeat, or
    an assignment; monotonic seconds) may have been put out of it by `now`."""
    return now - last_heard > session_timeout_s


class Fence:
    """`fence()`: whether `consumer`'s session may have ended (`lapsed`), callable from any
    thread; `joined()`: told when the group gives the member an assignment."""

    def __init__(self, consumer: KafkaConsumer):
        heartbeat = getattr(getattr(consumer, "_coordinator", None), "heartbeat", None)
        config = getattr(heartbeat, "config", None)
        if not hasattr(heartbeat, "last_receive") or "session_timeout_ms" not in (config or {}):
            import kafka

            raise VaradhiError(
                f"kafka-python {kafka.__version__} is not supported by the library runtime: its"
                " group coordinator has no heartbeat to tell a lapsed session"
                " (varadhi.library.fence); install kafka-python 3.0.x"
            )
        self._heartbeat = heartbeat
        self._session_s = config["session_timeout_ms"] / 1000
        self._joined = float("-inf")

    def joined(self) -> None:
        self._joined = time.monotonic()

    def __call__(self) -> bool:
        heard = max(self._heartbeat.last_receive, self._joined)
        return lapsed(time.monotonic(), heard, self._session_s)
