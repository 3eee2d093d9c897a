"""What the platform allows an endpoint to use: which secrets a subscription may name, and which
addresses it may reach. The platform's operator decides, not the spec's author.

A subscription spec names its secrets (the auth header's value, signing keys, the TLS material,
the OAuth2 client secret, the JWT key) by reference: an
environment variable (`env`) or a file (`file`). A spec author must not be able to make every
executor send a platform secret (a Kafka password, cloud keys) to a host of their choice, so a
reference is honoured only when the operator allows it, by settings of the shard's environment
(the machine that runs `apply` checks with its own environment too; set both alike):

- `VARADHI_ENDPOINT_SECRET_PREFIX` (default `VARADHI_ENDPOINT_`): environment variables whose
  name starts with it may be named;
- `VARADHI_ENDPOINT_SECRET_NAMES`: a comma-separated allow-list of further names;
- `VARADHI_ENDPOINT_SECRET_DIR`: files under this directory may be named (no file otherwise;
  the TLS CA bundle and client certificate too, though they are not secret: one rule for every
  file the engine reads);
- `VARADHI_ENDPOINT_DENY_PRIVATE` (`true`/`1`): endpoints may not reach private, loopback,
  link-local (cloud metadata services at 169.254.169.254), multicast or reserved addresses.

Whatever the settings, names the Kafka configuration uses are never allowed: `VARADHI_KAFKA_*`
always, and the variables a Kafka configuration file references (`${env:NAME}`), which the
caller that loaded it passes as `kafka_names`.

Addresses. `check_url` refuses an endpoint URL whose host is a literal IP in a denied range (at
`apply` and at a deliverer's start); names are checked where they are resolved, at connect time
(`varadhi.core.delivery` asks `address_refusal` for every address libcurl is about to connect
to: every connection, redirects included, so a name that resolves to a metadata address later,
DNS rebinding, is caught too). Hazard: through an HTTP proxy (`https_proxy`), the address
checked is the proxy's; the proxy must enforce its own rules.

Pure but for `EndpointPolicy.from_env` and `read_secret`, which read the environment and files.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import Endpoint, SecretRef

PREFIX_ENV = "VARADHI_ENDPOINT_SECRET_PREFIX"
NAMES_ENV = "VARADHI_ENDPOINT_SECRET_NAMES"
DIR_ENV = "VARADHI_ENDPOINT_SECRET_DIR"
DENY_PRIVATE_ENV = "VARADHI_ENDPOINT_DENY_PRIVATE"
DEFAULT_PREFIX = "VARADHI_ENDPOINT_"
KAFKA_PREFIX = "VARADHI_KAFKA_"  # the Kafka client configuration's own variables
SETTINGS = (PREFIX_ENV, NAMES_ENV, DIR_ENV, DENY_PRIVATE_ENV)


@dataclass(frozen=True)
class EndpointPolicy:
    """The operator's settings (module docstring). `kafka_names`: variables the Kafka
    configuration references, never allowed."""

    prefix: str = DEFAULT_PREFIX
    names: frozenset[str] = frozenset()
    secret_dir: str | None = None
    deny_private: bool = False
    kafka_names: frozenset[str] = frozenset()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, kafka_names: Iterable[str] = ()
    ) -> EndpointPolicy:
        """The policy the environment sets. Raises InvalidArgument (field: the setting) for a
        prefix that would admit the Kafka configuration's variables, or an unclear flag."""
        env = os.environ if environ is None else environ
        prefix = env.get(PREFIX_ENV, DEFAULT_PREFIX)
        if not prefix or KAFKA_PREFIX.startswith(prefix) or prefix.startswith(KAFKA_PREFIX):
            raise InvalidArgument(
                f"{prefix!r} would admit the Kafka configuration's variables ({KAFKA_PREFIX}*); "
                f"use a prefix of its own, such as {DEFAULT_PREFIX}",
                field=PREFIX_ENV,
            )
        flag = env.get(DENY_PRIVATE_ENV, "").strip().lower()
        if flag not in ("", "0", "1", "true", "false"):
            raise InvalidArgument(f"must be true or false, got {flag!r}", field=DENY_PRIVATE_ENV)
        names = frozenset(n.strip() for n in env.get(NAMES_ENV, "").split(",") if n.strip())
        return cls(
            prefix=prefix,
            names=names,
            secret_dir=env.get(DIR_ENV) or None,
            deny_private=flag in ("1", "true"),
            kafka_names=frozenset(kafka_names),
        )

    def refusal(self, ref: SecretRef) -> str | None:
        """Why `ref` may not be used, or None."""
        if ref.env is not None:
            name = ref.env
            if name.startswith(KAFKA_PREFIX) or name in self.kafka_names:
                return f"{name} is a variable of the Kafka configuration"
            if name.startswith(self.prefix) or name in self.names:
                return None
            return (
                f"{name} is not an endpoint secret the platform allows: its name must start "
                f"with {self.prefix} ({PREFIX_ENV}) or be listed in {NAMES_ENV}"
            )
        path = ref.file or ""
        if self.secret_dir is None:
            return f"secret files are not allowed: the platform sets no {DIR_ENV}"
        base = os.path.realpath(self.secret_dir)
        if not os.path.isabs(path) or os.path.commonpath([base, os.path.realpath(path)]) != base:
            return f"{path} is not under {self.secret_dir} ({DIR_ENV})"
        return None


