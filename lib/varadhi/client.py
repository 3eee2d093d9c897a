"""`varadhi.Client`: the one Python API over topics, subscriptions, status, offsets, the DLQ,
replay, shard-count changes and deletes. The `varadhi` command line and the notebooks both call
it; scripts and other tools can too.

    from varadhi import Client

    with Client.from_env() as client:  # $VARADHI_BOOTSTRAP, $VARADHI_KAFKA_CONFIG, ...
        dry = client.reset_offsets("orders-sub", "main", "to-datetime", "2026-11-25T10:00:00Z")
        print(dry.summary["replayed"], "messages would be delivered again")

Contract: every method returns a typed result (the modules' own dataclasses, or the documented
dictionaries of `status` and `describe`), raises a `VaradhiError` (exit code 2: refused before
any side effect, 1: failed part way) and never prints; long operations report their steps only
through the `log` callable they are given. The client holds one `Catalog` (Kafka consumer and
producer), made on first use; `close()` (or `with`) releases it.

Spark is needed only by `change_shards` (state step, in-process feeders), `replay` and deletes of
a warehouse on a remote file system. `spark`, when given, is used for those; otherwise the
modules' own default applies (the active session, or a local one from `varadhi.spark.session`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import SubscriptionSpec
from varadhi.core.subscription_spec import parse_spec
from varadhi.kafka import dlq, trace
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import Subscription, SubscriptionService, from_snapshot
from varadhi.kafka.topics import AddStorageReport, CompositeTopic, TopicService
from varadhi.ops import status
from varadhi.ops.offsets import Mode, OffsetReset, Plan, Queue

if TYPE_CHECKING:
    from varadhi.ops.change_shards_plan import FeederMode
    from varadhi.ops.change_shards_plan import Plan as ChangeShardsPlan
    from varadhi.ops.library_shards import Plan as LibraryShardsPlan
    from varadhi.ops.lifecycle import SubscriptionDeletePlan, TopicDeletePlan
    from varadhi.ops.replay import ReplayPlan, ReplayResult

Log = Callable[[str], None]


def _quiet(_line: str) -> None:
    """The default `log`: the client never prints."""


@dataclass(frozen=True)
class OffsetResetResult:
    """An offset reset's plan and what happened. `outcome`: `new` (a fresh plan), `resume` (the
    recorded plan of an interrupted reset of the same request) or `done` (that reset was carried
    out already and no shard has consumed since: nothing to do). `executed` is False for a dry
    run, which changed nothing."""

    plan: Plan
    outcome: str
    executed: bool

    @property
    def summary(self) -> dict[str, Any]:
        """Queue, mode, value, `skipped` and `replayed` totals and the per-partition `moves`."""
        return self.plan.summary()

    def to_dict(self) -> dict[str, Any]:
        """What `varadhi offsets reset --output json` prints."""
        return self.summary | {"executed": self.executed, "outcome": self.outcome}


@dataclass(frozen=True)
class RedriveProgress:
    """Which shards applied a re-drive (`done`; a rate-capped one: put everything back) out of
    the subscription's `shard_count`."""

    op_id: str
    done: tuple[int, ...]
    shard_count: int

    @property
    def complete(self) -> bool:
        return len(self.done) >= self.shard_count


