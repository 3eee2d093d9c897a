"""Subscription status: the newest progress document of each shard (`varadhi.kafka.progress`)
and what Kafka knows now.

`varadhi status` reads the newest document of each shard and adds what Kafka knows now (log-end
offsets, hence lag, and DLQ depth), so status needs neither Spark nor a running shard.

A subscription of `runtime: library` has no shards running: its status shows the library
members that reported within `MEMBER_WINDOW_MS` (`members_of`) and its consumer group's lag
from the group's committed offsets (`group_lag`) instead. `check_runtime_switch` is what a
runtime change waits for: no shard and no member of the subscription may still deliver.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kafka import TopicPartition
from kafka.errors import GroupAuthorizationFailedError, KafkaError

from varadhi.core.catalog_kinds import DocKind
from varadhi.core.errors import InvalidArgument, KafkaUnavailable, NotAuthorized, VaradhiError
from varadhi.core.policies import SubscriptionSpec
from varadhi.kafka import clients as kafka_clients
from varadhi.kafka import subscriptions, topics
from varadhi.kafka.catalog import Catalog
from varadhi.kafka.leases import KIND as LEASE_KIND
from varadhi.kafka.leases import lease_view
from varadhi.kafka.progress import (
    latest_progress,
    member_documents,
    progress_documents,
    progress_of_subscriptions,
    shard_documents,
    standbys_of,
)
from varadhi.spark import layouts

log = logging.getLogger(__name__)


def lag(
    consumed: dict[str, dict[str, int]], ends: dict[str, list[int]], owned: dict[str, list[int]]
) -> int:
    """Messages not yet read by a shard: log end minus consumed, over the partitions it owns.
    A partition the shard has not started reading counts from its log start (0) (pure)."""
    total = 0
    for topic, parts in owned.items():
        for p in parts:
            total += max(0, ends[topic][p] - int(consumed.get(topic, {}).get(str(p), 0)))
    return total


def circuit_text(circuit: dict[str, Any] | None, now_ms: int) -> str:
    """A shard's circuit breaker in one word for `varadhi status` (pure): closed, half-open,
    open with the seconds left (and `xN` for the N-th open in a row), off, or "-" (no report)."""
    if not circuit:
        return "-"
    if not circuit.get("enabled", True):
        return "off"
    state = circuit.get("state")
    if state == "open":
        left = max(0, int(circuit.get("open_until_ms") or now_ms) - now_ms) / 1000
        opens = int(circuit.get("consecutive_opens") or 1)
        return f"open {left:.0f}s" + (f" x{opens}" if opens > 1 else "")
    return "half-open" if state == "half_open" else str(state)


# A running shard publishes progress at least every 5 s: silent this long, it is taken for dead.
SILENT_MS = 60_000
# States in which a shard does nothing (`paused` too, while the subscription is paused).
IDLE_STATES = ("stopped", "fenced", "never started", "silent", "dead")


def shard_state(
    doc: dict[str, Any],
    age_ms: int | None,
    lease: dict[str, Any] | None,
    silent_ms: int = SILENT_MS,
) -> tuple[str, int | None]:
    """A shard's state for status (pure) and, when `dead`, ms since its lease was last renewed.

    `doc` is its newest progress document (`age_ms` old, None: none), `lease` its `lease_view`.
    Dead: its lease is held with a heartbeat and was not renewed for its TTL, and the progress
    document is at least that old and does not say the process ended (the process died or hangs;
    a standby takes over). Without a heartbeat (an older shard), silent after `silent_ms`."""
    said = str(doc.get("state", "never started")) if age_ms is not None else "never started"
    if said not in ("stopped", "fenced") and lease and lease["expired"]:
        ttl = int(lease["ttl_ms"])
        if age_ms is None or age_ms >= ttl:
            return "dead", lease["renewed_age_ms"]
    if age_ms is not None and age_ms >= silent_ms:
        return "silent", None
    return said, None


def running_shards(
    sub: subscriptions.Subscription,
    progress: Mapping[int, Mapping[str, Any]],
    leases: Mapping[int, dict[str, Any] | None],
    now_ms: int,
) -> dict[int, str]:
    """The shards of `sub` that may still be running, with their state (pure): not those that
    said they stopped or were fenced, never started, are dead by their lease or silent
    (`shard_state`: a killed process cannot say it stopped), nor those paused while the
    subscription is paused. A progress document of another shard count is an earlier era's
    shard of that number, not this one. Operations that need the shards stopped refuse while
    any is."""
    running = {}
    for shard in range(sub.shard_count):
        doc = progress.get(shard)
        if not doc or doc.get("shard_count", sub.shard_count) != sub.shard_count:
            continue
        age = now_ms - int(doc["updated_ms"]) if doc.get("updated_ms") else None
        state, _ = shard_state(dict(doc), age, leases.get(shard))
        if state in IDLE_STATES or (state == "paused" and sub.paused):
            continue
        running[shard] = state
    return running


def shards_running(catalog: Catalog, name: str) -> dict[int, str]:
    """`running_shards` of subscription `name` now, from the catalog, progress and leases."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    now = int(time.time() * 1000)
    ran = shards_that_ran(snap, sub)
    progress = latest_progress(catalog.settings, name, ran, sub.created_ms)
    return running_shards(sub, progress, leases_of(snap, sub, now), now)


