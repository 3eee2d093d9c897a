"""Signed requests, per the Standard Webhooks specification (https://www.standardwebhooks.com):
every request carries

    webhook-id: <the message id>
    webhook-timestamp: <seconds since the epoch, when the request was sent>
    webhook-signature: v1,<base64> v1a,<base64> ...

one signature per configured key (`Endpoint.signing`), each over the bytes
`<webhook-id>.<webhook-timestamp>.<body>`: `v1` is HMAC-SHA256 with a shared secret, `v1a` an
ed25519 signature (the endpoint verifies it with the public key). An endpoint accepts a request
when any signature verifies with any key it holds, so keys rotate without downtime: sign with the
old and the new key, move the endpoint to the new one, then drop the old.

`webhook-id` is stable across retries and replays of one message: it is the message id (the
`Idempotency-Key`). A batched request (`delivery.mode: batch`) is signed once over its whole
body; its `webhook-id` is `batch_<hex>`, a digest of its messages' ids in body order
(`batch_id`), so a batch sent again with the same messages has the same id and a batch of other
messages never shares one (a receiver that drops repeated ids drops no other batch).

Key formats: `v1` secrets as Standard Webhooks writes them, `whsec_<base64>` (the prefix may be
left out); `v1a` private keys `whsk_<base64>` of the 32-byte ed25519 seed (or of the 64-byte
seed-and-public-key form). The `cryptography` package signs `v1a`. A key is read once per
deliverer; what a key holds never appears in errors.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Sequence

from varadhi.core.errors import InvalidArgument
from varadhi.core.policies import SigningScheme

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
HEADERS = (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
_PREFIXES = {"v1": "whsec_", "v1a": "whsk_"}
_SHA256_BLOCK = 64  # bytes: HMAC pads the key to SHA-256's block


def batch_id(ids: Sequence[str]) -> str:
    """The `webhook-id` of a batched request of messages `ids` (in body order)."""
    digest = hashlib.sha256("\n".join(ids).encode("utf-8", "surrogatepass")).hexdigest()
    return f"batch_{digest[:32]}"


def _key_bytes(scheme: SigningScheme, text: str, field: str) -> bytes:
    text = text.strip().removeprefix(_PREFIXES[scheme])
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if not raw:
        raise InvalidArgument(
            f"the {scheme} key is not {_PREFIXES[scheme]}<base64> (or is empty)", field=field
        )
    return raw


def _signer(scheme: SigningScheme, text: str, field: str) -> Callable[[bytes, bytes], bytes]:
    """A function of (prefix, body) that signs prefix + body."""
    raw = _key_bytes(scheme, text, field)
    if scheme == "v1":
        return _hmac_sha256(raw)
    if len(raw) not in (32, 64):
        raise InvalidArgument(
            f"the v1a key must hold a 32-byte ed25519 seed (or 64 bytes), got {len(raw)}",
            field=field,
        )
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    sign = Ed25519PrivateKey.from_private_bytes(raw[:32]).sign
    return lambda prefix, body: sign(prefix + body)


def _hmac_sha256(key: bytes) -> Callable[[bytes, bytes], bytes]:
    """HMAC-SHA256 (RFC 2104) with `key`, as a function of (prefix, body) over prefix + body.
    The key's inner and outer padded blocks are hashed once; each signature copies those two
    SHA-256 states (about 0.3 us each) rather than an OpenSSL HMAC context (`hmac.HMAC.copy`,
    1.2 us of a 3.5 us signature of a 1 KiB body), and the body is never copied."""
    if len(key) > _SHA256_BLOCK:
        key = hashlib.sha256(key).digest()
    block = key.ljust(_SHA256_BLOCK, b"\0")
    inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
    outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def hmac_sha256(prefix: bytes, body: bytes) -> bytes:
        h = inner.copy()
        h.update(prefix)
        h.update(body)
        o = outer.copy()
        o.update(h.digest())
        return o.digest()

    return hmac_sha256


class Signer:
    """Signs requests with `keys`: (scheme, key text, field of the spec naming it). Not
    thread-safe (it keeps the current second's header line): one per deliverer."""

    __slots__ = ("_signers", "_ts", "_ts_bytes", "_ts_line")

    def __init__(self, keys: Sequence[tuple[SigningScheme, str, str]]):
        self._signers = [(f"{s},".encode(), _signer(s, text, field)) for s, text, field in keys]
        self._ts = -1
        self._ts_bytes = b""
        self._ts_line = b""

    def header_lines(self, webhook_id: str, timestamp: int, body: bytes) -> list[bytes]:
        """The three header lines of a request with this id, time and body. Per request this
        costs a hash of the body per key and little else (measured: docs/benchmarks.md)."""
        if timestamp != self._ts:  # one request in very many starts a new second
            self._ts = timestamp
            self._ts_bytes = b"%d" % timestamp
            self._ts_line = b"webhook-timestamp: " + self._ts_bytes
        wid = webhook_id.encode()
        prefix = b"%s.%s." % (wid, self._ts_bytes)
        if len(self._signers) == 1:
            scheme, sign = self._signers[0]
            signature = scheme + binascii.b2a_base64(sign(prefix, body), newline=False)
        else:
            signature = b" ".join(
                scheme + binascii.b2a_base64(sign(prefix, body), newline=False)
                for scheme, sign in self._signers
            )
        return [b"webhook-id: " + wid, self._ts_line, b"webhook-signature: " + signature]
