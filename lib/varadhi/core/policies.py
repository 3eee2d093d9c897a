"""Typed, immutable configuration of a subscription: endpoint, retry, consumption and circuit
breaker policies.

These are plain frozen dataclasses with defaults that match the README's guarantees. Parsing YAML or
CLI options into them, and validating them with messages that name the field, lives in
`varadhi.kafka.subscriptions`; deciding what a response means lives in `varadhi.core.retry`, and when to
stop sending to a failing endpoint in `varadhi.core.circuit`.

Secrets never live here: the endpoint names where its secrets are (`auth_env`, `SecretRef`s:
signing keys, the TLS client key, the OAuth2 client secret, the JWT key), and only the delivery
code on executors reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from varadhi.core.filters import Filter

Action = Literal["success", "retry", "dead_letter"]
Backoff = Literal["fixed", "exponential"]
OnDeadLetter = Literal["block", "skip"]
Method = Literal["POST", "PUT", "PATCH"]
SigningScheme = Literal["v1", "v1a"]
JwtAlgorithm = Literal["RS256", "ES256"]
DeliveryMode = Literal["single", "batch"]
BatchFormat = Literal["ndjson", "json_array"]
# Which processes deliver a subscription: Spark shards, or library members (docs/library.md).
Runtime = Literal["spark", "library"]
RUNTIMES: tuple[Runtime, ...] = ("spark", "library")


@dataclass(frozen=True)
class ResponseRule:
    """`codes` is a status code (`"404"`), a class (`"4xx"`), or one of the pseudo codes
    `"timeout"` and `"connection_error"`. `honour_retry_after` makes a retry wait at least as long
    as the response's Retry-After header asks."""

    codes: str
    action: Action
    honour_retry_after: bool = False


DEFAULT_RESPONSES: tuple[ResponseRule, ...] = (
    ResponseRule("2xx", "success"),
    ResponseRule("429", "retry", honour_retry_after=True),
    ResponseRule("503", "retry", honour_retry_after=True),
    ResponseRule("5xx", "retry"),
    ResponseRule("timeout", "retry"),
    ResponseRule("connection_error", "retry"),
    # Batch mode only: a 207 whose multi-status body is malformed or inconsistent.
    ResponseRule("invalid_response", "retry"),
    ResponseRule("4xx", "dead_letter"),
    ResponseRule("3xx", "dead_letter"),
)


@dataclass(frozen=True)
class SecretRef:
    """A secret by reference: exactly one of an environment variable name and a file path.
    Which references the platform honours: `varadhi.core.endpoint_guard`."""

    env: str | None = None
    file: str | None = None

    def __str__(self) -> str:
        return f"env {self.env}" if self.env is not None else f"file {self.file}"


@dataclass(frozen=True)
class SigningKey:
    """One key that signs every request (Standard Webhooks, `varadhi.core.signing`): `v1`, an
    HMAC-SHA256 secret (`whsec_<base64>`), or `v1a`, an ed25519 private key (`whsk_<base64>`)."""

    scheme: SigningScheme
    secret: SecretRef


@dataclass(frozen=True)
class EndpointTls:
    """The endpoint's TLS beyond the system's defaults (`varadhi.core.endpoint_auth`): `ca`, a
    PEM bundle of the CAs to trust instead of the system's (for the OAuth2 token endpoint too);
    `cert` and `key`, a PEM client certificate (chain) and its private key, for endpoints that
    require mutual TLS. Each by reference, like every secret."""

    ca: SecretRef | None = None
    cert: SecretRef | None = None
    key: SecretRef | None = None


@dataclass(frozen=True)
class OAuth2Credentials:
    """OAuth 2 client credentials (RFC 6749, 4.4): an access token from `token_url` (https)
    for `client_id` and the secret `client_secret` names, sent as a bearer token in the
    endpoint's `auth_header`. `scope` and `audience` are sent with the token request when set."""

    token_url: str
    client_id: str
    client_secret: SecretRef
    scope: str | None = None
    audience: str | None = None


@dataclass(frozen=True)
class JwtBearer:
    """A JWT of our own, signed with `key` (a PEM private key: RSA for RS256, P-256 for ES256),
    sent as a bearer token in the endpoint's `auth_header`, for endpoints that verify OIDC-style
    tokens: header `kid` = `key_id`; claims `iss`, `sub`, `aud`, `iat`, `exp` (`lifetime_ms`
    after `iat`). `subject` None: the issuer; `audience` None: the endpoint URL."""

    algorithm: JwtAlgorithm
    key: SecretRef
    key_id: str
    issuer: str
    subject: str | None = None
    audience: str | None = None
    lifetime_ms: int = 300_000


