"""The Kafka ACLs each component needs: the one table docs/kafka-acls.md shows (a unit test checks
the page holds `markdown()` verbatim) and the least-privilege test grants (one principal per
component, holding exactly `grants(component, names)`), so the two cannot disagree. Pure.

A grant names its resource by a template over `Names`: `{catalog}` the catalog topic,
`{topic}` a composite topic (its storage topics are `<topic>.0`, `<topic>.1`, ...), `{sub}` a
subscription (its Kafka topics `<sub>.rq.<n>`, `<sub>.dlq.<n>`, `<sub>.journal`, `<sub>.trace`,
`<sub>.state` (a library subscription's GroupState, `varadhi.library.group_state_topic`);
its library runtime's consumer group `varadhi-library.<sub>`, `varadhi.library.runtime.group_id`),
`{outbox}` a Delta outbox. User-facing names cannot contain a dot, so a prefix `<sub>.` matches
only that subscription's own topics (and those of a topic named exactly `<sub>`, if there is one).

The only consumer-group ACLs are on a `runtime: library` subscription's group: the operator's
(`status` reads its commits, `offsets reset` moves them, `subscription delete` deletes it) and
its members'; every other consumer of these components assigns partitions itself and commits no
offsets to Kafka. No cluster ACL appears:
since Kafka 3.0 `Write` on a topic covers an idempotent producer (no `IdempotentWrite`). The
library runtime's members (`varadhi.library`) join and commit to that group (Read).

Hazard: the table was measured, not derived: a change to what a component reads, writes,
creates or describes must change its rows here, and the least-privilege test
(`tests/integration/test_secure_kafka.py`) is what notices a missing one.
"""

from __future__ import annotations

from dataclasses import dataclass

TOPIC, TRANSACTIONAL_ID, GROUP = "Topic", "TransactionalId", "Group"
LITERAL, PREFIXED = "literal", "prefixed"
# kafka-acls.sh's option naming a resource of each kind
_TOOL_OPTION = {TOPIC: "--topic", TRANSACTIONAL_ID: "--transactional-id", GROUP: "--group"}

# component -> who runs as it (the table's first column)
COMPONENTS: dict[str, str] = {
    "operator": "the `varadhi` commands other than `produce` (topics, subscriptions, "
    "change-shards, status, DLQ, offset reset, replay, deletes), notebooks",
    "producer": "the producer library, `varadhi produce`",
    "shard": "a shard job (`varadhi-job shard`, `./spark-submit.sh NAME N`)",
    "feeder": "a feeder job of a shard-count change (`varadhi-job feeder`)",
    "outbox relay": "the SQL outbox relay (`varadhi-job outbox_relay`) and a Delta outbox's query",
    "member": "a library runtime member (`varadhi-consumer`, `varadhi.library.Consumer`)",
}


@dataclass(frozen=True)
class Names:
    """The names a deployment's grants are made for."""

    catalog: str = "__varadhi_catalog"
    topic: str = "orders"
    sub: str = "orders-http"
    outbox: str = "orders"


@dataclass(frozen=True)
class Grant:
    """One ACL of one component: ALLOW `operations` on `resource` (`TOPIC`,
    `TRANSACTIONAL_ID` or `GROUP`, a consumer group) named by `name`, a template over `Names`, matched as `pattern`
    (`LITERAL` or `PREFIXED`). `optional`: the component works without it (the test grants
    none of those)."""

    component: str
    resource: str
    pattern: str
    name: str
    operations: tuple[str, ...]
    why: str
    optional: bool = False

    def bound(self, names: Names) -> Grant:
        """This grant with its name filled in from `names`."""
        return Grant(
            self.component,
            self.resource,
            self.pattern,
            self.name.format(**vars(names)),
            self.operations,
            self.why,
            self.optional,
        )


_CATALOG_TXN = "varadhi-catalog-writer.{catalog}"
_LIBRARY_GROUP = "varadhi-library.{sub}"  # varadhi.library.runtime.group_id (a unit test checks)

