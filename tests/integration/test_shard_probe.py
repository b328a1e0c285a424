"""Asking for a shard that may not be up (past the last one, or not started yet), as `atoll
reshard` and `atoll drain` do past the shards they must reach, and a learner given a
--shards pattern does when it joins: nothing listening at the address is known at once,
where a Describe waits for the channel until its deadline."""

from __future__ import annotations

import socket
import threading
import time

from syncer_helpers import PLAN, free_port, serving_shard

from atoll.cluster import reshard
from atoll.learner.routing import PROBE_SECONDS, Router
from atoll.wire.client import ShardClient


def test_a_probe_ends_at_once_where_nothing_listens_and_after_its_timeout_where_silent(tmp_path):
    with serving_shard(tmp_path) as server, socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # takes connections, never answers
        clients = [
            ShardClient(f"127.0.0.1:{port}", "")
            for port in (server.port, free_port(), silent.getsockname()[1])
        ]
        try:
            assert reshard.answers(clients[0])
            start = time.monotonic()
            assert not reshard.answers(clients[1])  # refused: no wait for the channel
            assert time.monotonic() - start < 1.0  # (a Describe waits PROBE_SECONDS, 5 s)
            start = time.monotonic()
            assert not reshard.answers(clients[2], timeout=0.5)
            assert 0.5 <= time.monotonic() - start < 3.0  # silent: its timeout, once
        finally:
            for c in clients:
                c.close()


def test_a_learner_given_a_pattern_joins_without_waiting_for_the_shard_past_the_last(tmp_path):
    # one shard up; the pattern's shard 1 is an address where nothing listens
    with serving_shard(tmp_path) as server:
        ports = {0: server.port, 1: free_port()}
        router = Router(
            PLAN,
            [ShardClient(f"127.0.0.1:{ports[0]}", "a")],
            threading.Event(),
            max_backoff=0.1,
            connect=lambda i: ShardClient(f"127.0.0.1:{ports.get(i, ports[1])}", "a"),
        )
        try:
            start = time.monotonic()
            assert router.check_shards() == set()  # nothing seeded yet
            assert time.monotonic() - start < PROBE_SECONDS / 5  # shard 1 was asked at once
            assert len(router.clients) == 1 and router.fragment_map.owners == (0, 0, 0, 0)
        finally:
            router.close()
