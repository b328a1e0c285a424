"""The serving layer under the servicer: the process's one grpc.aio event loop, binding
ports (with the OS's reason when it cannot), and the state every stream shares: the
in-flight byte budget and the board of fragment versions that Watch streams read."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import prometheus_client as prom

from atoll.server.config import ConfigError, ShardConfig
from atoll.server.refusal import ShardError, Why
from atoll.wire import syncer_pb2 as pb

log = logging.getLogger("atoll.syncer")
SERVICE = pb.DESCRIPTOR.services_by_name["Syncer"].full_name
# A shard owns its ports: grpc sets SO_REUSEPORT on Linux by default, so a second shard
# started on a served port would start fine and the kernel would split calls between them.
OWN_PORT = (("grpc.so_reuseport", 0),)

T = TypeVar("T")


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim: memory that closed streams freed stays in malloc's arenas
    (threads allocate in their own) unless it is asked for back."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


# --- the event loop ---------------------------------------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's one grpc.aio event loop, running on a daemon thread of its own."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="grpc-aio", daemon=True).start()
            _loop = loop
        return _loop


def run_on_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on the event loop from another thread and returns its result."""
    return asyncio.run_coroutine_threadsafe(coroutine, event_loop()).result()


# --- ports and pings ---------------------------------------------------------------


def keepalive_policy(client_ms: int) -> list[tuple[str, int]]:
    """Server options that accept a client's keepalive pings every `client_ms`, with or
    without data or calls in flight; a client pinging more than twice as often still gets
    grpc's GOAWAY (timers and the network may bring two pings closer than the interval)."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", client_ms // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


LISTEN_HINTS = {
    errno.EADDRINUSE: "another process, perhaps another shard, serves that port: stop it or "
    "choose another port",
    errno.EADDRNOTAVAIL: "{host} is not an address of this host: give one of its own, or "
    "0.0.0.0 for all of them",
    errno.EACCES: "ports below 1024 need privileges: choose a higher one",
}


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_refusal(e: OSError, host: str) -> str:
    """The OS's reason for refusing to bind, and what to do about it."""
    hint = LISTEN_HINTS.get(e.errno or 0)
    return f"{e.strerror}; {hint.format(host=host)}" if hint else str(e.strerror or e)


def why_not_listening(host: str, port: int) -> str | None:
    """Why this host will not listen on host:port, as a plain socket learns it (grpc's own
    bind error names no cause), or None when it would now. A name is refused when none
    of its addresses can be had (grpc fails then too) or when another process holds one."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {host!r} ({e.strerror})"
    refused: list[OSError] = []
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc binds
            try:
                s.bind(address)
            except OSError as e:
                refused.append(e)
    in_use = [e for e in refused if e.errno == errno.EADDRINUSE]
    if in_use or (refused and len(refused) == len(found)):
        return bind_refusal((in_use or refused)[0], host)
    return None


def check_ports(cfg: ShardConfig) -> None:
    """A ConfigError naming the first of cfg's ports this host will not let a shard listen
    on (taken, or on an address the host lacks), found before anything is bound or made:
    a grpc server bound and never started keeps its port until the process ends."""
    for flag, port in (
        ("--listen", cfg.port),
        ("--health-port", cfg.health_port),
        ("--metrics-port", cfg.metrics_port),
    ):
        why = None if port is None else why_not_listening(cfg.host, port)
        if why is not None:
            raise ConfigError(f"{flag}: cannot listen on {host_port(cfg.host, port or 0)}: {why}")


def listen(
    server: grpc.aio.Server,
    flag: str,
    host: str,
    port: int,
    creds: grpc.ServerCredentials | None = None,
) -> int:
    """Binds `server` to host:port and returns the port; a ConfigError naming `flag`, the
    address and the reason when it cannot (TLS files are checked before, where they load)."""
    address = host_port(host, port)
    try:
        bound: int = (
            server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        )
    except RuntimeError:  # "Failed to bind to address": grpc names no cause
        why = why_not_listening(host, port)
        raise ConfigError(
            f"{flag}: cannot listen on {address}: "
            + (why or "gRPC refused it (GRPC_VERBOSITY=debug logs its reason)")
        ) from None
    return bound


# --- serving-layer state ------------------------------------------------------------


class ServingMetrics:
    """What the serving layer adds to the shard's registry: streams, bytes held, health."""

    def __init__(self, registry: prom.CollectorRegistry):
        self.open_calls = prom.Gauge(
            "atoll_open_calls",
            "Syncer calls in progress, by method (a Watch is open as long as its learner listens)",
            ["method"],
            registry=registry,
        )
        self.inflight_bytes = prom.Gauge(
            "atoll_inflight_frame_bytes",
            "Frame bytes declared by open Push "
            "and Init streams (held against --max-inflight-bytes)",
            registry=registry,
        )
        self.tick_failures = prom.Counter(
            "atoll_round_timer_failures",
            "Round-timer ticks that raised (each is logged with its traceback)",
            registry=registry,
        )
        self.serving = prom.Gauge(
            "atoll_serving", "1 while the health service says SERVING", registry=registry
        )