class Client:
    """Operations on one catalog (see the module docstring for the contract)."""

    def __init__(self, settings: Settings | None = None, *, spark: Any = None):
        self.settings = settings if settings is not None else Settings.from_env()
        self.spark = spark
        self._catalog: Catalog | None = None

    @classmethod
    def from_env(cls, command_config: str | None = None, **overrides: str | None) -> Client:
        """Settings from the environment (`Settings.from_env`); `command_config` is a Kafka client
        properties file, `overrides` e.g. `bootstrap=...`, `catalog_topic=...` (None: unset).
        Raises `KafkaConfigError` (one line) when the Kafka client configuration is bad."""
        return cls(Settings.from_env(command_config, **overrides))

    @property
    def catalog(self) -> Catalog:
        if self._catalog is None:
            self._catalog = Catalog(self.settings)
        return self._catalog

    def close(self) -> None:
        if self._catalog is not None:
            self._catalog.close()
            self._catalog = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- composite topics -------------------------------------------------------------------

    def create_topic(
        self, name: str, partitions: int, allow_uneven: bool = False
    ) -> CompositeTopic:
        return TopicService(self.catalog).create(name, partitions, allow_uneven)

    def add_storage(
        self, name: str, partitions: int, allow_uneven: bool = False
    ) -> AddStorageReport:
        """Append a storage topic; `report.compatible` is False for a partition change (K=1)."""
        return TopicService(self.catalog).add_storage(name, partitions, allow_uneven)

    def switch_produce(self, name: str) -> CompositeTopic:
        return TopicService(self.catalog).switch_produce(name)

    def topic(self, name: str) -> CompositeTopic:
        return TopicService(self.catalog).get(name)

    def topics(self) -> list[CompositeTopic]:
        return TopicService(self.catalog).list()

    def describe_topic(self, name: str) -> dict[str, Any]:
        """`TopicService.describe` (storage topics, K, end offsets, produce pointer) with
        `statistics`: messages inserted, and routed/emitted/acknowledged per subscription."""
        return self.describe_topics([name])[0]

    def describe_topics(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """`describe_topic` of each topic in `names`, in order, with a few Kafka requests
        whatever their number (`topic list`)."""
        docs = TopicService(self.catalog).describe_many(names)
        ends = {st["name"]: st["end_offsets"] for doc in docs for st in doc["storage_topics"]}
        statistics = status.topics_statistics(self.catalog, names, ends)
        for doc in docs:
            doc["statistics"] = statistics[doc["name"]]
        return docs

    def delete_topic(
        self, name: str, keep_data: bool = False, dry_run: bool = False, log: Log = _quiet
    ) -> TopicDeletePlan:
        """Delete a composite topic no subscription uses (refused, naming them, otherwise);
        `dry_run`: only the plan. A re-run after a crash finishes it."""
        from varadhi.ops.lifecycle import TopicDeleter

        deleter = TopicDeleter(self.catalog, log)
        return deleter.plan(name, keep_data) if dry_run else deleter.execute(name, keep_data)

    # -- subscriptions ----------------------------------------------------------------------

    def create_subscription(self, spec: SubscriptionSpec | Mapping[str, Any]) -> Subscription:
        """Create a subscription and its RQ/DLQ topics from a spec or a document in the shape of
        conf/subscriptions/example.yaml (checked before anything is created)."""
        if not isinstance(spec, SubscriptionSpec):
            spec = parse_spec(spec)
        return SubscriptionService(self.catalog).create(spec)

    def apply(self, specs: Sequence[SubscriptionSpec]) -> list[tuple[str, Subscription]]:
        """Create or update each subscription (all checked first): (`created`/`updated`/
        `unchanged`, subscription) pairs. A change of `runtime` is refused unless the
        subscription is paused and none of its shards or library members may still deliver
        (`status.check_runtime_switches`)."""
        status.check_runtime_switches(self.catalog, specs)
        return SubscriptionService(self.catalog).apply_all(specs)

    def subscription(self, name: str) -> Subscription:
        return SubscriptionService(self.catalog).get(name)

    def subscriptions(self) -> list[Subscription]:
        return SubscriptionService(self.catalog).list()

    def describe_subscription(self, name: str) -> dict[str, Any]:
        """Spec, state, RQ/DLQ storage topics and each shard's partitions (the CLI's JSON)."""
        return SubscriptionService(self.catalog).describe(name)

    def pause(self, name: str) -> Subscription:
        """Shards stop consuming after their current micro-batch and report `paused`."""
        return SubscriptionService(self.catalog).set_paused(name, True)

    def resume(self, name: str) -> Subscription:
        return SubscriptionService(self.catalog).set_paused(name, False)

    def plan_change_shards(
        self, name: str, to: int, allow_uneven: bool = False
    ) -> ChangeShardsPlan | LibraryShardsPlan:
        """The plan a shard-count change would follow (the dry run); refuses what `change_shards`
        would refuse. Changes nothing and needs no Spark. A `runtime: library` subscription's
        change is in place (`varadhi.ops.library_shards`)."""
        return self._change_shards().plan(name, to, allow_uneven)

    def change_shards(
        self,
        name: str,
        to: int,
        allow_uneven: bool = False,
        feeders: FeederMode = "in-process",
        log: Log = _quiet,
    ) -> dict[str, Any]:
        """Change (or resume changing) the shard count of a subscription whose shards are stopped
        or paused; returns the final operation document (`step` `done`, or `feed` with the
        `feeders` still to run when `feeders="external"`). `log` gets one line per step."""
        return self._change_shards(log).execute(name, to, allow_uneven, feeders)

    def _change_shards(self, log: Log = _quiet):
        from varadhi.ops.change_shards import ChangeShards

        factory = None if self.spark is None else (lambda: self.spark)
        return ChangeShards(self.catalog, spark=factory, log=log)

    def delete_subscription(
        self, name: str, keep_data: bool = False, dry_run: bool = False, log: Log = _quiet
    ) -> SubscriptionDeletePlan:
        """Delete a subscription whose shards are stopped and which has no operation in progress:
        its catalog records and, unless `keep_data`, its RQ/DLQ topics and warehouse folder;
        `dry_run`: only the plan. A re-run after a crash finishes it."""
        from varadhi.ops.lifecycle import SubscriptionDeleter

        deleter = SubscriptionDeleter(self.catalog, log)
        if dry_run:
            return deleter.plan(name, keep_data)
        return deleter.execute(name, keep_data, spark=self.spark)

    # -- status ---------------------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        """Per shard: state, lag and pending counts per queue, rates, blocked groups, standbys;
        plus totals (`stats`) and operations (`varadhi status --output json`). No Spark."""
        return status.collect(self.catalog, name)

    def running_shards(self, name: str) -> dict[int, str]:
        """The shards that may still be running, with their state: what `reset_offsets`,
        `change_shards` and `delete_subscription` wait for (empty: all stopped, or paused while
        the subscription is paused)."""
        return status.shards_running(self.catalog, name)

    # -- offsets ------------------------------------------------------------------------------

    def reset_offsets(
        self,
        name: str,
        queue: Queue,
        mode: Mode,
        value: int | str | None = None,
        *,
        execute: bool = False,
    ) -> OffsetResetResult:
        """Plan (and with `execute`, carry out) an offset reset of one queue, the way
        `kafka-consumer-groups --reset-offsets` does. `mode`: `to-earliest`, `to-latest`,
        `to-datetime` (`value`: ISO-8601, UTC if no zone, or epoch ms), `shift-by` (`value`: N,
        negative to rewind) or `to-storage-topic` (`value`: its index; main queue only). The RQ
        and DLQ only fast-forward. A dry run changes nothing; `execute` needs the shards stopped
        or paused, starts a new checkpoint generation, and re-running it after a crash finishes
        the same plan. A `runtime: library` subscription's consumer group is moved instead
        (`varadhi.ops.library_offsets`: its members must be stopped or paused, and leave the
        group for it)."""
        if mode == "to-datetime" and isinstance(value, str):
            value = dlq.parse_time_ms(value, "to_datetime")
        if mode == "to-storage-topic" and queue != "main":
            raise InvalidArgument(
                "--to-storage-topic applies to the main queue only", field="queue"
            )
        if mode in ("shift-by", "to-storage-topic") and isinstance(value, str):
            value = _integer(value, mode.replace("-", "_"))
        if self.subscription(name).spec.runtime == "library":
            from varadhi.ops import library_offsets

            plan, outcome = library_offsets.prepare(self.catalog, name, queue, mode, value)
            if execute:
                plan, outcome = library_offsets.execute(self.catalog, name, plan)
            return OffsetResetResult(plan, outcome, execute)
        reset = OffsetReset(self.catalog)
        plan, outcome = reset.prepare(name, queue, mode, value)
        if execute:
            plan, outcome = reset.execute(name, plan, spark=self.spark)
        return OffsetResetResult(plan, outcome, execute)

    # -- delivery trace -----------------------------------------------------------------------

    def trace(
        self, name: str, message_id: str, since: int | str | None = None
    ) -> list[dict[str, Any]]:
        """Every traced step of message `message_id` of subscription `name`, oldest first
        (`varadhi.core.trace`): each attempt (`at_ms`, `shard`, `attempt`, `status` or `error`,
        `latency_ms`, `answer`: the start of the answer) and where the message went next
        (`next`: delivered, retry, rq, dlq, filtered, deduplicated), with `reason` and
        `redriven` where they apply. `since` (ISO-8601 or epoch ms) reads only events written
        from then on; None reads the whole retention. Raises NotFound for an unknown
        subscription, `TraceOff` when it has no trace."""
        self.subscription(name)  # NotFound first: a clearer error than a missing topic
        since_ms = None if since is None else dlq.parse_time_ms(str(since), "since")
        events = trace.read(self.settings, name, message_id, since_ms)
        return [e.to_dict() for e in events]

    # -- dead-letter queue --------------------------------------------------------------------

    def dlq_messages(
        self, name: str, group_id: str | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """The newest `limit` (0: all) parked messages, oldest first: `msg_id`, `group_id`,
        `reason`, `status`, `attempts`, failure times, origin and `state` (`parked`,
        `redrive requested` or `redriven`)."""
        return dlq.list_parked(self.catalog, name, group_id, limit)

    def redrive(
        self,
        name: str,
        group_ids: Sequence[str] = (),
        message_ids: Sequence[str] = (),
        failed_since: int | str | None = None,
        failed_until: int | str | None = None,
        rate: float | str | None = None,
    ) -> str:
        """Record a re-drive (unsideline) of the parked messages any of the selectors match
        (times: ISO-8601 or epoch ms); each running shard applies it at its next micro-batch, in
        the groups' order. With `rate` (messages a second for the whole subscription: a number
        or text like `"50/s"`), the shards put them back at no more than that, in portions, each
        group in order and ahead of its newer traffic. Returns the re-drive's id (see
        `redrive_progress`)."""
        selector = dlq.Selector(
            group_ids=tuple(group_ids),
            message_ids=tuple(message_ids),
            failed_since_ms=_time_ms(failed_since, "failed_since"),
            failed_until_ms=_time_ms(failed_until, "failed_until"),
        ).validate()
        pace = None if rate is None else dlq.parse_rate(str(rate))
        return dlq.request_unsideline(self.catalog, name, selector, pace)

    def redrive_progress(self, name: str, op_id: str) -> RedriveProgress:
        snap = self.catalog.snapshot()
        doc = dlq.redrives(snap, name).get(op_id, {})
        shards = from_snapshot(snap, name).shard_count
        return RedriveProgress(op_id, tuple(doc.get("done", [])), shards)

    def wait_for_redrive(
        self, name: str, op_id: str, timeout_s: float, poll_s: float = 1.0
    ) -> RedriveProgress:
        """Wait until every shard applied the re-drive (a rate-capped one: put everything
        back); raises `RedriveNotApplied` after `timeout_s` (the shards are probably not
        running, or the rate needs longer)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            progress = self.redrive_progress(name, op_id)
            if progress.complete:
                return progress
            time.sleep(poll_s)
        raise dlq.RedriveNotApplied(op_id, timeout_s)

    # -- replay -------------------------------------------------------------------------------

    def plan_replay(
        self, name: str, from_: str, to: str | None = None, parallelism: int | None = None
    ) -> ReplayPlan:
        """Check and plan a replay of the main topic's messages with Kafka timestamps in
        [from_, to) (ISO-8601 or epoch ms; `to` default now). Refuses (exit 2) before any side
        effect; reads only the catalog and Kafka offsets."""
        from varadhi.ops import replay

        return replay.prepare(self.catalog, name, from_, to, parallelism=parallelism)

    def replay(self, plan: ReplayPlan) -> ReplayResult:
        """Deliver a planned replay with a bounded Spark job on the client's session, the active
        one, or a local one made and stopped here; the result is recorded in the catalog.
        `result.ok` is False when some messages failed (listed in `result.failures`)."""
        from varadhi.ops import replay

        if self.spark is not None:
            return replay.execute(self.spark, self.catalog, plan)
        from pyspark.sql import SparkSession

        from varadhi.spark.session import get_spark

        own = SparkSession.getActiveSession() is None
        spark = get_spark(f"varadhi-replay-{plan.subscription}")
        try:
            return replay.execute(spark, self.catalog, plan)
        finally:
            if own:
                spark.stop()


def _time_ms(value: int | str | None, field: str) -> int | None:
    if value is None or value == "":
        return None
    return dlq.parse_time_ms(str(value), field)


def _integer(text: str, field: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgument(f"not a whole number: {text!r}", field=field) from None
