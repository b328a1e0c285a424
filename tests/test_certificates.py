"""server/certificates.py: the fields read from a certificate, and when a reload happens
(on change only, whole pairs only, each bad change counted once). The served result over
real sockets is tests/integration/test_tls_reload.py."""

from __future__ import annotations

import base64
import datetime
import os
import pathlib

import prometheus_client as prom
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from atoll.server import certificates
from atoll.server.certificates import (
    CertificateError,
    CertificateFiles,
    ReloadingCertificate,
    describe,
)
from atoll.server.config import ConfigError

NOW = datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def self_signed(
    key: ec.EllipticCurvePrivateKey, name: str = "syncer", until: datetime.datetime | None = None
) -> x509.Certificate:
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "atoll"),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - datetime.timedelta(minutes=5))
        .not_valid_after(until or NOW + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey, password: bytes | None = None) -> bytes:
    encryption = (
        serialization.BestAvailableEncryption(password)
        if password
        else serialization.NoEncryption()
    )
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
    )


def write_pair(files: CertificateFiles, days: float = 1) -> x509.Certificate:
    """A new key and certificate written over files.cert and files.key (a new inode each)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = self_signed(key, until=NOW + datetime.timedelta(days=days))
    replace(files.cert, pem(cert))
    replace(files.key, key_pem(key))
    return cert


def replace(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.fixture
def files(tmp_path) -> CertificateFiles:
    return CertificateFiles(tmp_path / "tls.crt", tmp_path / "tls.key", None)


def sample(registry: prom.CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


# --- describe ---------------------------------------------------------------------------


def test_describe_reads_serial_subject_and_not_after():
    cert = self_signed(ec.generate_private_key(ec.SECP256R1()))
    c = describe(pem(cert))
    assert c.serial == cert.serial_number
    assert c.subject == "O=atoll,CN=syncer"
    assert c.not_after == cert.not_valid_after_utc.timestamp()


def test_describe_reads_generalized_time_and_the_first_of_a_chain():
    key = ec.generate_private_key(ec.SECP256R1())
    late = datetime.datetime(2061, 3, 4, 5, 6, 7, tzinfo=datetime.UTC)  # GeneralizedTime
    leaf, other = self_signed(key, until=late), self_signed(key, name="ca")
    c = describe(pem(leaf) + pem(other))
    assert (c.serial, c.not_after) == (leaf.serial_number, late.timestamp())


@pytest.mark.parametrize(
    "text, why",
    [
        (b"", "no PEM certificate"),
        (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "not a certificate"),
    ],
)
def test_describe_refuses_what_is_not_a_certificate(text, why):
    with pytest.raises(CertificateError, match=why):
        describe(text)


def test_describe_refuses_a_truncated_certificate():
    der = self_signed(ec.generate_private_key(ec.SECP256R1())).public_bytes(
        serialization.Encoding.DER
    )
    cut = base64.encodebytes(der[: len(der) // 2])
    with pytest.raises(CertificateError, match="truncated"):
        describe(b"-----BEGIN CERTIFICATE-----\n" + cut + b"-----END CERTIFICATE-----\n")


# --- loading at start ---------------------------------------------------------------------


def test_files_that_cannot_be_served_are_a_config_error_naming_them(files):
    write_pair(files)
    other = ec.generate_private_key(ec.SECP256R1())
    files.key.write_bytes(key_pem(other))
    with pytest.raises(ConfigError, match="KEY_VALUES_MISMATCH") as e:
        ReloadingCertificate(files, prom.CollectorRegistry())
    assert str(files.cert) in str(e.value) and str(files.key) in str(e.value)


def test_an_encrypted_key_is_refused_without_a_prompt(files):
    key = ec.generate_private_key(ec.SECP256R1())
    files.cert.write_bytes(pem(self_signed(key)))
    files.key.write_bytes(key_pem(key, password=b"secret"))
    with pytest.raises(ConfigError, match="encrypted"):
        ReloadingCertificate(files, prom.CollectorRegistry())


def test_start_sets_the_expiry_and_counts_no_reload(files):
    cert = write_pair(files)
    registry = prom.CollectorRegistry()
    ReloadingCertificate(files, registry)
    expiry = sample(registry, "atoll_tls_certificate_expiry_timestamp_seconds")
    assert expiry == cert.not_valid_after_utc.timestamp()
    for result in ("ok", "failed"):
        assert sample(registry, "atoll_tls_certificate_reloads_total", result=result) == 0


# --- reloading ----------------------------------------------------------------------------


def test_unchanged_files_are_not_read_again(files, monkeypatch):
    write_pair(files)
    reloading = ReloadingCertificate(files, prom.CollectorRegistry())
    monkeypatch.setattr(certificates, "load", lambda _: pytest.fail("read unchanged files"))
    assert all(reloading.fetch() is None for _ in range(100))


def test_a_changed_pair_is_served_once(files):
    write_pair(files)
    registry = prom.CollectorRegistry()
    reloading = ReloadingCertificate(files, registry)
    renewed = write_pair(files, days=30)
    assert reloading.fetch() is not None
    assert reloading.fetch() is None  # taken: not handed to gRPC again
    assert reloading.served.serial == renewed.serial_number
    expiry = sample(registry, "atoll_tls_certificate_expiry_timestamp_seconds")
    assert expiry == renewed.not_valid_after_utc.timestamp()
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="ok") == 1


def test_a_bad_pair_keeps_the_served_one_and_counts_once(files, caplog):
    first = write_pair(files)
    registry = prom.CollectorRegistry()
    reloading = ReloadingCertificate(files, registry)
    replace(files.key, key_pem(ec.generate_private_key(ec.SECP256R1())))  # not the cert's
    assert [reloading.fetch() for _ in range(5)] == [None] * 5
    assert reloading.served.serial == first.serial_number
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="failed") == 1
    errors = [r for r in caplog.records if "not taken" in r.getMessage()]
    assert len(errors) == 1 and "KEY_VALUES_MISMATCH" in errors[0].getMessage()
    renewed = write_pair(files)  # a good pair after a bad one is taken
    assert reloading.fetch() is not None and reloading.served.serial == renewed.serial_number


def test_files_changing_while_read_are_read_again_not_counted(files, monkeypatch):
    write_pair(files)
    registry = prom.CollectorRegistry()
    reloading = ReloadingCertificate(files, registry)
    write_pair(files)
    real_load, latest = certificates.load, []

    def load_while_renewed(f: CertificateFiles) -> certificates.Loaded:
        loaded = real_load(f)
        latest.append(write_pair(files))  # the next renewal lands mid-read
        return loaded

    monkeypatch.setattr(certificates, "load", load_while_renewed)
    assert reloading.fetch() is None
    monkeypatch.setattr(certificates, "load", real_load)
    assert reloading.fetch() is not None
    assert reloading.served.serial == latest[-1].serial_number
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="ok") == 1
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="failed") == 0


def test_the_client_ca_is_reloaded_and_checked(tmp_path):
    files = CertificateFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    write_pair(files)
    ca = self_signed(ec.generate_private_key(ec.SECP256R1()), name="ca")
    files.client_ca.write_bytes(pem(ca))
    registry = prom.CollectorRegistry()
    reloading = ReloadingCertificate(files, registry)
    replace(files.client_ca, b"not a CA\n")
    assert reloading.fetch() is None
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="failed") == 1
    another = self_signed(ec.generate_private_key(ec.SECP256R1()), name="ca2")
    replace(files.client_ca, pem(ca) + pem(another))
    assert reloading.fetch() is not None
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="ok") == 1


def test_a_missing_file_keeps_the_served_pair(files):
    write_pair(files)
    registry = prom.CollectorRegistry()
    reloading = ReloadingCertificate(files, registry)
    files.key.unlink()
    assert reloading.fetch() is None and reloading.fetch() is None
    assert sample(registry, "atoll_tls_certificate_reloads_total", result="failed") == 1