@dataclass(frozen=True)
class RequestShaping:
    """What of a record besides its value a single request carries (`varadhi.core.request_shaping`):
    `forward_headers` (Kafka header name, HTTP header name) pairs, `path`, a template over the
    record's headers appended to the URL's path (`/orders/{header:tenant}`), and `key_header`,
    the HTTP header that carries the text form of the record's Kafka key."""

    forward_headers: tuple[tuple[str, str], ...] = ()
    path: str | None = None
    key_header: str | None = None


@dataclass(frozen=True)
class Endpoint:
    url: str
    method: Method = "POST"
    headers: tuple[tuple[str, str], ...] = ()
    auth_header: str = "Authorization"
    auth_env: str | None = None
    # Several keys sign at once (a signature each), so that keys rotate without downtime.
    signing: tuple[SigningKey, ...] = ()
    shaping: RequestShaping = field(default_factory=RequestShaping)
    tls: EndpointTls | None = None
    # At most one of auth_env, oauth2 and jwt (each sets the auth header).
    oauth2: OAuth2Credentials | None = None
    jwt: JwtBearer | None = None
    # Connect fast (a local or in-VPC endpoint accepts in milliseconds; a dead one should fail
    # the attempt, not the batch); allow requests long enough for a slow but healthy endpoint.
    connect_timeout_ms: int = 2_000
    request_timeout_ms: int = 10_000
    # Messages a second for the whole subscription, split among its shards and slowed down by
    # 429/503 answers (`varadhi.core.rate_limit`); None: no limit.
    max_rate: float | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """`max_attempts` counts every delivery attempt, the first included. A retry that falls due
    within `in_place_window_ms` of the message's first failure waits in the delivery task
    instead of going through the RQ while the task has other deliveries to make, and at most
    `in_place_linger_ms` past its last one (`varadhi.core.retry.retries_in_place`,
    `varadhi.core.retry.linger_ms`; a window of 0 turns retries in place off)."""

    max_attempts: int = 5
    backoff: Backoff = "exponential"
    min_backoff_ms: int = 1_000
    max_backoff_ms: int = 60_000
    multiplier: float = 2.0
    jitter: float = 0.2  # +/- this fraction of the computed delay, so retries do not stampede
    responses: tuple[ResponseRule, ...] = DEFAULT_RESPONSES
    # Covers the first retry under the default backoff (1 s +/- 20%), which most transient
    # failures need, and no more (a later one goes through the RQ).
    in_place_window_ms: int = 2_000
    # The most a delivery task waits, once its other deliveries are done, for retries in place
    # and RQ records read back early (capped at the window). 0: no task idles; a retry not yet
    # due then goes through the RQ, due when it was, and an early RQ record is parked (measured
    # to cost grouped subscriptions far more than the idle time it saves: docs/benchmarks.md).
    in_place_linger_ms: int = 2_000


@dataclass(frozen=True)
class ConsumptionPolicy:
    """`concurrency`: delivery tasks per shard (the Kafka partitions a shard reads are coalesced
    into this many Spark tasks, or spread over them by group when there are fewer);
    `max_in_flight`: concurrent HTTP requests per task; `max_messages_per_batch` bounds a
    micro-batch (the Kafka source's maxOffsetsPerTrigger). A failing endpoint is the circuit
    breaker's (`CircuitPolicy`). `journal_interval_ms`: how often each delivery task records
    the messages its endpoint accepted (`varadhi.spark.journal`), so that a micro-batch run again
    after a crash re-sends only what was accepted in that last interval; 0 turns it off.
    `journal_max_lag_ms`: a task sends no new request while a message its endpoint accepted
    has waited longer than this for the broker's acknowledgement of its journal record (Kafka
    away or slow), so a crash then re-delivers at most about this much of its deliveries; a
    shorter hold-back bounds those re-deliveries and stalls delivery sooner when the broker is
    slow to acknowledge (at least twice `journal_interval_ms`; unset, four intervals when
    that is more than the default)."""

    concurrency: int = 2
    max_in_flight: int = 64
    max_messages_per_batch: int = 100_000
    trigger_interval_ms: int = 500
    journal_interval_ms: int = 250
    journal_max_lag_ms: int = 1_000


