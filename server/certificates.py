"""The shard's TLS certificate, taken anew whenever its files change, without a restart.

gRPC asks `ReloadingCertificate.fetch` on every TLS handshake whether to serve a new
configuration. The answer must be cheap, so the files are only read again when a `stat`
of them (through any symlinks: the kubelet swaps a Secret's files by re-pointing `..data`)
says they changed.

What a reload promises:
1. A new certificate is served only whole: the certificate parses, the key is its own
   and unencrypted, and the client CA (mutual TLS) holds a certificate. Otherwise the
   previous pair goes on serving, the reason is logged once (per change of the files),
   and `atoll_tls_certificate_reloads_total{result="failed"}` counts it.
2. Files that change while they are read (a copy half done) are read again at the next
   handshake, never served half old and half new.
3. Connections already open keep the certificate they were made with; new ones get the
   new certificate from the handshake after the change.
4. `atoll_tls_certificate_expiry_timestamp_seconds` is always the notAfter of the
   certificate served now.
"""

from __future__ import annotations

import base64
import calendar
import dataclasses
import logging
import os
import pathlib
import re
import ssl
import threading
import time

import grpc
import prometheus_client as prom

from atoll.server.config import ConfigError

log = logging.getLogger("atoll.syncer")

_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----\s*([A-Za-z0-9+/=\s]+?)\s*-----END CERTIFICATE-----"
)
_PEM_KEY = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----")
# Name attributes worth a log line, by their DER-encoded object identifier (X.520).
_NAME_PARTS = {b"\x55\x04\x03": "CN", b"\x55\x04\x0a": "O", b"\x55\x04\x0b": "OU"}


class CertificateError(ValueError):
    """A certificate, key or CA that cannot be served, with the reason."""


@dataclasses.dataclass(frozen=True)
class Certificate:
    """What the log and the metrics say of a served certificate."""

    serial: int
    subject: str  # e.g. "CN=syncer"; empty when the certificate names only SANs
    not_after: float  # unix seconds

    def __str__(self) -> str:
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.not_after))
        return f"serial {self.serial:X} ({self.subject or 'no subject'}), valid until {until}"


# --- reading a certificate --------------------------------------------------------------
# The few X.509 fields we log, read from the DER with the standard library: `ssl` checks
# the pair but shows no field of a certificate it did not verify as a peer's, and
# `cryptography` is a test dependency only (a compiled wheel in every image for three fields).