def shards_that_ran(snap, sub: subscriptions.Subscription) -> list[int]:
    """The shards of `sub` that have ever held their lease at its current shard count (pure):
    only they can have a progress document of this count to find."""
    owner = layouts.owner
    return [
        s
        for s in range(sub.shard_count)
        if snap.get(LEASE_KIND, owner(sub.name, sub.shard_count, s)) is not None
    ]


def leases_of(snap, sub: subscriptions.Subscription, now_ms: int) -> dict[int, Any]:
    """Each shard's lease as `lease_view` shows it (None: no lease document)."""
    return {
        shard: lease_view(
            snap.get(LEASE_KIND, layouts.owner(sub.name, sub.shard_count, shard)), now_ms
        )
        for shard in range(sub.shard_count)
    }


STAT_NAMES = ("inserted", "routed", "emitted", "acknowledged")


def carry_totals(
    carried: Mapping[str, int], progress: Mapping[int, Mapping[str, Any]], shard_count: int
) -> dict[str, int]:
    """`carried` plus the counters (`totals`) of shards 0..shard_count-1 from their latest
    progress documents of that shard count (pure). A shard-count change records this for the
    shards it retires, so the subscription's counts go on across the change."""
    out = {k: int(v) for k, v in carried.items()}
    for shard in range(shard_count):
        doc = progress.get(shard) or {}
        if doc.get("shard_count", shard_count) != shard_count:
            continue
        for k, v in (doc.get("totals") or {}).items():
            if isinstance(v, int):
                out[k] = out.get(k, 0) + v
    return out


def stats_of(inserted: int, totals: dict[str, int]) -> dict[str, int]:
    """Seed 002's counters for one shard: messages produced to its partitions (inserted), read by
    it from the main topic (routed), delivery attempts (emitted) and successes (acknowledged)."""
    return {
        "inserted": inserted,
        "routed": int(totals.get("routed", 0)),
        "emitted": int(totals.get("attempts", 0)),
        "acknowledged": int(totals.get("delivered", 0)),
    }


def topic_statistics(catalog: Catalog, topic: str) -> dict[str, Any]:
    """Counters of a composite topic: messages inserted, and per subscription of it what its
    shards routed, emitted and had acknowledged (from their latest progress)."""
    return topics_statistics(catalog, [topic])[topic]


def topics_statistics(
    catalog: Catalog, names: Sequence[str], ends: Mapping[str, list[int]] | None = None
) -> dict[str, dict[str, Any]]:
    """`topic_statistics` of each composite topic in `names`, with one end-offsets request and
    one read of the progress topic whatever their number (`topic list`). `ends`: the storage
    topics' end offsets when the caller has read them already (`topics.end_offsets`)."""
    snap = catalog.snapshot()
    mqs = {name: topics.from_snapshot(snap, name) for name in names}
    if ends is None:
        ends = topics.end_offsets(catalog, [st for mq in mqs.values() for st in mq.storage_topics])
    out: dict[str, dict[str, Any]] = {
        name: {"inserted": sum(sum(ends[st.name]) for st in mq.storage_topics), "subscriptions": {}}
        for name, mq in mqs.items()
    }
    subs = {n: d for n, d in snap.items(subscriptions.KIND).items() if d["spec"]["topic"] in out}
    progress = {}
    if subs:
        wanted = {
            n: {str(i) for i in shards_that_ran(snap, subscriptions.from_snapshot(snap, n))}
            for n in subs
        }
        since = min(int(d["state"]["created_ms"]) for d in subs.values())
        progress = progress_of_subscriptions(catalog.settings, set(subs), wanted, since)
    for name, doc in subs.items():
        carried = doc.get("state", {}).get("carried_totals", {})
        per_shard = [
            stats_of(0, p.get("totals", {}))
            for p in shard_documents(progress.get(name, {})).values()
        ]
        per_shard.append(stats_of(0, carried))
        out[doc["spec"]["topic"]]["subscriptions"][name] = {
            k: sum(s[k] for s in per_shard) for k in STAT_NAMES if k != "inserted"
        }
    return out


