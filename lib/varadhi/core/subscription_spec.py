"""Subscription specs as data: parse and validate a subscription document, and its stored form.

A subscription document (YAML in `conf/subscriptions/`, options of `varadhi subscription create`,
or the `spec` part of a catalog record) is parsed by `parse_spec` into the frozen dataclasses of
`varadhi.core.policies`. Parsing is strict: unknown keys are refused by name, and every invalid value
raises `InvalidArgument` whose `field` is the dotted path of the key (`retry.max_attempts`,
`retry.responses[2].codes`), so the user can find it in their file. Durations are integers in
milliseconds or strings with a unit (`500ms`, `2s`, `1m`, `1h`); stored documents use integers
(`spec_to_dict`, `spec_from_dict`). Documents written before the circuit breaker carry
`consumption.error_rate_threshold` and `consumption.throttle`; they still parse, into a
`circuit_breaker` policy, with a deprecation warning (`_parse_circuit`).

Secrets never reach the catalog: an endpoint names the environment variable that holds its auth
header value (`auth_env`) and where its signing keys, TLS material, OAuth2 client secret and JWT
key are (`signing`, `tls`, `oauth2.client_secret`, `jwt.key`: an environment variable or a file
each); literal `Authorization` headers and credentials in the URL are refused. Which names
and files the platform honours is checked at `apply` and at a deliverer's start
(`varadhi.core.endpoint_guard`), not here: a stored spec parses whatever the reader's settings.
Pure: no Kafka, no Spark (`varadhi.kafka.subscriptions` records specs in the catalog).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from varadhi.core import batching, endpoint_auth, filters, messages, names, request_shaping, signing
from varadhi.core.circuit import validate_circuit_policy
from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import (
    DEFAULT_RESPONSES,
    RUNTIMES,
    BlockedPolicy,
    CircuitPolicy,
    ConsumptionPolicy,
    DeliveryPolicy,
    Endpoint,
    EndpointTls,
    JwtBearer,
    OAuth2Credentials,
    RequestShaping,
    ResponseRule,
    RetryPolicy,
    SecretRef,
    SigningKey,
    SubscriptionSpec,
    TracePolicy,
)
from varadhi.core.retry import validate_retry_policy

log = logging.getLogger(__name__)

_DURATION_RE = re.compile(r" *([0-9]+) *(ms|s|m|h|d) *")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: int | str, field: str) -> int:
    """Milliseconds from an int (already milliseconds) or a string `<digits><ms|s|m|h|d>`.

    Negative values, fractions and strings without a unit are refused (a bare `"500"` is
    ambiguous between the YAML author's seconds and our milliseconds).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgument(f"must not be negative, got {text}", field=field)
        return text
    if isinstance(text, str):
        match = _DURATION_RE.fullmatch(text)
        if match:
            return int(match.group(1)) * _UNIT_MS[match.group(2)]
        if text.strip().isascii() and text.strip().isdigit():
            raise InvalidArgument(
                f"{text!r} has no unit: write {text.strip()}ms or {text.strip()}s", field=field
            )
    raise InvalidArgument(
        f"{text!r} is not a duration: use milliseconds (500) or a whole number with a unit "
        "(500ms, 2s, 1m, 1h, 7d)",
        field=field,
    )


# -- parsing --------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_HEADERS = ("authorization", "proxy-authorization")
_RESERVED_HEADERS = tuple(
    h.lower()
    for h in (
        messages.HTTP_MESSAGE_ID,
        messages.HTTP_IDEMPOTENCY_KEY,
        messages.HTTP_GROUP_ID,
        messages.HTTP_ATTEMPT,
        messages.HTTP_SOURCE,
        messages.HTTP_PRODUCED_AT,
        messages.HTTP_REPLAY,
        messages.HTTP_REDRIVEN,
        *signing.HEADERS,
    )
)
# Framing headers the HTTP engine owns (a static one would break the request's framing).
_FRAMING_HEADERS = ("host", "content-length", "transfer-encoding", "connection", "expect")
MAX_SIGNING_KEYS = 8

_ENDPOINT = Endpoint(url="")
_RETRY = RetryPolicy()
_CONSUMPTION = ConsumptionPolicy()
_CIRCUIT = CircuitPolicy()
_BLOCKED = BlockedPolicy()
_SPEC = SubscriptionSpec(name="", topic="", endpoint=_ENDPOINT)
_DELIVERY = DeliveryPolicy()


def _show(key: object) -> str:
    """A document key as it may appear in a field path and a one-line message."""
    return key if isinstance(key, str) and key.isprintable() else repr(key)


class _Section:
    """One mapping of the document at dotted path `path`, with typed, validating getters.

    Every getter treats a missing key or an explicit null as "use the default".
    """

    def __init__(self, doc: Any, path: str, source: str, allowed: Sequence[str]):
        self.path = path
        self.source = source
        if not isinstance(doc, Mapping):
            raise self.error(None, f"must be a mapping, got {type(doc).__name__}")
        unknown = sorted(_show(k) for k in doc if k not in allowed)
        if unknown:
            # The field is the first unknown key's path; the message names them all.
            raise self.error(
                unknown[0], f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
            )
        self.doc = doc

    def field(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, name: str | None, message: str) -> InvalidArgument:
        """An error about key `name` of this section, or about the section itself (None)."""
        field = self.path or None if name is None else self.field(name)
        return InvalidArgument(f"{message} (in {self.source})", field=field)

    @contextmanager
    def as_field(self, name: str) -> Iterator[None]:
        """Re-raise an InvalidArgument of a shared validator as one about `name`."""
        try:
            yield
        except InvalidArgument as e:
            message = str(e).removeprefix(f"{e.field}: ") if e.field else str(e)
            raise self.error(name, message) from None

    def has(self, name: str) -> bool:
        return self.doc.get(name) is not None

    def section(self, name: str, allowed: Sequence[str]) -> _Section:
        return _Section(self.doc.get(name) or {}, self.field(name), self.source, allowed)

    def string(self, name: str, default: str | None = None) -> str:
        if not self.has(name):
            if default is None:
                raise self.error(name, "is required")
            return default
        value = self.doc[name]
        if not isinstance(value, str) or not value.strip():
            raise self.error(name, f"must be a non-empty string, got {value!r}")
        return value

    def integer(self, name: str, default: int, minimum: int = 1) -> int:
        if not self.has(name):
            return default
        value = self.doc[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(name, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(name, f"must be at least {minimum}, got {value}")
        return value

    def number(self, name: str, default: float) -> float:
        if not self.has(name):
            return default
        value = self.doc[name]
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise self.error(name, f"must be a finite number, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        if not self.has(name):
            return default
        value = self.doc[name]
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, default: str | None, choices: Sequence[str]) -> Any:
        value = self.string(name, default)
        if value not in choices:
            raise self.error(name, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def duration(self, name: str, default: int, minimum: int = 1) -> int:
        if not self.has(name):
            return default
        with self.as_field(name):
            ms = parse_duration_ms(self.doc[name], name)
        if ms < minimum:
            raise self.error(name, f"must be at least {minimum}ms, got {ms}ms")
        return ms


_TOP_KEYS = (
    "name",
    "topic",
    "endpoint",
    "shards",
    "grouped",
    "rq_partitions",
    "dlq_partitions",
    "retry",
    "consumption",
    "circuit_breaker",
    "on_dead_letter",
    "blocked",
    "max_message_bytes",
    "dedup_window",
    "allow_uneven",
    "filter",
    "delivery",
    "trace",
    "runtime",
)
_TRACE_KEYS = ("retention",)
# The shortest and longest trace retention: an hour lets an operator look at a fresh failure;
# 90 days bounds what one `varadhi trace` may have to read.
TRACE_RETENTION_MS = (3_600_000, 90 * 24 * 3_600_000)
_DELIVERY_KEYS = ("mode", "max_messages", "max_bytes", "format")
_ENDPOINT_KEYS = (
    "url",
    "method",
    "headers",
    "auth_header",
    "auth_env",
    "signing",
    "forward_headers",
    "path",
    "key_header",
    "tls",
    "oauth2",
    "jwt",
    "connect_timeout",
    "request_timeout",
    "max_rate",
)
_SIGNING_KEYS = ("scheme", "env", "file")
_REF_KEYS = ("env", "file")
_TLS_KEYS = ("ca", "cert", "key")
_OAUTH2_KEYS = ("token_url", "client_id", "client_secret", "scope", "audience")
_JWT_KEYS = ("algorithm", "key", "key_id", "issuer", "subject", "audience", "lifetime")
JWT_LIFETIME_MS = (10_000, 3_600_000)  # a JWT lives 10 s to 1 h
_RETRY_KEYS = (
    "max_attempts",
    "backoff",
    "min_backoff",
    "max_backoff",
    "multiplier",
    "jitter",
    "responses",
    "in_place_window",
    "in_place_linger",
)
_RULE_KEYS = ("codes", "action", "honour_retry_after")
# Before the circuit breaker (`_parse_circuit`): still read, deprecated.
_LEGACY_CONSUMPTION_KEYS = ("error_rate_threshold", "throttle")
_CONSUMPTION_KEYS = (
    "concurrency",
    "max_in_flight",
    "max_messages_per_batch",
    "trigger_interval",
    "journal_interval",
    "journal_max_lag",
    *_LEGACY_CONSUMPTION_KEYS,
)
_BLOCKED_KEYS = ("max_held", "max_held_bytes")
_CIRCUIT_KEYS = (
    "enabled",
    "failure_rate",
    "min_requests",
    "window",
    "open_for",
    "max_open_for",
    "probes",
    "suspend_after",
    "resume",
)


def parse_spec(doc: Mapping[str, Any], source: str = "<input>") -> SubscriptionSpec:
    """A validated `SubscriptionSpec` from a YAML/dict document, or `InvalidArgument`.

    `source` (a file name, "command line", "catalog") is quoted in error messages. Defaults come
    from `varadhi.core.policies`; `rq_partitions`/`dlq_partitions` default to 2*shards and shards and
    are stored resolved, so the returned spec never holds None for them. Checks that need the
    catalog (the main topic exists and shards divide it) are `check_main_topic`'s.
    """
    top = _Section(doc, "", source, _TOP_KEYS)
    name = top.string("name")
    with top.as_field("name"):
        names.validate_name(name)
    topic = top.string("topic")
    with top.as_field("topic"):
        names.validate_name(topic)
    if not top.has("endpoint"):
        raise top.error("endpoint", "is required (at least endpoint.url)")
    shards = top.integer("shards", _SPEC.shards)
    if shards > names.MAX_PARTITIONS:
        raise top.error("shards", f"must be at most {names.MAX_PARTITIONS}, got {shards}")
    consumption = top.section("consumption", _CONSUMPTION_KEYS)
    endpoint = _parse_endpoint(top.section("endpoint", _ENDPOINT_KEYS))
    delivery = _parse_delivery(top.section("delivery", _DELIVERY_KEYS))
    shaping = endpoint.shaping
    why = request_shaping.check_mode(shaping, delivery.mode)
    if why is not None:
        key = f"endpoint.{request_shaping.fields_set(shaping)[0]}"
        raise InvalidArgument(f"{why} (in {source})", field=key)
    return SubscriptionSpec(
        name=name,
        topic=topic,
        endpoint=endpoint,
        shards=shards,
        grouped=top.boolean("grouped", _SPEC.grouped),
        rq_partitions=_internal_partitions(top, "rq_partitions", shards, 2 * shards),
        dlq_partitions=_internal_partitions(top, "dlq_partitions", shards, shards),
        retry=_parse_retry(top.section("retry", _RETRY_KEYS)),
        consumption=_parse_consumption(consumption),
        circuit_breaker=_parse_circuit(top, consumption),
        on_dead_letter=top.choice("on_dead_letter", _SPEC.on_dead_letter, ("block", "skip")),
        blocked=_parse_blocked(top.section("blocked", _BLOCKED_KEYS)),
        max_message_bytes=top.integer("max_message_bytes", _SPEC.max_message_bytes),
        dedup_window_ms=top.duration("dedup_window", 0) if top.has("dedup_window") else None,
        allow_uneven=top.boolean("allow_uneven", _SPEC.allow_uneven),
        filter=filters.parse(top.doc["filter"], "filter", source) if top.has("filter") else None,
        delivery=delivery,
        trace=_parse_trace(top),
        runtime=top.choice("runtime", _SPEC.runtime, RUNTIMES),
    )


def _parse_trace(top: _Section) -> TracePolicy | None:
    """The `trace` section (`trace: {retention: 7d}`; an empty section takes the default
    retention), or None when the spec has none (or null, or false): tracing is off."""
    if top.doc.get("trace") in (None, False):
        return None
    s = top.section("trace", _TRACE_KEYS)
    low, high = TRACE_RETENTION_MS
    retention = s.duration("retention", TracePolicy.retention_ms, minimum=low)
    if retention > high:
        raise s.error("retention", f"must be at most {high // 86_400_000}d, got {retention}ms")
    return TracePolicy(retention_ms=retention)


def _internal_partitions(top: _Section, name: str, shards: int, default: int) -> int:
    """RQ/DLQ partitions: a multiple of shards, so every shard owns the same number (seed 000)."""
    partitions = top.integer(name, default)
    if partitions % shards:
        raise top.error(
            name,
            f"{partitions} is not a multiple of shards ({shards}); every shard must own the "
            f"same number of partitions, e.g. {shards * max(1, partitions // shards)}",
        )
    with top.as_field(name):
        # A multiple of shards is even for this subscription whatever seed 000's general rule.
        names.validate_partitions(partitions, allow_uneven=True)
    return partitions


def _parse_endpoint(s: _Section) -> Endpoint:
    url = s.string("url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or re.search(r"\s", url):
        raise s.error("url", f"must be an http:// or https:// URL with a host, got {url!r}")
    if parts.username or parts.password:
        raise s.error(
            "url",
            "must not carry credentials (user:password@); put the secret in an environment "
            "variable and name it in endpoint.auth_env",
        )
    method = s.string("method", _ENDPOINT.method).upper()
    if method not in ("POST", "PUT", "PATCH"):
        raise s.error("method", f"must be one of POST, PUT, PATCH, got {method!r}")
    auth_header = s.string("auth_header", _ENDPOINT.auth_header)
    if not _TOKEN_RE.fullmatch(auth_header):
        raise s.error("auth_header", f"{auth_header!r} is not a valid HTTP header name")
    auth_env = s.doc.get("auth_env")
    if auth_env is not None and (not isinstance(auth_env, str) or not _ENV_RE.fullmatch(auth_env)):
        raise s.error("auth_env", f"must be an environment variable name, got {auth_env!r}")
    credentials = [name for name in ("auth_env", "oauth2", "jwt") if s.has(name)]
    if len(credentials) > 1:
        raise s.error(
            credentials[-1],
            f"set at most one of auth_env, oauth2 and jwt (each sets {auth_header}), got "
            f"{' and '.join(credentials)}",
        )
    return Endpoint(
        url=url,
        method=method,
        headers=_parse_headers(s, auth_header),
        auth_header=auth_header,
        auth_env=auth_env,
        signing=_parse_signing(s),
        shaping=_parse_shaping(s, auth_header),
        tls=_parse_tls(s),
        oauth2=_parse_oauth2(s),
        jwt=_parse_jwt(s),
        connect_timeout_ms=s.duration("connect_timeout", _ENDPOINT.connect_timeout_ms),
        request_timeout_ms=s.duration("request_timeout", _ENDPOINT.request_timeout_ms),
        max_rate=_parse_max_rate(s),
    )


def _parse_max_rate(s: _Section) -> float | None:
    """Messages a second for the whole subscription (`varadhi.core.rate_limit`), or None."""
    if s.doc.get("max_rate") is None:
        return None
    rate = s.number("max_rate", 0.0)
    if rate <= 0:
        raise s.error("max_rate", f"must be a positive number of messages a second, got {rate}")
    return rate


def _parse_signing(s: _Section) -> tuple[SigningKey, ...]:
    """Signing keys (`varadhi.core.signing`), each by reference: `env` (a variable name) or
    `file` (an absolute path), never the key itself."""
    if not s.has("signing"):
        return ()
    raw = s.doc["signing"]
    if not isinstance(raw, list) or not raw:
        raise s.error("signing", "must be a non-empty list of {scheme, env | file} keys")
    if len(raw) > MAX_SIGNING_KEYS:
        raise s.error("signing", f"must have at most {MAX_SIGNING_KEYS} keys, got {len(raw)}")
    keys: list[SigningKey] = []
    for i, item in enumerate(raw):
        k = _Section(item, s.field(f"signing[{i}]"), s.source, _SIGNING_KEYS)
        scheme = k.choice("scheme", None, ("v1", "v1a"))
        ref = _secret_ref(k)
        if any(key.secret == ref for key in keys):
            raise k.error("env" if ref.env else "file", f"{ref} is given twice")
        keys.append(SigningKey(scheme, ref))
    return tuple(keys)


def _secret_ref(k: _Section) -> SecretRef:
    """A secret by reference from a section holding `env` (a variable name) or `file` (an
    absolute path)."""
    if k.has("env") == k.has("file"):
        raise k.error(None, "needs exactly one of env (a variable name) and file (a path)")
    if k.has("env"):
        env = k.string("env")
        if not _ENV_RE.fullmatch(env):
            raise k.error("env", f"must be an environment variable name, got {env!r}")
        return SecretRef(env=env)
    path = k.string("file")
    if not path.startswith("/") or any(c in path for c in "\r\n\0"):
        raise k.error("file", f"must be an absolute path, got {path!r}")
    return SecretRef(file=path)


def _ref(s: _Section, name: str) -> SecretRef | None:
    """The secret reference under key `name` ({env: NAME} or {file: PATH}), None if absent."""
    if not s.has(name):
        return None
    return _secret_ref(s.section(name, _REF_KEYS))


def _parse_tls(s: _Section) -> EndpointTls | None:
    """The endpoint's CA bundle and client certificate (`varadhi.core.endpoint_auth`)."""
    if not s.has("tls"):
        return None
    t = s.section("tls", _TLS_KEYS)
    tls = EndpointTls(ca=_ref(t, "ca"), cert=_ref(t, "cert"), key=_ref(t, "key"))
    if (tls.cert is None) != (tls.key is None):
        raise t.error("key" if tls.key is None else "cert", "a client certificate needs its key")
    if tls == EndpointTls():
        raise t.error(None, "needs ca, or cert and key")
    if not urlsplit(s.doc["url"]).scheme == "https":
        raise t.error(None, "applies to https:// endpoints only")
    return tls


def _parse_oauth2(s: _Section) -> OAuth2Credentials | None:
    """OAuth 2 client credentials; the token URL must be https."""
    if not s.has("oauth2"):
        return None
    o = s.section("oauth2", _OAUTH2_KEYS)
    url = o.string("token_url")
    with o.as_field("token_url"):
        endpoint_auth.check_token_url(url, "token_url")
    secret = _ref(o, "client_secret")
    if secret is None:
        raise o.error("client_secret", "is required ({env: NAME} or {file: PATH})")
    return OAuth2Credentials(
        token_url=url,
        client_id=o.string("client_id"),
        client_secret=secret,
        scope=o.string("scope") if o.has("scope") else None,
        audience=o.string("audience") if o.has("audience") else None,
    )


def _parse_jwt(s: _Section) -> JwtBearer | None:
    """A signed JWT bearer of our own."""
    if not s.has("jwt"):
        return None
    j = s.section("jwt", _JWT_KEYS)
    key = _ref(j, "key")
    if key is None:
        raise j.error("key", "is required ({env: NAME} or {file: PATH})")
    low, high = JWT_LIFETIME_MS
    lifetime = j.duration("lifetime", JwtBearer.lifetime_ms, minimum=low)
    if lifetime > high or lifetime % 1000:
        raise j.error(
            "lifetime", f"must be whole seconds, at most {high // 1000}s, got {lifetime}ms"
        )
    return JwtBearer(
        algorithm=j.choice("algorithm", None, ("RS256", "ES256")),
        key=key,
        key_id=j.string("key_id"),
        issuer=j.string("issuer"),
        subject=j.string("subject") if j.has("subject") else None,
        audience=j.string("audience") if j.has("audience") else None,
        lifetime_ms=lifetime,
    )


def _ref_dict(ref: SecretRef | None) -> dict[str, str | None] | None:
    return None if ref is None else {"env": ref.env, "file": ref.file}


def _parse_shaping(s: _Section, auth_header: str) -> RequestShaping:
    """`forward_headers`, `path` and `key_header` (`varadhi.core.request_shaping`). Every HTTP
    header name they set is checked by `_check_shaped_header`, each distinct from the others."""
    static = {str(k).lower() for k in (s.doc.get("headers") or {})}
    taken: set[str] = set()
    forward = _parse_forward_headers(s, auth_header, static, taken)
    key_header = None
    if s.has("key_header"):
        key_header = s.string("key_header")
        _check_shaped_header(s, "key_header", key_header, auth_header, static, taken)
    return RequestShaping(forward, _parse_path(s), key_header)


def _check_shaped_header(
    s: _Section, path: str, http_name: object, auth_header: str, static: set[str], taken: set[str]
) -> None:
    """An HTTP header name shaping sets (at field `path`): a valid name, not one varadhi or the
    HTTP client sets, nor a credential's, a static header's or one in `taken` (lower case; the
    name is added to it)."""
    if not isinstance(http_name, str) or not _TOKEN_RE.fullmatch(http_name):
        raise s.error(path, f"{http_name!r} is not a valid HTTP header name")
    lower = http_name.lower()
    if lower in _SECRET_HEADERS or lower == auth_header.lower():
        raise s.error(path, f"{http_name} carries the endpoint's credential")
    if lower in _RESERVED_HEADERS or lower in _FRAMING_HEADERS:
        raise s.error(path, f"{http_name} is set by varadhi or the HTTP client")
    if lower in static or lower in taken:
        raise s.error(path, f"{http_name} is already given (header names are case-insensitive)")
    taken.add(lower)


def _parse_forward_headers(
    s: _Section, auth_header: str, static: set[str], taken: set[str]
) -> tuple[tuple[str, str], ...]:
    """Kafka header name -> HTTP header name (`varadhi.core.request_shaping`), sorted by Kafka
    name. The HTTP names are checked by `_check_shaped_header`; the shard's control headers
    cannot be forwarded."""
    raw = s.doc.get("forward_headers") or {}
    if not isinstance(raw, Mapping):
        raise s.error("forward_headers", f"must map Kafka header names to HTTP ones, got {raw!r}")
    for kafka_name, http_name in raw.items():
        path = f"forward_headers.{_show(kafka_name)}"
        if not isinstance(kafka_name, str) or not kafka_name or not kafka_name.isprintable():
            raise s.error(path, f"{kafka_name!r} is not a Kafka header name")
        if kafka_name in messages.CONTROL_HEADERS:
            raise s.error(path, "is a header only shards write; it is never a message's")
        _check_shaped_header(s, path, http_name, auth_header, static, taken)
    return tuple(sorted(raw.items()))


def _parse_path(s: _Section) -> str | None:
    """The URL path template (`varadhi.core.request_shaping.placeholders` says what it may hold)."""
    if not s.has("path"):
        return None
    template = s.string("path")
    try:
        for name in request_shaping.placeholders(template):
            if name in messages.CONTROL_HEADERS:
                raise ValueError(f"{{header:{name}}}: a header only shards write")
    except ValueError as e:
        raise s.error("path", str(e)) from None
    return template


def _parse_headers(s: _Section, auth_header: str) -> tuple[tuple[str, str], ...]:
    """Static request headers, sorted by name (a canonical form, so catalog round trips are exact)."""
    raw = s.doc.get("headers") or {}
    if not isinstance(raw, Mapping):
        raise s.error("headers", f"must be a mapping of header name to value, got {raw!r}")
    seen: set[str] = set()
    for name, value in raw.items():
        path = f"headers.{_show(name)}"
        if not isinstance(name, str) or not _TOKEN_RE.fullmatch(name):
            raise s.error(path, f"{name!r} is not a valid HTTP header name")
        lower = name.lower()
        if lower in _SECRET_HEADERS or lower == auth_header.lower():
            raise s.error(
                path,
                "a literal credential header would be stored in the catalog; put the secret in "
                "an environment variable and name it in endpoint.auth_env",
            )
        if lower in _RESERVED_HEADERS:
            raise s.error(path, "is set by varadhi on every delivery and cannot be overridden")
        if lower in _FRAMING_HEADERS:
            raise s.error(path, "is a framing header the HTTP client sets; it cannot be given")
        if lower in seen:
            raise s.error(path, "is given twice (header names are case-insensitive)")
        seen.add(lower)
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise s.error(path, f"must be a one-line string (quote it in YAML), got {value!r}")
    return tuple(sorted(raw.items()))


def _parse_retry(s: _Section) -> RetryPolicy:
    """The retry block. Range and consistency rules are `varadhi.core.retry.validate_retry_policy`'s
    (the module that executes the policy owns what a usable policy is); its `*_ms` field names
    are reported under this document's duration keys (`retry.min_backoff`)."""
    policy = RetryPolicy(
        max_attempts=s.integer("max_attempts", _RETRY.max_attempts),
        backoff=s.choice("backoff", _RETRY.backoff, ("fixed", "exponential")),
        min_backoff_ms=s.duration("min_backoff", _RETRY.min_backoff_ms, minimum=0),
        max_backoff_ms=s.duration("max_backoff", _RETRY.max_backoff_ms, minimum=0),
        multiplier=s.number("multiplier", _RETRY.multiplier),
        jitter=s.number("jitter", _RETRY.jitter),
        responses=_parse_responses(s),
        in_place_window_ms=s.duration("in_place_window", _RETRY.in_place_window_ms, minimum=0),
        in_place_linger_ms=s.duration("in_place_linger", _RETRY.in_place_linger_ms, minimum=0),
    )
    try:
        validate_retry_policy(policy, prefix=s.path)
    except InvalidArgument as e:
        field = (e.field or s.path).removesuffix("_ms")
        message = str(e).removeprefix(f"{e.field}: ")
        raise InvalidArgument(f"{message} (in {s.source})", field=field) from None
    return policy


def _parse_responses(s: _Section) -> tuple[ResponseRule, ...]:
    """A given table replaces the default one entirely (first matching rule wins, so a partial
    table merged into the defaults would be ambiguous)."""
    if not s.has("responses"):
        return DEFAULT_RESPONSES
    raw = s.doc["responses"]
    if not isinstance(raw, list) or not raw:
        raise s.error("responses", "must be a non-empty list of {codes, action} rules")
    rules: list[ResponseRule] = []
    for i, item in enumerate(raw):
        r = _Section(item, s.field(f"responses[{i}]"), s.source, _RULE_KEYS)
        codes = r.doc.get("codes")
        # YAML reads `codes: 404` as an int; the table speaks strings ("404", "4xx").
        codes = str(codes) if isinstance(codes, int) and not isinstance(codes, bool) else codes
        if any(rule.codes == codes for rule in rules):
            raise r.error("codes", f"{codes} already has a rule above; only the first would apply")
        action = r.choice("action", None, ("success", "retry", "dead_letter"))
        honour = r.boolean("honour_retry_after", False)
        if honour and action != "retry":
            raise r.error("honour_retry_after", "only applies to rules whose action is retry")
        rules.append(ResponseRule(codes, action, honour))
    return tuple(rules)


def _parse_consumption(s: _Section) -> ConsumptionPolicy:
    # Zero triggers at once after the previous batch (Spark's default).
    trigger = s.duration("trigger_interval", _CONSUMPTION.trigger_interval_ms, minimum=0)
    journal_interval = s.duration("journal_interval", _CONSUMPTION.journal_interval_ms, minimum=0)
    # Unset: the default, or four intervals when the interval is long.
    journal_max_lag = s.duration(
        "journal_max_lag", max(_CONSUMPTION.journal_max_lag_ms, 4 * journal_interval)
    )
    if journal_interval and journal_max_lag < 2 * journal_interval:
        raise s.error(
            "journal_max_lag",
            f"must be at least twice journal_interval ({2 * journal_interval} ms), "
            f"got {journal_max_lag} ms: a record waits up to one interval before it is sent",
        )
    return ConsumptionPolicy(
        concurrency=s.integer("concurrency", _CONSUMPTION.concurrency),
        max_in_flight=s.integer("max_in_flight", _CONSUMPTION.max_in_flight),
        max_messages_per_batch=s.integer(
            "max_messages_per_batch", _CONSUMPTION.max_messages_per_batch
        ),
        trigger_interval_ms=trigger,
        journal_interval_ms=journal_interval,
        journal_max_lag_ms=journal_max_lag,
    )


def _parse_blocked(s: _Section) -> BlockedPolicy:
    """What a group blocked behind a dead letter keeps (`BlockedPolicy`); 0 keeps nothing
    behind the dead letter (every later message of the group is dead-lettered)."""
    return BlockedPolicy(
        max_held=s.integer("max_held", _BLOCKED.max_held, minimum=0),
        max_held_bytes=s.integer("max_held_bytes", _BLOCKED.max_held_bytes, minimum=0),
    )


_deprecation_warned: set[str] = set()


def _parse_circuit(top: _Section, consumption: _Section) -> CircuitPolicy:
    """The `circuit_breaker` section, or the policy a document written before it means.

    Such a document has `consumption.error_rate_threshold` (default 0.5) and
    `consumption.throttle` (default 5s; 0 never paused): they are still validated, and read as
    `failure_rate` and `open_for`, or as a disabled breaker for a throttle of 0, with a warning
    (once per message and process). Next to a `circuit_breaker` section they are ignored."""
    legacy = [k for k in _LEGACY_CONSUMPTION_KEYS if consumption.has(k)]
    threshold = consumption.number("error_rate_threshold", _CIRCUIT.failure_rate)
    if not 0.0 < threshold <= 1.0:
        raise consumption.error("error_rate_threshold", f"must be in (0, 1], got {threshold}")
    throttle = consumption.duration("throttle", _CIRCUIT.open_for_ms, minimum=0)
    if top.has("circuit_breaker") or not legacy:
        policy = _parse_circuit_section(top.section("circuit_breaker", _CIRCUIT_KEYS))
        meaning = "ignored: the circuit_breaker section applies"
    elif throttle == 0:
        policy = replace(_CIRCUIT, enabled=False)
        meaning = "read as circuit_breaker.enabled: false"
    else:
        policy = replace(
            _CIRCUIT,
            failure_rate=threshold,
            open_for_ms=throttle,
            max_open_for_ms=max(_CIRCUIT.max_open_for_ms, throttle),
        )
        meaning = f"read as circuit_breaker failure_rate {threshold}, open_for {throttle}ms"
    if legacy:
        keys = " and ".join(consumption.field(k) for k in legacy)
        message = (
            f"{keys} (in {consumption.source}) are deprecated, {meaning}; configure the "
            "circuit_breaker section instead (conf/subscriptions/example.yaml)"
        )
        if message not in _deprecation_warned:
            _deprecation_warned.add(message)
            log.warning("%s", message)
    return policy


def _parse_circuit_section(s: _Section) -> CircuitPolicy:
    """Range rules are `varadhi.core.circuit.validate_circuit_policy`'s; its `*_ms` field names are
    reported under this document's duration keys (`circuit_breaker.open_for`)."""
    open_for = s.duration("open_for", _CIRCUIT.open_for_ms)
    policy = CircuitPolicy(
        enabled=s.boolean("enabled", _CIRCUIT.enabled),
        failure_rate=s.number("failure_rate", _CIRCUIT.failure_rate),
        min_requests=s.integer("min_requests", _CIRCUIT.min_requests),
        window_ms=s.duration("window", _CIRCUIT.window_ms, minimum=0),
        open_for_ms=open_for,
        # Left out, it grows with a long open_for rather than refusing it.
        max_open_for_ms=s.duration("max_open_for", max(_CIRCUIT.max_open_for_ms, open_for)),
        probes=s.integer("probes", _CIRCUIT.probes),
        suspend_after_ms=None
        if s.doc.get("suspend_after") is None
        else s.duration("suspend_after", 0),
        resume=s.choice("resume", _CIRCUIT.resume, ("probe", "operator")),
    )
    try:
        validate_circuit_policy(policy, prefix=s.path)
    except InvalidArgument as e:
        field = (e.field or s.path).removesuffix("_ms")
        message = str(e).removeprefix(f"{e.field}: ")
        raise InvalidArgument(f"{message} (in {s.source})", field=field) from None
    return policy


def _parse_delivery(s: _Section) -> DeliveryPolicy:
    """One message per request (`single`), or batches (`varadhi.core.batching`)."""
    max_messages = s.integer("max_messages", _DELIVERY.max_messages)
    if max_messages > batching.MAX_BATCH_MESSAGES:
        raise s.error(
            "max_messages", f"must be at most {batching.MAX_BATCH_MESSAGES}, got {max_messages}"
        )
    max_bytes = s.integer("max_bytes", _DELIVERY.max_bytes, minimum=batching.MIN_BATCH_BYTES)
    if max_bytes > batching.MAX_BATCH_BYTES:
        raise s.error("max_bytes", f"must be at most {batching.MAX_BATCH_BYTES}, got {max_bytes}")
    return DeliveryPolicy(
        mode=s.choice("mode", _DELIVERY.mode, ("single", "batch")),
        max_messages=max_messages,
        max_bytes=max_bytes,
        format=s.choice("format", _DELIVERY.format, tuple(batching.CONTENT_TYPES)),
    )


# -- documents ------------------------------------------------------------------------------


def spec_to_dict(spec: SubscriptionSpec) -> dict[str, Any]:
    """The document `parse_spec` reads, with durations in milliseconds (JSON-safe)."""
    e, r, c, b = spec.endpoint, spec.retry, spec.consumption, spec.circuit_breaker
    return {
        "name": spec.name,
        "topic": spec.topic,
        "endpoint": {
            "url": e.url,
            "method": e.method,
            "headers": dict(e.headers),
            "auth_header": e.auth_header,
            "auth_env": e.auth_env,
            "signing": [
                {"scheme": k.scheme, "env": k.secret.env, "file": k.secret.file} for k in e.signing
            ]
            or None,
            "forward_headers": dict(e.shaping.forward_headers),
            "path": e.shaping.path,
            "key_header": e.shaping.key_header,
            "tls": None
            if e.tls is None
            else {
                "ca": _ref_dict(e.tls.ca),
                "cert": _ref_dict(e.tls.cert),
                "key": _ref_dict(e.tls.key),
            },
            "oauth2": None
            if e.oauth2 is None
            else {
                "token_url": e.oauth2.token_url,
                "client_id": e.oauth2.client_id,
                "client_secret": _ref_dict(e.oauth2.client_secret),
                "scope": e.oauth2.scope,
                "audience": e.oauth2.audience,
            },
            "jwt": None
            if e.jwt is None
            else {
                "algorithm": e.jwt.algorithm,
                "key": _ref_dict(e.jwt.key),
                "key_id": e.jwt.key_id,
                "issuer": e.jwt.issuer,
                "subject": e.jwt.subject,
                "audience": e.jwt.audience,
                "lifetime": e.jwt.lifetime_ms,
            },
            "connect_timeout": e.connect_timeout_ms,
            "request_timeout": e.request_timeout_ms,
            "max_rate": e.max_rate,
        },
        "shards": spec.shards,
        "grouped": spec.grouped,
        "rq_partitions": spec.rq_partitions,
        "dlq_partitions": spec.dlq_partitions,
        "retry": {
            "max_attempts": r.max_attempts,
            "backoff": r.backoff,
            "min_backoff": r.min_backoff_ms,
            "max_backoff": r.max_backoff_ms,
            "multiplier": r.multiplier,
            "jitter": r.jitter,
            "responses": [
                {"codes": x.codes, "action": x.action, "honour_retry_after": x.honour_retry_after}
                for x in r.responses
            ],
            "in_place_window": r.in_place_window_ms,
            "in_place_linger": r.in_place_linger_ms,
        },
        "consumption": {
            "concurrency": c.concurrency,
            "max_in_flight": c.max_in_flight,
            "max_messages_per_batch": c.max_messages_per_batch,
            "trigger_interval": c.trigger_interval_ms,
            "journal_interval": c.journal_interval_ms,
            "journal_max_lag": c.journal_max_lag_ms,
        },
        "circuit_breaker": {
            "enabled": b.enabled,
            "failure_rate": b.failure_rate,
            "min_requests": b.min_requests,
            "window": b.window_ms,
            "open_for": b.open_for_ms,
            "max_open_for": b.max_open_for_ms,
            "probes": b.probes,
            "suspend_after": b.suspend_after_ms,
            "resume": b.resume,
        },
        "on_dead_letter": spec.on_dead_letter,
        "blocked": {
            "max_held": spec.blocked.max_held,
            "max_held_bytes": spec.blocked.max_held_bytes,
        },
        "max_message_bytes": spec.max_message_bytes,
        "dedup_window": spec.dedup_window_ms,
        "allow_uneven": spec.allow_uneven,
        "filter": None if spec.filter is None else filters.to_dict(spec.filter),
        "delivery": {
            "mode": spec.delivery.mode,
            "max_messages": spec.delivery.max_messages,
            "max_bytes": spec.delivery.max_bytes,
            "format": spec.delivery.format,
        },
        "trace": None if spec.trace is None else {"retention": spec.trace.retention_ms},
        "runtime": spec.runtime,
    }


def spec_from_dict(d: Mapping[str, Any]) -> SubscriptionSpec:
    """The inverse of `spec_to_dict` (for specs that came from `parse_spec`).

    It re-validates: a catalog record that no longer parses (hand-edited, or written by a newer
    version with new keys) is refused rather than half-understood.
    """
    return parse_spec(d, source="catalog")
