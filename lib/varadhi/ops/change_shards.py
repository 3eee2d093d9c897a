"""Changing a subscription's shard count (seed 000, ChangeShardCount): the operation's steps
against the catalog, Kafka and the warehouse.

`varadhi subscription change-shards NAME --to S` moves a subscription from its current shard
count to S while its shards are stopped (or the subscription is paused). The decision is a pure
function (`plan_change`; it and every other decision of the change are in
`varadhi.ops.change_shards_plan`); executing it (`ChangeShards.execute`) takes these steps, each
recorded in the catalog under `operation/<sub>/change-shards` *before* it is taken, so a re-run
after a crash resumes at the recorded step (every step is idempotent):

1. `fence`:    take the old shards' leases, so an old instance still alive (paused) stops;
2. `queues`:   add a new RQ storage topic (2*S partitions) and DLQ storage topic (S partitions)
               and switch their produce pointers to them. They are always added: an old RQ
               partition's records were routed with `routing.internal_partition` over the OLD
               owner's partitions, so new shards cannot read it in place;
3. `state`:    reshard GroupState: every old shard's pending rows go to the table of the group's
               new shard (plain Delta overwrite: nobody else writes now; the meta row is not
               carried, so the new shards' first batch is not taken for a replay). The `out`
               rows of each old table's last batch are re-sent to the new queues (a shard that
               crashed between its commit and its send never sent them), in one Kafka
               transaction, skipped when the new queues already hold a committed record.
               An old shard's batch planned and never committed (it died or was fenced in
               it) has its delivery journal handed over (`varadhi.spark.journal`): the pending
               entries it delivered are dropped (`drop_delivered`), and the main-topic
               messages it delivered go to the new shards as `HandOver` documents, with
               what an earlier change handed an old shard and it has not yet read past
               (two changes in a row: its messages must not be delivered again either).
               A journal that cannot be read stops the change (`HandOverUnreadable`), here
               before the step writes anything and, before the `fence` step, in `execute`;
4. `layouts`:  the new shards' reader layouts: the lowest main-topic storage topic any old shard
               still reads, or past it when they consumed it and it is sealed (`first_unread`:
               old shards waiting at a K=1 boundary), starting where the old shards stopped
               (`checkpoints.shard_position`, per partition from its old owner; -2 = earliest
               where unknown), the new RQ storage topic from its beginning;
5. `activate`: the subscription's record, in place: `shard_count` = S, `rq_from`/`dlq_from` = the
               new storage topics (the shards read and browse those on), and the spec's
               `shards`/`rq_partitions`/`dlq_partitions` to match (`activated`);
6. `feed`:     the feeders (`varadhi.ops.feeders`: in this process, or as jobs of their own with
               `--feeders external`) copy every record of the old RQ/DLQ storage topics to the
               new ones, while the new shards already run (why that keeps order: there). They
               never call the endpoint and never touch GroupState;
7. `done`:     the same command run again then does nothing (`finished`).

A crash after any step, then the same command again, ends where one clean run does (the
subscription, operation, reader-layout and hand-over documents, the new GroupState tables and the
records of the new RQ/DLQ storage topics: `tests/integration/test_change_shards_crash.py`).

A `runtime: library` subscription is changed in place instead (`varadhi.ops.library_shards`:
its members cannot read a second RQ/DLQ storage topic): none of the steps above is taken.

`ChangeShards` refuses before anything when the warehouse is not writable (the state step moves
Delta tables), and starts Spark only for the steps that need it (the state step and in-process
feeders), so a dry run (`ChangeShards.plan`) needs none. `journaled_plan` reads what an old
shard's uncommitted batch delivered (its checkpoint and its delivery journal); a read that keeps
failing stops the change (`HandOverUnreadable`) rather than hand over nothing.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import pandas as pd

from varadhi.core.errors import InvalidArgument, NotFound, VaradhiError
from varadhi.core.faults import crash_point
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import progress, subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.leases import Lease
from varadhi.kafka.settings import Settings
from varadhi.kafka.subscriptions import Subscription
from varadhi.kafka.topics import StorageTopic
from varadhi.ops import library_shards, status
from varadhi.ops.change_shards_plan import (
    OPERATION,
    STEPS,
    FeederMode,
    Plan,
    activated,
    carried,
    check_stopped,
    drop_delivered,
    finished,
    first_unread,
    internal_target,
    next_layout_seq,
    operation_name,
    plan_change,
    require_op,
    reshard_tables,
    touched,
)
from varadhi.ops.feeders import feed
from varadhi.spark import checkpoints, journal, layouts
from varadhi.spark.checkpoints import Offsets, shard_position
from varadhi.spark.layouts import READER_KIND, Layout
from varadhi.spark.warehouse_fs import check_writable, for_path

log = logging.getLogger(__name__)

#: Seconds the state step's re-send waits for each record's acknowledgement, and for its commit.
RESEND_TIMEOUT_S = 30


class HandOverUnreadable(VaradhiError):
    """What an old shard's uncommitted batch delivered cannot be found out (its checkpoint or
    its delivery journal cannot be read, e.g. Kafka just restarted): handing over nothing would
    make the new shards deliver that batch's messages again, so the change stops and says so.
    Exit code 2 when raised before the change's first step (nothing changed), 1 when raised at
    its `state` step (the operation resumes there when the same command runs again)."""

    def __init__(self, name: str, shard: int, error: BaseException, started: bool):
        where = (
            "the change stopped before its state step; run the same command again once it "
            "can be read (it resumes there)"
            if started
            else "nothing was changed; run the same command again once it can be read"
        )
        super().__init__(
            f"change-shards {name}: what old shard {shard}'s uncommitted batch delivered cannot "
            f"be read ({type(error).__name__}: {error}); the new shards would deliver it again: "
            f"{where}"
        )
        self.exit_code = 1 if started else 2
        self.shard = shard


def journaled_plan(
    settings: Settings,
    name: str,
    count: int,
    shard: int,
    layout: Layout,
    created_ms: int,
    fs,
) -> tuple[int, Any, journal.Accepted] | None:
    """Shard `shard` of `count`'s newest batch in its `layout`'s checkpoint if it is planned and
    not committed (`checkpoints.uncommitted_plan`, through `fs`): its id, its planned end, and
    what its journal names as accepted (`journal.read_shard`, under the batch's key, from its
    planning time minus `journal.LOOKBACK_MS`; possibly empty). None when there is no such
    batch. Raises what reading Kafka raises."""
    path = layouts.checkpoint_path(settings.warehouse, name, count, shard, layout)
    planned = checkpoints.uncommitted_plan(path, fs)
    if planned is None:
        return None
    batch_id, planned_ms, end = planned
    app_id = layouts.app_id(name, count, shard, layout)
    accepted = journal.read_shard(
        settings,
        name,
        shard,
        journal.batch_key(app_id, batch_id, created_ms),
        since_ms=planned_ms - journal.LOOKBACK_MS,
    )
    return batch_id, end, accepted


def _load(snap: Snapshot, name: str):
    sub = subscriptions.from_snapshot(snap, name)
    return (
        sub,
        topics.from_snapshot(snap, sub.spec.topic),
        topics.from_snapshot(snap, sub.spec.rq_topic),
        topics.from_snapshot(snap, sub.spec.dlq_topic),
    )


class ChangeShards:
    """Plans and executes shard-count changes against the catalog, Kafka and Delta.

    `spark` is a factory, called only when a step needs Spark (the state step and in-process
    feeders), so a dry run needs none. `log` receives one line per step taken.
    """

    def __init__(
        self,
        catalog: Catalog,
        spark: Callable[[], Any] | None = None,
        log: Callable[[str], None] = lambda _line: None,
    ):
        self.catalog = catalog
        self._spark_factory = spark
        self._spark = None
        self.log = log

    @property
    def spark(self):
        if self._spark is None:
            if self._spark_factory is None:
                from varadhi.spark.session import get_spark

                self._spark = get_spark("varadhi-change-shards")
            else:
                self._spark = self._spark_factory()
        return self._spark

    def operation(self, name: str) -> dict[str, Any] | None:
        return self.catalog.get(OPERATION, operation_name(name))

    def plan(self, name: str, to: int, allow_uneven: bool = False) -> Plan | library_shards.Plan:
        """The plan a fresh change would follow (refusing what it would refuse); no effects. A
        `runtime: library` subscription's is `library_shards`' (in place; no Spark)."""
        snap = self.catalog.snapshot()
        if subscriptions.from_snapshot(snap, name).spec.runtime == "library":
            return library_shards.plan(self.catalog, name, to, allow_uneven)
        sub, mq, rq, dlq = _load(snap, name)
        op = snap.get(OPERATION, operation_name(name))
        wh = self.catalog.settings.warehouse
        check_writable(for_path(wh, lambda: self.spark), wh)  # state moves: refuse first
        if op is not None and op.get("step") != "done":
            self._check_resumable(op, name, to)
            if STEPS.index(op["step"]) > STEPS.index("activate"):
                raise InvalidArgument(
                    f"the change of {name} to {to} shards is active and waits for its feeders "
                    f"({', '.join(f['source'] for f in op['feeders'] if not f['done'])}); run "
                    "it again without --dry-run, or run the feeders, to finish it"
                )
            return self._resumed_plan(snap, name, op)
        self._check_no_pending_feeders(op, name)
        now = int(time.time() * 1000)
        check_stopped(
            sub, _progress(self.catalog, snap, sub), now, status.leases_of(snap, sub, now)
        )
        seq = next_layout_seq(snap, name, to, sub.generation)
        positions = self._positions(sub)
        ends = topics.end_offsets(self.catalog, mq.storage_topics)
        now = int(time.time() * 1000)
        start = first_unread(mq, sub.shard_count, positions, ends, now, topics.SEAL_GRACE_MS)
        return plan_change(
            sub, mq, rq, dlq, positions, to, allow_uneven, layout_seq=seq, mq_index=start
        )

    def execute(
        self, name: str, to: int, allow_uneven: bool = False, feeders: FeederMode = "in-process"
    ) -> dict[str, Any]:
        """Run (or resume) the change; returns the final operation document. A `runtime:
        library` subscription's is `library_shards`' (in place, one catalog write)."""
        snap = self.catalog.snapshot()
        if subscriptions.from_snapshot(snap, name).spec.runtime == "library":
            return library_shards.execute(self.catalog, name, to, allow_uneven, self.log)
        op = snap.get(OPERATION, operation_name(name))
        if finished(op, subscriptions.from_snapshot(snap, name), to):
            assert op is not None
            self.log(f"the change of {name} to {to} shards is done; nothing to do")
            return op
        wh = self.catalog.settings.warehouse
        check_writable(for_path(wh, lambda: self.spark), wh)  # state moves: refuse first
        if op is not None and op.get("step") != "done":
            self._check_resumable(op, name, to)
            op = dict(op, feeders_mode=feeders)
            self.log(f"resuming the change {op['from']} -> {op['to']} at step {op['step']}")
        else:
            plan = self.plan(name, to, allow_uneven)
            # Refuse before the first step if an uncommitted batch's journal cannot be read
            # (the state step reads it again once the old shards are fenced).
            self._uncommitted_batches(plan, started=False)
            op = plan.operation_doc("fence", feeders)
            self._write_op(name, op)
            crash_point("change_shards_recorded")
            for w in plan.warnings:
                self.log(f"warning: {w}")
        step = op["step"]
        if STEPS.index(step) <= STEPS.index("activate"):
            snap = self.catalog.snapshot()
            plan = self._resumed_plan(snap, name, op)
            if step != "fence":  # fenced old shards report "fenced"; anything else is new
                now = int(time.time() * 1000)
                current = subscriptions.from_snapshot(snap, name)
                check_stopped(
                    current,
                    _progress(self.catalog, snap, current),
                    now,
                    status.leases_of(snap, current, now),
                )
            for s in STEPS[STEPS.index(step) : STEPS.index("feed")]:
                report = getattr(self, f"_step_{s}")(plan)
                op = dict(op, step=STEPS[STEPS.index(s) + 1], **(report or {}))
                if s not in ("layouts", "activate"):  # those two record it in their own write
                    self._write_op(name, op)
                crash_point(f"change_shards_{s}")
        return self._feed_all(name, op["feeders_mode"])

    # -- steps ----------------------------------------------------------------------------
    def _step_fence(self, plan: Plan) -> None:
        for shard in range(plan.from_shards):
            Lease(self.catalog, layouts.owner(plan.name, plan.from_shards, shard)).acquire()
        self.log(f"fence: took the leases of shards 0..{plan.from_shards - 1}")

    def _step_queues(self, plan: Plan) -> None:
        sub = subscriptions.from_snapshot(self.catalog.snapshot(), plan.name)
        service = topics.TopicService(self.catalog)
        for composite, target, index in (
            (sub.spec.rq_topic, plan.rq_target, plan.rq_target_index),
            (sub.spec.dlq_topic, plan.dlq_target, plan.dlq_target_index),
        ):
            topic = service.get(composite)
            if len(topic.storage_topics) == index:
                service.add_storage(composite, target.partitions, allow_uneven=True)
            elif (
                len(topic.storage_topics) < index
                or topic.storage(index).partitions != target.partitions
            ):
                raise VaradhiError(
                    f"{composite} does not have the expected storage topic {target.name} with "
                    f"{target.partitions} partitions; it was changed during the shard-count change"
                )
            while service.get(composite).produce_pointer < index:
                service.switch_produce(composite)
        self.log(
            f"queues: {plan.rq_target.name} ({plan.rq_target.partitions} partitions) and "
            f"{plan.dlq_target.name} ({plan.dlq_target.partitions}) take new failures"
        )

    def _step_state(self, plan: Plan) -> dict[str, Any]:
        from varadhi.core.state_frames import normalise
        from varadhi.core.state_rows import STATE_SCHEMA
        from varadhi.spark.state_store import StateStore

        wh = self.catalog.settings.warehouse
        # The hand-over (`varadhi.spark.journal`): what old shards' uncommitted batches delivered,
        # read first: a journal that cannot be read stops the step before it writes anything.
        batches = self._uncommitted_batches(plan, started=True)
        old = [
            StateStore(
                self.spark, layouts.state_path(wh, plan.name, plan.from_shards, i), "-"
            ).frame
            for i in range(plan.from_shards)
        ]
        accepted: dict[int, journal.Accepted] = defaultdict(journal.Accepted)
        for b in batches:
            accepted[b.shard] = accepted[b.shard] | b.accepted
        kept = [drop_delivered(t, accepted[i]) for i, t in enumerate(old)]
        dropped = sum(len(t) - len(k) for t, k in zip(old, kept, strict=True))
        snap = self.catalog.snapshot()
        mq = topics.from_snapshot(snap, subscriptions.from_snapshot(snap, plan.name).spec.topic)
        handed, left_out = journal.hand_over(
            batches,
            [st.name for st in mq.storage_topics],
            plan.after,
            plan.generation,
            plan.layout_seq,
        )
        new, outs = reshard_tables(kept, plan.new_shard_of, plan.to_shards)
        for j, frame in enumerate(new):
            (
                self.spark.createDataFrame(normalise(frame), STATE_SCHEMA)
                .write.format("delta")
                .mode("overwrite")
                .option("userMetadata", f"change-shards {plan.from_shards}->{plan.to_shards}")
                .save(layouts.state_path(wh, plan.name, plan.to_shards, j))
            )
        crash_point("change_shards_state_tables")
        self._resend(plan, outs)
        self._write_handover(plan, handed)
        moved = {
            "pending": sum(len(f) for f in new),
            "groups": sum(f["group_key"].nunique() for f in new),
            "resent": len(outs),
        }
        self.log(
            f"state: {moved['pending']} pending entries of {moved['groups']} groups moved to "
            f"{plan.to_shards} shards; {moved['resent']} last-batch records re-sent"
        )
        if batches:
            over = {j: len(journal.Accepted.of_runs(h.runs)) for j, h in handed.items()}
            moved["handover"] = {
                "batches": [
                    {"shard": b.shard, "batch": b.batch_id, "accepted": len(b.accepted)}
                    for b in batches
                ],
                "pending_dropped": dropped,
                "handed_over": {str(j): n for j, n in over.items()},
                "left_out": left_out,
            }
            self.log(
                f"state: hand-over of {len(batches)} uncommitted batches: "
                f"{sum(len(b.accepted) for b in batches)} messages their journals name as "
                f"accepted; {dropped} of them dropped from GroupState, {sum(over.values())} "
                f"handed to the new shards"
                + (f", {left_out} left out (to be delivered again)" if left_out else "")
            )
        return {"state": moved}

    def _uncommitted_batches(
        self, plan: Plan, started: bool = True
    ) -> list[journal.UncommittedBatch]:
        """Every old shard's batch planned and never committed, with the origins its journal
        names as accepted (`varadhi.spark.journal`: the hand-over); batches with none are left out.
        Also, as a batch of its own (`batch_id` -1), what an earlier change handed an old
        shard that it has not committed past yet (`carried`). Nothing reads them while the
        journal is off. A checkpoint or journal that cannot be read (after `journal.READ_TRIES`
        tries, `journal.read_again`) raises `HandOverUnreadable` (`started`: whether the change's steps began): the
        command refuses rather than hand over nothing, which would deliver that batch again."""
        snap = self.catalog.snapshot()
        sub = subscriptions.from_snapshot(snap, plan.name)
        if sub.spec.consumption.journal_interval_ms <= 0:
            return []
        settings = self.catalog.settings
        fs = for_path(settings.warehouse, lambda: self.spark)
        out = []
        for shard in range(plan.from_shards):
            try:  # OSError, Py4J, Kafka errors
                found = journal.read_again(
                    partial(self._uncommitted_of, plan, sub, snap, shard, fs),
                    (Exception,),
                    partial(self._cannot_read, plan.name, shard),
                )
            except Exception as e:  # noqa: BLE001 - the last try's error, whatever it is
                raise HandOverUnreadable(plan.name, shard, e, started) from e
            out.extend(found)
        return out

    @staticmethod
    def _cannot_read(name: str, shard: int, error: Exception) -> None:
        log.warning(
            "%s: reading old shard %d's uncommitted batch failed (%s); again", name, shard, error
        )

    def _uncommitted_of(
        self, plan: Plan, sub: Subscription, snap: Snapshot, shard: int, fs
    ) -> list[journal.UncommittedBatch]:
        """Old shard `shard`'s part of `_uncommitted_batches`; raises what reading raises."""
        settings = self.catalog.settings
        out = []
        layout, start = shard_position(self.catalog, sub, shard, fs)
        doc = snap.get(journal.HANDOVER_KIND, layouts.owner(plan.name, plan.from_shards, shard))
        earlier = carried(shard, layout, start, doc)
        if earlier is not None:
            out.append(earlier)
        found = journaled_plan(
            settings, plan.name, plan.from_shards, shard, layout, sub.created_ms, fs
        )
        if found is not None and found[2]:
            batch_id, end, accepted = found
            out.append(journal.UncommittedBatch(shard, batch_id, start, end, accepted))
        return out

    def _write_handover(self, plan: Plan, handed: Mapping[int, journal.HandOver]) -> None:
        """One catalog write: every new shard's hand-over document (`handover/<sub>/s<S>/<j>`),
        deleting one left by an earlier change for a shard that gets none now. The old shards'
        documents stay (their shards are retired; a later change to their shard count replaces
        or deletes them): a re-run of this step after a crash reads them again (`carried`).
        Idempotent: a re-run writes the same."""
        name = plan.name
        kind = journal.HANDOVER_KIND

        def change(snap: Snapshot):
            new = [layouts.owner(name, plan.to_shards, j) for j in range(plan.to_shards)]
            writes: dict[str, Any] = {
                key(kind, owner): None for owner in new if snap.get(kind, owner) is not None
            }
            for j, handover in handed.items():
                writes[key(kind, new[j])] = handover.to_dict()
            return writes

        self.catalog.mutate(change)

    def _resend(self, plan: Plan, outs: pd.DataFrame) -> None:
        """Send the old tables' last-batch records to the new queues, once: in one Kafka
        transaction (transactional id per subscription's change, so a re-run aborts what a
        crashed run left open), and not at all when the new queues already hold a committed
        record. Until `activate` nothing else writes to them (the old shards are fenced and
        write to the old queues, the new shards do not run yet), so a committed record there
        is this step's earlier, complete send."""
        if not len(outs):
            return

        from varadhi.core.queue_records import MAX_REQUEST_BYTES, out_record
        from varadhi.core.state_frames import out_rows

        targets = {"rq": plan.rq_target, "dlq": plan.dlq_target}
        limits = topics.max_message_bytes(self.catalog, [st.name for st in targets.values()])
        producer = kafka_clients.producer(
            self.catalog.settings,
            acks="all",
            max_request_size=MAX_REQUEST_BYTES,
            transactional_id=f"varadhi.{plan.name}.change-shards",
        )
        try:
            producer.init_transactions()
            if _holds_committed(self.catalog.settings, list(targets.values())):
                self.log("state: the last-batch records were re-sent by an earlier run")
                return
            producer.begin_transaction()
            futures = []
            for row in out_rows(outs):
                st = targets[row.target]
                record = out_record(row, min(limits[st.name], MAX_REQUEST_BYTES))
                futures.append(
                    producer.send(
                        st.name,
                        key=record.key,
                        value=record.value,
                        partition=internal_target(
                            row.group_key, plan.route_by, plan.to_shards, st.partitions
                        ),
                        headers=record.headers,
                    )
                )
            for f in futures:
                f.get(timeout=RESEND_TIMEOUT_S)
            # a commit whose outcome is unknown fails the step; the re-run's `init_transactions`
            # waits for the broker's verdict, and `_holds_committed` reads it
            kafka_clients.end_transaction(
                producer,
                commit=True,
                timeout_s=RESEND_TIMEOUT_S,
                what=f"change-shards of {plan.name}",
            )
        finally:
            producer.close(timeout=5)

    def _step_layouts(self, plan: Plan) -> None:
        name = plan.name

        def change(snap: Snapshot):
            op = require_op(snap, name)
            writes: dict[str, Any] = {
                key(READER_KIND, layouts.owner(name, plan.to_shards, j)): lay.to_dict()
                for j, lay in enumerate(plan.layouts)
            }
            writes[key(OPERATION, operation_name(name))] = touched(op, step="activate")
            return writes

        self.catalog.mutate(change)
        self.log(
            f"layouts: {plan.to_shards} reader layouts, reading the main topic from its "
            f"storage topic {plan.mq_index}"
        )

    def _step_activate(self, plan: Plan) -> None:
        name = plan.name
        # The retired shards are stopped: their last progress holds their final counts.
        created_ms = subscriptions.from_snapshot(self.catalog.snapshot(), name).created_ms
        final = progress.latest_progress(
            self.catalog.settings, name, range(plan.from_shards), created_ms
        )

        def change(snap: Snapshot):
            doc = snap.get(subscriptions.KIND, name)
            if doc is None:
                raise NotFound("subscription", name)
            before = doc["state"].get("carried_totals", {})
            carried = status.carry_totals(before, final, plan.from_shards)
            return {
                key(subscriptions.KIND, name): activated(doc, plan, carried),
                key(OPERATION, operation_name(name)): touched(require_op(snap, name), step="feed"),
            }

        self.catalog.mutate(change)
        self.log(f"activate: {name} now has {plan.to_shards} shards")

    def _feed_all(self, name: str, mode: FeederMode) -> dict[str, Any]:
        op = require_op(self.catalog.snapshot(), name)
        if mode == "in-process":
            for f in op["feeders"]:
                if not f["done"]:
                    n = feed(self.spark, self.catalog, name, f["source"])
                    self.log(f"feed: {f['source']} -> {f['target']}: {n} records")
        op = require_op(self.catalog.snapshot(), name)
        if all(f["done"] for f in op["feeders"]) and op["step"] != "done":
            self._write_op(name, dict(op, step="done"))
            op = require_op(self.catalog.snapshot(), name)
        return op

    # -- helpers --------------------------------------------------------------------------
    def _positions(self, sub: Subscription) -> dict[int, tuple[Layout, Offsets]]:
        """The old shards' positions from their checkpoints: through Spark's Hadoop FileSystem
        when a session runs or the warehouse is not local (this starts one), else locally."""
        fs = for_path(self.catalog.settings.warehouse, lambda: self.spark)
        return {i: shard_position(self.catalog, sub, i, fs) for i in range(sub.shard_count)}

    def _resumed_plan(self, snap: Snapshot, name: str, op: Mapping[str, Any]) -> Plan:
        """The recorded operation's plan, recomputed from the old shards' positions (frozen:
        they are fenced and stopped)."""
        sub, mq, rq, dlq = _load(snap, name)
        if sub.shard_count != op["from"]:
            raise VaradhiError(
                f"subscription {sub.name} has {sub.shard_count} shards, but the change in "
                f"progress is from {op['from']}; the catalog was changed by something else"
            )
        return plan_change(
            sub,
            mq,
            rq,
            dlq,
            self._positions(sub),
            int(op["to"]),
            allow_uneven=True,  # checked when the operation was recorded
            layout_seq=int(op["layout_seq"]),
            rq_target_index=int(op["rq_target_index"]),
            dlq_target_index=int(op["dlq_target_index"]),
            route_by=StorageTopic.from_dict(op["route_by"]),
            mq_index=int(op["mq_index"]),
        )

    @staticmethod
    def _check_resumable(op: Mapping[str, Any], name: str, to: int) -> None:
        if int(op["to"]) != to:
            raise InvalidArgument(
                f"a change of {name} from {op['from']} to {op['to']} shards is in progress "
                f"(step {op['step']}); run `varadhi subscription change-shards {name} "
                f"--to {op['to']}` to finish it first",
                field="to",
            )

    @staticmethod
    def _check_no_pending_feeders(op: Mapping[str, Any] | None, name: str) -> None:
        if op is not None and not all(f.get("done") for f in op.get("feeders", [])):
            raise InvalidArgument(
                f"the previous change of {name} still has feeders to run: "
                + ", ".join(f["source"] for f in op["feeders"] if not f.get("done"))
            )

    def _write_op(self, name: str, op: dict[str, Any]) -> None:
        doc = dict(op, subscription=name, updated_ms=int(time.time() * 1000))
        self.catalog.mutate(lambda _snap: {key(OPERATION, operation_name(name)): doc})


def _holds_committed(settings: kafka_clients.HasKafka, storages: Sequence[StorageTopic]) -> bool:
    """Whether any of the Kafka topics `storages` holds a committed record."""
    from kafka import TopicPartition

    consumer = kafka_clients.consumer(
        settings, isolation_level="read_committed", enable_auto_commit=False
    )
    try:
        tps = [TopicPartition(st.name, p) for st in storages for p in range(st.partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)  # the last stable offsets: nothing open is waited for
        deadline = time.monotonic() + 30
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if any(consumer.poll(timeout_ms=200).values()):
                return True
            if time.monotonic() > deadline:
                raise VaradhiError(
                    "timed out reading the new RQ/DLQ storage topics "
                    f"{', '.join(st.name for st in storages)}"
                )
        return False
    finally:
        consumer.close()


def _progress(catalog: Catalog, snap: Snapshot, sub: Subscription) -> dict[int, dict[str, Any]]:
    """The newest progress document of each of `sub`'s shards that ever ran (by `snap`)."""
    shards = status.shards_that_ran(snap, sub)
    return progress.latest_progress(catalog.settings, sub.name, shards, sub.created_ms)


__all__ = [
    "ChangeShards",
]
