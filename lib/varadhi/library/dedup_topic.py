"""The library runtime's de-duplication topic `<subscription>.dedup`: one record per delivery
(`dedup_window`; from the main topic or the RQ), its key the message's dedup id
(`varadhi.library.dedup.dedup_id`), its value when it was delivered (epoch ms, ASCII digits).

Every member writes the ids it delivers and reads everyone's (`DedupReader`): at start, from
`window` back to the end, before it joins the group (so nothing it hands out was delivered
within the window before it started), then the topic's tail, as long as it runs. One partition:
the records are small and their rate is the subscription's delivery rate.

The topic is made by the first member that starts (`ensure_topic`; `subscription delete`
deletes it), `cleanup.policy=delete` with `retention.ms` the window plus an hour (only the
window is read; the hour leaves room for clocks and segment roll), with the DLQ's replication
factor. An existing topic keeps its retention: a window lengthened later needs its
`retention.ms` raised (`kafka-configs.sh`), or ids older than the old retention are forgotten.
"""

from __future__ import annotations

import threading
import time

from kafka import TopicPartition

from varadhi.core.errors import KafkaUnavailable
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.library import group_state_topic
from varadhi.library.dedup import DedupMemory

#: The topic's one partition.
PARTITION = 0
#: Retention beyond the window (clock skew between members, segment roll).
MARGIN_MS = 3_600_000
#: How long reading the window at start may take before the member gives up (it fails to start).
READ_TIMEOUT_S = 120.0


def topic_name(subscription: str) -> str:
    """The dedup topic of a subscription (user names hold no dot: no clash)."""
    return f"{subscription}.dedup"


def encode(delivered_ms: int) -> bytes:
    return str(int(delivered_ms)).encode("ascii")


def decode(value: bytes | None) -> int | None:
    """A record's delivery time; None for one no member wrote (skipped)."""
    try:
        return int(value.decode("ascii")) if value else None
    except (UnicodeDecodeError, ValueError):
        return None


def ensure_topic(settings, subscription: str, window_ms: int, dlq: topics.CompositeTopic) -> str:
    """Make the subscription's dedup topic (module docstring), or accept an existing one of one
    partition (`InvalidArgument` otherwise); its name. A missing Create (or Describe) ACL is
    `NotAuthorized` naming it (exit 4)."""
    name = topic_name(subscription)
    configs = (("cleanup.policy", "delete"), ("retention.ms", str(window_ms + MARGIN_MS)))
    group_state_topic.ensure_beside_dlq(settings, name, 1, configs, dlq, "the dedup topic")
    return name


class DedupReader:
    """Feeds a `DedupMemory` from the dedup topic `topic`: `catch_up` reads the window up to the
    end the topic has now (at start), `run` follows its tail until `stopping` is set (a thread
    of its own). Raises Kafka's errors; `catch_up` raises `KafkaUnavailable` when reading
    takes longer than `READ_TIMEOUT_S`."""

    def __init__(self, settings, topic: str, memory: DedupMemory):
        self.memory = memory
        self._tp = TopicPartition(topic, PARTITION)
        self._consumer = kafka_clients.consumer(settings, enable_auto_commit=False)

    def catch_up(self, now_ms: int) -> int:
        """Read the ids delivered since `now_ms - window` up to the topic's end now; how many
        records were read."""
        consumer, tp = self._consumer, self._tp
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        found = consumer.offsets_for_times({tp: now_ms - self.memory.window_ms}).get(tp)
        consumer.seek(tp, end if found is None else found.offset)
        read = 0
        deadline = time.monotonic() + READ_TIMEOUT_S
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise KafkaUnavailable(f"{tp.topic}: not read to its end in {READ_TIMEOUT_S} s")
            read += self._poll(200)
        return read

    def run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            self._poll(200)

    def close(self) -> None:
        self._consumer.close(autocommit=False)

    def _poll(self, timeout_ms: int) -> int:
        read = 0
        for records in self._consumer.poll(timeout_ms=timeout_ms).values():
            for r in records:
                at = decode(r.value)
                if r.key is not None and at is not None:
                    self.memory.remember(r.key.decode("utf-8", "surrogateescape"), at)
                    read += 1
        return read
