"""One Kafka client configuration for every component.

A Kafka-style client properties file (what `kafka-console-producer.sh --command-config` takes),
named by `varadhi --command-config FILE` or `$VARADHI_KAFKA_CONFIG`, plus single keys from the
environment (`VARADHI_KAFKA_SASL_MECHANISM=SCRAM-SHA-512` sets `sasl.mechanism`: the key in
upper case, dots as underscores). `load` parses, resolves and validates it into a frozen
`KafkaConfig` with two views:

- `python_kwargs()`: kafka-python's arguments (`security_protocol`, `ssl_cafile`, `sasl_*`, ...);
- `spark_options()`: the Spark Kafka source/sink's `kafka.`-prefixed options (the Java client
  takes the properties as written, with references resolved);
- `librdkafka_config()`: librdkafka's (confluent-kafka's) properties, for the library runtime's
  fetching (`varadhi.kafka.clients.fetch_consumer`).

Supported: security.protocol PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL; TLS with a PEM CA file
(`ssl.truststore.type=PEM`, `ssl.truststore.location`), a PEM client key and certificate chain for
mutual TLS (`ssl.keystore.type=PEM`, `ssl.keystore.location`, `ssl.key.password`), hostname
verification on unless `ssl.endpoint.identification.algorithm=` (empty); sasl.mechanism PLAIN,
SCRAM-SHA-256, SCRAM-SHA-512 (username and password from `sasl.jaas.config`) and OAUTHBEARER in
three forms (`oauth_flavor`):

- client credentials: `clientId`, `clientSecret`, `scope` in `sasl.jaas.config` and
  `sasl.oauthbearer.token.endpoint.url` (an OAuth 2 identity provider);
- unsecured JWT: `unsecuredLoginStringClaim_sub="<principal>"` in `sasl.jaas.config` (Kafka's
  built-in development login; the broker must use its unsecured validator). The Python clients
  build the same unsigned token (`alg: none`) as the Java login handler;
- Amazon MSK IAM: `sasl.login.callback.handler.class` (and `sasl.client.callback.handler.class`)
  `software.amazon.msk.auth.iam.IAMOAuthBearerLoginCallbackHandler`, the cluster's region in
  `varadhi.aws.region`. The Python clients sign tokens with aws-msk-iam-sasl-signer-python (the
  AWS credentials of the environment: variables, profile, instance role); the Java clients need
  the `MSK_IAM_PACKAGE` jar (`spark_extras()`).

Secrets by reference: a value may contain `${env:NAME}` (an environment variable) or
`${file:/path}` (a file's content, without its trailing newline). The resolved values live only
in the `KafkaConfig` object; its `repr`, `describe()` and `summary()` show the references, never
the values, and `redact(text)` removes them from any text (error messages).

Bad configuration raises `KafkaConfigError` (exit code 2) with one line naming the problem: an
unknown or misspelt property (with the likely intended one), a missing variable or file, a
mechanism without its credentials, TLS settings under a plaintext protocol.

The product's own keys are never passed to a client: `varadhi.aws.region` (MSK IAM) and
`varadhi.topic.*`, how its topics are created (`varadhi.kafka.topic_settings`). The Python
clients' OAUTHBEARER tokens come from `varadhi.kafka.oauth_tokens`.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from varadhi.core.errors import KafkaConfigError
from varadhi.kafka.oauth_tokens import (
    ClientCredentialsTokenProvider,
    MskIamTokenProvider,
    UnsecuredJwtProvider,
    client_credentials_provider,
)
from varadhi.kafka.topic_settings import (
    TOPIC_CONFIGS,
    TOPIC_KEY,
    TOPIC_KINDS,
    TOPIC_PREFIX,
    TopicSettings,
    topic_settings,
)

log = logging.getLogger(__name__)

CONFIG_ENV = "VARADHI_KAFKA_CONFIG"
ENV_PREFIX = "VARADHI_KAFKA_"

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
OAUTH_HANDLER = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
UNSECURED_HANDLER = (
    "org.apache.kafka.common.security.oauthbearer.OAuthBearerUnsecuredLoginCallbackHandler"
)
MSK_IAM_HANDLER = "software.amazon.msk.auth.iam.IAMOAuthBearerLoginCallbackHandler"
#: The Java side of MSK IAM (Maven Central; the shaded `all` classifier bundles the AWS SDK).
MSK_IAM_PACKAGE = "software.amazon.msk:aws-msk-iam-auth:2.3.9"
#: The product's own keys of the file (never passed to a client), besides `varadhi.topic.*`.
PRODUCT_KEYS: dict[str, str] = {
    "varadhi.aws.region": "MSK IAM: the cluster's AWS region (us-east-1, ...) for the token signer",
}

#: Every property this product understands (Java client names), with what it is for.
KNOWN: dict[str, str] = {
    "bootstrap.servers": "host:port[,host:port...] (--bootstrap and $VARADHI_BOOTSTRAP win)",
    "client.dns.lookup": "Java clients and librdkafka: use_all_dns_ips or resolve_canonical_bootstrap_servers_only",
    "security.protocol": "PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
    "ssl.truststore.type": "PEM (the Python clients read PEM only)",
    "ssl.truststore.location": "a PEM file of the CA certificates that sign the brokers' certificates",
    "ssl.truststore.password": "ignored for PEM; accepted for property files shared with Java tools",
    "ssl.keystore.type": "PEM",
    "ssl.keystore.location": "a PEM file with the client's private key and certificate chain",
    "ssl.keystore.password": "ignored for PEM; accepted for property files shared with Java tools",
    "ssl.key.password": "the password of an encrypted private key in ssl.keystore.location",
    "ssl.endpoint.identification.algorithm": "https (default: hostname verification) or empty",
    "sasl.mechanism": "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER",
    "sasl.jaas.config": "the login module and its options (username/password, clientId/...)",
    "sasl.login.callback.handler.class": "the OAUTHBEARER login handler (OAuth, MSK IAM)",
    "sasl.client.callback.handler.class": "Java clients: MSK IAM's login callback handler",
    "sasl.oauthbearer.token.endpoint.url": "OAUTHBEARER: the OAuth token endpoint",
    "sasl.oauthbearer.scope.claim.name": "Java clients: OAUTHBEARER scope claim name",
    "sasl.oauthbearer.sub.claim.name": "Java clients: OAUTHBEARER subject claim name",
}

#: What `KafkaConfig.librdkafka_config` does with each property it accepts: mapped to librdkafka's
#: own, or used for the mapping, or of no use to librdkafka (the Java clients' PEM store types and
#: store passwords, their OAUTHBEARER claim names). A property of `KNOWN` missing here is refused
#: there, never dropped.
RDKAFKA_HANDLED: dict[str, str] = {
    "bootstrap.servers": "bootstrap.servers (varadhi.kafka.clients.fetch_consumer's)",
    "client.dns.lookup": "client.dns.lookup",
    "security.protocol": "security.protocol",
    "ssl.truststore.type": "PEM only (validated); librdkafka reads PEM",
    "ssl.truststore.location": "ssl.ca.location",
    "ssl.truststore.password": "ignored for PEM",
    "ssl.keystore.type": "PEM only (validated); librdkafka reads PEM",
    "ssl.keystore.location": "ssl.certificate.location and ssl.key.location",
    "ssl.keystore.password": "ignored for PEM",
    "ssl.key.password": "ssl.key.password",
    "ssl.endpoint.identification.algorithm": "ssl.endpoint.identification.algorithm https/none",
    "sasl.mechanism": "sasl.mechanism",
    "sasl.jaas.config": "sasl.username and sasl.password, or the OAUTHBEARER token provider's",
    "sasl.login.callback.handler.class": "which OAUTHBEARER token provider (oauth_flavor)",
    "sasl.client.callback.handler.class": "which OAUTHBEARER token provider (oauth_flavor)",
    "sasl.oauthbearer.token.endpoint.url": "the client-credentials token provider's",
    "sasl.oauthbearer.scope.claim.name": "Java clients only",
    "sasl.oauthbearer.sub.claim.name": "Java clients only",
}


def _topic_property(key: str, value: str, where: str) -> None:
    """Refuse a bad `varadhi.topic.*` property."""
    m = TOPIC_KEY.fullmatch(key)
    if not m:
        forms = [
            f"{TOPIC_PREFIX}{k}replication.factor" for k in ("", *[f"{k}." for k in TOPIC_KINDS])
        ] + list(PRODUCT_KEYS)
        close = difflib.get_close_matches(key, forms, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise KafkaConfigError(
            f"{where}unknown property {key!r}{hint}: use {TOPIC_PREFIX}[<kind>.]replication.factor "
            f"or {TOPIC_PREFIX}[<kind>.]config.<topic config>, kind one of {', '.join(TOPIC_KINDS)}"
        )
    kind, what, config = m.groups()
    if config is None:
        if not re.fullmatch(r"-1|[1-9]\d{0,4}", value.strip()):
            raise KafkaConfigError(
                f"{where}{key} must be a positive integer or -1 (the cluster's "
                f"default.replication.factor), not {value!r}"
            )
        return
    if config not in TOPIC_CONFIGS:
        close = difflib.get_close_matches(config, TOPIC_CONFIGS, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise KafkaConfigError(f"{where}{key}: {config!r} is not a Kafka topic config{hint}")
    if kind == "catalog" and config == "cleanup.policy" and "compact" not in value:
        raise KafkaConfigError(
            f"{where}{key}={value}: the catalog topic must be compacted (cleanup.policy=compact)"
        )


def _check_topics(props: Mapping[str, str], where: str) -> None:
    for kind in TOPIC_KINDS:
        ts = topic_settings(props, kind)
        isr = dict(ts.configs).get("min.insync.replicas")
        if isr is not None and not re.fullmatch(r"[1-9]\d{0,4}", isr):
            raise KafkaConfigError(
                f"{where}min.insync.replicas must be a positive integer, not {isr!r}"
            )
        if isr is not None and ts.replication_factor != -1 and int(isr) > ts.replication_factor:
            raise KafkaConfigError(
                f"{where}{kind} topics: min.insync.replicas {isr} is more than their replication "
                f"factor {ts.replication_factor}: no write could ever succeed"
            )


#: What makes a key (`ssl.key.password`) or a sasl.jaas.config option (`clientSecret`,
#: MSK IAM's `awsRoleSecretAccessKey` and `awsRoleSessionToken`) secret: its name holds one of
#: these words, whatever its case.
SECRET_WORDS = ("secret", "token", "password")


def is_secret(name: str) -> bool:
    """Whether a jaas option named `name` holds a secret (pure)."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def is_secret_key(key: str) -> bool:
    """Whether property `key` holds a secret, by its last part (`ssl.key.password`; not
    `sasl.oauthbearer.token.endpoint.url`) (pure)."""
    return is_secret(key.rsplit(".", 1)[-1])