# A member publishes every 5 s while it runs (`varadhi.library.runtime.PROGRESS_S`); status
# shows the members that reported within this window (a stopped member's last word too).
MEMBER_WINDOW_MS = 10 * 60_000
# States in which a member delivers nothing.
MEMBER_IDLE_STATES = ("stopped", "failed", "silent")


def member_state(doc: Mapping[str, Any], now_ms: int, silent_ms: int = SILENT_MS) -> str:
    """A library member's state for status (pure): what its newest document says, or `silent`
    when that is `silent_ms` old and does not say it ended (the process died or hangs)."""
    said = str(doc.get("state", "?"))
    age = now_ms - int(doc.get("updated_ms") or 0)
    if said not in ("stopped", "failed") and age >= silent_ms:
        return "silent"
    return said


def members_of(
    found: Mapping[str, Mapping[str, Any]], now_ms: int, window_ms: int = MEMBER_WINDOW_MS
) -> list[dict[str, Any]]:
    """The library members among `progress_documents` that reported within `window_ms`, by
    member name (pure): member, state (`member_state`), seconds since its last report, slots,
    partitions, counters, committed offsets, circuit (`CircuitBreaker.status`), what its slots
    wait for at a storage-topic boundary (`crossing.waiting_text`, else None) and error."""
    out = []
    for member, doc in sorted(member_documents(dict(found)).items()):
        age = now_ms - int(doc.get("updated_ms") or 0)
        if age >= window_ms:
            continue
        out.append(
            {
                "member": member,
                "state": member_state(doc, now_ms),
                "age_ms": age,
                "slots": list(doc.get("slots") or []),
                "partitions": list(doc.get("partitions") or []),
                "counters": dict(doc.get("counters") or {}),
                "committed": dict(doc.get("committed") or {}),
                "circuit": doc.get("circuit"),
                "waiting": doc.get("waiting"),
                "error": doc.get("error"),
            }
        )
    return out


def running_members(
    sub: subscriptions.Subscription, members: Sequence[Mapping[str, Any]]
) -> dict[str, str]:
    """The members of `members_of` that may still deliver, with their state (pure): not those
    stopped, failed or silent, nor those paused while the subscription is paused."""
    return {
        m["member"]: m["state"]
        for m in members
        if m["state"] not in MEMBER_IDLE_STATES and not (sub.paused and m["state"] == "paused")
    }


def ensure_members_idle(catalog: Catalog, sub: subscriptions.Subscription, action: str) -> None:
    """Refuse (`InvalidArgument`, exit 2) to `action` `sub` while a library member of it may
    still deliver (`running_members` of the members that reported within `MEMBER_WINDOW_MS`):
    each must be stopped, or paused and reported paused while the subscription is paused."""
    now = int(time.time() * 1000)
    since = max(sub.created_ms, now - MEMBER_WINDOW_MS)
    found = progress_documents(catalog.settings, sub.name, None, since)
    running = running_members(sub, members_of(found, now))
    if running:
        busy = ", ".join(f"{m} ({state})" for m, state in sorted(running.items()))
        raise InvalidArgument(
            f"cannot {action} {sub.name}: its library members may still deliver: {busy}; "
            f"`varadhi subscription pause {sub.name}` and wait until `varadhi status` shows "
            "them paused, or stop them",
            field="subscription",
        )


def group_lag(
    committed: Mapping[TopicPartition, int],
    ends: Mapping[str, list[int]],
    topic_names: Sequence[str],
) -> int:
    """Records of `topic_names` (storage topics) past the consumer group's committed offsets
    (pure); a partition without a commit counts from its log start (0), as a new group reads.
    The commit is a member's lowest unfinished offset: what finished above it counts too."""
    consumed = {
        name: {str(tp.partition): offset for tp, offset in committed.items() if tp.topic == name}
        for name in topic_names
    }
    return lag(consumed, dict(ends), {n: list(range(len(ends[n]))) for n in topic_names})


