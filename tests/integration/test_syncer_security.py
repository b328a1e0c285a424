"""Who may talk to a shard: bearer tokens on every Syncer call, TLS, mutual TLS.

Real in-process servers on port 0 over real sockets; certificates are made per run
with `cryptography` (a CA, a server certificate for 127.0.0.1 and localhost, client
certificates from that CA and from a stranger's).
"""

from __future__ import annotations

import pathlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pki import pki  # noqa: F401 (a fixture)
from syncer_helpers import (
    DEADLINE,
    PLAN,
    SERVICE,
    bearer,
    connect,
    describe,
    health_status,
    init,
    pull,
    push,
    status_of,
)

from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import syncer_pb2 as pb

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
def serve(tmp_path):
    """start(**ShardConfig fields) -> a started in-process shard; all stopped at the end."""
    servers = []

    def start(**fields) -> SyncerServer:
        server = SyncerServer(
            ShardConfig(
                shard_index=0,
                num_shards=1,
                data_dir=tmp_path / f"s{len(servers)}",
                listen="127.0.0.1:0",
                **fields,
            )
        )
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


# --- bearer tokens ---

# Tokens as long as config.load_tokens demands (32 characters at least).
SECRET_A = "secret-a-4f1c9e2b7d3a8c6e5b0f9a1d2c"
SHARED = "shared-secret-7c1e0b5a9d3f4e2b8a6c"


@pytest.fixture
def token_server(tmp_path, serve):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# learner-bound and shared tokens\nlearner-a {SECRET_A}\n\n{SHARED}\n")
    return serve(token_file=tokens)


def _calls(stub, metadata):
    """One call of each Syncer RPC, as `metadata` (Watch: its first message)."""
    size = PLAN.fragment_sizes[0]
    return {
        "Init": lambda: init(
            stub, PLAN, 0, np.zeros(size, np.float32), learner="learner-a", metadata=metadata
        ),
        "Push": lambda: push(
            stub, PLAN, 0, "learner-a", 1, 0, np.full(size, 0.01, np.float32), metadata=metadata
        ),
        "Pull": lambda: pull(stub, 0, metadata=metadata),
        "Describe": lambda: describe(stub, metadata=metadata),
        "Watch": lambda: next(
            stub.Watch(pb.WatchRequest(fragments=[0]), timeout=DEADLINE, metadata=metadata)
        ),
    }


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        bearer("wrong"),
        bearer(""),
        [("authorization", SECRET_A)],
        [("authorization", f"Basic {SECRET_A}")],
    ],
    ids=["none", "wrong", "empty", "no-scheme", "basic"],
)
def test_calls_without_a_known_bearer_token_are_unauthenticated(token_server, metadata):
    channel, stub = connect(token_server.port)
    good = bearer(SECRET_A)
    assert init(
        stub,
        PLAN,
        0,
        np.zeros(PLAN.fragment_sizes[0], np.float32),
        learner="learner-a",
        metadata=good,
    ).created
    before = describe(stub, metadata=good)
    for method, call in _calls(stub, metadata).items():
        assert status_of(call) == UNAUTHENTICATED, method
    assert describe(stub, metadata=good) == before  # nothing got through
    channel.close()


def test_known_tokens_open_every_call(token_server):
    channel, stub = connect(token_server.port)
    for token in (SECRET_A, SHARED):
        calls = _calls(stub, bearer(token))
        assert calls["Init"]().created == (token == SECRET_A)  # then it exists
        assert calls["Push"]().accepted  # the second time: a duplicate, answered the same
        assert calls["Pull"]()[0].fragment == 0
        assert calls["Describe"]().num_shards == 1
        assert calls["Watch"]().fragment == 0
    channel.close()


