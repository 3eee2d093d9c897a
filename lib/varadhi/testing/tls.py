"""A throw-away PKI for tests of endpoint TLS (`endpoint.tls`): a CA, a server certificate for
127.0.0.1 and localhost, and a client certificate, all signed by the CA (P-256 keys, made with
`cryptography` once per process), plus the TLS contexts a test server uses. Never a real
secret.

The tests' conftest puts the CA, the client certificate and its key in the environment
(`export`) before any Spark starts, so that shards and their executors can name them in a spec
(`{env: VARADHI_ENDPOINT_TEST_CA}`, ...), as the signing keys' tests do.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import ssl
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_ENV = "VARADHI_ENDPOINT_TEST_CA"
CLIENT_CERT_ENV = "VARADHI_ENDPOINT_TEST_CLIENT_CERT"
CLIENT_KEY_ENV = "VARADHI_ENDPOINT_TEST_CLIENT_KEY"


@dataclass(frozen=True)
class Pki:
    """PEM texts: the CA's certificate, the server's and the client's certificate and key."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server_context(self, require_client_cert: bool) -> ssl.SSLContext:
        """A server's TLS context with the server certificate; with `require_client_cert`, a
        handshake without a client certificate the CA signed fails."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as d:  # load_cert_chain reads files only
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            with open(cert, "w") as f:
                f.write(self.server_cert)
            with open(key, "w") as f:
                f.write(self.server_key)
            context.load_cert_chain(cert, key)
        if require_client_cert:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.ca)
        return context


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@functools.cache
def test_pki() -> Pki:
    """The process's PKI (made once)."""
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    later = now + datetime.timedelta(days=2)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("varadhi test CA"))
        .issuer_name(_name("varadhi test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(name: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName]):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM).decode(), _pem_key(key)

    server_cert, server_key = leaf(
        "127.0.0.1",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )
    client_cert, client_key = leaf("varadhi test client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return Pki(
        ca=ca.public_bytes(serialization.Encoding.PEM).decode(),
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
    )


test_pki.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def export(environ: MutableMapping[str, str]) -> None:
    """Put the CA, the client certificate and its key under their names in `environ`."""
    pki = test_pki()
    environ[CA_ENV] = pki.ca
    environ[CLIENT_CERT_ENV] = pki.client_cert
    environ[CLIENT_KEY_ENV] = pki.client_key