#: How long a consumer-group request waits out a coordinator that is not available yet: a
#: cluster's first group lookup makes its offsets topic (`__consumer_offsets`; a cluster used by
#: Spark shards only may have none), a coordinator loads after a restart.
COORDINATOR_WAIT_S = 30.0


def group_request(
    settings: kafka_clients.HasKafka,
    group: str,
    operation: str,
    call: Callable[[Any], Any],
    wait_s: float = COORDINATOR_WAIT_S,
) -> Any:
    """`call(admin)` on a new admin client, about consumer group `group`, tried again while
    Kafka's answer is retriable (the group's coordinator not available yet) for up to `wait_s`.
    `NotAuthorized` naming `operation` on the group when its ACL is missing; `KafkaUnavailable`
    when the coordinator is still unavailable after the wait."""
    admin = kafka_clients.admin(settings, client_id="varadhi-admin")
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                return call(admin)
            except GroupAuthorizationFailedError:
                raise NotAuthorized(
                    operation, "Group", group, kafka_clients.principal(settings)
                ) from None
            except KafkaError as e:
                if not getattr(e, "retriable", False):
                    raise
                if time.monotonic() > deadline:
                    raise KafkaUnavailable(
                        f"Kafka's coordinator of consumer group {group} is not available after "
                        f"{wait_s:g} s ({type(e).__name__}): see the brokers' logs (the offsets "
                        "topic __consumer_offsets needs offsets.topic.replication.factor brokers)"
                    ) from e
                time.sleep(0.5)
    finally:
        admin.close()


def group_committed(catalog: Catalog, group: str) -> dict[TopicPartition, int]:
    """The committed offsets of consumer group `group` (none: empty; `group_request`)."""
    found = group_request(
        catalog.settings,
        group,
        "Describe",
        lambda admin: admin.list_group_offsets({group: None}).get(group, {}),
    )
    return {tp: om.offset for tp, om in found.items() if om.offset >= 0}


def group_members(settings: kafka_clients.HasKafka, group: str) -> list[str] | None:
    """The members consumer group `group` has now, each as `client id@host` (a library member's
    client id is its name, as `varadhi status` shows it), or None when Kafka has no such group
    (no member and no commit). A DescribeGroups request (`group_request`); `NotAuthorized`
    without Describe on the group, `VaradhiError` for another error Kafka answers (never taken
    for "no group")."""
    found = group_request(
        settings, group, "Describe", lambda admin: admin.describe_groups([group]).get(group)
    )
    found = found or {}
    error = found.get("error") or ""
    if "GroupAuthorizationFailed" in error:
        raise NotAuthorized("Describe", "Group", group, kafka_clients.principal(settings))
    if "GroupIdNotFound" in error or (not error and found.get("group_state") == "Dead"):
        return None
    if error or not found:
        raise VaradhiError(f"cannot describe consumer group {group}: {error or 'no answer'}")
    return sorted(f"{m['client_id']}@{m['client_host']}" for m in found.get("members") or [])


def library_status(
    catalog: Catalog,
    sub: subscriptions.Subscription,
    ends: Mapping[str, list[int]],
    main: Sequence[str],
    rq: str,
    now_ms: int,
) -> dict[str, Any]:
    """The members and the consumer group of a `runtime: library` subscription (`collect`):
    its lag on the storage topics `main` (all of the main topic's) and on the RQ `rq`."""
    # here, not at the top: the library runtime cost every CLI start up to 0.08 s of CPU
    from varadhi.library.runtime import group_id

    since = max(sub.created_ms, now_ms - MEMBER_WINDOW_MS)
    members = members_of(progress_documents(catalog.settings, sub.name, None, since), now_ms)
    committed = group_committed(catalog, group_id(sub.name))
    return {
        "group": group_id(sub.name),
        "main_lag": group_lag(committed, ends, main),
        "rq_lag": group_lag(committed, ends, [rq]),
        "members": members,
    }


