"""`atoll syncer` refuses, at start, what this host cannot give it: a port another process
serves, an address the host does not have, a data directory it cannot write, TLS files
gRPC cannot load. Each is one readable line and exit status 2, as for a bad flag; no
traceback, and a shard already serving goes on serving."""

from __future__ import annotations

import pathlib
import subprocess
import time

import pytest
from syncer_helpers import connect, describe, free_port, run_atoll, syncer_processes, wait_serving

START_SECONDS = 60  # a refused start returns well within this (imports take a few seconds)


@pytest.fixture
def processes(tmp_path):
    with syncer_processes(tmp_path) as start:
        yield start


def syncer(*flags: str) -> subprocess.CompletedProcess:
    """`atoll syncer FLAGS`, expected to exit of itself within START_SECONDS."""
    return run_atoll("syncer", *flags, timeout=START_SECONDS)


def assert_refused(r: subprocess.CompletedProcess, *words: str) -> str:
    """Exit status 2, no traceback, and a last line `atoll syncer: error: ...` naming `words`."""
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert last.startswith("atoll syncer: error: "), r.stderr
    for word in words:
        assert word in last, (word, last)
    return last


# --- ports: a shard owns its ports ---


@pytest.mark.parametrize("flag", ["--listen", "--health-port", "--metrics-port"])
def test_a_second_shard_on_a_port_a_shard_serves_refuses_to_start(tmp_path, processes, flag):
    health, metrics = free_port(), free_port()
    first = processes(tmp_path / "first", "--health-port", health, "--metrics-port", metrics)
    taken = {"--listen": first.port, "--health-port": health, "--metrics-port": metrics}[flag]
    flags = {"--listen": "127.0.0.1:0", "--health-port": "0", "--metrics-port": "0"}
    flags[flag] = f"127.0.0.1:{taken}" if flag == "--listen" else str(taken)
    started = time.monotonic()
    r = syncer("--data-dir", str(tmp_path / "second"), *[x for kv in flags.items() for x in kv])
    last = assert_refused(r, flag, f"127.0.0.1:{taken}", "in use")
    assert time.monotonic() - started < START_SECONDS, last
    assert not (tmp_path / "second").exists()  # refused before its data directory was made
    # the first shard still owns the port and answers on it
    assert first.proc.poll() is None
    wait_serving(first.port, timeout=10)
    channel, stub = connect(first.port)
    try:
        describe(stub)
    finally:
        channel.close()


def test_port_zero_still_picks_a_free_port_for_each_of_two_shards(tmp_path, processes):
    flags = ("--health-port", "0", "--metrics-port", "0")
    a = processes(tmp_path / "a", *flags)
    b = processes(tmp_path / "b", *flags)
    assert a.port != b.port
    wait_serving(a.port)
    wait_serving(b.port)


@pytest.mark.parametrize(
    "listen,why",
    [
        ("192.0.2.1:7070", "not an address of this host"),  # TEST-NET-1: never a host's own
        ("no-such-host.invalid:7070", "cannot resolve"),
    ],
)
def test_listen_on_an_address_this_host_lacks_is_refused(tmp_path, listen, why):
    r = syncer("--data-dir", str(tmp_path / "data"), "--listen", listen)
    assert_refused(r, "--listen", listen, why)
    assert not (tmp_path / "data").exists()


# --- the data directory ---


def _file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n")
    return path


@pytest.mark.parametrize(
    "make,why",
    [
        (_file, "not a directory"),  # the path itself is a file
        (lambda tmp: _file(tmp) / "data", "Not a directory"),  # under a file
        (lambda tmp: pathlib.Path("/proc/atoll-no-such-dir"), "/proc/atoll-no-such-dir"),
        (lambda tmp: pathlib.Path("/proc"), "/proc"),  # a directory no one, root too, can write
    ],
    ids=["a-file", "under-a-file", "under-proc", "proc"],
)
def test_a_data_dir_that_cannot_hold_a_shard_is_refused_and_nothing_is_made(tmp_path, make, why):
    data = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    r = syncer("--data-dir", str(data), "--listen", "127.0.0.1:0")
    assert_refused(r, "--data-dir", why)
    assert sorted(tmp_path.rglob("*")) == before
    assert not pathlib.Path("/proc/atoll-no-such-dir").exists()
    assert not pathlib.Path("/proc/wal").exists()


def test_a_data_dir_another_shard_holds_is_refused(tmp_path, processes):
    first = processes(tmp_path / "data")
    r = syncer("--data-dir", str(tmp_path / "data"), "--listen", "127.0.0.1:0")
    assert_refused(r, "--data-dir", str(tmp_path / "data"), "already open")
    assert first.proc.poll() is None
    wait_serving(first.port, timeout=10)


# --- files the flags name ---


def test_tls_files_grpc_cannot_load_are_refused(tmp_path):
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    r = syncer(
        "--data-dir",
        str(tmp_path / "data"),
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    assert_refused(r, "--tls-cert", str(cert), str(key))
    assert not (tmp_path / "data").exists(), "refused before its data directory was made"


def test_a_token_file_that_is_not_text_is_a_flag_error(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_bytes(bytes(range(128, 256)))
    r = syncer("--data-dir", str(tmp_path / "data"), "--token-file", str(tokens))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(tokens) in r.stderr.strip().splitlines()[-1], r.stderr
    assert not (tmp_path / "data").exists()
