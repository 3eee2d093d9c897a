"""The exception hierarchy. Every exception carries the data a caller needs to react to it.

`VaradhiError` is the root; the CLI turns any of them into a one-line message and exit code 2
(bad input or state: nothing was changed) or 1 (an operation failed part way). `StopRequested` is
no failure and no `VaradhiError`: the shard's refusal of a batch while it stops.
"""

from __future__ import annotations


class VaradhiError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code = 1


class InvalidArgument(VaradhiError):
    """A name, count, option or document is invalid. Raised before any side effect."""

    exit_code = 2

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NotFound(VaradhiError):
    """A topic, subscription or other catalog entry does not exist."""

    exit_code = 2

    def __init__(self, kind: str, name: str):
        super().__init__(f"{kind} {name!r} does not exist")
        self.kind = kind
        self.name = name


class AlreadyExists(VaradhiError):
    """A create was asked for something the catalog already has."""

    exit_code = 2

    def __init__(self, kind: str, name: str):
        super().__init__(f"{kind} {name!r} already exists")
        self.kind = kind
        self.name = name


class WrongRuntime(InvalidArgument):
    """A process of one runtime was given a subscription whose spec names the other
    (`runtime: spark | library`): refused before it delivers anything, so that Spark shards and
    library members never deliver one subscription at once (exit code 2)."""

    def __init__(self, name: str, runtime: str, process: str):
        super().__init__(
            f"subscription {name} has runtime: {runtime}; {process} does not deliver it"
            f" ({_RUNNERS[runtime]} does). To move it to the other runtime: docs/library.md"
            "#moving-between-runtimes"
        )
        self.name = name
        self.runtime = runtime


_RUNNERS = {"spark": "a Spark shard, `varadhi-job shard`", "library": "`varadhi-consumer`"}


class ConcurrentModification(VaradhiError):
    """Another writer changed the catalog entry between our read and our write. Safe to retry."""


class Fenced(VaradhiError):
    """This process lost its lease (a newer instance took over); it must stop without committing."""

    def __init__(self, what: str, mine: int, current: int):
        super().__init__(f"{what}: fenced (my epoch {mine}, current epoch {current})")
        self.mine = mine
        self.current = current


class LeaseExpired(VaradhiError):
    """This process could not renew its lease for a whole TTL (Kafka did not answer), and no
    other instance is known to hold it. It must deliver and commit nothing until a renewal
    succeeds (the lease still its own: it goes on) or finds another holder (`Fenced`)."""

    def __init__(self, owner: str, ttl_ms: int):
        super().__init__(
            f"lease {owner} not renewed for {ttl_ms} ms (Kafka does not answer): delivering "
            "nothing until it is renewed or another instance is seen to hold it"
        )
        self.owner = owner
        self.ttl_ms = ttl_ms


class StopRequested(Exception):
    """Raised inside `foreachBatch` when the shard driver is stopping (`varadhi.spark.shard.job`): the
    batch does nothing and is replayed by the next query run. The query then ends with it,
    which `varadhi.kafka.jvm_errors` recognises by this class's qualified name, not as a failure."""


class KafkaUnavailable(VaradhiError):
    """The Kafka cluster could not be reached within the configured time."""


class KafkaConfigError(InvalidArgument):
    """The Kafka client configuration is invalid; nothing was started."""


class UnsupportedSparkVersion(InvalidArgument):
    """The running (or asked for) Spark version is outside the supported lines
    (`varadhi.spark.lines`). Raised before any side effect."""

    def __init__(self, version: str, supported: str):
        super().__init__(f"Spark {version} is not supported (supported lines: {supported})")
        self.version = version


class NotAuthorized(VaradhiError):
    """The cluster's ACLs refused an operation: which principal lacks which operation on which
    resource, and the `kafka-acls.sh` arguments that would grant it (docs/kafka-acls.md).
    `operation` may be "Describe or Read" where the client did not say which (the JVM's)."""

    exit_code = 4

    def __init__(self, operation: str, resource_type: str, name: str, principal: str | None):
        who = principal or "this principal"
        flag = {"Topic": "--topic", "Group": "--group", "TransactionalId": "--transactional-id"}
        grant = (
            f"--{resource_type.lower()}"
            if resource_type == "Cluster"
            else (f"{flag.get(resource_type, '--' + resource_type.lower())} {name}")
        )
        ops = " ".join(f"--operation {o}" for o in operation.split(" or "))
        super().__init__(
            f"not authorized: {who} lacks {operation} on {resource_type} {name} "
            f"(kafka-acls.sh --add --allow-principal {who} {ops} {grant})"
        )
        self.operation = operation
        self.resource_type = resource_type
        self.name = name
        self.principal = principal