def check_runtime_switch(
    sub: subscriptions.Subscription,
    shards: Mapping[int, str],
    members: Mapping[str, str],
) -> None:
    """Refuse a change of `sub`'s runtime while any of its shards (`running_shards`) or library
    members (`running_members`) may still deliver (pure). The subscription must also be paused
    (`subscriptions.changed_fields` refuses that): paused processes of the old runtime stop,
    before delivering, once they see the change (`subscriptions.check_runtime`)."""
    busy = [f"shard {s} ({state})" for s, state in sorted(shards.items())]
    busy += [f"member {m} ({state})" for m, state in sorted(members.items())]
    if busy:
        raise InvalidArgument(
            f"cannot change the runtime of {sub.name} while it may still deliver: "
            f"{', '.join(busy)}; pause it (`varadhi subscription pause {sub.name}`) and wait "
            "until `varadhi status` shows them paused or stopped",
            field="runtime",
        )


def check_runtime_switches(catalog: Catalog, specs: Sequence[SubscriptionSpec]) -> None:
    """`check_runtime_switch` for each of `specs` that changes an existing paused
    subscription's runtime (`varadhi.Client.apply`, before it applies anything)."""
    snap = catalog.snapshot()
    now = int(time.time() * 1000)
    for spec in specs:
        if snap.get(subscriptions.KIND, spec.name) is None:
            continue
        sub = subscriptions.from_snapshot(snap, spec.name)
        if sub.spec.runtime == spec.runtime or not sub.paused:
            continue  # unchanged, or refused by `changed_fields` for not being paused
        since = max(sub.created_ms, now - MEMBER_WINDOW_MS)
        found = progress_documents(catalog.settings, sub.name, None, since)
        shards = running_shards(sub, shard_documents(found), leases_of(snap, sub, now), now)
        check_runtime_switch(sub, shards, running_members(sub, members_of(found, now)))


def collect(catalog: Catalog, name: str) -> dict[str, Any]:
    """Status of subscription `name`: per shard and queue, lag, rates, blocked groups, DLQ depth,
    generation and operations in progress; for a `runtime: library` subscription its members
    and its consumer group's lag instead of shards (`library_status`, under `library`)."""
    snap = catalog.snapshot()
    sub = subscriptions.from_snapshot(snap, name)
    mq = topics.from_snapshot(snap, sub.spec.topic)
    rq = topics.from_snapshot(snap, sub.spec.rq_topic)
    dlq = topics.from_snapshot(snap, sub.spec.dlq_topic)
    ends = topics.end_offsets(catalog, mq.storage_topics + rq.storage_topics + dlq.storage_topics)
    if sub.spec.runtime == "library":
        return _library_collect(catalog, snap, sub, mq, rq, dlq, ends)
    found = progress_documents(catalog.settings, name, shards_that_ran(snap, sub), sub.created_ms)
    progress = shard_documents(found)
    now = int(time.time() * 1000)
    standbys = standbys_of(found, now)
    leases = leases_of(snap, sub, now)
    shards = []
    for shard in range(sub.shard_count):
        doc = progress.get(shard, {})
        if doc.get("shard_count", sub.shard_count) != sub.shard_count:
            doc = {}  # the last word of shard `shard` of the count before a change: not this one
        consumed = doc.get("consumed") or {}
        mq_owned = {
            st.name: subscriptions.owned_partitions(sub, mq, i, shard)
            for i, st in enumerate(mq.storage_topics)
            if i >= int(doc.get("mq_index", 0))
        }
        # Older RQ/DLQ storage topics (before rq_from/dlq_from) are a previous shard count's;
        # feeders copy them into the current ones, which the shards read.
        rq_owned = {
            st.name: subscriptions.internal_partitions(sub, rq, i, shard)
            for i, st in enumerate(rq.storage_topics)
            if i >= sub.rq_from
        }
        dlq_owned = {
            st.name: subscriptions.internal_partitions(sub, dlq, i, shard)
            for i, st in enumerate(dlq.storage_topics)
            if i >= sub.dlq_from
        }
        age = (now - int(doc["updated_ms"])) if doc.get("updated_ms") else None
        totals = doc.get("totals", {})
        inserted = sum(
            ends[st.name][p]
            for i, st in enumerate(mq.storage_topics)
            for p in subscriptions.owned_partitions(sub, mq, i, shard)
        )
        held = leases[shard]
        state, dead_ms = shard_state(doc, age, held)
        shards.append(
            {
                "shard": shard,
                "state": state,
                "dead_for_ms": dead_ms,
                "lease": held,
                "standbys": [
                    {k: s.get(k) for k in ("instance", "updated_ms", "watching")}
                    for s in standbys.get(shard, [])
                    if s.get("shard_count", sub.shard_count) == sub.shard_count
                ],
                "progress_age_ms": age,
                "generation": doc.get("generation"),
                "layout": doc.get("layout"),
                "instance": doc.get("instance"),
                "queues": {
                    "main": {"lag": lag(consumed, ends, mq_owned)},
                    "rq": {
                        "lag": lag(consumed, ends, rq_owned),
                        "pending": doc.get("rq_pending", 0),
                    },
                    "dlq": {
                        "depth": sum(ends[t][p] for t, parts in dlq_owned.items() for p in parts),
                        "parked": doc.get("dlq_pending", 0),
                    },
                },
                "blocked_groups": doc.get("blocked_groups", 0),
                "blocked": doc.get("blocked", []),
                # at the end of a storage topic, before one that gives groups other shards
                "waiting": doc.get("waiting"),
                "held": doc.get("held", 0),
                "circuit": doc.get("circuit"),
                "rates": doc.get("rates", {}),
                "totals": totals,
                "stats": stats_of(inserted, totals),
                "filtered": int(totals.get("filtered", 0)),
            }
        )
    operations = _operations(snap, name)
    # Counts of the shards a shard-count change retired (`carry_totals`) go on in the totals.
    carried = (snap.get(subscriptions.KIND, name) or {}).get("state", {}).get("carried_totals", {})
    before = stats_of(0, carried)
    return {
        "runtime": sub.spec.runtime,
        "stats": {k: before[k] + sum(s["stats"][k] for s in shards) for k in STAT_NAMES},
        # Main-topic messages the subscription's filter dropped (`varadhi.core.filters`).
        "filtered": int(carried.get("filtered", 0)) + sum(s["filtered"] for s in shards),
        "subscription": name,
        "paused": sub.paused,
        "suspended": sub.suspended.to_dict() if sub.suspended else None,
        "generation": sub.generation,
        "shard_count": sub.shard_count,
        "shards": shards,
        "operations": operations,
    }