def _element(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start, end) of the value of the DER element that begins at `at`."""
    if at + 2 > len(der):
        raise CertificateError("the certificate's DER is truncated")
    tag, n, at = der[at], der[at + 1], at + 2
    if n & 0x80:  # long form: the next n & 0x7F bytes are the length
        width = n & 0x7F
        n, at = int.from_bytes(der[at : at + width], "big"), at + width
    if at + n > len(der):
        raise CertificateError("the certificate's DER is truncated")
    return tag, at, at + n


def _children(der: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    found = []
    while start < end:
        found.append(element := _element(der, start))
        start = element[2]
    return found


def _time(tag: int, text: bytes) -> float:
    """Unix seconds of an X.509 UTCTime (YYMMDDHHMMSSZ) or GeneralizedTime (YYYYMMDDHHMMSSZ)."""
    s = text.decode("ascii")
    if tag == 0x17:  # UTCTime: years 50-99 are 19xx (RFC 5280 4.1.2.5.1)
        s = ("19" if int(s[:2]) >= 50 else "20") + s
    return calendar.timegm(time.strptime(s, "%Y%m%d%H%M%SZ"))


def _subject(der: bytes, start: int, end: int) -> str:
    parts = []
    for _, set_start, set_end in _children(der, start, end):  # SET OF AttributeTypeAndValue
        for _, a_start, a_end in _children(der, set_start, set_end):
            (_, o_start, o_end), (_, v_start, v_end) = _children(der, a_start, a_end)[:2]
            name = _NAME_PARTS.get(der[o_start:o_end])
            if name:
                parts.append(f"{name}={der[v_start:v_end].decode('utf-8', 'replace')}")
    return ",".join(parts)


def describe(pem: bytes) -> Certificate:
    """The serial, subject and notAfter of the first certificate in `pem` (the served one).

    Example: `describe(pathlib.Path("tls.crt").read_bytes()).not_after` -> 1767225600.0
    """
    m = _PEM_CERTIFICATE.search(pem)
    if m is None:
        raise CertificateError("no PEM certificate in it")
    try:
        der = base64.b64decode(m.group(1), validate=False)
        _, start, end = _element(der, 0)  # Certificate
        _, start, end = _element(der, start)  # TBSCertificate
        fields = _children(der, start, end)
        if fields[0][0] == 0xA0:  # [0] version, absent in v1 certificates
            fields = fields[1:]
        serial, _, _, validity, subject = fields[:5]
        _, (after_tag, a_start, a_end) = _children(der, validity[1], validity[2])[:2]
        return Certificate(
            serial=int.from_bytes(der[serial[1] : serial[2]], "big"),
            subject=_subject(der, subject[1], subject[2]),
            not_after=_time(after_tag, der[a_start:a_end]),
        )
    except (ValueError, IndexError) as e:  # CertificateError is a ValueError too
        raise CertificateError(f"not a certificate gRPC can serve ({e})") from None


# --- loading and reloading ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CertificateFiles:
    """The files a shard serves TLS from (ShardConfig's --tls-* flags)."""

    cert: pathlib.Path  # PEM certificate chain, the served certificate first
    key: pathlib.Path  # PEM private key of cert, unencrypted
    client_ca: pathlib.Path | None  # PEM CA bundle of client certificates (mutual TLS)

    def paths(self) -> list[pathlib.Path]:
        return [self.cert, self.key] + ([self.client_ca] if self.client_ca else [])

    def flags(self) -> str:
        return f"--tls-cert {self.cert}, --tls-key {self.key}" + (
            f", --tls-client-ca {self.client_ca}" if self.client_ca else ""
        )


Stamp = tuple[tuple[int, int, int, int, int] | None, ...]


def stamp(files: CertificateFiles) -> Stamp:
    """What changes when any of the files does: device, inode, size, mtime and ctime of
    each, through symlinks (None for a file that cannot be stat'ed)."""
    found: list[tuple[int, int, int, int, int] | None] = []
    for path in files.paths():
        try:
            s = os.stat(path)
        except OSError:
            found.append(None)
        else:
            found.append((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))
    return tuple(found)


def _encrypted_key() -> bytes:
    raise CertificateError("the key is encrypted: give it unencrypted")


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A certificate configuration that passed every check, ready for gRPC."""

    config: grpc.ServerCertificateConfiguration
    certificate: Certificate


def load(files: CertificateFiles) -> Loaded:
    """Reads and checks the files: a CertificateError saying which file and why when gRPC
    could not serve them."""
    try:
        cert, key = files.cert.read_bytes(), files.key.read_bytes()
        ca = files.client_ca.read_bytes() if files.client_ca else None
    except OSError as e:
        raise CertificateError(f"cannot read {e.filename}: {e.strerror}") from None
    try:
        certificate = describe(cert)
    except CertificateError as e:
        raise CertificateError(f"--tls-cert {files.cert}: {e}") from None
    if not _PEM_KEY.search(key):
        raise CertificateError(f"--tls-key {files.key}: no PEM private key in it")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # the check gRPC's handshake depends on: the key is the certificate's own
        context.load_cert_chain(files.cert, files.key, password=_encrypted_key)
    except ssl.SSLError as e:
        raise CertificateError(
            f"--tls-key {files.key} with --tls-cert {files.cert}: {e.reason or e}"
        ) from None
    except OSError as e:
        raise CertificateError(f"cannot read {e.filename}: {e.strerror}") from None
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise CertificateError(f"--tls-client-ca {files.client_ca}: {e.reason or e}") from None
    config = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
    return Loaded(config, certificate)


def check(files: CertificateFiles) -> Loaded:
    """`load`, with a ConfigError (a flag error) naming the flags when gRPC cannot serve the
    files: at start-up, before the shard makes anything."""
    try:
        return load(files)
    except CertificateError as e:
        raise ConfigError(
            f"{files.flags()}: gRPC cannot serve them ({e}); each must be PEM, and the "
            "key the certificate's own, unencrypted"
        ) from None


class CertificateMetrics:
    """The served certificate's expiry and the outcome of each reload."""

    def __init__(self, registry: prom.CollectorRegistry):
        self.expiry = prom.Gauge(
            "atoll_tls_certificate_expiry_timestamp_seconds",
            "notAfter of the TLS certificate served now, unix seconds",
            registry=registry,
        )
        self.reloads = prom.Counter(
            "atoll_tls_certificate_reloads",
            "Changes of the TLS files taken (ok) or refused, the previous certificate "
            "still served (failed)",
            ["result"],
            registry=registry,
        )
        for result in ("ok", "failed"):
            self.reloads.labels(result)  # both series from the start, for rate()


class ReloadingCertificate:
    """The shard's TLS credentials, reloaded on change (see the promises at the top)."""

    def __init__(self, files: CertificateFiles, registry: prom.CollectorRegistry):
        self.files = files
        self.metrics = CertificateMetrics(registry)
        self._stamp = stamp(files)
        loaded = check(files)
        self._initial = loaded.config
        self.served = loaded.certificate
        self.metrics.expiry.set(self.served.not_after)
        self._lock = threading.Lock()
        log.info("TLS: serving certificate %s", self.served)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial,
            self.fetch,
            require_client_authentication=self.files.client_ca is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake (on one of its own threads): a new
        configuration to serve from now on, or None to keep the one it has."""
        # A handshake never waits on another's reload: it keeps the current pair.
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._check()
        finally:
            self._lock.release()

    def _check(self) -> grpc.ServerCertificateConfiguration | None:
        before = stamp(self.files)
        if before == self._stamp:
            return None
        try:
            loaded = load(self.files)
        except CertificateError as e:
            if stamp(self.files) != before:
                return None  # changing under us: judged once it settles
            self._stamp = before  # logged and counted once per change of the files
            self.metrics.reloads.labels("failed").inc()
            log.error("TLS: new files not taken, still serving %s: %s", self.served, e)
            return None
        if stamp(self.files) != before:
            return None  # (2) read while changing: maybe half old, half new
        self._stamp, self.served = before, loaded.certificate
        self.metrics.expiry.set(self.served.not_after)
        self.metrics.reloads.labels("ok").inc()
        log.info("TLS: new certificate taken, serving %s", self.served)
        return loaded.config
