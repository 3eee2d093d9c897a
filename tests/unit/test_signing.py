"""`varadhi.core.signing`'s v1 signatures against the references: Python's `hmac` (RFC 2104) for
keys shorter than, as long as and longer than SHA-256's block, and the Standard Webhooks package's
verifier. (The signed requests an endpoint receives: tests/integration/test_endpoint_security.py.)"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time

import pytest
from standardwebhooks.webhooks import Webhook

from varadhi.core.signing import Signer


def headers_of(lines: list[bytes]) -> dict[str, str]:
    return dict(line.decode().split(": ", 1) for line in lines)


@pytest.mark.parametrize("size", [1, 24, 32, 63, 64, 65, 200])
def test_a_v1_signature_is_rfc_2104_hmac_sha256_for_any_key_length(size):
    key = os.urandom(size)
    signer = Signer([("v1", "whsec_" + base64.b64encode(key).decode(), "endpoint.signing[0]")])
    body = os.urandom(1500)
    for msg_id, timestamp in (("m-1", 1_800_000_000), ("grüße-ü", 1_800_000_001)):
        h = headers_of(signer.header_lines(msg_id, timestamp, body))
        expected = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
        assert h["webhook-signature"] == "v1," + base64.b64encode(expected.digest()).decode()
        assert (h["webhook-id"], h["webhook-timestamp"]) == (msg_id, str(timestamp))


def test_the_reference_verifier_accepts_every_key_of_a_rotation():
    keys = [os.urandom(32), os.urandom(48)]
    secrets = ["whsec_" + base64.b64encode(k).decode() for k in keys]
    signer = Signer([("v1", s, f"endpoint.signing[{i}]") for i, s in enumerate(secrets)])
    body = b'{"order": 42}'
    timestamp = int(time.time())
    h = headers_of(signer.header_lines("order-42", timestamp, body))
    assert len(h["webhook-signature"].split(" ")) == 2
    for secret in secrets:  # an endpoint that knows either key accepts the request
        Webhook(secret).verify(body, h)
