"""Deleting subscriptions and topics (`varadhi subscription delete`, `varadhi topic delete`).

What a delete removes is planned by pure functions of a catalog `Snapshot`
(`plan_subscription_delete`, `plan_topic_delete`, `operations_in_progress`), so `--dry-run`
prints exactly what the command would remove, and the refusals are tested without Kafka.

A subscription owns, in the catalog, its record `subscription/<sub>`, its RQ/DLQ composite
topics `topic/<sub>.rq` and `topic/<sub>.dlq`, and every key whose name is `<sub>` or starts
with `<sub>/` in any other kind (leases and reader layouts `<sub>/s<S>/<i>`, operations
`<sub>/...`); outside it, the RQ/DLQ Kafka storage topics, its delivery journal's topic
`<sub>.journal` and its delivery trace's `<sub>.trace` (when a shard created them), its warehouse folder
`<warehouse>/<sub>` (GroupState, checkpoints, dedup tables), its library runtime's consumer group
`varadhi-library.<sub>` (the members' commits: `runtime.group_id`, whatever the runtime is now: a
subscription moved to Spark keeps it) and its progress documents (`<catalog>_progress`, keys
`<sub>/...`).

`SubscriptionDeleter.execute` runs in three steps, each safe to repeat, so running the same
command again after a crash part way finishes the job:

1. mark: one catalog transaction pauses the subscription and records `operation/<sub>/delete`
   (status shows it; a shard started meanwhile does not consume);
2. data: unless `--keep-data`, delete the consumer group (Kafka deletes only a group without
   members: `check_group_empty` refused one with members before step 1, and a member that
   joined since makes this step fail, to be run again once it is stopped), the RQ/DLQ storage
   topics, the journal's and the trace's topics (and wait until Kafka has removed them, so a
   subscription created again with the name gets new, empty ones) and the warehouse folder;
   tombstone the progress documents;
3. forget: one catalog transaction tombstones every catalog record of the subscription, the
   mark included.

A topic is deleted data first (its storage topics), then its record, so a crash in between
leaves the record, and the same command finishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kafka.errors import KafkaError, TopicAuthorizationFailedError

from varadhi.core import names, trace
from varadhi.core.catalog_kinds import DocKind, OpKind
from varadhi.core.errors import (
    InvalidArgument,
    KafkaUnavailable,
    NotAuthorized,
    NotFound,
    VaradhiError,
)
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import progress, subscriptions, topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.library import dedup_topic, group_state_topic
from varadhi.library.runtime import group_id
from varadhi.ops import status
from varadhi.spark import journal, warehouse_fs
from varadhi.spark.warehouse_fs import WarehouseFS

log = logging.getLogger(__name__)

OPERATION = DocKind.OPERATION
DELETE_OP = "delete"  # operation/<sub>/delete: a subscription delete in progress
# Warehouse folders other components keep next to subscriptions' (`varadhi.outbox.delta` checkpoints
# live in `<warehouse>/checkpoints/delta_outbox/<name>`): a subscription named `checkpoints`
# has its own folders deleted, never these.
FOREIGN_WAREHOUSE_CHILDREN = {"checkpoints": ("delta_outbox",)}
TOPIC_DELETE_WAIT_S = 60.0


# -- pure planning ----------------------------------------------------------------------------


def delete_op_name(name: str) -> str:
    return f"{name}/{DELETE_OP}"


def subscription_keys(snapshot: Snapshot, name: str) -> list[str]:
    """Every catalog key that belongs to subscription `name` (pure): its record, its RQ/DLQ
    composite topics, and the keys of any other kind named `<name>` or `<name>/...`. A topic
    named like the subscription is not its (topics and subscriptions have separate names)."""
    queues = {key(topics.KIND, f"{name}.rq"), key(topics.KIND, f"{name}.dlq")}
    out = []
    for k in snapshot.all_keys():
        kind, _, rest = k.partition("/")
        if k in queues or rest.startswith(f"{name}/") or (rest == name and kind != topics.KIND):
            out.append(k)
    return out


def busy_refusal(doing: str, busy: Mapping[str, str]) -> InvalidArgument:
    """The refusal of `doing` ("delete subscription X") while `busy`'s operations
    (`operations_in_progress`) are under way."""
    return InvalidArgument(
        f"cannot {doing} while an operation is in progress: "
        + "; ".join(f"{k} ({v})" for k, v in sorted(busy.items()))
        + "; finish it (run its command again) first",
        field="subscription",
    )


def operations_in_progress(snapshot: Snapshot, name: str, shard_count: int) -> dict[str, str]:
    """Operations of subscription `name` not finished (pure): key -> what it is.

    A shard-count change, an offset reset or a replay is in progress while its `step` is not
    `done` (nor `failed`, for a replay); a re-drive until every current shard applied it. The
    subscription's own delete (`<name>/delete`) is not counted."""
    out = {}
    for rest, doc in snapshot.items(OPERATION).items():
        if rest != name and not rest.startswith(f"{name}/"):
            continue
        if rest == delete_op_name(name):
            continue
        op = rest[len(name) + 1 :] or rest
        if doc.get("kind") == OpKind.UNSIDELINE or op.startswith("redrive-"):
            done = {int(s) for s in doc.get("done", [])}
            missing = [s for s in range(shard_count) if s not in done]
            if missing:
                out[key(OPERATION, rest)] = f"re-drive {op} not yet applied by shards {missing}"
        elif "step" in doc and doc["step"] not in ("done", "failed"):
            out[key(OPERATION, rest)] = f"{doc.get('kind') or op} at step {doc['step']}"
    return out