_REF = re.compile(r"\$\{(env|file):([^}]*)\}")
_HIDDEN = "[hidden]"


# -- Java properties ------------------------------------------------------------------------------
def parse_properties(text: str, source: str = "properties") -> dict[str, str]:
    """Java `.properties` syntax: `key=value`, `key: value` or `key value`; `#`/`!` comments;
    a trailing backslash continues a line; backslash escapes (`\\t`, `\\n`, `\\uXXXX`, ...)."""
    props: dict[str, str] = {}
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.lstrip()
        if not pending and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2 == 1:
            pending += line[:-1]
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    for line in logical:
        key, value = _split(line)
        if not key:
            raise KafkaConfigError(f"{source}: a line has no property name: {line[:40]!r}")
        props[key] = value
    return props


def _split(line: str) -> tuple[str, str]:
    i, n = 0, len(line)
    while i < n and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    key = _unescape(line[:i])
    j = i
    while j < n and line[j] in " \t\f":
        j += 1
    if j < n and line[j] in "=:":
        j += 1
        while j < n and line[j] in " \t\f":
            j += 1
    return key, _unescape(line[j:])


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            nxt = s[i + 1]
            if nxt == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", s[i + 2 : i + 6]):
                out.append(chr(int(s[i + 2 : i + 6], 16)))
                i += 6
                continue
            out.append({"t": "\t", "n": "\n", "r": "\r", "f": "\f"}.get(nxt, nxt))
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