class Budget:
    """Frame bytes that open streams declared, per connection and in all (event loop only)."""

    def __init__(self, total: int, per_connection: int, gauge: prom.Gauge):
        self.total, self.per_connection, self.gauge = total, per_connection, gauge
        self.held = 0
        self.by_peer: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, peer: str, n: int) -> Iterator[None]:
        mine = self.by_peer.get(peer, 0)
        if mine + n > self.per_connection:
            raise ShardError(
                Why.TOO_BIG,
                f"this connection's open streams already declare {mine} frame bytes; {n} more "
                f"would pass its limit of {self.per_connection}: wait for them, then retry",
            )
        if self.held + n > self.total:
            raise ShardError(
                Why.TOO_BIG,
                f"the shard holds {self.held} frame bytes in flight; {n} more would pass its "
                f"limit of {self.total}: retry shortly",
            )
        self.by_peer[peer] = mine + n
        self.held += n
        self.gauge.set(self.held)
        try:
            yield
        finally:
            left = self.by_peer[peer] - n
            if left:
                self.by_peer[peer] = left
            else:
                del self.by_peer[peer]
            self.held -= n
            self.gauge.set(self.held)


class Wake:
    """One slice of woken Watch streams: done once each has sent its notices, or left."""

    def __init__(self, streams: int):
        self.left = streams
        self.done = asyncio.Event()

    def release(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.done.set()


class VersionBoard:
    """The newest fragment versions, read from the shard once per change and shared by
    every Watch stream: a change costs one domain call, not one per stream. Streams are
    woken a slice at a time, the next slice once this one's notices are sent, so a
    health check waits behind at most one slice of sends, never a crowd's."""

    WAKE_SLICE = 64  # Watch streams woken at once
    SLICE_WAIT = 0.1  # seconds a slice may take before the next is woken anyway (a stuck reader)

    def __init__(self, read: Callable[[], Awaitable[dict[int, tuple[int, int]]]]):
        self.read = read  # the shard's {fragment: (version, contributors)}
        self.versions: dict[int, tuple[int, int]] = {}
        self._waiters: dict[asyncio.Future[Wake], None] = {}
        self._dirty = False
        self._task: asyncio.Task[None] | None = None

    def subscribe(self) -> asyncio.Future[Wake]:
        """A future that completes (with a Wake to release) at the first refresh after this call."""
        waiter: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
        self._waiters[waiter] = None
        return waiter

    def unsubscribe(self, waiter: asyncio.Future[Wake]) -> None:
        self._waiters.pop(waiter, None)

    def poke(self) -> None:
        """A version changed (called on the event loop): refresh, one read at a time."""
        self._dirty = True
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                self.versions = await self.read()
            except Exception:  # the next change tries again; watchers keep what they had
                log.exception("reading fragment versions for Watch streams failed")
                return
            waiters, self._waiters = list(self._waiters), {}
            for start in range(0, len(waiters), self.WAKE_SLICE):
                batch = [w for w in waiters[start : start + self.WAKE_SLICE] if not w.done()]
                if not batch:
                    continue
                wake = Wake(len(batch))
                for waiter in batch:
                    waiter.set_result(wake)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.SLICE_WAIT):
                        await wake.done.wait()

    def view(self, fragments: list[int] | None) -> dict[int, tuple[int, int]]:
        if fragments is None:
            return self.versions
        return {p: self.versions[p] for p in fragments if p in self.versions}
