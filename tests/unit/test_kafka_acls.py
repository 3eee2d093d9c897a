"""The ACL table (`varadhi.kafka.acls`): docs/kafka-acls.md shows it verbatim, and its rows are
well formed. The least-privilege test grants from the same table
(tests/integration/test_secure_kafka.py), so page and test cannot disagree."""

from __future__ import annotations

from pathlib import Path

import pytest

from varadhi.kafka import acls

DOC = (Path(__file__).resolve().parents[2] / "docs" / "kafka-acls.md").read_text()
NAMES = acls.Names("cat", "orders", "orders-http", "box")


def test_the_page_shows_the_table_and_its_commands():
    assert acls.markdown() in DOC
    for component in acls.COMPONENTS:
        assert acls.commands(component) in DOC, component


def test_every_component_has_rows_and_every_row_a_known_component():
    assert {g.component for g in acls.TABLE} == set(acls.COMPONENTS)
    with pytest.raises(ValueError, match="no component 'consumer'"):
        acls.grants("consumer", NAMES)


def test_rows_name_topics_transactional_ids_and_the_library_group_with_known_operations():
    """No cluster ACL (no producer needs IdempotentWrite), and one consumer group only: the
    operator's on a library subscription's (no other consumer commits offsets)."""
    known = {"Create", "Delete", "Describe", "DescribeConfigs", "AlterConfigs", "Read", "Write"}
    for g in acls.TABLE:
        assert g.resource in (acls.TOPIC, acls.TRANSACTIONAL_ID, acls.GROUP), g
        assert g.pattern in (acls.LITERAL, acls.PREFIXED), g
        assert g.operations and set(g.operations) <= known, g
        if g.resource == acls.TRANSACTIONAL_ID:
            assert set(g.operations) == {"Describe", "Write"}, g


def test_grants_fill_in_the_names_and_leave_out_the_optional_ones():
    shard = acls.grants("shard", NAMES)
    assert all("{" not in g.name for g in shard)
    assert ("literal", "orders-http.journal", ("Create",)) in [
        (g.pattern, g.name, g.operations) for g in shard
    ]
    assert not any(g.optional for g in shard)
    optional = acls.grants("shard", NAMES, optional=True)
    assert [(g.name, g.operations) for g in optional if g.optional] == [
        ("cat", ("AlterConfigs",)),
        ("orders-http.trace", ("AlterConfigs",)),
    ]


@pytest.mark.parametrize("component", ["producer", "outbox relay"])
def test_producers_only_read_the_catalog(component):
    """A producer reads a topic's produce pointer and never changes the catalog: no Write or
    Create on it, no catalog writer's transactional id."""
    catalog = [g for g in acls.grants(component, NAMES) if g.name == "cat"]
    assert [g.operations for g in catalog] == [("Describe", "DescribeConfigs", "Read")]
    assert not any(g.name.startswith("varadhi-catalog-writer") for g in acls.TABLE
                   if g.component == component)  # fmt: skip


def test_the_library_group_is_the_only_group_its_members_and_the_operator_may_use():
    """`varadhi status` of a `runtime: library` subscription reads its consumer group's commits
    (OffsetFetch: Describe), `offsets reset` waits for the group to be empty (DescribeGroups:
    Describe) and commits its new offsets (OffsetCommit: Read), `subscription delete` checks
    that it is empty and deletes it (DeleteGroups: Delete); its members join and commit (Read).
    The rows name the group the members join (`runtime.group_id`)."""
    from varadhi.library.runtime import group_id

    groups = [g for g in acls.TABLE if g.resource == acls.GROUP]
    assert [(g.component, g.pattern, g.operations) for g in groups] == [
        ("operator", acls.LITERAL, ("Delete", "Describe", "Read")),
        ("member", acls.LITERAL, ("Read",)),
    ]
    for component in ("operator", "member"):
        names = [g.name for g in acls.grants(component, NAMES) if g.resource == acls.GROUP]
        assert names == [group_id("orders-http")], component
    line = 'acl --group "varadhi-library.${SUB}" --operation Delete --operation Describe'
    assert f"{line} --operation Read\n" in acls.commands("operator")


def test_the_commands_use_the_shell_variables():
    assert acls.commands("shard").splitlines()[-1] == (
        'acl --resource-pattern-type prefixed --transactional-id "varadhi.${SUB}.s" '
        "--operation Describe --operation Write"
    )