@dataclass(frozen=True)
class DeliveryPolicy:
    """How messages are put into requests (`varadhi.core.batching`). `single`: one message per
    request, its value the body. `batch`: up to `max_messages` messages (at most one per group)
    and about `max_bytes` of body per request, as NDJSON or a JSON array (`format`); the
    endpoint answers for all of them, or per message with a 207 multi-status body."""

    mode: DeliveryMode = "single"
    max_messages: int = 100
    max_bytes: int = 1_048_576
    format: BatchFormat = "ndjson"


ResumeMode = Literal["probe", "operator"]


@dataclass(frozen=True)
class CircuitPolicy:
    """When a shard stops sending to its endpoint, and how it tries again (`varadhi.core.circuit`).

    Closed: the shard delivers normally; it opens when the batches that ended within the last
    `window_ms` made at least `min_requests` attempts and at least `failure_rate` of them failed.
    Open: nothing is read or sent for `open_for_ms`, doubled for every consecutive open (a failed
    probe) up to `max_open_for_ms`. Half-open: micro-batches read at most `probes` records and
    make no retries in place; the first one that makes attempts closes the circuit if fewer than
    `failure_rate` of them failed and opens it again otherwise.

    Endpoint health: when every attempt a shard made has failed for `suspend_after_ms` (None:
    never), the subscription is suspended: every shard stops reading and sending (nothing is
    lost; messages wait) until an operator resumes it (`resume: operator`) or, with `resume:
    probe`, the shard that suspended it finds the endpoint healthy again with its circuit's
    half-open probes (`varadhi.core.circuit`)."""

    enabled: bool = True
    failure_rate: float = 0.5
    min_requests: int = 20
    window_ms: int = 10_000
    open_for_ms: int = 5_000
    max_open_for_ms: int = 60_000
    probes: int = 10
    suspend_after_ms: int | None = None
    resume: ResumeMode = "probe"


@dataclass(frozen=True)
class BlockedPolicy:
    """How much of a group blocked behind a dead letter (block mode) the shard keeps.

    Behind its dead-lettered head, such a group keeps at most `max_held` messages, whose bodies
    total at most `max_held_bytes`, in the shard's GroupState (`held`, the first ones by produce
    order). The first message over either limit is dead-lettered with reason
    `group_state.OVER_LIMIT` and stays in the state without its body as the group's *overflow
    mark*; every later message of the group is dead-lettered with the same reason and not kept
    at all while the mark is there. So the state of a blocked group is at most `max_held`
    bodies and two rows without one, however long it stays blocked. `dlq unsideline --group-ids`
    brings them all back in produce order (`varadhi.core.group_state.over_limit`)."""

    max_held: int = 1_000
    max_held_bytes: int = 16 * 1_048_576


@dataclass(frozen=True)
class TracePolicy:
    """The delivery trace (`varadhi.core.trace`): every attempt of every message, and where it
    went next, kept in the subscription's trace topic for `retention_ms`."""

    retention_ms: int = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class SubscriptionSpec:
    """Everything a user declares about a subscription (YAML `conf/subscriptions/*.yaml`)."""

    name: str
    topic: str
    endpoint: Endpoint
    shards: int = 1
    grouped: bool = True
    rq_partitions: int | None = None  # default: 2 * shards
    dlq_partitions: int | None = None  # default: shards
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    consumption: ConsumptionPolicy = field(default_factory=ConsumptionPolicy)
    circuit_breaker: CircuitPolicy = field(default_factory=CircuitPolicy)
    on_dead_letter: OnDeadLetter = "block"
    blocked: BlockedPolicy = field(default_factory=BlockedPolicy)
    max_message_bytes: int = 1_048_576
    dedup_window_ms: int | None = None
    # Accept a shard count that does not divide the main topic's produce storage topic (some
    # shards then own more partitions than others; seed 000 "Considerations").
    allow_uneven: bool = False
    # Which main-topic messages are delivered, by key and headers (`varadhi.core.filters`); None: all.
    filter: Filter | None = None
    delivery: DeliveryPolicy = field(default_factory=DeliveryPolicy)
    # The delivery trace (`varadhi trace`); None: off.
    trace: TracePolicy | None = None
    # Who delivers it: `spark` shards (`varadhi-job shard`) or `library` members
    # (`varadhi-consumer`); each refuses a subscription of the other (never both at once).
    runtime: Runtime = "spark"

    @property
    def rq_topic(self) -> str:
        return f"{self.name}.rq"

    @property
    def dlq_topic(self) -> str:
        return f"{self.name}.dlq"