@dataclass(frozen=True)
class WarehouseFolder:
    """A subscription's folder in the warehouse; `keep` names children that are not its."""

    path: str
    keep: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, **({"keep": list(self.keep)} if self.keep else {})}


def warehouse_folder(warehouse: str, name: str) -> WarehouseFolder:
    return WarehouseFolder(
        f"{warehouse.rstrip('/')}/{name}", FOREIGN_WAREHOUSE_CHILDREN.get(name, ())
    )


@dataclass(frozen=True)
class SubscriptionDeletePlan:
    """What `subscription delete` removes (`kafka_topics` and `warehouse` empty/None with
    `keep_data`: they are listed in `kept`)."""

    name: str
    exists: bool  # False: only leftovers of the subscription are in the catalog
    resuming: bool  # an earlier delete of it stopped part way
    catalog_keys: tuple[str, ...]
    kafka_topics: tuple[str, ...]
    warehouse: WarehouseFolder | None
    progress_keys: tuple[str, ...] = ()
    keep_data: bool = False
    kept: dict[str, Any] = field(default_factory=dict)
    consumer_group: str | None = None  # the library's, when Kafka has it (None: keep_data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "subscription": self.name,
            "exists": self.exists,
            "resuming": self.resuming,
            "catalog_records": list(self.catalog_keys),
            "kafka_topics": list(self.kafka_topics),
            "warehouse": self.warehouse.to_dict() if self.warehouse else None,
            "progress_documents": list(self.progress_keys),
            "consumer_group": self.consumer_group,
            "keep_data": self.keep_data,
            "kept": self.kept,
        }


def queue_storage_topics(snapshot: Snapshot, name: str) -> list[str]:
    """The Kafka storage topics of the RQ and DLQ of subscription `name`, as the catalog
    records them (every storage topic, those of earlier shard counts too)."""
    out = []
    for queue in (f"{name}.rq", f"{name}.dlq"):
        doc = snapshot.get(topics.KIND, queue)
        if doc is not None:
            out += [st["name"] for st in doc["storage_topics"]]
    return out


