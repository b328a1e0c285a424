"""Certificates made per test run with `cryptography`: a CA, a server certificate for
127.0.0.1 and localhost, client certificates from that CA and from a stranger's."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import pathlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: pathlib.Path  # CA certificate (PEM)
    server_cert: pathlib.Path
    server_key: pathlib.Path
    client_cert: pathlib.Path  # signed by ca
    client_key: pathlib.Path
    stranger_ca: pathlib.Path  # another CA, trusted by nobody here
    stranger_cert: pathlib.Path  # a client certificate signed by stranger_ca
    stranger_key: pathlib.Path
    ca_key: pathlib.Path | None = None  # the CA's own key, for renew_server


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(
    subject: str,
    key,
    issuer: str,
    issuer_key,
    *,
    ca: bool = False,
    server: bool = False,
    client: bool = False,
    days: float = 1,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
    if client:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: pathlib.Path, name: str, cert: x509.Certificate, key=None
) -> tuple[pathlib.Path, pathlib.Path]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


def make_pki(d: pathlib.Path) -> Pki:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate from that
    CA and an impostor's from a stranger CA, written under `d`."""
    ca_key, stranger_key = _key(), _key()
    ca = _cert("atoll test CA", ca_key, "atoll test CA", ca_key, ca=True)
    stranger = _cert("stranger CA", stranger_key, "stranger CA", stranger_key, ca=True)
    server_key, client_key, impostor_key = _key(), _key(), _key()
    ca_path, ca_key_path = _write(d, "ca", ca, ca_key)
    stranger_path, _ = _write(d, "stranger-ca", stranger)
    server_cert, server_key_path = _write(
        d, "server", _cert("syncer", server_key, "atoll test CA", ca_key, server=True), server_key
    )
    client_cert, client_key_path = _write(
        d,
        "client",
        _cert("learner-a", client_key, "atoll test CA", ca_key, client=True),
        client_key,
    )
    impostor_cert, impostor_key_path = _write(
        d,
        "impostor",
        _cert("learner-a", impostor_key, "stranger CA", stranger_key, client=True),
        impostor_key,
    )
    return Pki(
        ca_path,
        server_cert,
        server_key_path,
        client_cert,
        client_key_path,
        stranger_path,
        impostor_cert,
        impostor_key_path,
        ca_key_path,
    )


def renew_server(pki: Pki, d: pathlib.Path, days: float) -> tuple[pathlib.Path, pathlib.Path]:
    """A new server certificate and key from pki's CA, for the same names as
    `pki.server_cert` (a new serial, valid for `days`), written under `d` as
    server.pem and server.key: what a renewal brings."""
    assert pki.ca_key is not None
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), None)
    key = _key()
    return _write(
        d, "server", _cert("syncer", key, "atoll test CA", ca_key, server=True, days=days), key
    )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
