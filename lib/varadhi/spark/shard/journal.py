"""The shard driver's side of the delivery journal (`varadhi.spark.journal`): the journal topic, where
each batch's tasks journal what the endpoint accepted, and what a re-run batch skips.

- `ensure(sub)`: create the subscription's journal topic once per process when the journal is
  on (`consumption.journal_interval` > 0). Kafka failing here (a shard started while the broker
  is down or restarting) is logged and tried again before every batch (`target`), so the
  journal is off only for the batches that start while Kafka cannot take the topic, never for
  the rest of the query. Such a batch is delivered unjournaled (logged) rather than refused:
  a topic that can never be made (a missing ACL, a pre-created topic that does not fit) would
  otherwise stop delivery for good, and a batch that read its records from Kafka meets a
  reachable cluster in nearly every other case.
- `plan_replay(checkpoint, uncommitted)`: at a query's start, the batch a crashed run planned
  in the query's `checkpoint` and never committed (`checkpoints.uncommitted_batch`: batch id,
  planning time), which the query runs first.
- `target(sub, app_id, batch_id)`: where a batch's tasks journal (`journal.JournalTarget`: the
  shard's partition of the topic, the batch's key), or None with the journal off or its topic
  still not reachable (after one more `ensure`).
- `replayed(sub, app_id, batch_id)`: for the query's first batch only, and only when it is the
  planned uncommitted one, the origins the crashed run journaled as accepted (read from
  its planning time minus `journal.LOOKBACK_MS`); None for every other batch, or when the journal
  cannot be read after `journal.READ_TRIES` tries (`journal.read_again`; logged: the batch is delivered again whole, rather
  than failing the query: duplicates of one batch against a shard that stops delivering).
- `expect_handover(handover, layout)` and `handed_over(checkpoint, fs)`: what a shard-count
  change handed this shard (`journal.HandOver`: messages an old shard's uncommitted batch
  delivered), which every batch skips while the query reads below those messages.

Contract: `target`, `replayed` and `handed_over` run on the batch's thread, `ensure`,
`plan_replay` and `expect_handover` on the control loop's before the query starts. The topic and the reader are injected (unit-tested in
tests/unit/test_shard_journal.py; a real crash and re-run in tests/integration/
test_shard_crash.py, the journal over SASL_SSL in test_secure_kafka.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kafka.errors import KafkaError

from varadhi.core.errors import VaradhiError
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions
from varadhi.kafka.settings import Settings
from varadhi.spark import checkpoints, journal, layouts
from varadhi.spark.layouts import Layout
from varadhi.spark.warehouse_fs import WarehouseFS

log = logging.getLogger("varadhi.spark.shard.job")


class ShardJournal:
    """The journal of shard `shard` of subscription `name` (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        name: str,
        shard: int,
        ensure_topic: Callable[[Settings, str, int], int] = journal.ensure_topic,
        read: Callable[..., journal.Accepted] = journal.read,
    ):
        self.settings, self.name, self.shard = settings, name, shard
        self._ensure_topic, self._read = ensure_topic, read
        self.partitions: int | None = None  # the topic's partition count once it exists
        self._replay: tuple[str, int, int] | None = None  # (checkpoint, batch id, planned ms)
        # What a shard-count change handed this shard's layout (`journal.HandOver`), if any.
        self._handover: tuple[journal.HandOver, Layout] | None = None

    def ensure(self, sub: subscriptions.Subscription) -> None:
        if sub.spec.consumption.journal_interval_ms <= 0 or self.partitions:
            return
        try:
            self.partitions = self._ensure_topic(
                self.settings, journal.topic_name(self.name), sub.shard_count
            )
        except (KafkaError, VaradhiError) as e:
            log.warning(
                "%s shard %d: the delivery journal's topic cannot be reached (%s); tried again "
                "before the next batch",
                self.name,
                self.shard,
                e,
            )

    def plan_replay(self, checkpoint: str, uncommitted: tuple[int, int] | None) -> None:
        self._replay = (checkpoint, *uncommitted) if uncommitted else None

    def expect_handover(self, handover: journal.HandOver | None, layout: Layout) -> None:
        """The hand-over a shard-count change left for `layout`'s query (None: none)."""
        self._handover = (handover, layout) if handover else None

    def handed_over(self, checkpoint: str, fs: WarehouseFS) -> journal.Accepted | None:
        """The origins a shard-count change handed this shard (`journal.HandOver`: messages an
        old shard's uncommitted batch delivered) while the query (`checkpoint`) reads below
        them; forgotten once it has committed past them all."""
        if self._handover is None:
            return None
        handover, layout = self._handover
        committed = checkpoints.committed_offsets(checkpoint, fs) or {}
        accepted = handover.accepted_below(layouts.merged(layout.starting_offsets, committed))
        if accepted is None:
            self._handover = None
            return None
        log.info(
            "%s shard %d: %d messages an old shard delivered before the shard-count change "
            "are not sent again when this batch reads them (hand-over)",
            self.name,
            self.shard,
            len(accepted),
        )
        return accepted

    def target(
        self, sub: subscriptions.Subscription, app_id: str, batch_id: int
    ) -> journal.JournalTarget | None:
        interval = sub.spec.consumption.journal_interval_ms
        if interval <= 0:
            return None
        self.ensure(sub)  # not made yet: Kafka was away when the query started
        if not self.partitions:
            log.warning(
                "%s shard %d: batch %d is not journaled (no journal topic yet): a crash before "
                "it commits delivers it again whole",
                self.name,
                self.shard,
                batch_id,
            )
            return None
        return journal.JournalTarget(
            bootstrap=self.settings.bootstrap,
            topic=journal.topic_name(self.name),
            partition=journal.partition_of(self.shard, self.partitions),
            key=journal.batch_key(app_id, batch_id, sub.created_ms),
            interval_ms=interval,
            max_lag_ms=sub.spec.consumption.journal_max_lag_ms,
            kafka=kafka_clients.config_of(self.settings),
        )

    def replayed(
        self, sub: subscriptions.Subscription, app_id: str, batch_id: int
    ) -> journal.Accepted | None:
        replay, self._replay = self._replay, None  # only the first batch can be a replay
        if replay is None or replay[1] != batch_id:
            return None
        target = self.target(sub, app_id, batch_id)
        if target is None:
            return None
        started = time.monotonic()
        try:
            accepted = journal.read_again(
                lambda: self._read(
                    self.settings,
                    target.topic,
                    target.partition,
                    target.key,
                    since_ms=replay[2] - journal.LOOKBACK_MS,
                ),
                (KafkaError, VaradhiError),
                lambda e: self._cannot_read(batch_id, e, f"again in {journal.READ_RETRY_S:.0f} s"),
            )
        except (KafkaError, VaradhiError) as e:
            self._cannot_read(batch_id, e, "it is delivered again whole")
            return None
        log.info(
            "%s shard %d: batch %d re-runs a batch an earlier run started; %d of its messages "
            "were accepted then and are not sent again (journal read in %.2f s)",
            self.name,
            self.shard,
            batch_id,
            len(accepted),
            time.monotonic() - started,
        )
        return accepted or None

    def _cannot_read(self, batch_id: int, error: Exception, then: str) -> None:
        log.warning(
            "%s shard %d: batch %d re-runs; its journal cannot be read (%s): %s",
            self.name,
            self.shard,
            batch_id,
            error,
            then,
        )