def plan_subscription_delete(
    snapshot: Snapshot,
    name: str,
    warehouse: str,
    keep_data: bool = False,
    progress_keys: Iterable[str] = (),
    other_topics: Iterable[str] = (),
    group_exists: bool = False,
) -> SubscriptionDeletePlan:
    """Plan deleting subscription `name` (pure). `other_topics`: the subscription's Kafka topics
    that the catalog does not record and that exist (its delivery journal: `own_topics`);
    `group_exists`: whether Kafka has its library consumer group (`group_id`).
    `NotFound` when the catalog holds nothing of it; `InvalidArgument` while one of its
    operations is in progress. Whether shards run is `check_stopped`'s (it needs their progress
    documents)."""
    names.validate_name(name)
    keys = subscription_keys(snapshot, name)
    doc = snapshot.get(subscriptions.KIND, name)
    if not keys:
        raise NotFound("subscription", name)
    if doc is not None:
        sub = subscriptions.from_snapshot(snapshot, name)
        busy = operations_in_progress(snapshot, name, sub.shard_count)
        if busy:
            raise busy_refusal(f"delete subscription {name}", busy)
    storage = queue_storage_topics(snapshot, name) + sorted(set(other_topics))
    folder = warehouse_folder(warehouse, name)
    progress = tuple(sorted(progress_keys))
    group = group_id(name) if group_exists else None
    kept: dict[str, Any] = {"kafka_topics": storage, "warehouse": folder.to_dict()}
    if group is not None:
        kept["consumer_group"] = group
    return SubscriptionDeletePlan(
        name=name,
        exists=doc is not None,
        resuming=snapshot.get(OPERATION, delete_op_name(name)) is not None,
        catalog_keys=tuple(keys),
        kafka_topics=() if keep_data else tuple(storage),
        warehouse=None if keep_data else folder,
        progress_keys=progress,
        keep_data=keep_data,
        kept=kept if keep_data else {},
        consumer_group=None if keep_data else group,
    )


def own_topics(name: str) -> tuple[str, ...]:
    """The Kafka topics of subscription `name` that the catalog does not record: the delivery
    journal's and the delivery trace's, which a shard creates when the journal (trace) is on
    (`varadhi.spark.journal`, `varadhi.kafka.trace`), and the library runtime's GroupState
    topic, which its members create in block mode (`varadhi.library.group_state_topic`), and
    its dedup topic, made with a dedup window (`varadhi.library.dedup_topic`)."""
    return (
        journal.topic_name(name),
        trace.topic_name(name),
        group_state_topic.topic_name(name),
        dedup_topic.topic_name(name),
    )


def check_stopped(
    sub: subscriptions.Subscription,
    progress: Mapping[int, Mapping[str, Any]],
    leases: Mapping[int, dict[str, Any] | None],
    now_ms: int,
    members: Mapping[str, str],
) -> None:
    """Refuse while any shard of `sub` may be running (`status.running_shards`; a shard that
    reported paused while the subscription is paused counts as stopped), or any of its library
    members (`members`: `status.running_members`, the same rule) (pure)."""
    running = [
        f"{s} ({state})"
        for s, state in sorted(status.running_shards(sub, progress, leases, now_ms).items())
    ]
    running += [f"member {m} ({state})" for m, state in sorted(members.items())]
    if running:
        raise InvalidArgument(
            f"cannot delete subscription {sub.name} while its shards or members may be running:"
            f" {', '.join(running)}; stop them (SIGTERM), or `varadhi subscription pause"
            f" {sub.name}` and wait until they report paused",
            field="subscription",
        )


def check_group_empty(name: str, members: Sequence[str] | None) -> None:
    """Refuse to delete subscription `name` while its library consumer group has members
    (`status.group_members`; None: no group) (pure): Kafka deletes only an empty group, and a
    member, paused ones included (a paused member stays in the group), would go on without its
    subscription. Its refusal comes before any side effect."""
    if members:
        raise InvalidArgument(
            f"cannot delete subscription {name} while its consumer group {group_id(name)} has "
            f"members: {', '.join(members)}; stop them (SIGTERM to `varadhi-consumer`, "
            "`Consumer.stop()`: a paused member stays in the group until it stops; a killed one "
            "leaves it after its session timeout, 45 s by default), or pass --keep-data to keep "
            "the group",
            field="subscription",
        )


def topic_users(snapshot: Snapshot, name: str) -> list[str]:
    """The subscriptions that consume composite topic `name` (pure)."""
    return sorted(
        s for s, d in snapshot.items(subscriptions.KIND).items() if d["spec"]["topic"] == name
    )


@dataclass(frozen=True)
class TopicDeletePlan:
    name: str
    catalog_keys: tuple[str, ...]
    kafka_topics: tuple[str, ...]
    keep_data: bool = False
    kept: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "topic": self.name,
            "catalog_records": list(self.catalog_keys),
            "kafka_topics": list(self.kafka_topics),
            "keep_data": self.keep_data,
            "kept": self.kept,
        }