TABLE: tuple[Grant, ...] = (
    # -- operator --------------------------------------------------------------------------
    Grant("operator", TOPIC, LITERAL, "{catalog}",
          ("Create", "Describe", "DescribeConfigs", "Read", "Write"),
          "the catalog: read and changed by every command; made by the first one (Create); "
          "checked to be compacted (DescribeConfigs)"),
    Grant("operator", TRANSACTIONAL_ID, PREFIXED, _CATALOG_TXN, ("Describe", "Write"),
          "the catalog writer's transactions"),
    Grant("operator", TOPIC, LITERAL, "{catalog}_progress",
          ("Create", "Describe", "Read", "Write"),
          "`status` reads the shards' progress (and makes the topic if no shard has yet); "
          "`subscription delete` writes tombstones for its shards' progress"),
    Grant("operator", TOPIC, PREFIXED, "{topic}.",
          ("Create", "Delete", "Describe", "DescribeConfigs", "Read"),
          "`topic create`, `add-storage`, `delete`; the RQ/DLQ take the main topic's "
          "`max.message.bytes`; offsets, status lag and replay read it"),
    Grant("operator", TOPIC, PREFIXED, "{sub}.",
          ("Create", "Delete", "Describe", "DescribeConfigs", "Read", "Write"),
          "`subscription apply` and `change-shards` make the RQ/DLQ, `change-shards` writes "
          "the last batch's records to the new ones; DLQ list, re-drive, offsets and status "
          "read them, `trace` reads the delivery trace; `subscription delete` deletes them, the "
          "journal, the trace and a library subscription's GroupState topic"),
    Grant("operator", TRANSACTIONAL_ID, LITERAL, "varadhi.{sub}.change-shards",
          ("Describe", "Write"),
          "`change-shards` sends the last batch's records in one transaction"),
    Grant("operator", GROUP, LITERAL, _LIBRARY_GROUP, ("Delete", "Describe", "Read"),
          "a `runtime: library` subscription's consumer group: `status` reads its commits "
          "(Describe); `offsets reset` waits for it to be empty (Describe), commits its new "
          "offsets (Read) and removes its commits on the main topic's storage topics after the "
          "one it moves to (Delete); `subscription delete` checks that it is empty (Describe) "
          "and deletes it"),
    # -- producer --------------------------------------------------------------------------
    Grant("producer", TOPIC, LITERAL, "{catalog}", ("Describe", "DescribeConfigs", "Read"),
          "reads a topic's produce pointer (no Write: it never changes the catalog)"),
    Grant("producer", TOPIC, PREFIXED, "{topic}.", ("Describe", "Write"),
          "sends to the produce storage topic"),
    Grant("producer", TRANSACTIONAL_ID, PREFIXED, "varadhi-producer-{topic}-",
          ("Describe", "Write"),
          "transactional sends (`send_transaction`, `varadhi produce --transactional`)"),
    # -- shard -----------------------------------------------------------------------------
    Grant("shard", TOPIC, LITERAL, "{catalog}", ("Describe", "DescribeConfigs", "Read", "Write"),
          "reads the subscription, writes its lease and hand-overs"),
    Grant("shard", TOPIC, LITERAL, "{catalog}", ("AlterConfigs",),
          "gives a catalog made by an older version hourly segments (`segment.ms`); without "
          "it the shard logs that it could not and goes on", optional=True),
    Grant("shard", TRANSACTIONAL_ID, PREFIXED, _CATALOG_TXN, ("Describe", "Write"),
          "the catalog writer's and its lease writer's transactions"),
    Grant("shard", TOPIC, LITERAL, "{catalog}_progress", ("Create", "Describe", "Read", "Write"),
          "publishes its progress (made on first use), reads its last counters back"),
    Grant("shard", TOPIC, PREFIXED, "{topic}.", ("Describe", "Read"),
          "the Spark source reads the storage topics"),
    Grant("shard", TOPIC, PREFIXED, "{sub}.", ("Describe", "DescribeConfigs", "Read", "Write"),
          "reads and writes its RQ, DLQ, delivery journal and trace; sizes its RQ/DLQ records by their "
          "`max.message.bytes`"),
    Grant("shard", TOPIC, LITERAL, "{sub}.journal", ("Create",),
          "makes the delivery journal on first use"),
    Grant("shard", TOPIC, LITERAL, "{sub}.trace", ("Create",),
          "makes the delivery trace on first use (a spec with a `trace` section)"),
    Grant("shard", TOPIC, LITERAL, "{sub}.trace", ("AlterConfigs",),
          "sets a changed `trace.retention` on the trace topic; without it the shard logs that "
          "it could not and keeps the topic's retention", optional=True),
    Grant("shard", TRANSACTIONAL_ID, PREFIXED, "varadhi.{sub}.s", ("Describe", "Write"),
          "the RQ/DLQ writer's transactions (`varadhi.<sub>.s<count>.shard-<n>`)"),
    # -- feeder ----------------------------------------------------------------------------
    Grant("feeder", TOPIC, LITERAL, "{catalog}", ("Describe", "DescribeConfigs", "Read", "Write"),
          "reads the change, marks itself done"),
    Grant("feeder", TRANSACTIONAL_ID, PREFIXED, _CATALOG_TXN, ("Describe", "Write"),
          "the catalog writer's transactions"),
    Grant("feeder", TOPIC, PREFIXED, "{sub}.", ("Describe", "Read", "Write"),
          "reads the old RQ/DLQ storage topic, writes the new one (Spark's Kafka sink)"),
    # -- outbox relay ----------------------------------------------------------------------
    Grant("outbox relay", TOPIC, LITERAL, "{catalog}", ("Describe", "DescribeConfigs", "Read"),
          "reads a topic's produce pointer (no Write)"),
    Grant("outbox relay", TOPIC, PREFIXED, "{topic}.", ("Describe", "Write"),
          "sends the outbox's rows to the produce storage topic"),
    Grant("outbox relay", TOPIC, LITERAL, "__varadhi_delta_outbox",
          ("Create", "Describe", "Read", "Write"),
          "a Delta outbox's markers (made on first use)"),
    Grant("outbox relay", TRANSACTIONAL_ID, LITERAL, "varadhi-delta-outbox-{outbox}",
          ("Describe", "Write"),
          "a Delta outbox's transactions"),
    # -- member ----------------------------------------------------------------------------
    Grant("member", TOPIC, LITERAL, "{catalog}", ("Describe", "DescribeConfigs", "Read", "Write"),
          "reads the subscription (and checks it every 5 s); marks the slots of a re-drive "
          "done; records and ends the subscription's suspension (endpoint health)"),
    Grant("member", TRANSACTIONAL_ID, PREFIXED, _CATALOG_TXN, ("Describe", "Write"),
          "the catalog writer's transactions"),
    Grant("member", TOPIC, LITERAL, "{catalog}_progress", ("Create", "Describe", "Read", "Write"),
          "publishes the member's progress and its circuit reports, reads the other members' "
          "(the circuit on the subscription's error rate; made on first use)"),
    Grant("member", TOPIC, PREFIXED, "{topic}.", ("Describe", "Read"),
          "reads the main topic's storage topics (and, at a switch that moves groups, their "
          "end offsets and the group's commits on them)"),
    Grant("member", TOPIC, PREFIXED, "{sub}.", ("Describe", "DescribeConfigs", "Read", "Write"),
          "reads its RQ and, for a re-drive, its DLQ; writes retries, dead letters and re-driven "
          "messages, and the delivery trace; reads and writes its blocked keys (the GroupState "
          "topic; at a switch that moves groups it counts them all) and the ids it delivered (the dedup topic); sizes its RQ/DLQ records by their "
          "`max.message.bytes`"),
    Grant("member", TOPIC, LITERAL, "{sub}.trace", ("Create",),
          "makes the delivery trace on first use (a spec with a `trace` section)"),
    Grant("member", TOPIC, LITERAL, "{sub}.state", ("Create",),
          "makes the GroupState topic on first use (`on_dead_letter: block`, the default)"),
    Grant("member", TOPIC, LITERAL, "{sub}.dedup", ("Create",),
          "makes the dedup topic on first use (a spec with a `dedup_window`)"),
    Grant("member", GROUP, LITERAL, _LIBRARY_GROUP, ("Read",),
          "joins the subscription's consumer group and commits its offsets (Read covers "
          "JoinGroup, SyncGroup, Heartbeat, OffsetCommit and OffsetFetch)"),
)  # fmt: skip


