"""The shard accepts the learners' HTTP/2 keepalive pings: an idle Watch stays open.

A learner's channel pings every 30 s; grpc's default server policy (one ping per 5 min
without data, GOAWAY too_many_pings on the third early one) dropped Watch streams that
heard no new version for a few minutes."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from syncer_helpers import connect

from atoll.server import service
from atoll.server.config import ShardConfig
from atoll.server.service import SyncerServer
from atoll.wire import syncer_pb2 as pb
from atoll.wire.client import ShardClient

# The real-network test's keepalive interval, both sides: a grpc client pings at most
# once a second whatever it is asked; grpc's default policy ends its Watch at the 4th.
PING_MS = 1000
IDLE_SECONDS = 8.0  # an idle Watch this long sees ~7 pings


def test_the_shard_permits_the_pings_a_learners_client_sends(tmp_path, monkeypatch):
    channels: list[dict] = []  # the options of each channel and server made
    servers: list[dict] = []
    real_channel, real_server = grpc.insecure_channel, grpc.aio.server

    def channel(target, options=None, *args, **kwargs):
        channels.append(dict(options or ()))
        return real_channel(target, options, *args, **kwargs)

    def server(*args, **kwargs):
        servers.append(dict(kwargs.get("options") or ()))
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", channel)
    monkeypatch.setattr(grpc.aio, "server", server)
    ShardClient("127.0.0.1:1", "learner-0").channel.close()
    SyncerServer(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, listen="127.0.0.1:0")
    ).stop(grace=0)

    (ping_ms,) = [c["grpc.keepalive_time_ms"] for c in channels]
    assert ping_ms == service.LEARNER_KEEPALIVE_MS, (
        "the shard must take the client's keepalive interval (wire.client.KEEPALIVE_MS)"
    )
    (syncer,) = [s for s in servers if "grpc.max_concurrent_streams" in s]  # the main port's
    # pings as often as the client's, with no data moving, and with no call open
    assert syncer["grpc.http2.min_ping_interval_without_data_ms"] <= ping_ms
    assert syncer["grpc.keepalive_permit_without_calls"] == 1
    assert syncer.get("grpc.http2.max_ping_strikes", 2) > 0  # a faster client is still refused


def _idle_watch_outcome(port: int, seconds: float) -> object:
    """What an idle Watch over a channel pinging every PING_MS gets within `seconds`: its
    first message or error code, or None when it is still open and silent."""
    channel, stub = connect(
        port,
        options=[
            ("grpc.keepalive_time_ms", PING_MS),
            # keep pinging with no data moving: a learner's channel slows to one ping a
            # minute after two, so this one presses the server's policy harder than it
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    call = stub.Watch(pb.WatchRequest(learner_id="idle"), timeout=seconds + 30)
    got: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            got.put(next(call))
        except grpc.RpcError as e:
            got.put(e.code())
        except StopIteration:
            got.put("ended")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        return got.get(timeout=seconds)
    except queue.Empty:
        return None
    finally:
        call.cancel()
        reader.join(timeout=10)
        channel.close()


@pytest.mark.parametrize("policy", ["the shard's", "grpc's default"])
def test_an_idle_watch_outlives_many_keepalive_pings(tmp_path, monkeypatch, policy):
    monkeypatch.setattr(service, "LEARNER_KEEPALIVE_MS", PING_MS)
    if policy == "grpc's default":  # the fault this guards against, shown to fire
        monkeypatch.setattr(service, "keepalive_policy", lambda client_ms: [])
    shard = SyncerServer(
        ShardConfig(shard_index=0, num_shards=1, data_dir=tmp_path, listen="127.0.0.1:0")
    )
    shard.start()
    try:
        if policy == "the shard's":
            outcome = _idle_watch_outcome(shard.port, IDLE_SECONDS)
            assert outcome is None, f"the idle Watch ended: {outcome}"
        else:  # ends at ~4 s; the margin is for a loaded host
            outcome = _idle_watch_outcome(shard.port, 3 * IDLE_SECONDS)
            assert outcome == grpc.StatusCode.UNAVAILABLE, outcome  # GOAWAY too_many_pings
    finally:
        shard.stop(grace=0)
