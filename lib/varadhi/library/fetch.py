"""The library member's fetching: librdkafka (confluent-kafka) reading the partitions the
member holds, by manual assignment, while kafka-python keeps the group membership.

Why two clients. kafka-python decodes records in Python: about a third of a healthy member's
CPU went to its fetch path (docs/benchmarks.md). librdkafka decodes them in C on its own
threads. Group membership stays with kafka-python: the slot assignor (`varadhi.library.assign`)
is a Python assignor, which librdkafka cannot run; the member's kafka-python consumer joins,
heartbeats and commits, and never fetches (every partition it is assigned stays paused:
`varadhi.library.runtime`'s `_assign`).

`Fetcher` has the calls of kafka-python's consumer that the member makes on its fetch
position (`poll`, `pause`, `resume`, `paused`, `seek`, `position`, `assignment`), plus
`assign` (a partition from an offset) and `unassign`. Records come back as `Record`s (offset,
key, value, headers, as kafka-python's records have them).

Contract. Only the member's Kafka thread calls a `Fetcher`: the assignment changes where the
member sets up a rebalance (`assign`, `unassign`), never in the rebalance listener. A record of
a partition not assigned, or paused, is never returned (librdkafka drops what it prefetched
for a partition that is paused, sought or unassigned; one of a paused partition that comes all
the same is sought back to, read after the resume). `position(tp)` is the offset of the next
record the member gets: librdkafka's position once it returned one (past transaction markers),
else where it was assigned or last sought.

Errors. An error that Kafka will not cure by itself stops the member: a missing Read ACL on a
topic (`NotAuthorized`, exit 4), or what `varadhi.kafka.clients.permanent` calls permanent (a
fatal client error, credentials or a certificate refused), reported with a record or to the
client's error callback (`FetchConsumer.failure`), with `explain`'s line. Other errors (a
broker away, a leader moving) are librdkafka's to retry; they are logged.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as RdPartition
from kafka import TopicPartition

from varadhi.core.errors import KafkaUnavailable, NotAuthorized
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka.clients import FetchConsumer

log = logging.getLogger(__name__)

#: What librdkafka may hold of fetched records, in KiB (its default, 64 MiB, is more than a member
#: that holds at most `Options.max_pending` messages uses).
QUEUED_KIB = 32768

#: How long a look-up of a log's start may take (s).
LOOKUP_S = 10.0

#: A record's errors that stop the member as `NotAuthorized`.
_AUTHORIZATION = frozenset(
    {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED}
)


class Record(NamedTuple):
    """A record as the member reads it (kafka-python's `ConsumerRecord` fields it uses)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]


class Fetcher:
    """See the module docstring. `consumer` is a librdkafka consumer that never subscribes,
    made from `settings` (`kafka_clients.fetch_consumer`), which also name the user in a
    `NotAuthorized` and explain a permanent error. A failure its client reported and will not
    get past by retrying (`FetchConsumer.failure`) is raised by the next `poll`."""

    def __init__(self, consumer: FetchConsumer, settings: kafka_clients.HasKafka):
        self._consumer = consumer
        self._settings = settings
        self._assigned: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()
        self._starts: dict[TopicPartition, int] = {}  # where assigned or last sought

    @staticmethod
    def config(client_id: str) -> dict[str, Any]:
        """The librdkafka properties of a member's fetcher (the connection's come from the
        client configuration). `group.id` is required by librdkafka but never used: the
        fetcher neither subscribes nor commits."""
        return {
            "client.id": client_id,
            "group.id": f"{client_id}-fetch-unused",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            "queued.max.messages.kbytes": QUEUED_KIB,
        }

    # -- the assignment ----------------------------------------------------------------------
    def assign(self, starts: dict[TopicPartition, int | None]) -> None:
        """Read each partition of `starts` from its offset, or from the log's start for None
        (again from there if held already). Raises `KafkaUnavailable` when a log's start is not
        known within `LOOKUP_S` (the caller tries again)."""
        if not starts:
            return
        starts = {tp: self._log_start(tp) if at is None else at for tp, at in starts.items()}
        again = [tp for tp in starts if tp in self._assigned]
        self.unassign(again)
        self._consumer.incremental_assign(
            [RdPartition(tp.topic, tp.partition, offset) for tp, offset in starts.items()]
        )
        self._assigned |= set(starts)
        self._starts.update(starts)

    def _log_start(self, tp: TopicPartition) -> int:
        try:
            low, _ = self._consumer.get_watermark_offsets(
                RdPartition(tp.topic, tp.partition), timeout=LOOKUP_S
            )
        except KafkaException as e:
            raise KafkaUnavailable(f"the start of {tp.topic}/{tp.partition} not known: {e}") from e
        return low

    def unassign(self, tps) -> None:
        """Stop reading `tps` (those not assigned are ignored)."""
        held = [tp for tp in tps if tp in self._assigned]
        if not held:
            return
        self._consumer.incremental_unassign([RdPartition(tp.topic, tp.partition) for tp in held])
        for tp in held:
            self._assigned.discard(tp)
            self._paused.discard(tp)
            self._starts.pop(tp, None)

    def reading(self) -> bool:
        """Whether a partition is assigned and not paused."""
        return len(self._paused) < len(self._assigned)

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    # -- the position --------------------------------------------------------------------------
    def pause(self, *tps: TopicPartition) -> None:
        held = [tp for tp in tps if tp in self._assigned and tp not in self._paused]
        if held:
            self._consumer.pause([RdPartition(tp.topic, tp.partition) for tp in held])
            self._paused.update(held)

    def resume(self, *tps: TopicPartition) -> None:
        held = [tp for tp in tps if tp in self._paused]
        if held:
            self._consumer.resume([RdPartition(tp.topic, tp.partition) for tp in held])
            self._paused.difference_update(held)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read `tp` again from `offset` (what librdkafka fetched beyond it is dropped)."""
        if tp not in self._assigned:
            return
        self._consumer.seek(RdPartition(tp.topic, tp.partition, offset))
        self._starts[tp] = offset

    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record `poll` returns of `tp` (module docstring)."""
        found = self._consumer.position([RdPartition(tp.topic, tp.partition)])[0].offset
        return found if found >= 0 else self._starts[tp]  # OFFSET_INVALID: none returned yet

    # -- reading ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Record]]:
        """The records librdkafka has, at most `max_records`, waiting up to `timeout_ms` for the
        first (not for more: the member's latency); by partition, in offset order. Raises on an
        error that stops the member."""
        # librdkafka's consume waits for all `max_records` or the timeout: at a low rate every
        # record would wait the timeout out. So: what is there; else the first that comes, and
        # what came with it.
        consumer = self._consumer
        messages = consumer.consume(max_records, 0)
        if not messages:
            messages = consumer.consume(1, timeout_ms / 1000)
            if messages and max_records > 1:
                messages += consumer.consume(max_records - 1, 0)
        failure = self._consumer.failure()
        if failure is not None:
            raise failure
        out: dict[TopicPartition, list[Record]] = {}
        current: tuple[str, int] | None = None
        batch: list[Record] = []
        assigned = self._assigned
        for m in messages:
            error = m.error()
            if error is not None:
                self._on_error(error, m.topic())
                continue
            where = (m.topic(), m.partition())
            if where != current:
                current = where
                tp = TopicPartition(*where)
                batch = out.setdefault(tp, []) if tp in assigned else []
            batch.append(Record(m.offset(), m.key(), m.value(), m.headers() or []))
        # librdkafka drops what it fetched of a partition once paused; should any come all the
        # same, its position moved past them: they are read again after the resume, not lost
        for tp in self._paused & out.keys():
            self.seek(tp, out.pop(tp)[0].offset)
        return out

    def _on_error(self, error: KafkaError, topic: str | None) -> None:
        if error.code() in _AUTHORIZATION and topic:
            raise NotAuthorized("Read", "Topic", topic, kafka_clients.principal(self._settings))
        if kafka_clients.permanent(error):
            raise kafka_clients.unavailable(self._settings, error)
        log.debug("fetch: %s (librdkafka retries)", error.str())

    def close(self) -> None:
        self._consumer.close()


class Reading:
    """A member's reading in two fetchers (`Fetcher`'s calls, each routed by topic): one for
    its RQ, one for the main topic's storage topics.

    Why two. A member that holds `max_pending` messages reads the RQ alone (`poll(...,
    main=False)`): a retry's copy read back can free the messages that wait behind its key. With
    one librdkafka consumer the RQ's records queue behind thousands of the main topic's that
    it fetched ahead (up to `QUEUED_KIB`); dropping and fetching those again each turn starved
    the RQ (bench/library.py with 10% of attempts failing stalled for 35 s at `max_pending`).
    Each consumer has its own queue: the main topic's records wait in theirs, fetched once.

    Every poll takes the RQ's records first. Hazard: while only the main topic has records to
    wait for, an RQ record that comes during that wait is taken at the next poll (up to
    `timeout_ms` later; a retry waits its backoff of at least 100 ms anyway)."""

    def __init__(self, main: Fetcher, rq: Fetcher, rq_topic: str):
        self._main = main
        self._rq = rq
        self._rq_topic = rq_topic

    @classmethod
    def of(cls, settings: kafka_clients.HasKafka, member: str, rq_topic: str) -> Reading:
        """Both fetchers, made with `settings` (`kafka_clients.fetch_consumer`) and named after
        `member`; the first is closed if the second cannot be made."""
        main = Fetcher(kafka_clients.fetch_consumer(settings, **Fetcher.config(member)), settings)
        try:
            rq = Fetcher(
                kafka_clients.fetch_consumer(settings, **Fetcher.config(f"{member}-rq")), settings
            )
        except BaseException:
            main.close()
            raise
        return cls(main, rq, rq_topic)

    def _of(self, tp: TopicPartition) -> Fetcher:
        return self._rq if tp.topic == self._rq_topic else self._main

    def _split(self, tps) -> tuple[list[TopicPartition], list[TopicPartition]]:
        rq = [tp for tp in tps if tp.topic == self._rq_topic]
        return [tp for tp in tps if tp.topic != self._rq_topic], rq

    def assign(self, starts: dict[TopicPartition, int | None]) -> None:
        main, rq = self._split(starts)
        self._main.assign({tp: starts[tp] for tp in main})
        self._rq.assign({tp: starts[tp] for tp in rq})

    def unassign(self, tps) -> None:
        main, rq = self._split(tps)
        self._main.unassign(main)
        self._rq.unassign(rq)

    def reading(self) -> bool:
        return self._main.reading() or self._rq.reading()

    def assignment(self) -> set[TopicPartition]:
        return self._main.assignment() | self._rq.assignment()

    def pause(self, *tps: TopicPartition) -> None:
        main, rq = self._split(tps)
        self._main.pause(*main)
        self._rq.pause(*rq)

    def resume(self, *tps: TopicPartition) -> None:
        main, rq = self._split(tps)
        self._main.resume(*main)
        self._rq.resume(*rq)

    def paused(self) -> set[TopicPartition]:
        return self._main.paused() | self._rq.paused()

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._of(tp).seek(tp, offset)

    def position(self, tp: TopicPartition) -> int:
        return self._of(tp).position(tp)

    def poll(
        self, timeout_ms: int, max_records: int, main: bool = True
    ) -> dict[TopicPartition, list[Record]]:
        """The RQ's records librdkafka has, then (if `main`) the main topic's, at most
        `max_records` in all, waiting up to `timeout_ms` for the first (`Fetcher.poll`)."""
        out = self._rq.poll(0 if main else timeout_ms, max_records)
        if main:
            taken = sum(map(len, out.values()))
            if taken < max_records:
                out.update(self._main.poll(0 if taken else timeout_ms, max_records - taken))
        return out

    def close(self) -> None:
        try:
            self._main.close()
        finally:
            self._rq.close()