def grants(component: str, names: Names, optional: bool = False) -> list[Grant]:
    """The grants `component` needs for `names` (with the optional ones when asked)."""
    if component not in COMPONENTS:
        raise ValueError(f"no component {component!r}; one of {', '.join(COMPONENTS)}")
    return [
        g.bound(names) for g in TABLE if g.component == component and (optional or not g.optional)
    ]


def markdown() -> str:
    """The table docs/kafka-acls.md shows: one row per grant, grouped by component."""
    rows = [
        "| Component | Resource | Pattern | Name | Operations | Why |",
        "|---|---|---|---|---|---|",
    ]
    seen: set[str] = set()
    for g in TABLE:
        who = "" if g.component in seen else f"**{g.component}**: {COMPONENTS[g.component]}"
        seen.add(g.component)
        ops = ", ".join(g.operations) + (" (optional)" if g.optional else "")
        name = g.name.replace("{", "<").replace("}", ">")
        rows.append(f"| {who} | {g.resource} | {g.pattern} | `{name}` | {ops} | {g.why} |")
    return "\n".join(rows) + "\n"


def commands(component: str) -> str:
    """`kafka-acls.sh` arguments granting `component` its (non-optional) grants, one line each,
    as `acl ARGS` lines over the shell variables `CATALOG`, `TOPIC`, `SUB` and `OUTBOX`."""
    shell = Names("${CATALOG}", "${TOPIC}", "${SUB}", "${OUTBOX}")
    lines = []
    for g in grants(component, shell):
        kind = _TOOL_OPTION[g.resource]
        pattern = "--resource-pattern-type prefixed " if g.pattern == PREFIXED else ""
        ops = " ".join(f"--operation {op}" for op in g.operations)
        lines.append(f'acl {pattern}{kind} "{g.name}" {ops}')
    return "\n".join(lines) + "\n"