def check_ref(ref: SecretRef, field: str, policy: EndpointPolicy) -> None:
    """Raise InvalidArgument naming `field` if the policy does not allow `ref`."""
    reason = policy.refusal(ref)
    if reason is not None:
        raise InvalidArgument(reason, field=field)


def read_secret(
    ref: SecretRef, field: str, policy: EndpointPolicy, environ: Mapping[str, str] | None = None
) -> str:
    """The secret's value (a file's without its trailing line break), after `check_ref`.
    Errors name `field` and the reference, never the value."""
    check_ref(ref, field, policy)
    if ref.env is not None:
        value = (os.environ if environ is None else environ).get(ref.env)
        if value is None:
            raise InvalidArgument(f"environment variable {ref.env} is not set", field=field)
        return value
    assert ref.file is not None
    try:
        with open(ref.file, encoding="utf-8") as f:
            return f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise InvalidArgument(f"cannot read {ref.file} ({why})", field=field) from None


def check_endpoint(endpoint: Endpoint, policy: EndpointPolicy) -> None:
    """Every check of this module that needs no secret's value: the URL's (and the OAuth2
    token URL's) literal address, and every secret's reference (the auth header, signing keys,
    the TLS material, the OAuth2 client secret, the JWT key). Raises InvalidArgument naming the
    field."""
    check_url(endpoint.url, "endpoint.url", policy)
    if endpoint.oauth2 is not None:
        check_url(endpoint.oauth2.token_url, "endpoint.oauth2.token_url", policy)
    for field, ref in secret_refs(endpoint):
        check_ref(ref, field, policy)


def secret_refs(endpoint: Endpoint) -> list[tuple[str, SecretRef]]:
    """Every secret `endpoint` names, with the field naming it: the auth header's variable,
    the signing keys, the TLS material, the OAuth2 client secret, the JWT key."""
    refs = []
    if endpoint.auth_env is not None:
        refs.append(("endpoint.auth_env", SecretRef(env=endpoint.auth_env)))
    refs += [(f"endpoint.signing[{i}]", key.secret) for i, key in enumerate(endpoint.signing)]
    tls = endpoint.tls
    if tls is not None:
        for name, ref in (("ca", tls.ca), ("cert", tls.cert), ("key", tls.key)):
            if ref is not None:
                refs.append((f"endpoint.tls.{name}", ref))
    if endpoint.oauth2 is not None:
        refs.append(("endpoint.oauth2.client_secret", endpoint.oauth2.client_secret))
    if endpoint.jwt is not None:
        refs.append(("endpoint.jwt.key", endpoint.jwt.key))
    return refs


def address_refusal(address: str) -> str | None:
    """Why an endpoint may not connect to the IP address `address` under a deny-list of private
    ranges, or None (also None for text that is not an IP address)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local:
        kind = "link-local (cloud metadata services answer there)"
    elif ip.is_loopback:
        kind = "loopback"
    elif ip.is_private:
        kind = "private"
    elif ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        kind = "reserved"
    else:
        return None
    return f"address {ip} is {kind}, and {DENY_PRIVATE_ENV} denies such endpoints"


def check_url(url: str, field: str, policy: EndpointPolicy) -> None:
    """Refuse a URL whose host is a literal IP the policy denies (names: at connect time)."""
    if not policy.deny_private:
        return
    host = urlsplit(url).hostname or ""
    reason = address_refusal(host)
    if reason is not None:
        raise InvalidArgument(reason, field=field)
