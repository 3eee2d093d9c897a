"""The de-duplication window in a library member (`dedup_window`; pure, thread-safe): the ids
delivered within the window, by any member of the subscription, and whether a message's id is
among them.

The shards' semantics (`varadhi.spark.dedup`): a message's id is its message id header (its
text form, `varadhi.core.record_ids.text_id`), else the SHA-256 of its value (`dedup_id`); a
main-topic message whose id was delivered within the window is finished unsent and counted
(`deduplicated`), never attempted. Every delivery is remembered, from the main topic or the RQ
(a retry delivered late); retries and re-drives are not checked: they carry the id of a
message not delivered yet.

Every member learns the ids delivered from the subscription's dedup topic
(`varadhi.library.dedup_topic`), its own and the others', and checks a message when it is about
to hand it out (so a copy queued behind its original, in the same key, is checked after the
original was delivered). The memory holds the ids of the last `window_ms`; older ones are
forgotten as time goes on (`seen` evicts them).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Mapping

from varadhi.core import messages as m


def dedup_id(headers: Mapping[str, str], value: bytes | None) -> str:
    """The id a message is de-duplicated by, from its entry as the shards take it
    (`varadhi.spark.batch.dedup_id`): its message id header (its text form, as read), else the
    hex SHA-256 of its value. The same for a main-topic record and its RQ copy, which carries
    the original's headers and value."""
    return headers.get(m.H_MSG_ID) or hashlib.sha256(value or b"").hexdigest()


class DedupMemory:
    """Ids delivered within the last `window_ms` (module docstring). `remember` an id
    delivered at some time; `seen(id, now)` says whether it was delivered within the window
    before `now`."""

    def __init__(self, window_ms: int):
        if window_ms <= 0:
            raise ValueError(f"a dedup window is positive, got {window_ms} ms")
        self.window_ms = window_ms
        self._lock = threading.Lock()
        self._latest: dict[str, int] = {}  # id -> its latest delivery (ms)
        self._order: deque[tuple[int, str]] = deque()  # (delivered_ms, id), as remembered

    def remember(self, dedup: str, delivered_ms: int) -> None:
        with self._lock:
            if delivered_ms > self._latest.get(dedup, -1):
                self._latest[dedup] = delivered_ms
                self._order.append((delivered_ms, dedup))

    def seen(self, dedup: str, now_ms: int) -> bool:
        with self._lock:
            self._evict(now_ms)
            at = self._latest.get(dedup)
            return at is not None and at > now_ms - self.window_ms

    def __len__(self) -> int:
        with self._lock:
            return len(self._latest)

    def _evict(self, now_ms: int) -> None:
        """Forget the ids whose latest delivery left the window (ids are remembered roughly in
        time order: one remembered late stays until the entries before it left)."""
        horizon = now_ms - self.window_ms
        order, latest = self._order, self._latest
        while order and order[0][0] <= horizon:
            at, dedup = order.popleft()
            if latest.get(dedup) == at:
                del latest[dedup]
