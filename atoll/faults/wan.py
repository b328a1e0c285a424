"""WAN emulation: learners in their own network namespaces ("regions") behind slow, distant links.

The shards run on the host, listening on 127.0.0.1. Each region is a network namespace joined
to the host by a veth pair; a process started with `command_prefix(r)` runs inside region r and
reaches shard s at `shard_addresses(r)[s]`, an address on the host end of its veth:

    region r netns                  host
    learner --veth (tbf: uplink)--> proxy (+latency) --lo--> 127.0.0.1:shard_port
    learner <--(tbf: downlink)veth-- proxy (+latency) <--lo--

The model, per region and direction: a rate limit and a one-way delay, nothing else.
- Rate: a `tbf` qdisc on each veth end limits uplink and downlink to `rate_mbit` each,
  counting Ethernet frames (TCP payload gets ~95 % of it). Regions do not share a bottleneck.
- Latency: a user-space TCP proxy in a background thread of the owning process holds every
  chunk it reads until `latency_ms` after it arrived, then forwards it, in order (the kernel's
  `netem` is not assumed to exist). A round trip therefore takes 2 × latency_ms plus
  serialisation at the rate. Half-closes and resets are forwarded after the same delay, so
  gRPC/HTTP2 streams of any size pass through unchanged.
- No loss, no jitter, no reordering. TCP between the region and the proxy sees a ~0 ms
  round trip, so slow start and window growth over a long path are not emulated: a flow
  reaches the full rate after about one round trip, like a well-tuned long-fat-pipe TCP.
- Only TCP to the shard ports crosses the WAN; anything else in a region sees only its
  own loopback and the host end of its veth.
- Region to region (`peer_ports`, for data-parallel collectives): TCP from region s to a
  port in that range at `region_address(r)` leaves by s's uplink, passes the proxy (one
  latency_ms) and enters r by its downlink, so it crosses both regions' links:

    region s --(s uplink tbf)--> host: policy route `iif NAMEhS` -> local -> transparent
    proxy listener on region_address(r):port (+latency) --(r downlink tbf)--> region r

  Each region's ephemeral ports are set to `peer_ports`, so a server there that binds
  port 0 (gloo does) gets a port the proxy already listens on.

Needs root (namespaces, veth, tc) and iproute2; `available()` says whether this machine can
run it. Everything made is named after `name` and removed on exit, at interpreter exit and on
SIGTERM; namespaces left by a killed (-9) owner with a default name are swept by the next Wan.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import fcntl
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import zlib
from collections.abc import Callable
from types import FrameType
from typing import Any

LOCK_PATH = "/run/atoll-wan.lock"  # serialises subnet choice across concurrent Wan instances
POOL = ipaddress.IPv4Network("10.200.0.0/13")  # private block the per-instance /24s come from
CHUNK = 64 * 1024  # proxy read size, bytes
MAX_REGIONS = 64  # one /30 per region in one /24
MAX_PEER_PORTS = 256  # ports in a peer_ports range (one proxy listener each, per region)
# routing table and rule priority of a Wan with peers: TABLE_BASE + its /24's index
TABLE_BASE = 30000
IP_TRANSPARENT = 19  # linux/in.h: a socket may bind, and answer from, an address not on the host
_NAME = re.compile(r"[a-z][a-z0-9]{0,9}")  # leaves room for "h63" in a 15-byte interface name
_DEFAULT_NAME = re.compile(r"w(\d+)[a-z]")  # f"w{pid}{letter}": swept once that pid is gone
_names = itertools.count()


class WanError(RuntimeError):
    """WAN emulation cannot be set up here; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class WanConfig:
    regions: int  # network namespaces, each one learner region, 1..64
    rate_mbit: float  # link rate per region and direction, Mbit/s (10^6 bit/s), > 0
    latency_ms: float  # one-way delay added in each direction, ms, >= 0 (RTT = 2x)
    # tbf bucket, KiB; bytes sent at line speed after idle; 0 = max(16, 4 ms of rate)
    burst_kb: float = 0.0
    queue_ms: float = 50.0  # tbf queue, as time at the rate; packets beyond it are dropped, > 0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise WanError(message)

        need(
            1 <= self.regions <= MAX_REGIONS,
            f"regions must be in 1..{MAX_REGIONS}, got {self.regions}",
        )
        need(0 < self.rate_mbit <= 10_000, f"rate_mbit must be in (0, 10000], got {self.rate_mbit}")
        need(
            0 <= self.latency_ms <= 10_000,
            f"latency_ms (one-way) must be in [0, 10000], got {self.latency_ms}",
        )
        need(
            self.burst_kb == 0 or 2 <= self.burst_kb <= 65_536,
            f"burst_kb must be 0 (automatic) or in [2, 65536] (at least one 1514-byte frame), got {self.burst_kb}",
        )
        need(0 < self.queue_ms <= 10_000, f"queue_ms must be in (0, 10000], got {self.queue_ms}")

    @property
    def rate_bytes(self) -> float:
        return self.rate_mbit * 1e6 / 8

    @property
    def burst_bytes(self) -> int:
        return (
            int(self.burst_kb * 1024)
            if self.burst_kb
            else max(16 * 1024, int(self.rate_bytes * 0.004))
        )

    @property
    def limit_bytes(self) -> int:
        # at least a few full frames plus the bucket, or tbf drops whole GSO bursts
        return max(self.burst_bytes + 8 * 1514, int(self.rate_bytes * self.queue_ms / 1000))

    @property
    def proxy_buffer_bytes(self) -> int:
        """Bytes one direction of one connection may hold: a round trip at the rate, plus slack."""
        return 128 * 1024 + int(2 * self.rate_bytes * self.latency_ms / 1000)


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise WanError(f"`{args[0]}` not found: install iproute2") from None
    if check and done.returncode != 0:
        raise WanError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