# -- JAAS -----------------------------------------------------------------------------------------
_JAAS = re.compile(
    r"\s*([\w.$]+)\s+(required|requisite|sufficient|optional)\s*(.*?)\s*;?\s*$", re.S
)
_OPTION = re.compile(r'\s*([\w.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s;]+)')


def parse_jaas(value: str) -> tuple[str, dict[str, str]]:
    """`<LoginModule> required key="value" ...;` -> (login module class, options)."""
    m = _JAAS.fullmatch(value)
    if not m:
        raise KafkaConfigError(
            "sasl.jaas.config is not '<LoginModule> required key=\"value\" ...;'"
        )
    options: dict[str, str] = {}
    rest = m.group(3)
    pos = 0
    while pos < len(rest):
        om = _OPTION.match(rest, pos)
        if not om:
            if rest[pos:].strip(" ;\n\t"):
                raise KafkaConfigError(
                    f"sasl.jaas.config: cannot read the options after {rest[:pos].strip()[:20]!r}"
                    if pos
                    else "sasl.jaas.config: cannot read its options"
                )
            break
        v = om.group(2)
        if v.startswith('"'):
            v = re.sub(r"\\(.)", r"\1", v[1:-1])
        options[om.group(1)] = v
        pos = om.end()
    return m.group(1), options