def plan_topic_delete(snapshot: Snapshot, name: str, keep_data: bool = False) -> TopicDeletePlan:
    """Plan deleting composite topic `name` (pure): refused while a subscription uses it (they
    are named), and for a subscription's RQ/DLQ (deleted with the subscription)."""
    doc = snapshot.get(topics.KIND, name)
    if doc is None:
        names.validate_name(name)
        raise NotFound("topic", name)
    topic = topics.CompositeTopic.from_dict(doc)
    if topic.internal:
        owner = name.rsplit(".", 1)[0]
        raise InvalidArgument(
            f"{name} is a queue of subscription {owner}; it is deleted with "
            f"`varadhi subscription delete {owner}`",
            field="topic",
        )
    users = topic_users(snapshot, name)
    if users:
        raise InvalidArgument(
            f"cannot delete topic {name}: subscription(s) {', '.join(users)} use it; delete "
            "them first (`varadhi subscription delete NAME`)",
            field="topic",
        )
    storage = [st.name for st in topic.storage_topics]
    return TopicDeletePlan(
        name=name,
        catalog_keys=(key(topics.KIND, name),),
        kafka_topics=() if keep_data else tuple(storage),
        keep_data=keep_data,
        kept={"kafka_topics": storage} if keep_data else {},
    )


def text_subscription_plan(plan: SubscriptionDeletePlan, done: bool = False) -> list[str]:
    """The plan as lines for the terminal (pure)."""
    verb = "deleted" if done else "would delete"
    head = f"{verb} subscription {plan.name}"
    if not plan.exists:
        head += " (only leftovers in the catalog)"
    if plan.resuming and not done:
        head += " (finishing an earlier delete)"
    lines = [head + ":"]
    lines.append(f"  catalog records ({len(plan.catalog_keys)}): {', '.join(plan.catalog_keys)}")
    if plan.kafka_topics:
        lines.append(f"  Kafka topics ({len(plan.kafka_topics)}): {', '.join(plan.kafka_topics)}")
    if plan.warehouse:
        extra = f" (except {', '.join(plan.warehouse.keep)})" if plan.warehouse.keep else ""
        lines.append(
            f"  warehouse folder: {plan.warehouse.path}{extra} (GroupState, checkpoints, dedup)"
        )
    if plan.consumer_group:
        lines.append(f"  consumer group: {plan.consumer_group} (the library members' commits)")
    if plan.progress_keys:
        lines.append(f"  progress documents: {', '.join(plan.progress_keys)}")
    if plan.keep_data:
        kept = plan.kept
        group = f"; consumer group {kept['consumer_group']}" if "consumer_group" in kept else ""
        lines.append(
            f"  kept (--keep-data): Kafka topics {', '.join(kept['kafka_topics']) or '-'}; "
            f"warehouse folder {kept['warehouse']['path']}{group}"
        )
    return lines


def text_topic_plan(plan: TopicDeletePlan, done: bool = False) -> list[str]:
    verb = "deleted" if done else "would delete"
    lines = [f"{verb} topic {plan.name}:", f"  catalog records: {', '.join(plan.catalog_keys)}"]
    if plan.kafka_topics:
        lines.append(f"  Kafka topics ({len(plan.kafka_topics)}): {', '.join(plan.kafka_topics)}")
    if plan.keep_data:
        lines.append(f"  kept (--keep-data): Kafka topics {', '.join(plan.kept['kafka_topics'])}")
    return lines


# -- files: `varadhi.spark.warehouse_fs` (Hadoop FileSystem through Spark, or the local one) -------


def files_for(path: str, spark: Any = None) -> WarehouseFS:
    """How to delete under `path` (`warehouse_fs.for_path`): a warehouse that is not local and
    no Spark session that can be started is refused in one line, before anything is deleted."""
    try:
        return warehouse_fs.for_path(path, spark, purpose="varadhi-delete")
    except InvalidArgument as e:
        raise InvalidArgument(
            f"{e}; run the delete where Spark is available, or pass --keep-data and remove the "
            "folder yourself"
        ) from None


def delete_folder(files: WarehouseFS, folder: WarehouseFolder) -> None:
    if not folder.keep:
        files.delete(folder.path)
        return
    for name in files.list(folder.path):
        if name not in folder.keep:
            files.delete(warehouse_fs.child(folder.path, name))


# -- Kafka ------------------------------------------------------------------------------------


def _admin(settings: kafka_clients.HasKafka):
    try:
        return kafka_clients.admin(settings, client_id="varadhi-admin")
    except KafkaError as e:
        raise KafkaUnavailable(f"cannot reach Kafka at {settings.bootstrap}: {e}") from e


