"""Subscriptions in the catalog: record specs (parsed by `varadhi.core.subscription_spec`), assign
shards.

The catalog holds one record per subscription under `subscription/<name>`:

    {"spec": spec_to_dict(spec),
     "state": {"paused": bool, "generation": int, "shard_count": int, "created_ms": int,
               "suspended": {"reason": str, "since_ms": int, "shard": int, "resume": str}?}}

Decisions are pure functions of a catalog `Snapshot` (`check_create`, `check_main_topic`,
`changed_fields`, `plan_apply`, `shard_assignments`) so they are tested without Kafka;
`SubscriptionService` at the bottom applies them to the catalog and Kafka, refusing everything it
can before its first side effect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from varadhi.core import endpoint_guard, routing
from varadhi.core.catalog_kinds import DocKind
from varadhi.core.endpoint_guard import EndpointPolicy
from varadhi.core.errors import AlreadyExists, InvalidArgument, NotFound, WrongRuntime
from varadhi.core.policies import Runtime, SubscriptionSpec
from varadhi.core.subscription_spec import parse_spec, spec_from_dict, spec_to_dict
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import topics
from varadhi.kafka.catalog import Catalog, Snapshot, key
from varadhi.kafka.topics import CompositeTopic

KIND = DocKind.SUBSCRIPTION

log = logging.getLogger(__name__)

# -- durations ------------------------------------------------------------------------------


# ASCII digits only (`\d` also matches other scripts' digits, which int() accepts); fullmatch,
# because `$` would also match before a trailing newline.
@dataclass(frozen=True)
class Suspension:
    """Why and since when a shard (or a library member: `member`, and `shard` -1) suspended its
    subscription (endpoint health: `circuit_breaker.suspend_after`), and how it ends: `probe`
    (that shard's half-open probes, or any library member's, find the endpoint healthy, or an
    operator's resume) or `operator` (a resume only)."""

    reason: str
    since_ms: int
    shard: int
    resume: str
    member: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reason": self.reason,
            "since_ms": self.since_ms,
            "shard": self.shard,
            "resume": self.resume,
        }
        return out if self.member is None else {**out, "member": self.member}

    @property
    def by(self) -> str:
        """Who suspended it, for people: `shard 2`, `member vm-1-ab12`."""
        return f"member {self.member}" if self.member is not None else f"shard {self.shard}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Suspension | None:
        if not d:
            return None
        member = d.get("member")
        return cls(
            str(d["reason"]),
            int(d["since_ms"]),
            int(d["shard"]),
            str(d["resume"]),
            None if member is None else str(member),
        )


