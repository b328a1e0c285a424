"""The in-cluster `atoll status` Job (k8s/components/operator-tls) against shards on TLS
whose certificate, like a real one, names the shards' per-pod DNS names and no IP: it
finds the shard pods through the Kubernetes API (kmock's emulator, as in test_kube.py),
dials each by the Job's --address-template, and must find every shard reachable.

The certificate names atoll-syncer-<i>.atoll-syncer.localhost: the cluster's names
(atoll-syncer-<i>.atoll-syncer) resolve only in a cluster, while gRPC's own resolver
(c-ares, forced here) answers any *.localhost name with the loopback address (RFC 6761),
where the shard processes listen. The shards' other address, the pod IP, is not in the
certificate: dialled there, as the Job did before, TLS refuses every shard.
"""

from __future__ import annotations

import datetime
import json
import pathlib

import numpy as np
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from pki import _cert, _key, _write
from syncer_helpers import PLAN, run_atoll, syncer_processes
from test_kube import NS, Emulator, free_port, seed_run

from atoll.wire import codec
from atoll.wire.client import ShardClient, TlsFiles

JOBS = pathlib.Path(__file__).resolve().parents[2] / "k8s" / "components" / "operator" / "jobs.yaml"
OPERATOR = "operator-token-3c9d0e7a1b5f4d2e8a6c"  # a bare line: bound to no learner
SUFFIX = ".localhost"  # makes a cluster name resolve to this host (see the docstring)
# gRPC's resolver: c-ares answers *.localhost itself; the system's (native) may not
RESOLVER = {"GRPC_DNS_RESOLVER": "ares"}


def status_job_args() -> list[str]:
    """The atoll-status Job's args, as the kubelet expands them (minus the `status`)."""
    (job,) = [
        d
        for d in yaml.safe_load_all(JOBS.read_text())
        if d["kind"] == "Job" and d["metadata"]["name"] == "atoll-status"
    ]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "status"
    return [a.replace("$(POD_NAMESPACE)", NS) for a in c["args"][1:]]


def server_certificate(d: pathlib.Path, names: list[str]) -> tuple[pathlib.Path, ...]:
    """(CA, certificate, key): a CA and a server certificate for DNS `names` alone."""
    ca_key, key = _key(), _key()
    ca = _cert("atoll test CA", ca_key, "atoll test CA", ca_key, ca=True)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "syncer")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, _ = _write(d, "ca", ca)
    return (ca_path, *_write(d, "server", cert, key))


@pytest.fixture
def run(tmp_path):
    """Two TLS shards with tokens, every fragment seeded; the emulated API lists their pods
    (IP 127.0.0.1, `grpc` port). Yields (kubeconfig, CA, operator token file, grpc ports)."""
    names = [f"atoll-syncer-{i}.atoll-syncer{SUFFIX}" for i in (0, 1)]
    ca, cert, key = server_certificate(tmp_path, names)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{OPERATOR}\n")
    with syncer_processes(tmp_path) as start:
        ports = [
            start(
                tmp_path / f"shard{i}",
                *("--num-shards", "2", "--quorum", "1", "--grace-factor", "0"),
                *("--shard-index", str(i), "--tls-cert", cert, "--tls-key", key),
                *("--token-file", tokens, "--health-port", "0"),
            ).port
            for i in (0, 1)
        ]
        files = TlsFiles(ca, None, None)
        for p in range(PLAN.num_fragments):
            client = ShardClient(
                f"{names[p % 2]}:{ports[p % 2]}", "seed", token=OPERATOR, tls=files
            )
            try:
                values = np.zeros(PLAN.fragment_sizes[p], np.float32)
                client.init(PLAN, p, codec.encode(values, codec.Codec.FP32), codec.Codec.FP32)
            finally:
                client.close()
        api = Emulator(lambda k: seed_run(k, [(port, free_port()) for port in ports]))
        try:
            kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", token="sa-token")
            operator_token = tmp_path / "operator-token"  # the Secret's key the Job mounts
            operator_token.write_text(OPERATOR)
            yield kubeconfig, ca, operator_token, ports
        finally:
            api.close()


def test_status_job_reaches_shards_whose_certificate_holds_only_their_names(run):
    kubeconfig, ca, token, ports = run
    args = []
    for a in status_job_args():
        flag, _, value = a.partition("=")
        if flag == "--address-template":  # the cluster's name, made to resolve here
            host, _, port = value.rpartition(":")
            value = f"{host}{SUFFIX}:{port}"
        elif flag == "--token-file":
            value = str(token)
        args.append(f"{flag}={value}")
    # what k8s/components/operator-tls adds, and the kubeconfig in place of the pod's account
    args += [f"--tls-ca={ca}", f"--kubeconfig={kubeconfig}", "--json"]
    ok = run_atoll("status", *args, env=RESOLVER)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    shards = json.loads(ok.stdout)["shards"]
    assert [s["address"] for s in shards] == [
        f"atoll-syncer-{i}.atoll-syncer{SUFFIX}:{ports[i]}" for i in (0, 1)
    ]
    assert [s["describe"]["shard_index"] for s in shards] == [0, 1]
    assert sorted(f["fragment"] for s in shards for f in s["describe"]["fragments"]) == list(
        range(PLAN.num_fragments)
    )

    # The pod IP, as the Job dialled before: the certificate does not hold it.
    by_ip = [a for a in args if not a.startswith("--address-template=")]
    failed = run_atoll("status", *by_ip, "--deadline", "3", env=RESOLVER)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    shards = json.loads(failed.stdout)["shards"]
    assert [s["address"] for s in shards] == [f"127.0.0.1:{p}" for p in ports]
    for s in shards:  # and it says what to dial instead
        assert s["error"].startswith("unreachable") and "--address-template" in s["error"], s
