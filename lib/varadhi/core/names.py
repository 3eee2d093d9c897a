"""Names and partition counts a user gives: topics, subscriptions (pure)."""

from __future__ import annotations

import re

from varadhi.core import routing
from varadhi.core.errors import InvalidArgument

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,199}$")
INTERNAL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,199}\.(rq|dlq)$")
MAX_PARTITIONS = 10_000


def validate_name(name: str, internal: bool = False) -> str:
    pattern = INTERNAL_NAME_RE if internal else NAME_RE
    if not isinstance(name, str) or not pattern.fullmatch(name):
        raise InvalidArgument(
            f"{name!r} is not a valid name: use 1-200 letters, digits, '_' or '-', "
            "starting with a letter or digit",
            field="name",
        )
    return name


def validate_partitions(partitions: int, allow_uneven: bool = False) -> int:
    """Refuse counts that cannot be sharded evenly (seed 000) unless `allow_uneven`."""
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise InvalidArgument(f"must be a positive integer, got {partitions!r}", field="partitions")
    if partitions > MAX_PARTITIONS:
        raise InvalidArgument(
            f"must be at most {MAX_PARTITIONS}, got {partitions}", field="partitions"
        )
    if not allow_uneven and not routing.is_even_partition_count(partitions):
        raise InvalidArgument(
            f"{partitions} cannot be sharded evenly; use 1, 2, 3 or a multiple of 4 or 6 "
            "(or pass --allow-uneven to accept uneven shards)",
            field="partitions",
        )
    return partitions