@dataclass(frozen=True)
class Subscription:
    """A subscription's spec plus the runtime state recorded with it in the catalog.

    `shard_count` is the number of shards that currently own the main topic (the spec's `shards`
    at creation; a shard-count change moves it). `generation` numbers the checkpoint generation;
    an offset reset bumps it so checkpoints and idempotency keys start afresh (DESIGN hazard 7).
    `paused` asks the shard jobs to stop consuming; they honour it between batches.
    `suspended` does the same, set by a shard whose endpoint failed every attempt for the spec's
    `circuit_breaker.suspend_after` (`Suspension`); a resume clears both.
    `rq_from`/`dlq_from` are the first RQ/DLQ storage topics the current shards own: a
    shard-count change adds new internal storage topics and feeders drain the older ones.
    """

    spec: SubscriptionSpec
    shard_count: int
    created_ms: int
    paused: bool = False
    generation: int = 0
    rq_from: int = 0
    dlq_from: int = 0
    suspended: Suspension | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stopped(self) -> bool:
        """Whether the shards must read and send nothing: paused or suspended."""
        return self.paused or self.suspended is not None

    def state_dict(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "generation": self.generation,
            "shard_count": self.shard_count,
            "created_ms": self.created_ms,
            "rq_from": self.rq_from,
            "dlq_from": self.dlq_from,
            "suspended": self.suspended.to_dict() if self.suspended else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"spec": spec_to_dict(self.spec), "state": self.state_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Subscription:
        """Reads the keys it knows. State keys added by other components (shard-change steps,
        for instance) are ignored here, and `to_dict` drops them: writers that update a record
        must change the stored document in place rather than re-serialise a `Subscription`."""
        state = d["state"]
        return cls(
            spec=spec_from_dict(d["spec"]),
            shard_count=int(state["shard_count"]),
            created_ms=int(state["created_ms"]),
            paused=bool(state.get("paused", False)),
            generation=int(state.get("generation", 0)),
            rq_from=int(state.get("rq_from", 0)),
            dlq_from=int(state.get("dlq_from", 0)),
            suspended=Suspension.from_dict(state.get("suspended")),
        )


def from_snapshot(snapshot: Snapshot, name: str) -> Subscription:
    doc = snapshot.get(KIND, name)
    if doc is None:
        raise NotFound("subscription", name)
    return Subscription.from_dict(live_record(snapshot, doc))


def check_runtime(sub: Subscription, runtime: Runtime, process: str) -> None:
    """Refuse (`WrongRuntime`, exit code 2) to run `sub` in a process of `runtime` (`process`
    names it in the message) unless its spec names that runtime (pure). A Spark shard and a
    library member both call it when they start, before any side effect, and again while
    they run (a shard before each query, a member with each look at the catalog), so that a
    process left over from before a runtime change stops instead of delivering."""
    if sub.spec.runtime != runtime:
        raise WrongRuntime(sub.name, sub.spec.runtime, process)


def live_record(snapshot: Snapshot, doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """A subscription record whose spec has the live shard count (pure).

    `subscription change-shards` sets the spec's `shards`, `rq_partitions` and `dlq_partitions`
    with `state.shard_count` (`change_shards_plan.activated`). Records changed by earlier versions
    kept the creation values in the spec (`spec.shards` 2, `state.shard_count` 4), which made
    every later edit, `pause` and `resume` included, fail as a shard-count change. Such a record
    is read with the live values: the state's shard count and the partitions of the RQ/DLQ
    storage topics the shards own (`rq_from`, `dlq_from`); the next edit stores them.
    """
    spec, state = doc["spec"], doc["state"]
    count = int(state["shard_count"])
    if spec.get("shards") == count:
        return doc
    live = dict(spec, shards=count)
    for field, suffix, first in (
        ("rq_partitions", "rq", "rq_from"),
        ("dlq_partitions", "dlq", "dlq_from"),
    ):
        queue = snapshot.get(topics.KIND, f"{spec['name']}.{suffix}")
        index = int(state.get(first, 0))
        if queue is not None and index < len(queue["storage_topics"]):
            live[field] = CompositeTopic.from_dict(queue).storage(index).partitions
    return {**doc, "spec": live}


# -- shard assignment -----------------------------------------------------------------------


def _owned(sub: Subscription, topic: CompositeTopic, storage_index: int, shard: int) -> list[int]:
    if not 0 <= shard < sub.shard_count:
        raise InvalidArgument(
            f"shard {shard} is outside 0..{sub.shard_count - 1} of subscription {sub.name}",
            field="shard",
        )
    partitions = topic.storage(storage_index).partitions
    return routing.shard_partitions(shard, sub.shard_count, partitions)


def owned_partitions(
    sub: Subscription, topic: CompositeTopic, storage_index: int, shard: int
) -> list[int]:
    """The partitions of main-topic storage topic `storage_index` that `shard` reads.

    Contiguous ranges (`routing.shard_partitions`) over the subscription's current shard count.
    With `allow_uneven` some shards own one partition more than others; a shard may own none of
    a storage topic with fewer partitions than shards.
    """
    if topic.name != sub.spec.topic:
        raise InvalidArgument(
            f"{topic.name} is not the main topic of subscription {sub.name} ({sub.spec.topic})",
            field="topic",
        )
    return _owned(sub, topic, storage_index, shard)


def internal_partitions(
    sub: Subscription, internal_topic: CompositeTopic, storage_index: int, shard: int
) -> list[int]:
    """The partitions of RQ/DLQ storage topic `storage_index` that `shard` reads and writes.

    A failed message must go to one of these (`routing.internal_partition`) so its group's shard
    sees it again. Internal queues are created with a multiple of the shard count, so at creation
    every shard owns the same non-empty range.
    """
    if internal_topic.name not in (sub.spec.rq_topic, sub.spec.dlq_topic):
        raise InvalidArgument(
            f"{internal_topic.name} is not the RQ or DLQ of subscription {sub.name}",
            field="topic",
        )
    return _owned(sub, internal_topic, storage_index, shard)


_Owner = Callable[[Subscription, CompositeTopic, int, int], list[int]]


def shard_assignments(
    sub: Subscription, mq: CompositeTopic, rq: CompositeTopic, dlq: CompositeTopic
) -> list[dict[str, Any]]:
    """Per shard, the partitions it owns of every storage topic of its MQ, RQ and DLQ:
    `[{"shard": 0, "mq": [{"storage_topic_idx", "storage_topic", "partitions"}], "rq": ..., "dlq": ...}]`.
    RQ/DLQ storage topics before `rq_from`/`dlq_from` (left by a shard-count change, drained
    by its feeders) belong to no current shard and are not listed.
    """

    def table(
        topic: CompositeTopic, owner: _Owner, shard: int, first: int = 0
    ) -> list[dict[str, Any]]:
        return [
            {
                "storage_topic_idx": i,
                "storage_topic": st.name,
                "partitions": owner(sub, topic, i, shard),
            }
            for i, st in enumerate(topic.storage_topics)
            if i >= first
        ]

    return [
        {
            "shard": s,
            "mq": table(mq, owned_partitions, s),
            "rq": table(rq, internal_partitions, s, sub.rq_from),
            "dlq": table(dlq, internal_partitions, s, sub.dlq_from),
        }
        for s in range(sub.shard_count)
    ]


# -- decisions against the catalog -----------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_main_topic(snapshot: Snapshot, spec: SubscriptionSpec) -> CompositeTopic:
    """The main topic, if it exists, is not internal, and `spec.shards` can own it.

    Shards must divide the partition count of the topic's produce storage topic so every shard
    owns as many partitions as the others, unless `allow_uneven`; more shards than partitions is
    refused either way (a shard would own nothing).
    """
    doc = snapshot.get(topics.KIND, spec.topic)
    if doc is None:
        raise InvalidArgument(
            f"topic {spec.topic!r} does not exist (create it with `varadhi topic create`)",
            field="topic",
        )
    topic = CompositeTopic.from_dict(doc)
    if topic.internal:
        raise InvalidArgument(f"{spec.topic} is an internal queue, not a topic", field="topic")
    produce = topic.produce_topic
    if spec.shards > produce.partitions:
        raise InvalidArgument(
            f"{spec.shards} shards exceed the {produce.partitions} partitions of {produce.name} "
            "(the produce storage topic); some shards would own no partition",
            field="shards",
        )
    if not spec.allow_uneven and not routing.divides_evenly(spec.shards, produce.partitions):
        choices = ", ".join(map(str, _divisors(produce.partitions)))
        raise InvalidArgument(
            f"{spec.shards} does not divide the {produce.partitions} partitions of "
            f"{produce.name} (the produce storage topic); use one of {choices}, or "
            "allow_uneven: true (--allow-uneven) to accept uneven shards",
            field="shards",
        )
    return topic


def _internal_queues(spec: SubscriptionSpec) -> tuple[tuple[str, int, str], ...]:
    assert spec.rq_partitions is not None and spec.dlq_partitions is not None  # parse_spec resolves
    return (
        (spec.rq_topic, spec.rq_partitions, "rq_partitions"),
        (spec.dlq_topic, spec.dlq_partitions, "dlq_partitions"),
    )


def check_create(snapshot: Snapshot, spec: SubscriptionSpec) -> list[tuple[str, int]]:
    """Refuse creating `spec` in this catalog state; return the internal queues still to create.

    RQ/DLQ topics that already exist are accepted only if they are internal topics with one
    storage topic of the spec's partition count: that is what a create that crashed after making
    them and before recording the subscription leaves behind, so a re-run can finish it.
    """
    if snapshot.get(KIND, spec.name) is not None:
        raise AlreadyExists("subscription", spec.name)
    check_main_topic(snapshot, spec)
    missing: list[tuple[str, int]] = []
    for name, partitions, field in _internal_queues(spec):
        doc = snapshot.get(topics.KIND, name)
        if doc is None:
            missing.append((name, partitions))
            continue
        existing = CompositeTopic.from_dict(doc)
        counts = [st.partitions for st in existing.storage_topics]
        if not existing.internal or counts != [partitions]:
            raise InvalidArgument(
                f"{name} already exists with storage partitions {counts}, not [{partitions}] "
                f"(left by an earlier create with other settings?); set {field}: {counts[-1]} "
                "or choose another subscription name",
                field=field,
            )
    return missing


MUTABLE_FIELDS = frozenset(
    {
        "endpoint",
        "retry",
        "consumption",
        "circuit_breaker",
        "on_dead_letter",
        "blocked",
        "dedup_window_ms",
        "max_message_bytes",
        "allow_uneven",
        "filter",
        "delivery",
        "trace",
        "runtime",
    }
)
IMMUTABLE_FIELDS = frozenset(
    {"name", "topic", "grouped", "shards", "rq_partitions", "dlq_partitions"}
)


def changed_fields(current: Subscription, new: SubscriptionSpec) -> list[str]:
    """The spec fields `new` changes, or `InvalidArgument` if it changes one `apply` cannot.

    Shards are compared with the live `shard_count`: changing them moves state and queues and
    is `subscription change-shards`' job. Topic, grouping and partition counts never change; a
    different choice is a new subscription. `allow_uneven` only affects validation at creation.
    `runtime` changes only while the subscription is paused (the caller, `varadhi.Client.apply`,
    also refuses while a process of it may still deliver: `ops.status.check_runtime_switch`).
    """
    old = current.spec
    if new.shards != current.shard_count:
        raise InvalidArgument(
            f"cannot change from {current.shard_count} to {new.shards} with apply; use "
            f"`varadhi subscription change-shards {old.name} --to {new.shards}`",
            field="shards",
        )
    changed: list[str] = []
    for f in fields(SubscriptionSpec):
        before, after = getattr(old, f.name), getattr(new, f.name)
        if f.name == "shards" or before == after:
            continue
        if f.name in IMMUTABLE_FIELDS:
            raise InvalidArgument(
                f"cannot change ({before!r} -> {after!r}); create a new subscription instead",
                field=f.name,
            )
        if f.name == "runtime" and not current.paused:
            raise InvalidArgument(
                f"cannot change ({before} -> {after}) while the subscription runs: "
                f"`varadhi subscription pause {old.name}`, wait until `varadhi status` shows "
                "its shards or members paused or stopped, apply, stop them, start the other "
                "runtime's processes, resume (docs/library.md#moving-between-runtimes)",
                field="runtime",
            )
        changed.append(f.name)
    return changed


ApplyAction = Literal["create", "update", "unchanged"]


def plan_apply(snapshot: Snapshot, spec: SubscriptionSpec) -> ApplyAction:
    """What `apply` would do with `spec` in this catalog state, refusing what it may not do."""
    doc = snapshot.get(KIND, spec.name)
    if doc is None:
        check_create(snapshot, spec)
        return "create"
    current = Subscription.from_dict(live_record(snapshot, doc))
    return "update" if changed_fields(current, spec) else "unchanged"


def _normalise(spec: SubscriptionSpec, source: str) -> SubscriptionSpec:
    """Validate a spec that may have been built in code, and resolve its defaults."""
    return parse_spec(spec_to_dict(spec), source=source)


def check_platform(spec: SubscriptionSpec, policy: EndpointPolicy) -> None:
    """What the platform allows the endpoint (`varadhi.core.endpoint_guard`: secret names and
    files, a literal private address), at `apply`/`create`; the shard checks again at its
    start with its own settings."""
    endpoint_guard.check_endpoint(spec.endpoint, policy)


# -- I/O ------------------------------------------------------------------------------------


class SubscriptionService:
    """Subscription commands against the catalog and Kafka.

    Everything that can be refused is refused before the first side effect. `create` has two
    effects (internal topics, then the record) and is safe to re-run after a crash between them.
    Commands return what their catalog change wrote (or found), never a re-read: a snapshot
    taken right after a commit may not show it yet (the commit markers that make a Kafka
    transaction visible to read_committed readers are written asynchronously).
    """

    def __init__(self, catalog: Catalog):
        self.catalog = catalog

    def _policy(self) -> EndpointPolicy:
        """This process's endpoint policy; the Kafka configuration's variables excluded."""
        kafka = kafka_clients.config_of(self.catalog.settings)
        return EndpointPolicy.from_env(kafka_names=kafka.env_references())

    def get(self, name: str) -> Subscription:
        return from_snapshot(self.catalog.snapshot(), name)

    def list(self) -> list[Subscription]:
        snap = self.catalog.snapshot()
        return [Subscription.from_dict(live_record(snap, d)) for d in snap.items(KIND).values()]

    def create(self, spec: SubscriptionSpec) -> Subscription:
        spec = _normalise(spec, "create")
        check_platform(spec, self._policy())
        missing = check_create(self.catalog.snapshot(), spec)
        topic_service = topics.TopicService(self.catalog)
        configs = (
            topics.queue_configs(
                self.catalog, topics.from_snapshot(self.catalog.snapshot(), spec.topic)
            )
            if missing
            else None
        )
        for name, partitions in missing:
            try:
                topic_service.create(
                    name, partitions, allow_uneven=True, internal=True, configs=configs
                )
            except AlreadyExists:
                pass  # a concurrent create of the same subscription; the record step re-checks
        sub = Subscription(spec, shard_count=spec.shards, created_ms=int(time.time() * 1000))

        def change(snap: Snapshot):
            # Re-check against the latest state (a concurrent create, a mismatched queue). The
            # queues just created may not be visible yet, so their absence is not an error.
            check_create(snap, spec)
            return {key(KIND, spec.name): sub.to_dict()}

        self.catalog.mutate(change)
        return sub

    def apply(self, spec: SubscriptionSpec) -> tuple[str, Subscription]:
        """Create or update one subscription: `("created" | "updated" | "unchanged", sub)`."""
        return self.apply_all([spec])[0]

    def apply_all(self, specs: Sequence[SubscriptionSpec]) -> list[tuple[str, Subscription]]:
        """`apply` for several specs, all of them checked before any is applied.

        A refusal leaves everything unchanged. A failure part way (Kafka goes away) leaves the
        earlier ones applied; re-running is safe.
        """
        specs = [_normalise(s, "apply") for s in specs]
        policy = self._policy()
        for s in specs:
            check_platform(s, policy)
        names = [s.name for s in specs]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise InvalidArgument(f"subscription(s) {', '.join(dups)} given more than once")
        snapshot = self.catalog.snapshot()
        plans = [plan_apply(snapshot, s) for s in specs]
        results: list[tuple[str, Subscription]] = []
        for spec, plan in zip(specs, plans, strict=True):
            if plan == "create":
                results.append(("created", self.create(spec)))
            elif plan == "update":
                results.append(("updated", self._update(spec)))
            else:
                results.append(("unchanged", from_snapshot(snapshot, spec.name)))
        return results

    def _update(self, spec: SubscriptionSpec) -> Subscription:
        return self._edit(spec.name, lambda doc: {**doc, "spec": spec_to_dict(spec)})

    def set_paused(self, name: str, paused: bool) -> Subscription:
        """Set the `paused` flag (pause; a resume also ends a suspension). Only the state: the
        shard jobs act on it."""
        state = {"paused": paused} if paused else {"paused": False, "suspended": None}
        return self._edit(name, lambda doc: {**doc, "state": {**doc["state"], **state}})

    def set_suspended(self, name: str, suspension: Suspension | None) -> Subscription:
        """Suspend the subscription (endpoint health; a suspension already recorded stays, so
        the first shard to suspend it probes it), or end its suspension (None)."""

        def edit(doc: dict[str, Any]) -> dict[str, Any]:
            state = doc["state"]
            if suspension is not None and state.get("suspended"):
                return doc
            value = suspension.to_dict() if suspension else None
            return {**doc, "state": {**state, "suspended": value}}

        return self._edit(name, edit)

    def _edit(self, name: str, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> Subscription:
        """Replace the record of `name` by `edit(record)`; nothing is written if that is equal.

        `edit` changes the stored document in place (keys it does not know, such as state
        another component added, stay) and its result must still parse; for a spec change,
        `changed_fields` must allow it (a state-only edit, such as pause, is never refused for
        the spec). It gets the record as `live_record` reads it, so the edit also stores the
        live shard count in a spec an earlier version left behind.
        """
        result: dict[str, Subscription] = {}

        def change(snap: Snapshot):
            doc = snap.get(KIND, name)
            if doc is None:
                raise NotFound("subscription", name)
            live = live_record(snap, doc)
            new = edit(dict(live))
            current, updated = Subscription.from_dict(live), Subscription.from_dict(new)
            if new["spec"] != live["spec"]:
                changed_fields(current, updated.spec)
            result["sub"] = updated
            return {} if new == doc else {key(KIND, name): new}

        self.catalog.mutate(change)
        return result["sub"]

    def describe(self, name: str) -> dict[str, Any]:
        """Spec, state, the RQ/DLQ with end offsets, and each shard's partition assignment."""
        snapshot = self.catalog.snapshot()
        sub = from_snapshot(snapshot, name)
        mq = topics.from_snapshot(snapshot, sub.spec.topic)
        rq = topics.from_snapshot(snapshot, sub.spec.rq_topic)
        dlq = topics.from_snapshot(snapshot, sub.spec.dlq_topic)
        ends = topics.end_offsets(self.catalog, rq.storage_topics + dlq.storage_topics)

        def queue(topic: CompositeTopic) -> dict[str, Any]:
            doc = topic.to_dict()
            for st in doc["storage_topics"]:
                st["end_offsets"] = ends[st["name"]]
                st["messages"] = sum(ends[st["name"]])
            return doc

        return {
            "name": sub.name,
            "spec": spec_to_dict(sub.spec),
            "state": sub.state_dict(),
            "topic": mq.to_dict(),
            "rq": queue(rq),
            "dlq": queue(dlq),
            "shards": shard_assignments(sub, mq, rq, dlq),
        }