def _jaas_display(value: str) -> str:
    """The jaas config with inline secret options hidden (references are shown as written)."""

    def hide(m: re.Match) -> str:
        name, v = m.group(1), m.group(2)
        if is_secret(name) and not _REF.fullmatch(v.strip('"')):
            return f'{m.group(0)[: m.start(2) - m.start(0)]}"{_HIDDEN}"'
        return m.group(0)

    return _OPTION.sub(hide, value)


# -- the configuration ----------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class KafkaConfig:
    """Resolved client properties. `written` holds them as written (references unresolved)."""

    written: tuple[tuple[str, str], ...] = ()
    resolved: tuple[tuple[str, str], ...] = ()
    source: str | None = None

    # -- reading
    def get(self, key: str, default: str | None = None) -> str | None:
        return dict(self.resolved).get(key, default)

    @property
    def protocol(self) -> str:
        return (self.get("security.protocol") or "PLAINTEXT").upper()

    @property
    def mechanism(self) -> str | None:
        return self.get("sasl.mechanism") if self.protocol.startswith("SASL_") else None

    @property
    def bootstrap(self) -> str | None:
        return self.get("bootstrap.servers")

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def _jaas_options(self) -> dict[str, str]:
        jaas = self.get("sasl.jaas.config")
        return parse_jaas(jaas)[1] if jaas else {}

    @property
    def username(self) -> str | None:
        options = self._jaas_options()
        return (
            options.get("username")
            or options.get("clientId")
            or options.get("unsecuredLoginStringClaim_sub")
        )

    @property
    def oauth_flavor(self) -> str | None:
        """For OAUTHBEARER: 'msk-iam', 'unsecured' or 'client-credentials' (`oauth_flavor`)."""
        return oauth_flavor(dict(self.resolved)) if self.mechanism == "OAUTHBEARER" else None

    # -- views
    def python_kwargs(self) -> dict[str, Any]:
        """kafka-python's security arguments (nothing for PLAINTEXT)."""
        kw: dict[str, Any] = {}
        if self.protocol == "PLAINTEXT":
            return kw
        kw["security_protocol"] = self.protocol
        if self.uses_tls:
            if self.get("ssl.truststore.location"):
                kw["ssl_cafile"] = self.get("ssl.truststore.location")
            if self.get("ssl.keystore.location"):
                kw["ssl_certfile"] = self.get("ssl.keystore.location")
                kw["ssl_keyfile"] = self.get("ssl.keystore.location")
                if self.get("ssl.key.password"):
                    kw["ssl_password"] = self.get("ssl.key.password")
            algorithm = self.get("ssl.endpoint.identification.algorithm", "https")
            kw["ssl_check_hostname"] = bool(algorithm)
        mechanism = self.mechanism
        if mechanism:
            kw["sasl_mechanism"] = mechanism
            if mechanism == "OAUTHBEARER":
                kw["sasl_oauth_token_provider"] = self._token_provider()
            else:
                options = self._jaas_options()
                kw["sasl_plain_username"] = options["username"]
                kw["sasl_plain_password"] = options["password"]
        return kw

    def _token_provider(
        self,
    ) -> MskIamTokenProvider | UnsecuredJwtProvider | ClientCredentialsTokenProvider:
        """The OAUTHBEARER token provider of this configuration's `oauth_flavor` (a new one
        each call, except client credentials: one per credentials in the process)."""
        options = self._jaas_options()
        flavor = self.oauth_flavor
        if flavor == "msk-iam":
            return MskIamTokenProvider(
                self.get("varadhi.aws.region") or "",
                profile=options.get("awsProfileName"),
                role_arn=options.get("awsRoleArn"),
                session_name=options.get("awsRoleSessionName"),
            )
        if flavor == "unsecured":
            return UnsecuredJwtProvider.from_jaas(options)
        return client_credentials_provider(
            self.get("sasl.oauthbearer.token.endpoint.url") or "",
            options.get("clientId", ""),
            options.get("clientSecret", ""),
            options.get("scope"),
        )

    def librdkafka_config(self) -> dict[str, Any]:
        """librdkafka's (confluent-kafka's) properties for this configuration, without
        bootstrap.servers (`varadhi.kafka.clients.fetch_consumer` adds it); nothing for
        PLAINTEXT. How each property maps is `RDKAFKA_HANDLED`:

        - TLS: `ssl.ca.location` (without it, librdkafka's default CAs), the PEM keystore as
          both `ssl.certificate.location` and `ssl.key.location`, `ssl.key.password`, and
          `ssl.endpoint.identification.algorithm` https (the default) or none (empty);
        - PLAIN and SCRAM: `sasl.mechanism`, `sasl.username`, `sasl.password`;
        - OAUTHBEARER: `oauth_cb`, a function on the same token provider `python_kwargs` makes
          (`varadhi.kafka.oauth_tokens`), answering (token, expiry in epoch seconds).
          Hazard: confluent-kafka turns an exception raised in `oauth_cb` during the
          consumer's construction into an unrelated error (a SystemError, or a 10 s wait), so
          `fetch_consumer` asks it for the first token before.

        Raises KafkaConfigError for a property or mechanism it has no mapping for (a setting is
        never dropped), and as `python_kwargs` does for a token provider that cannot be made."""
        unmapped = sorted(
            k for k, _ in self.resolved if k not in RDKAFKA_HANDLED and not k.startswith("varadhi.")
        )
        if unmapped:
            raise KafkaConfigError(
                f"{unmapped[0]} has no librdkafka equivalent: the library runtime cannot fetch "
                f"with this Kafka client configuration"
            )
        conf: dict[str, Any] = {}
        if self.get("client.dns.lookup"):
            conf["client.dns.lookup"] = self.get("client.dns.lookup")
        if self.protocol == "PLAINTEXT":
            return conf
        conf["security.protocol"] = self.protocol
        if self.uses_tls:
            if self.get("ssl.truststore.location"):
                conf["ssl.ca.location"] = self.get("ssl.truststore.location")
            if self.get("ssl.keystore.location"):
                conf["ssl.certificate.location"] = self.get("ssl.keystore.location")
                conf["ssl.key.location"] = self.get("ssl.keystore.location")
                if self.get("ssl.key.password"):
                    conf["ssl.key.password"] = self.get("ssl.key.password")
            algorithm = self.get("ssl.endpoint.identification.algorithm", "https")
            conf["ssl.endpoint.identification.algorithm"] = "https" if algorithm else "none"
        mechanism = self.mechanism
        if mechanism == "OAUTHBEARER":
            conf["sasl.mechanism"] = mechanism
            conf["oauth_cb"] = _oauth_cb(self._token_provider())
        elif mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            options = self._jaas_options()
            conf["sasl.mechanism"] = mechanism
            conf["sasl.username"] = options["username"]
            conf["sasl.password"] = options["password"]
        elif mechanism:
            raise KafkaConfigError(
                f"sasl.mechanism {mechanism} has no librdkafka mapping: the library runtime "
                f"cannot fetch with this Kafka client configuration"
            )
        return conf

    def spark_options(self) -> dict[str, str]:
        """The Spark Kafka source/sink's options (`kafka.` + the Java client property), without
        bootstrap.servers (the caller sets `kafka.bootstrap.servers`)."""
        props = {
            k: v
            for k, v in self.resolved
            if k != "bootstrap.servers" and not k.startswith("varadhi.")  # the product's keys
        }
        if props.get("ssl.truststore.location") and "ssl.truststore.type" not in props:
            props["ssl.truststore.type"] = "PEM"
        if props.get("ssl.keystore.location") and "ssl.keystore.type" not in props:
            props["ssl.keystore.type"] = "PEM"
        flavor = self.oauth_flavor
        if flavor == "client-credentials":
            props.setdefault("sasl.login.callback.handler.class", OAUTH_HANDLER)
        elif flavor == "msk-iam":
            props.setdefault("sasl.client.callback.handler.class", MSK_IAM_HANDLER)
        return {f"kafka.{k}": v for k, v in props.items()}

    def spark_extras(self) -> tuple[str, ...]:
        """What the Spark Kafka source/sink needs beyond the Kafka connector for this
        configuration, as `varadhi.spark.lines.packages` extras: ("msk-iam",) (the `MSK_IAM_PACKAGE`
        jar) for MSK IAM, else none."""
        return ("msk-iam",) if self.oauth_flavor == "msk-iam" else ()

    def topics(self, kind: str) -> TopicSettings:
        """How to create the product's topics of `kind` (one of `TOPIC_KINDS`)."""
        return topic_settings(dict(self.resolved), kind)

    def describe(self) -> dict[str, str]:
        """The properties as written, inline secrets hidden (safe to print and log)."""
        shown = {}
        for key, value in self.written:
            if is_secret_key(key) and not _REF.fullmatch(value):
                shown[key] = _HIDDEN
            elif key == "sasl.jaas.config":
                shown[key] = _jaas_display(value)
            else:
                shown[key] = value
        return shown

    def summary(self) -> str:
        """A short description for messages: 'SASL_SSL, SCRAM-SHA-512 as alice'."""
        parts = [self.protocol]
        if self.oauth_flavor == "msk-iam":
            parts.append(f"OAUTHBEARER (MSK IAM, {self.get('varadhi.aws.region')})")
        elif self.mechanism:
            user = self.username
            parts.append(f"{self.mechanism} as {user}" if user else self.mechanism)
        elif self.get("ssl.keystore.location"):
            parts.append("client certificate")
        return ", ".join(parts)

    def env_references(self) -> frozenset[str]:
        """The environment variables the properties as written name (`${env:NAME}`): an
        endpoint may never name them (`varadhi.core.endpoint_guard`)."""
        return frozenset(
            m.group(2).strip() for _, v in self.written for m in _REF.finditer(v) if m[1] == "env"
        )

    def secrets(self) -> list[str]:
        found = [v for k, v in self.resolved if is_secret_key(k) and v]
        for name, v in self._jaas_options().items() if self.get("sasl.jaas.config") else ():
            if is_secret(name) and v:
                found.append(v)
        return sorted(set(found), key=len, reverse=True)

    def redact(self, text: str) -> str:
        """`text` with every secret value of this configuration replaced by [hidden]."""
        for secret in self.secrets():
            if len(secret) >= 3:
                text = text.replace(secret, _HIDDEN)
        return text

    def __repr__(self) -> str:
        return f"KafkaConfig({self.source or 'defaults'}: {self.describe()})"