def _operations(snap, name: str) -> dict[str, Any]:
    return {
        k: v
        for k, v in snap.items(DocKind.OPERATION).items()
        if k == name or k.startswith(f"{name}/")
    }


def _library_collect(catalog, snap, sub, mq, rq, dlq, ends) -> dict[str, Any]:
    """`collect` of a `runtime: library` subscription: no shards; its members and group."""
    now = int(time.time() * 1000)
    main, rq_now = [st.name for st in mq.storage_topics], rq.produce_topic.name
    library = library_status(catalog, sub, ends, main, rq_now, now)
    library["dlq_depth"] = sum(sum(ends[st.name]) for st in dlq.storage_topics)
    totals: dict[str, int] = {}
    for m in library["members"]:
        for k, v in m["counters"].items():
            if isinstance(v, int):
                totals[k] = totals.get(k, 0) + v
    inserted = sum(sum(ends[st.name]) for st in mq.storage_topics)
    # Members count from their own start: these are the shown members' totals.
    stats = stats_of(inserted, {"routed": totals.get("read", 0), **totals})
    return {
        "runtime": sub.spec.runtime,
        "stats": stats,
        "filtered": 0,
        "subscription": sub.name,
        "paused": sub.paused,
        "suspended": sub.suspended.to_dict() if sub.suspended else None,
        "generation": sub.generation,
        "shard_count": sub.shard_count,
        "shards": [],
        "library": library,
        "operations": _operations(snap, sub.name),
    }


def shard_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per shard of a `collect` document (pure): the columns `varadhi status` shows
    as text, for a table (a DataFrame in the notebooks)."""
    return [
        {
            "shard": s["shard"],
            "state": s["state"],
            "generation": s["generation"],
            "main_lag": s["queues"]["main"]["lag"],
            "rq_lag": s["queues"]["rq"]["lag"],
            "rq_pending": s["queues"]["rq"]["pending"],
            "dlq_parked": s["queues"]["dlq"]["parked"],
            "dlq_depth": s["queues"]["dlq"]["depth"],
            "blocked_groups": s["blocked_groups"],
            "delivered_per_s": s["rates"].get("delivered_per_s", 0),
            "failures_per_s": s["rates"].get("failures_per_s", 0),
        }
        for s in doc["shards"]
    ]
