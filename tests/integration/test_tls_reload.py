"""A running `atoll syncer` takes a renewed TLS certificate without a restart, swapped in
the way the kubelet updates a mounted Secret: the new files in a new directory, then the
`..data` symlink re-pointed in one rename, the served paths being symlinks through it.
Real processes over real sockets; certificates made per run (pki.py)."""

from __future__ import annotations

import os
import pathlib
import shutil
import ssl
import time
from collections.abc import Callable

import grpc
import pytest
from cryptography import x509
from pki import Pki, pki, renew_server  # noqa: F401 (pki is a fixture)
from syncer_helpers import DEADLINE, connect, describe, syncer_processes
from test_syncer_startup import free_port

from atoll.wire.metrics import read_metrics

EXPIRY = "atoll_tls_certificate_expiry_timestamp_seconds"
RELOADS = "atoll_tls_certificate_reloads_total"


class SecretVolume:
    """A directory laid out as the kubelet mounts a Secret: tls.crt and tls.key are
    symlinks into `..data`, itself a symlink to the current timestamped directory."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.root.mkdir()
        self.swaps = 0
        for name in ("tls.crt", "tls.key"):
            (root / name).symlink_to(f"..data/{name}")

    def project(self, cert: bytes, key: bytes) -> None:
        """Writes a new timestamped directory, then swaps `..data` to it atomically and
        removes the old one, as the kubelet's AtomicWriter does."""
        self.swaps += 1
        new = f"..2026_01_01_00_00_{self.swaps:02d}.{os.getpid()}"
        (self.root / new).mkdir()
        (self.root / new / "tls.crt").write_bytes(cert)
        (self.root / new / "tls.key").write_bytes(key)
        data = self.root / "..data"
        old = os.readlink(data) if data.is_symlink() else None
        (self.root / "..data_tmp").symlink_to(new)
        os.rename(self.root / "..data_tmp", data)  # the swap: one rename
        if old is not None:
            shutil.rmtree(self.root / old)

    @property
    def cert(self) -> pathlib.Path:
        return self.root / "tls.crt"

    @property
    def key(self) -> pathlib.Path:
        return self.root / "tls.key"


def served_certificate(port: int) -> x509.Certificate:
    """The certificate a new TLS connection to 127.0.0.1:port is shown."""
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=DEADLINE)
    return x509.load_pem_x509_certificate(pem.encode())


def metrics(port: int) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in read_metrics(f"127.0.0.1:{port}", timeout=DEADLINE)
    }


def reloads(port: int, result: str) -> float:
    return metrics(port)[(RELOADS, (("result", result),))]


def poll(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


@pytest.fixture
def shard(tmp_path, pki: Pki):
    """A shard serving TLS from a Secret-like volume; yields (volume, port, metrics port,
    process)."""
    volume = SecretVolume(tmp_path / "tls")
    volume.project(pki.server_cert.read_bytes(), pki.server_key.read_bytes())
    metrics_port = free_port()
    with syncer_processes(tmp_path) as start:
        proc = start(
            tmp_path / "data",
            *("--tls-cert", volume.cert, "--tls-key", volume.key),
            *("--metrics-port", metrics_port, "--health-port", "0"),
        )
        yield volume, proc.port, metrics_port, proc
        assert proc.stop() == 0, proc.log()


def test_a_renewed_certificate_is_served_without_a_restart(shard, pki: Pki, tmp_path):
    volume, port, metrics_port, proc = shard
    first = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    assert served_certificate(port).serial_number == first.serial_number
    assert metrics(metrics_port)[(EXPIRY, ())] == first.not_valid_after_utc.timestamp()
    channel, stub = connect(port, grpc.ssl_channel_credentials(pki.ca.read_bytes()))
    try:
        describe(stub)  # the connection that stays open across the swap

        renewed_dir = tmp_path / "renewed"
        renewed_dir.mkdir()
        cert, key = renew_server(pki, renewed_dir, days=30)
        renewed = x509.load_pem_x509_certificate(cert.read_bytes())
        assert renewed.not_valid_after_utc > first.not_valid_after_utc
        volume.project(cert.read_bytes(), key.read_bytes())

        poll(
            lambda: served_certificate(port).serial_number == renewed.serial_number,
            "a new connection is shown the renewed certificate",
        )
        describe(stub)  # the open channel goes on working
        m = metrics(metrics_port)
        assert m[(EXPIRY, ())] == renewed.not_valid_after_utc.timestamp()
        assert m[(RELOADS, (("result", "ok"),))] == 1
        assert m[(RELOADS, (("result", "failed"),))] == 0
        assert f"serial {renewed.serial_number:X}" in proc.log()

        # a broken renewal: the renewed certificate goes on serving
        volume.project(b"-----BEGIN CERTIFICATE-----\ngarbage\n", key.read_bytes())
        poll(
            lambda: (
                served_certificate(port).serial_number == renewed.serial_number
                and reloads(metrics_port, "failed") == 1
            ),
            "the broken files are refused and counted",
        )
        for _ in range(3):  # more handshakes on the same broken files: counted and logged once
            assert served_certificate(port).serial_number == renewed.serial_number
        fresh, fresh_stub = connect(port, grpc.ssl_channel_credentials(pki.ca.read_bytes()))
        try:
            describe(fresh_stub)  # new gRPC clients still get in
        finally:
            fresh.close()
        describe(stub)
        m = metrics(metrics_port)
        assert m[(RELOADS, (("result", "failed"),))] == 1
        assert m[(RELOADS, (("result", "ok"),))] == 1
        assert m[(EXPIRY, ())] == renewed.not_valid_after_utc.timestamp()
        assert proc.log().count("TLS: new files not taken") == 1, proc.log()
        assert "no PEM certificate in it" in proc.log(), proc.log()
    finally:
        channel.close()