def _present(admin, names: Iterable[str]) -> list[str]:
    """Those of `names` the cluster has, in their order."""
    listed = set(admin.list_topics())
    return [n for n in names if n in listed]


def existing_topics(settings: kafka_clients.HasKafka, names: Iterable[str]) -> list[str]:
    """Those of `names` the cluster has."""
    admin = _admin(settings)
    try:
        return _present(admin, names)
    finally:
        admin.close()


def delete_kafka_topics(
    settings: kafka_clients.HasKafka, names: Iterable[str], wait_s: float = TOPIC_DELETE_WAIT_S
) -> None:
    """Delete Kafka topics (those already gone are fine) and wait until the cluster no longer
    lists them, so a topic created again with the name is a new one."""
    names = sorted(set(names))
    if not names:
        return
    admin = _admin(settings)
    try:
        present = _present(admin, names)
        if present:
            result = admin.delete_topics(present, timeout_ms=30_000, raise_errors=False)
            for t in result.get("topics", []):
                code = t.get("error_code", 0)
                if code not in (0, 3):  # 3: UNKNOWN_TOPIC_OR_PARTITION, gone already
                    raise VaradhiError(
                        f"Kafka refused to delete topic {t.get('name')}: error code {code} "
                        f"({t.get('error_message') or 'see the broker log'}); nothing else "
                        "was removed after it, run the command again once fixed"
                    )
        deadline = time.monotonic() + wait_s
        while True:
            left = sorted(set(names) & set(admin.list_topics()))
            if not left:
                return
            if time.monotonic() > deadline:
                raise VaradhiError(
                    f"Kafka has not finished deleting {', '.join(left)} after {wait_s:.0f}s; "
                    "run the command again"
                )
            time.sleep(0.2)
    finally:
        admin.close()


def delete_group(settings: kafka_clients.HasKafka, group: str) -> None:
    """Delete consumer group `group` (one already gone is fine; `status.group_request`).
    VaradhiError when Kafka refuses, e.g. a member joined it since the delete was planned (Kafka
    deletes only an empty group)."""
    answers = status.group_request(
        settings, group, "Delete", lambda admin: admin.delete_groups([group])
    )
    answer = answers.get(group, "OK")
    if answer in ("OK", "GroupIdNotFoundError"):
        return
    if answer == "GroupAuthorizationFailedError":
        raise NotAuthorized("Delete", "Group", group, kafka_clients.principal(settings))
    why = (
        "it has members again: stop them"
        if answer == "NonEmptyGroupError"
        else "see the broker log"
    )
    raise VaradhiError(
        f"Kafka refused to delete consumer group {group} ({answer}): {why}, then run the same "
        "command again"
    )


def tombstone_progress(settings: Any, keys: Iterable[str]) -> None:
    """Write a tombstone (no value) for each progress key: `progress.progress_documents` then
    forgets the key, so a subscription created again with the name starts without them. Every
    send is acknowledged or raises (`NotAuthorized` for a missing Write on the progress topic):
    a tombstone lost unnoticed would show the old shards' counters to the new subscription."""
    keys = list(keys)
    if not keys:
        return
    topic = progress.progress_topic(settings)
    producer = kafka_clients.producer(settings, acks="all")
    try:
        sent = [producer.send(topic, key=k.encode(), value=None, partition=0) for k in keys]
        for future in sent:
            future.get(timeout=30)
    except TopicAuthorizationFailedError as e:
        raise kafka_clients.refused(settings, e, "Write", topic) from None
    finally:
        producer.close(timeout=5)


# -- the commands -------------------------------------------------------------------------------