PLAINTEXT = KafkaConfig()


def _oauth_cb(
    provider: MskIamTokenProvider | UnsecuredJwtProvider | ClientCredentialsTokenProvider,
) -> Callable[[str | None], tuple[str, float]]:
    """confluent-kafka's `oauth_cb` on `provider`: (token, expiry in epoch seconds), called by
    librdkafka when it needs a token (at 80% of the last one's life). Its argument, librdkafka's
    `sasl.oauthbearer.config`, is not used. A provider's error is logged (librdkafka reports
    only "OAuth callback raised exception") and raised."""

    def oauth_cb(_sasl_oauthbearer_config: str | None) -> tuple[str, float]:
        try:
            return provider.token_and_expiry()
        except Exception as e:
            log.warning("no OAUTHBEARER token for librdkafka: %s: %s", type(e).__name__, e)
            raise

    return oauth_cb


def env_name(key: str) -> str:
    """The environment variable that overrides one property: security.protocol ->
    VARADHI_KAFKA_SECURITY_PROTOCOL."""
    return ENV_PREFIX + key.upper().replace(".", "_")


def load(path: str | None = None, environ: Mapping[str, str] | None = None) -> KafkaConfig:
    """The configuration from `path` (else `$VARADHI_KAFKA_CONFIG`, else none) and the
    single-key environment overrides; validated, references resolved."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(CONFIG_ENV) or None
    props: dict[str, str] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise KafkaConfigError(
                f"cannot read the Kafka client configuration {path}: {e.strerror or e}"
            ) from None
        props = parse_properties(text, source=path)
    for key in KNOWN:
        value = environ.get(env_name(key))
        if value is not None:
            props[key] = value
    return from_properties(props, source=path, environ=environ)


def from_properties(
    props: Mapping[str, str],
    source: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> KafkaConfig:
    environ = os.environ if environ is None else environ
    where = f"{source}: " if source else ""
    for key in props:
        if key in PRODUCT_KEYS:
            continue
        if key.startswith("varadhi."):
            _topic_property(key, props[key], where)
        elif key not in KNOWN:
            close = difflib.get_close_matches(key, KNOWN, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise KafkaConfigError(f"{where}unknown Kafka client property {key!r}{hint}")
    resolved = {k: _resolve(k, v, environ, where) for k, v in props.items()}
    _validate(resolved, where)
    _check_topics(resolved, where)
    return KafkaConfig(
        written=tuple(sorted(props.items())),
        resolved=tuple(sorted(resolved.items())),
        source=source,
    )


def _resolve(key: str, value: str, environ: Mapping[str, str], where: str) -> str:
    def one(m: re.Match) -> str:
        kind, name = m.group(1), m.group(2).strip()
        if kind == "env":
            if name not in environ:
                raise KafkaConfigError(
                    f"{where}{key} names the environment variable {name}, which is not set"
                )
            return environ[name]
        try:
            with open(name, encoding="utf-8") as f:
                return f.read().rstrip("\r\n")
        except OSError as e:
            raise KafkaConfigError(
                f"{where}{key} names the file {name}, which cannot be read "
                f"({e.strerror or type(e).__name__})"
            ) from None

    return _REF.sub(one, value)


def _readable(key: str, path: str, where: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        raise KafkaConfigError(
            f"{where}{key}: cannot read {path} ({e.strerror or type(e).__name__})"
        ) from None
    return head.decode("latin-1")


def _validate(props: dict[str, str], where: str) -> None:
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise KafkaConfigError(
            f"{where}security.protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}"
        )
    tls = protocol in ("SSL", "SASL_SSL")
    ssl_keys = sorted(k for k in props if k.startswith("ssl."))
    if ssl_keys and not tls:
        raise KafkaConfigError(
            f"{where}{ssl_keys[0]} is set but security.protocol is {protocol} (no TLS): "
            f"use SSL or SASL_SSL"
        )
    for kind in ("truststore", "keystore"):
        location = props.get(f"ssl.{kind}.location")
        type_ = props.get(f"ssl.{kind}.type", "").upper()
        if type_ and type_ != "PEM":
            raise KafkaConfigError(
                f"{where}ssl.{kind}.type {type_} cannot be read by the Python clients: use PEM "
                f"files (openssl pkcs12 -in store.p12 -nodes, or keytool -exportcert -rfc)"
            )
        if location:
            head = _readable(f"ssl.{kind}.location", location, where)
            if "-----BEGIN" not in head:
                raise KafkaConfigError(
                    f"{where}ssl.{kind}.location {location} is not a PEM file (JKS and PKCS12 "
                    f"stores cannot be read by the Python clients; convert them to PEM)"
                )
            parts = (("PRIVATE KEY-----", "private key"), ("CERTIFICATE-----", "certificate"))
            for part, what in parts:
                if kind == "keystore" and part not in head:
                    raise KafkaConfigError(
                        f"{where}ssl.keystore.location {location} holds no {what} (it needs the "
                        f"client's private key and certificate chain, for mutual TLS)"
                    )
            legacy = re.search(r"-----BEGIN (RSA|EC|DSA) PRIVATE KEY-----", head)
            if kind == "keystore" and legacy:
                raise KafkaConfigError(
                    f"{where}ssl.keystore.location {location} holds a {legacy.group(1)} private "
                    f"key in the old format, which the Java clients (Spark) cannot read: convert "
                    f"it to PKCS#8 (openssl pkcs8 -topk8 -nocrypt -in key.pem -out key8.pem)"
                )
        elif props.get(f"ssl.{kind}.type"):
            raise KafkaConfigError(f"{where}ssl.{kind}.type is set without ssl.{kind}.location")
    algorithm = props.get("ssl.endpoint.identification.algorithm")
    if algorithm not in (None, "", "https", "HTTPS"):
        raise KafkaConfigError(
            f"{where}ssl.endpoint.identification.algorithm must be https or empty, not "
            f"{algorithm!r}"
        )

    sasl = protocol.startswith("SASL_")
    mechanism = props.get("sasl.mechanism")
    sasl_keys = sorted(k for k in props if k.startswith("sasl."))
    if sasl_keys and not sasl:
        raise KafkaConfigError(
            f"{where}{sasl_keys[0]} is set but security.protocol is {protocol}: "
            f"use SASL_SSL (or SASL_PLAINTEXT)"
        )
    if not sasl:
        return
    if not mechanism:
        raise KafkaConfigError(
            f"{where}security.protocol {protocol} needs sasl.mechanism "
            f"({', '.join(MECHANISMS)}; Kafka's default GSSAPI/Kerberos is not supported)"
        )
    if mechanism not in MECHANISMS:
        raise KafkaConfigError(
            f"{where}sasl.mechanism {mechanism!r} is not supported: use one of "
            f"{', '.join(MECHANISMS)}"
        )
    jaas = props.get("sasl.jaas.config")
    if not jaas:
        raise KafkaConfigError(f"{where}sasl.mechanism {mechanism} needs sasl.jaas.config")
    module, options = parse_jaas(jaas)
    expected = {
        "PLAIN": "PlainLoginModule",
        "SCRAM-SHA-256": "ScramLoginModule",
        "SCRAM-SHA-512": "ScramLoginModule",
        "OAUTHBEARER": "OAuthBearerLoginModule",
    }[mechanism]
    if module.rsplit(".", 1)[-1] != expected:
        raise KafkaConfigError(
            f"{where}sasl.mechanism {mechanism} needs {expected} in sasl.jaas.config, not "
            f"{module.rsplit('.', 1)[-1]}"
        )
    if mechanism == "OAUTHBEARER":
        _validate_oauth(props, options, protocol, where)
        return
    for option in ("username", "password"):
        if not options.get(option):
            raise KafkaConfigError(
                f'{where}sasl.mechanism {mechanism} needs {option}="..." in sasl.jaas.config'
            )


def oauth_flavor(props: Mapping[str, str]) -> str:
    """Which OAUTHBEARER login `props` configure: 'msk-iam' (the MSK IAM login handler),
    'unsecured' (`unsecuredLogin*` options and no other handler) or 'client-credentials'."""
    handlers = {
        (props.get(k) or "").strip()
        for k in ("sasl.login.callback.handler.class", "sasl.client.callback.handler.class")
    }
    if MSK_IAM_HANDLER in handlers:
        return "msk-iam"
    jaas = props.get("sasl.jaas.config")
    options = parse_jaas(jaas)[1] if jaas else {}
    login = (props.get("sasl.login.callback.handler.class") or "").strip()
    if login in ("", UNSECURED_HANDLER) and any(o.startswith("unsecuredLogin") for o in options):
        return "unsecured"
    return "client-credentials"


def _validate_oauth(
    props: Mapping[str, str], options: Mapping[str, str], protocol: str, where: str
) -> None:
    flavor = oauth_flavor(props)
    if flavor == "msk-iam":
        if protocol != "SASL_SSL":
            raise KafkaConfigError(f"{where}MSK IAM needs security.protocol SASL_SSL")
        region = (props.get("varadhi.aws.region") or "").strip()
        if not region:
            raise KafkaConfigError(
                f"{where}MSK IAM ({MSK_IAM_HANDLER.rsplit('.', 1)[-1]}) needs "
                f"varadhi.aws.region=<the cluster's AWS region, e.g. us-east-1>"
            )
        if not re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d", region):
            raise KafkaConfigError(
                f"{where}varadhi.aws.region {region!r} is not an AWS region (e.g. us-east-1)"
            )
        return
    if flavor == "unsecured":
        if not options.get("unsecuredLoginStringClaim_sub"):
            raise KafkaConfigError(
                f"{where}the unsecured OAUTHBEARER login needs "
                f'unsecuredLoginStringClaim_sub="<principal>" in sasl.jaas.config'
            )
        UnsecuredJwtProvider.from_jaas(options, where)  # refuses a bad lifetime or claim
        return
    for option in ("clientId", "clientSecret"):
        if not options.get(option):
            raise KafkaConfigError(
                f'{where}sasl.mechanism OAUTHBEARER needs {option}="..." in sasl.jaas.config '
                f'(or unsecuredLoginStringClaim_sub="..." for unsecured tokens, or MSK IAM\'s '
                f"login handler)"
            )
    url = props.get("sasl.oauthbearer.token.endpoint.url", "")
    if urllib.parse.urlsplit(url).scheme != "https":
        raise KafkaConfigError(
            f"{where}sasl.mechanism OAUTHBEARER needs sasl.oauthbearer.token.endpoint.url "
            f"(an https URL: the client secret is sent to it)"
        )