@functools.cache
def available() -> str | None:
    """None if WAN emulation can run here, else why not (for test skips and CLI errors)."""
    if os.geteuid() != 0:
        return "WAN emulation needs root (network namespaces, veth pairs, tc): run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"WAN emulation needs `{tool}`, not found on PATH: install iproute2"
    probe = f"atoll-probe-{os.getpid()}"
    try:  # the probe touches nothing outside its own namespace (tbf on that namespace's lo)
        _run(["ip", "netns", "add", probe])
        _run(
            [
                "tc",
                "-n",
                probe,
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                "1mbit",
                "burst",
                "16kb",
                "limit",
                "64kb",
            ]
        )
    except WanError as e:
        return f"WAN emulation cannot run here: {e}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Removes namespaces and host links of default-named Wans whose owner process is gone."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"atoll-({_DEFAULT_NAME.pattern})-r\d+", ns)
        if m and not _pid_alive(int(m.group(2))):
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    for line in _run(["ip", "rule", "show"], check=False).stdout.splitlines():
        m = re.match(rf"(\d+):.* iif ({_DEFAULT_NAME.pattern})h\d+ .*lookup (\d+)", line)
        if m and m.group(1) == m.group(4) and not _pid_alive(int(m.group(3))):
            _drop_table(int(m.group(1)))
            removed.append(f"table {m.group(1)}")
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        m = re.match(rf"\d+: (({_DEFAULT_NAME.pattern})h\d+)[@:]", line)
        if m and not _pid_alive(int(m.group(3))):
            _run(["ip", "link", "del", m.group(1)], check=False)
            removed.append(m.group(1))
    return removed


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has an address or a route in (any table)."""
    text = (
        _run(["ip", "-4", "-o", "addr", "show"]).stdout
        + _run(["ip", "-4", "route", "show", "table", "all"]).stdout
    )
    used = []
    for token in re.findall(r"(?<![\d.])(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", text):
        with contextlib.suppress(ValueError):
            used.append(ipaddress.IPv4Network(token, strict=False))
    return used


def _free_subnet(name: str) -> ipaddress.IPv4Network:
    """A /24 of POOL that clashes with nothing on the host; starts at a spot picked by `name`.

    Prefers a /24 no address or route touches; else one only covered by a broader route
    (a 10.0.0.0/8 VPN route, say), which our /30s then shadow for just their own addresses.
    """
    candidates = list(POOL.subnets(new_prefix=24))
    used = _networks_in_use()
    start = zlib.crc32(name.encode()) % len(candidates)
    ordered = candidates[start:] + candidates[:start]
    tests: tuple[Callable[[ipaddress.IPv4Network, ipaddress.IPv4Network], bool], ...] = (
        lambda net, u: net.overlaps(u),
        lambda net, u: u.subnet_of(net),
    )
    for clashes in tests:
        for net in ordered:
            if not any(clashes(net, u) for u in used):
                return net
    raise WanError(
        f"no free /24 left in {POOL}: every one holds an address or route of this host; "
        "remove stale links (`ip -o link`) or change atoll.faults.wan.POOL"
    )


def _set_linger_reset(writer: asyncio.StreamWriter) -> None:
    """Close so the peer sees a reset (RST), as it would from a dead endpoint."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Proxy:
    """Delaying TCP proxy on its own asyncio loop in a daemon thread."""

    def __init__(self, latency_s: float, buffer_bytes: int, regions: int):
        self.latency_s, self.buffer_bytes = latency_s, buffer_bytes
        self.stats = [
            {"bytes_up": 0, "bytes_down": 0, "connections": 0, "open": 0} for _ in range(regions)
        ]
        self.loop = asyncio.new_event_loop()
        self.servers: list[asyncio.Server] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="atoll-wan-proxy", daemon=True
        )
        self.thread.start()

    def listen_peer(
        self, host: str, port: int, region: int, region_of: Callable[[str], int | None]
    ) -> None:
        """Serves region `region`'s host:port to the other regions (`region_of` names a client's)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise WanError(
                f"cannot listen on {host}:{port} for region-to-region traffic: {e}"
            ) from None

        async def start() -> None:
            handler = functools.partial(self._connection, (host, port), region, region_of)
            server = await asyncio.start_server(handler, sock=sock, limit=2 * CHUNK)
            self.servers.append(server)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=10)

    def listen(self, region: int, host: str, shard_port: int) -> int:
        """Serves host:shard_port (or host:ephemeral if taken) for the shard; returns the port."""

        async def start() -> int:
            handler = functools.partial(
                self._connection, ("127.0.0.1", shard_port), region, lambda _: region
            )
            try:
                server = await asyncio.start_server(handler, host, shard_port, limit=2 * CHUNK)
            except OSError:  # taken: any free port
                server = await asyncio.start_server(handler, host, 0, limit=2 * CHUNK)
            self.servers.append(server)
            port: int = server.sockets[0].getsockname()[1]
            return port

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        async def shutdown() -> None:
            for server in self.servers:
                server.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        if self.thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()

    async def _connection(
        self,
        target: tuple[str, int],
        target_region: int,
        region_of: Callable[[str], int | None],
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
    ) -> None:
        """One client connection relayed to `target` (a shard, or a server in `target_region`).

        Bytes count as the client region's up and the target region's down, and back.
        """
        task = asyncio.current_task()
        assert task is not None  # a connection's handler runs as a task of its own
        self.tasks.add(task)
        peer = client_w.get_extra_info("peername")
        region = region_of(peer[0]) if peer else None
        if region is None:  # not from one of our regions: refuse
            _set_linger_reset(client_w)
            self.tasks.discard(task)
            return
        stats, theirs = self.stats[region], self.stats[target_region]
        stats["connections"] += 1
        stats["open"] += 1
        shard_w: asyncio.StreamWriter | None = None
        clean = False
        try:
            try:
                shard_r, shard_w = await asyncio.open_connection(*target, limit=2 * CHUNK)
            except OSError:  # the shard is down: reset after a round trip, as a refusal would
                await asyncio.sleep(2 * self.latency_s)
                raise
            ups, downs = [(stats, "bytes_up")], [(stats, "bytes_down")]
            if theirs is not stats:  # region to region: the other end's counts too
                ups, downs = ups + [(theirs, "bytes_down")], downs + [(theirs, "bytes_up")]
            pipes = [
                asyncio.create_task(self._pipe(client_r, shard_w, ups)),
                asyncio.create_task(self._pipe(shard_r, client_w, downs)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
                clean = all(p.done() and p.exception() is None for p in pipes)
            finally:
                for p in pipes:
                    p.cancel()
        except (OSError, asyncio.CancelledError):
            pass  # shard down, or stop(); re-raising a cancel makes asyncio's streams log it
        finally:
            # a clean end (EOF both ways) closes; a shard that is down, a reset or stop() resets
            for w in (client_w, shard_w):
                if w is not None:
                    w.close() if clean else _set_linger_reset(w)
            stats["open"] -= 1
            self.tasks.discard(task)

    async def _pipe(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        counters: list[tuple[dict[str, int], str]],
    ) -> None:
        """One direction: each chunk leaves latency_s after it was read, in order; EOF and reset too."""
        loop = asyncio.get_running_loop()
        # (when it leaves, a chunk; b"" at EOF, None once the source reset: the destination is
        # reset after the delay)
        queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        room = asyncio.Event()
        room.set()
        held = 0

        async def read() -> None:
            nonlocal held
            while True:
                await room.wait()  # a full buffer stops reading: the sender's TCP window closes
                try:
                    chunk = await src.read(CHUNK)
                except OSError:
                    queue.put_nowait((loop.time() + self.latency_s, None))
                    return
                queue.put_nowait((loop.time() + self.latency_s, chunk))
                if not chunk:
                    return
                held += len(chunk)
                if held >= self.buffer_bytes:
                    room.clear()

        reader = asyncio.create_task(read())
        try:
            while True:
                due, chunk = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if chunk is None:
                    raise ConnectionResetError(f"peer reset ({counters[0][1]})")
                if not chunk:
                    if dst.can_write_eof():
                        dst.write_eof()  # half-close: the other direction keeps flowing
                    return
                dst.write(chunk)
                await dst.drain()
                held -= len(chunk)
                for stats, key in counters:
                    stats[key] += len(chunk)
                if held < self.buffer_bytes:
                    room.set()
        finally:
            reader.cancel()


class Wan:
    """Learner regions in network namespaces, joined to host shards over slow, distant links.

    Args:
        cfg: regions, rate and latency.
        shard_ports: the shards' ports on 127.0.0.1 of the host (they may start later).
        name: unique prefix for namespaces and links, [a-z][a-z0-9]{0,9}; default from the pid.
        peer_ports: (first, last) port range, or None: regions reach each other's servers on
            these ports at `region_address(r)`, through both links and the proxy; each
            region's ephemeral ports become this range.

    Example:
        with Wan(WanConfig(regions=2, rate_mbit=20, latency_ms=40), [port]) as wan:
            addrs = wan.shard_addresses(0)  # ["10.20x.y.1:PORT"]
            subprocess.run(wan.command_prefix(0) + ["atoll", "learner", "--shards", ",".join(addrs)])
    """

    def __init__(
        self,
        cfg: WanConfig,
        shard_ports: list[int],
        name: str | None = None,
        peer_ports: tuple[int, int] | None = None,
    ):
        if peer_ports is not None and not (
            len(peer_ports) == 2
            and 1024 <= peer_ports[0] <= peer_ports[1] <= 65535
            and peer_ports[1] - peer_ports[0] < MAX_PEER_PORTS
        ):
            raise WanError(
                f"peer_ports must be (first, last) with 1024 <= first <= last <= 65535 and at "
                f"most {MAX_PEER_PORTS} ports, got {peer_ports!r}"
            )
        if not shard_ports or not all(isinstance(p, int) and 0 < p < 65536 for p in shard_ports):
            raise WanError(
                f"shard_ports must be a non-empty list of ports in 1..65535, got {shard_ports!r}"
            )
        if name is None:
            name = f"w{os.getpid()}{chr(ord('a') + next(_names) % 26)}"
        if not _NAME.fullmatch(name):
            raise WanError(
                f"name must match [a-z][a-z0-9]{{0,9}} (it prefixes 15-byte interface names), got {name!r}"
            )
        self.cfg, self.shard_ports, self.name = cfg, list(shard_ports), name
        self.peer_ports = peer_ports
        self._table: int | None = None  # routing table (and rule priority) of peer traffic
        self.subnet: ipaddress.IPv4Network | None = None
        self._proxy: _Proxy | None = None
        self._ports: list[list[int]] = []
        # namespaces and host links this Wan created: all teardown deletes
        self._made: list[str] = []
        self._prev_sigterm: Callable[[int, FrameType | None], Any] | int | None = None
        self._sigterm_installed = False
        self._closed = False

    def namespace(self, region: int) -> str:
        return f"atoll-{self.name}-r{region}"

    def _links(self, region: int) -> tuple[str, str]:
        return f"{self.name}h{region}", f"{self.name}n{region}"

    def _addresses(self, region: int) -> tuple[str, str]:
        assert self.subnet is not None, "Wan is not set up: use it as a context manager"
        base = self.subnet.network_address + 4 * region
        return str(base + 1), str(base + 2)

    def __enter__(self) -> Wan:
        if (why := available()) is not None:
            raise WanError(why)
        sweep_stale()
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_installed = True
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        cfg = self.cfg
        tbf = [
            "tbf",
            "rate",
            f"{int(cfg.rate_bytes * 8)}bit",
            "burst",
            str(cfg.burst_bytes),
            "limit",
            str(cfg.limit_bytes),
        ]
        # the lock spans choosing the subnet and adding its addresses, so two Wans never pick the same
        with open(LOCK_PATH, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            existing = _run(["ip", "netns", "list"]).stdout.split()
            if taken := [
                self.namespace(r) for r in range(cfg.regions) if self.namespace(r) in existing
            ]:
                raise WanError(
                    f"namespace {taken[0]} exists: another Wan uses the name {self.name!r}; pick another "
                    f"name, or if it is a leftover, remove it with `ip netns del {taken[0]}`"
                )
            self.subnet = _free_subnet(self.name)
            for r in range(cfg.regions):
                ns, (host_link, ns_link), (host_ip, ns_ip) = (
                    self.namespace(r),
                    self._links(r),
                    self._addresses(r),
                )
                _run(["ip", "netns", "add", ns])
                self._made.append(ns)
                _run(
                    [
                        "ip",
                        "link",
                        "add",
                        host_link,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        ns_link,
                        "netns",
                        ns,
                    ]
                )
                self._made.append(host_link)
                _run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_link])
                _run(["ip", "link", "set", host_link, "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_link])
                _run(["ip", "-n", ns, "link", "set", ns_link, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["tc", "qdisc", "add", "dev", host_link, "root", *tbf])  # downlink
                _run(["tc", "-n", ns, "qdisc", "add", "dev", ns_link, "root", *tbf])  # uplink
            if self.peer_ports is not None:
                self._route_peers()
        self._proxy = _Proxy(cfg.latency_ms / 1000, cfg.proxy_buffer_bytes, cfg.regions)
        self._ports = [
            [self._proxy.listen(r, self._addresses(r)[0], p) for p in self.shard_ports]
            for r in range(cfg.regions)
        ]
        if self.peer_ports is not None:
            first, last = self.peer_ports
            for r in range(cfg.regions):
                for port in range(first, last + 1):
                    self._proxy.listen_peer(self._addresses(r)[1], port, r, self._region_of)

    def _route_peers(self) -> None:
        """Region-to-region TCP goes to the host, which delivers it to the proxy (not forwarded).

        In each region the /24 routes via the host end. On the host, packets that come in on
        one of our links and are addressed to a region's own address are looked up in our
        table, where every region address is local; the proxy's transparent listeners take
        them. The host's own connections still reach a region by its link (main table).
        """
        assert self.subnet is not None and self.peer_ports is not None
        first, last = self.peer_ports
        self._table = (
            TABLE_BASE + (int(self.subnet.network_address) - int(POOL.network_address)) // 256
        )
        table = str(self._table)
        for r in range(self.cfg.regions):
            host_ip, ns_ip = self._addresses(r)
            _run(["ip", "route", "add", "local", f"{ns_ip}/32", "dev", "lo", "table", table])
            _run(["ip", "rule", "add", "iif", self._links(r)[0], "lookup", table, "pref", table])
            ns = self.namespace(r)
            _run(["ip", "-n", ns, "route", "add", str(self.subnet), "via", host_ip])
            _run(
                ["ip", "netns", "exec", ns, "sysctl", "-q", "-w"]
                + [f"net.ipv4.ip_local_port_range={first} {last}"]
            )

    def _region_of(self, ip: str) -> int | None:
        """The region whose namespace end has address `ip`, else None."""
        assert self.subnet is not None
        offset = int(ipaddress.ip_address(ip)) - int(self.subnet.network_address)
        region, rest = divmod(offset, 4)
        return region if rest == 2 and 0 <= region < self.cfg.regions else None

    def region_address(self, region: int) -> str:
        """The address of `region`'s end of its link: what its servers bind for peer traffic."""
        return self._addresses(self._region(region))[1]

    def _region(self, region: int) -> int:
        if self._closed or self.subnet is None:
            raise WanError("Wan is not running: call its methods inside `with Wan(...) as wan:`")
        if not 0 <= region < self.cfg.regions:
            raise WanError(f"region must be in 0..{self.cfg.regions - 1}, got {region}")
        return region

    def command_prefix(self, region: int) -> list[str]:
        """Prepend to a command to run it inside `region`: ["ip", "netns", "exec", NS]."""
        return ["ip", "netns", "exec", self.namespace(self._region(region))]

    def shard_addresses(self, region: int) -> list[str]:
        """ "HOST:PORT" per shard, reachable from inside `region`, through its link and the proxy."""
        host_ip = self._addresses(self._region(region))[0]
        return [f"{host_ip}:{port}" for port in self._ports[region]]

    def stats(self) -> dict[int, dict[str, Any]]:
        """Per region: proxy bytes up/down, connections (total, open), and tc counters per direction."""
        out: dict[int, dict[str, Any]] = {}
        for r in range(self.cfg.regions):
            out[r] = dict(self._proxy.stats[r]) if self._proxy else {}
            host_link, ns_link = self._links(r)
            out[r]["tc_down"] = _tc_counters(["tc", "-s", "-j", "qdisc", "show", "dev", host_link])
            out[r]["tc_up"] = _tc_counters(
                ["tc", "-n", self.namespace(r), "-s", "-j", "qdisc", "show", "dev", ns_link]
            )
        return out

    def close(self) -> None:
        """Stops the proxy and removes every namespace and link this Wan made; safe to call again."""
        if self._closed:
            return
        self._closed = True
        if self._proxy is not None:
            self._proxy.stop()
        if self._table is not None:
            _drop_table(self._table)
        # deleting a namespace deletes its veth end, so the pair and both qdiscs; a host link whose
        # namespace is already gone is deleted on its own
        for made in self._made:
            if made.startswith("atoll-"):
                _run(["ip", "netns", "del", made], check=False)
            elif _run(["ip", "link", "show", made], check=False).returncode == 0:
                _run(["ip", "link", "del", made], check=False)
        atexit.unregister(self.close)
        # restore only if still on top; under a later Wan's handler ours stays in the chain, now a no-op
        if self._sigterm_installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(
                signal.SIGTERM,
                self._prev_sigterm if self._prev_sigterm is not None else signal.SIG_DFL,
            )

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        prev = self._prev_sigterm
        if callable(prev):
            prev(signum, frame)
        elif prev != signal.SIG_IGN:  # default or set outside Python: die by SIGTERM, as without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def _drop_table(table: int) -> None:
    """Removes every rule of priority `table` and every route in `table`."""
    while _run(["ip", "rule", "del", "pref", str(table)], check=False).returncode == 0:
        pass
    _run(["ip", "route", "flush", "table", str(table)], check=False)


def _tc_counters(args: list[str]) -> dict[str, Any]:
    done = _run(args, check=False)
    with contextlib.suppress(ValueError, IndexError, TypeError):
        q = next(q for q in json.loads(done.stdout) if q.get("root"))
        return {k: q[k] for k in ("bytes", "packets", "drops", "overlimits", "backlog") if k in q}
    return {}