class SubscriptionDeleter:
    """`subscription delete`: plan (refusing before any side effect), then execute."""

    def __init__(self, catalog: Catalog, log_line: Callable[[str], None] = lambda _l: None):
        self.catalog = catalog
        self.log = log_line

    def plan(self, name: str, keep_data: bool = False) -> SubscriptionDeletePlan:
        snap = self.catalog.snapshot()
        names.validate_name(name)
        doc = snap.get(subscriptions.KIND, name)
        since = int(doc["state"]["created_ms"]) if doc is not None else None
        # every key (standbys' too), back to the subscription's creation: all get tombstones
        found = progress.progress_documents(self.catalog.settings, name, since_ms=since)
        progress_keys = [f"{name}/{k}" for k in found]
        existing = existing_topics(self.catalog.settings, own_topics(name))
        in_group = status.group_members(self.catalog.settings, group_id(name))
        plan = plan_subscription_delete(
            snap,
            name,
            self.catalog.settings.warehouse,
            keep_data,
            progress_keys,
            existing,
            group_exists=in_group is not None,
        )
        if plan.exists:
            sub = subscriptions.from_snapshot(snap, name)
            now = int(time.time() * 1000)
            members = status.running_members(sub, status.members_of(found, now))
            check_stopped(
                sub, progress.shard_documents(found), status.leases_of(snap, sub, now), now, members
            )
        if plan.consumer_group:
            check_group_empty(name, in_group)
        return plan

    def execute(
        self, name: str, keep_data: bool = False, spark: Any = None
    ) -> SubscriptionDeletePlan:
        plan = self.plan(name, keep_data)
        files = files_for(plan.warehouse.path, spark) if plan.warehouse else None
        if plan.warehouse and files is not None:  # refuse before the catalog mark
            try:
                warehouse_fs.check_writable(files, self.catalog.settings.warehouse)
            except InvalidArgument as e:
                raise InvalidArgument(
                    f"{e}; fix the warehouse's permissions, or pass --keep-data and remove "
                    "the folder yourself"
                ) from None
        if plan.exists:
            self._mark(name)
        if plan.consumer_group:
            self.log(f"deleting consumer group {plan.consumer_group}")
            delete_group(self.catalog.settings, plan.consumer_group)
        if plan.kafka_topics:
            self.log(f"deleting Kafka topics {', '.join(plan.kafka_topics)}")
            delete_kafka_topics(self.catalog.settings, plan.kafka_topics)
        if plan.warehouse and files is not None:
            self.log(f"deleting {plan.warehouse.path} ({files.where})")
            delete_folder(files, plan.warehouse)
        tombstone_progress(self.catalog.settings, plan.progress_keys)
        written = self.catalog.mutate(lambda snap: {k: None for k in subscription_keys(snap, name)})
        return replace(plan, catalog_keys=tuple(sorted(set(plan.catalog_keys) | set(written))))

    def _mark(self, name: str) -> None:
        def change(snap: Snapshot):
            doc = snap.get(subscriptions.KIND, name)
            if doc is None:
                return {}
            sub = subscriptions.from_snapshot(snap, name)
            busy = operations_in_progress(snap, name, sub.shard_count)
            if busy:
                raise InvalidArgument(
                    f"cannot delete subscription {name}: an operation started meanwhile: "
                    + ", ".join(sorted(busy)),
                    field="subscription",
                )
            out: dict[str, Any] = {}
            if not doc["state"].get("paused"):
                out[key(subscriptions.KIND, name)] = {
                    **doc,
                    "state": {**doc["state"], "paused": True},
                }
            if snap.get(OPERATION, delete_op_name(name)) is None:
                out[key(OPERATION, delete_op_name(name))] = {
                    "kind": OpKind.DELETE,
                    "step": "deleting",
                    "started_ms": int(time.time() * 1000),
                }
            return out

        self.catalog.mutate(change)


class TopicDeleter:
    """`topic delete`: plan (refusing before any side effect), then execute."""

    def __init__(self, catalog: Catalog, log_line: Callable[[str], None] = lambda _l: None):
        self.catalog = catalog
        self.log = log_line

    def plan(self, name: str, keep_data: bool = False) -> TopicDeletePlan:
        return plan_topic_delete(self.catalog.snapshot(), name, keep_data)

    def execute(self, name: str, keep_data: bool = False) -> TopicDeletePlan:
        plan = self.plan(name, keep_data)
        if plan.kafka_topics:
            plan_topic_delete(self.catalog.snapshot(), name, keep_data)  # re-check just before
            self.log(f"deleting Kafka topics {', '.join(plan.kafka_topics)}")
            delete_kafka_topics(self.catalog.settings, plan.kafka_topics)

        def change(snap: Snapshot):
            if snap.get(topics.KIND, name) is None:
                return {}
            plan_topic_delete(snap, name, keep_data)  # a subscription created meanwhile
            return {key(topics.KIND, name): None}

        self.catalog.mutate(change)
        return plan