def test_health_and_reflection_need_no_token(token_server):
    channel, _ = connect(token_server.port)
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflect.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=DEADLINE
    )
    services = {s.name for s in next(answers).list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= services
    channel.close()


def test_a_learner_bound_token_cannot_push_as_another_learner(token_server):
    """`learner-a SECRET_A` binds the token to learner-a (config.load_tokens): a push
    that says it comes from learner-b under that token is refused and changes nothing."""
    channel, stub = connect(token_server.port)
    size = PLAN.fragment_sizes[0]
    good = bearer(SECRET_A)
    init(stub, PLAN, 0, np.zeros(size, np.float32), learner="learner-a", metadata=good)
    code = status_of(
        lambda: push(
            stub, PLAN, 0, "learner-b", 1, 0, np.full(size, 0.01, np.float32), metadata=good
        )
    )
    assert code in (grpc.StatusCode.PERMISSION_DENIED, UNAUTHENTICATED), code
    assert describe(stub, metadata=good).fragments[0].round_size == 0
    channel.close()


def test_only_an_operator_token_may_move_fragments(token_server):
    """Freeze/Unfreeze/Export/Adopt/Commit move a fragment's state between shards: a token
    bound to a learner is refused them (PERMISSION_DENIED), no token at all is
    UNAUTHENTICATED, and a token bound to no learner may make them."""
    channel, stub = connect(token_server.port)
    size = PLAN.fragment_sizes[0]
    init(stub, PLAN, 0, np.zeros(size, np.float32), learner="learner-a", metadata=bearer(SHARED))
    new = pb.FragmentMap(version=1, owners=[1, 0, 0, 0], moved_at=[1, 0, 0, 0])
    calls = {
        "Freeze": lambda m: stub.Freeze(pb.MoveRequest(fragment=0, map=new), metadata=m),
        "Unfreeze": lambda m: stub.Unfreeze(pb.MoveRequest(fragment=0), metadata=m),
        "Export": lambda m: list(stub.Export(pb.MoveRequest(fragment=0), metadata=m)),
        "Adopt": lambda m: stub.Adopt(
            iter([pb.FragmentState(header=pb.FragmentStateHeader(meta_json="{}"))]), metadata=m
        ),
        "Commit": lambda m: stub.Commit(pb.MoveRequest(fragment=0, map=new), metadata=m),
    }
    for name, call in calls.items():
        assert status_of(lambda c=call: c(bearer(SECRET_A))) == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(lambda c=call: c(None)) == UNAUTHENTICATED, name
    assert describe(stub, metadata=bearer(SHARED)).fragments[0].moving_version == 0
    # the operator's token: a freeze goes in, and is undone
    stub.Freeze(pb.MoveRequest(fragment=0, map=new), metadata=bearer(SHARED))
    assert describe(stub, metadata=bearer(SHARED)).fragments[0].moving_version == 1
    stub.Unfreeze(pb.MoveRequest(fragment=0), metadata=bearer(SHARED))
    assert describe(stub, metadata=bearer(SHARED)).fragments[0].moving_version == 0
    channel.close()


# --- TLS and mutual TLS ---


def _credentials(
    root: pathlib.Path, cert: pathlib.Path | None = None, key: pathlib.Path | None = None
) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=root.read_bytes(),
        private_key=key.read_bytes() if key else None,
        certificate_chain=cert.read_bytes() if cert else None,
    )


def _describe_status(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """OK, or the code one Describe fails with, on a fresh channel."""
    channel, stub = connect(port, credentials)
    try:
        describe(stub)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()


def test_tls_serves_clients_that_trust_its_ca_only(serve, pki):
    server = serve(tls_cert=pki.server_cert, tls_key=pki.server_key)
    assert _describe_status(server.port, _credentials(pki.ca)) == grpc.StatusCode.OK
    channel, stub = connect(server.port, _credentials(pki.ca))
    assert init(
        stub, PLAN, 0, np.zeros(PLAN.fragment_sizes[0], np.float32)
    ).created  # streams work too
    assert pull(stub, 0)[0].snapshot
    assert health_status(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    # The certificate names localhost as well as 127.0.0.1.
    channel = grpc.secure_channel(f"localhost:{server.port}", _credentials(pki.ca))
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    channel.close()
    assert _describe_status(server.port, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert (
        _describe_status(server.port, _credentials(pki.stranger_ca)) == grpc.StatusCode.UNAVAILABLE
    )


def test_mutual_tls_requires_a_client_certificate_from_its_ca(serve, pki):
    server = serve(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    assert (
        _describe_status(server.port, _credentials(pki.ca, pki.client_cert, pki.client_key))
        == grpc.StatusCode.OK
    )
    assert (
        _describe_status(server.port, _credentials(pki.ca)) == grpc.StatusCode.UNAVAILABLE
    )  # no cert
    assert (
        _describe_status(server.port, _credentials(pki.ca, pki.stranger_cert, pki.stranger_key))
        == grpc.StatusCode.UNAVAILABLE
    )  # a certificate the shard's CA never signed
    assert _describe_status(server.port, None) == grpc.StatusCode.UNAVAILABLE


def test_tokens_and_mutual_tls_together(tmp_path, serve, pki):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{SHARED}\n")
    server = serve(
        tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca, token_file=tokens
    )
    channel, stub = connect(server.port, _credentials(pki.ca, pki.client_cert, pki.client_key))
    assert describe(stub, metadata=bearer(SHARED)).num_shards == 1
    assert status_of(lambda: describe(stub)) == UNAUTHENTICATED  # a certificate is not a token
    channel.close()
