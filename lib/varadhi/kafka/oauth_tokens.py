"""kafka-python's OAUTHBEARER token providers, one per login the Kafka client configuration
supports (`varadhi.kafka.config.oauth_flavor`); `KafkaConfig.python_kwargs()` builds the one its
properties name, and `KafkaConfig.librdkafka_config()` the same one for librdkafka's `oauth_cb`
(which needs each token's expiry too: `token_and_expiry()`). The Java clients (Spark) log in with
their own handlers instead.

- client credentials: the OAuth 2 client-credentials grant against the token endpoint, one provider
  per (endpoint, client, secret, scope) in the process (`client_credentials_provider`);
- unsecured JWT: the unsigned token (`alg: none`) Kafka's Java unsecured login handler makes from
  the same JAAS options, for brokers that run the unsecured validator (development and tests);
- Amazon MSK IAM: a SigV4-signed token from aws-msk-iam-sasl-signer-python (`MSK_IAM_PYPI`, the
  `msk` extra), with the AWS credentials of the environment.

Hazards: a token is itself a credential, and a provider holds the secret it is made from: no
`repr` shows either. The client secret goes only to an https token endpoint, and never on to
another URL (a redirect is refused, `varadhi.core.endpoint_auth.RedirectRefused`; the request
and the token cache are that module's, shared with endpoints' OAuth2). Anyone can forge an unsecured token. A bad unsecured-login option or a missing
MSK IAM signer raises `KafkaConfigError`, like the rest of the configuration.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from kafka.net.sasl.oauth import AbstractTokenProvider

from varadhi.core import endpoint_auth
from varadhi.core.errors import InvalidArgument, KafkaConfigError

#: The Python side of MSK IAM (PyPI; pyproject.toml's `msk` extra).
MSK_IAM_PYPI = "aws-msk-iam-sasl-signer-python==1.0.2"


# -- OAUTHBEARER client credentials -------------------------------------------------------------
_providers: dict[tuple, Any] = {}
_providers_lock = threading.Lock()


def client_credentials_provider(url: str, client_id: str, secret: str, scope: str | None) -> Any:
    key = (url, client_id, secret, scope)
    with _providers_lock:
        if key not in _providers:
            _providers[key] = ClientCredentialsTokenProvider(url, client_id, secret, scope)
        return _providers[key]


class ClientCredentialsTokenProvider(AbstractTokenProvider):
    """kafka-python's token provider for OAUTHBEARER: the OAuth 2 client-credentials grant
    against the token endpoint (`varadhi.core.endpoint_auth.request_token`: https only, no
    redirect followed), the token reused until a little before it expires
    (`endpoint_auth.CachedToken`). A URL that is not https raises KafkaConfigError."""

    def __init__(self, url: str, client_id: str, secret: str, scope: str | None = None):
        try:
            endpoint_auth.check_token_url(url, "sasl.oauthbearer.token.endpoint.url")
        except InvalidArgument as e:
            raise KafkaConfigError(str(e)) from None
        self.url, self.client_id, self.scope = url, client_id, scope
        self._fetched: tuple[str, float] = ("", 0.0)  # the last token, its expiry (epoch s)

        def fetch() -> tuple[str, float]:
            token, lifetime = endpoint_auth.request_token(url, client_id, secret, scope)
            self._fetched = (token, time.time() + lifetime)
            return token, lifetime

        self._cached = endpoint_auth.CachedToken(fetch)

    def token(self) -> str:
        return self._cached.get()

    def token_and_expiry(self) -> tuple[str, float]:
        """The current token and when it expires (epoch seconds, from the endpoint's
        `expires_in`). Hazard: when another thread fetched a newer token meanwhile, that newer
        one is returned (with its own expiry)."""
        self._cached.get()
        return self._fetched

    def extensions(self) -> dict:
        return {}

    def __repr__(self) -> str:
        return f"ClientCredentialsTokenProvider({self.url}, {self.client_id})"


# -- OAUTHBEARER unsecured JWT (development, tests) ---------------------------------------------
class UnsecuredJwtProvider(AbstractTokenProvider):
    """kafka-python's token provider for Kafka's unsecured OAUTHBEARER login: what the Java
    `OAuthBearerUnsecuredLoginCallbackHandler` makes from the same JAAS options, an unsigned JWT
    (`{"alg":"none"}`) with `sub`, `iat`, `exp` (`unsecuredLoginLifetimeSeconds`, default 3600)
    and every `unsecuredLoginStringClaim_<name>`, `unsecuredLoginNumberClaim_<name>` and
    `unsecuredLoginListClaim_<name>` (its first character separates the items). A new token is
    made when less than a tenth of the lifetime is left. Anyone can forge such a token: only for
    brokers that run the unsecured validator (development and tests)."""

    def __init__(self, claims: Mapping[str, Any], lifetime: float = 3600.0):
        self.claims = dict(claims)
        self.lifetime = lifetime
        self._token: str | None = None
        self._expires = 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_jaas(cls, options: Mapping[str, str], where: str = "") -> UnsecuredJwtProvider:
        claims: dict[str, Any] = {}
        lifetime = 3600.0
        for name, value in options.items():
            kind, _, claim = name.partition("_")
            if kind == "unsecuredLoginStringClaim":
                claims[claim] = value
            elif kind == "unsecuredLoginNumberClaim":
                claims[claim] = _number(name, value, where)
            elif kind == "unsecuredLoginListClaim":
                items = value[1:].split(value[:1]) if value else []
                claims[claim] = [item for item in items if item]
            elif name == "unsecuredLoginLifetimeSeconds":
                lifetime = _number(name, value, where)
                if lifetime <= 0:
                    raise KafkaConfigError(f"{where}{name} must be positive, not {value!r}")
        if not claims.get("sub"):
            raise KafkaConfigError(
                f'{where}the unsecured OAUTHBEARER login needs unsecuredLoginStringClaim_sub="..."'
            )
        return cls(claims, lifetime)

    def token(self) -> str:
        return self.token_and_expiry()[0]

    def token_and_expiry(self) -> tuple[str, float]:
        """The current token and its `exp` claim (epoch seconds)."""
        with self._lock:
            now = time.time()
            if self._token is None or now > self._expires - self.lifetime / 10:
                self._expires = round(now + self.lifetime, 3)
                payload = {**self.claims, "iat": round(now, 3), "exp": self._expires}
                self._token = ".".join(
                    [_b64url({"alg": "none"}), _b64url(payload), ""]
                )  # header.payload. (no signature)
            return self._token, self._expires

    def __repr__(self) -> str:
        return f"UnsecuredJwtProvider(sub={self.claims.get('sub')})"


def _number(name: str, value: str, where: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise KafkaConfigError(f"{where}{name} must be a number, not {value!r}") from None


def _b64url(doc: Mapping[str, Any]) -> str:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


# -- OAUTHBEARER Amazon MSK IAM ------------------------------------------------------------------
class MskIamTokenProvider(AbstractTokenProvider):
    """kafka-python's token provider for Amazon MSK IAM: a SigV4-signed token from
    aws-msk-iam-sasl-signer-python for `region`, with the AWS credentials of the environment
    (or `profile`, or `role_arn` assumed through STS), reused until a minute before it expires.
    Signing is local: no request leaves the machine except with `role_arn`. The token carries
    the access key id and a signature, never the secret key; it is itself a credential, so
    `repr` never shows it."""

    def __init__(
        self,
        region: str,
        profile: str | None = None,
        role_arn: str | None = None,
        session_name: str | None = None,
    ):
        try:
            from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
        except ImportError:
            raise KafkaConfigError(
                f"MSK IAM needs the Python package aws-msk-iam-sasl-signer-python "
                f"(pip install {MSK_IAM_PYPI}, or the msk extra: pip install 'varadhi-spark[msk]')"
            ) from None
        self._signer = MSKAuthTokenProvider
        self.region, self.profile, self.role_arn = region, profile, role_arn
        self.session_name = session_name
        self._token: str | None = None
        self._expires_ms = 0
        self._lock = threading.Lock()

    def token(self) -> str:
        return self.token_and_expiry()[0]

    def token_and_expiry(self) -> tuple[str, float]:
        """The current token and when it expires (epoch seconds, the signer's)."""
        with self._lock:
            if self._token is None or time.time() * 1000 > self._expires_ms - 60_000:
                if self.role_arn:
                    args = [self.region, self.role_arn]
                    if self.session_name:
                        args.append(self.session_name)
                    token, expires_ms = self._signer.generate_auth_token_from_role_arn(*args)
                elif self.profile:
                    token, expires_ms = self._signer.generate_auth_token_from_profile(
                        self.region, self.profile
                    )
                else:
                    token, expires_ms = self._signer.generate_auth_token(self.region)
                self._token, self._expires_ms = token, int(expires_ms)
            return self._token, self._expires_ms / 1000

    def __repr__(self) -> str:
        return f"MskIamTokenProvider({self.region})"
