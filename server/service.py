"""The gRPC face of a shard: a thin asyncio servicer, auth, limits, health, reflection, TLS.

Serving runs on grpc.aio, so an open stream (a Watch, or a Push that sends its header
and stalls) costs a coroutine, never a thread: health and reflection are answered
whatever crowd is connected. The Shard's domain calls block (fragment locks, fsync,
merges), so they run on a small pool of worker threads and the event loop never waits
on them; on the event loop itself only `Shard.due_in` (no lock) and plain attributes are read.
Every SyncerServer in a process shares one event loop on a thread of its own (grpc.aio
polls through the first loop it meets), so tests and `atoll syncer` start and stop
servers from plain synchronous code.

Limits, each checked before the bytes it guards are buffered:
  1. A learner id is at most 128 of [A-Za-z0-9._:-] (empty on Pull and Watch: an anonymous
     reader; Init and Push need one).
  2. A frame's declared size is at most the shard's frame limit (RESOURCE_EXHAUSTED)
     and at most what its fragment can need in its codec (INVALID_ARGUMENT).
  3. Declared frame bytes are held against a per-connection and a shard-wide
     in-flight budget until the call ends (RESOURCE_EXHAUSTED when either is spent).
  4. A Push or Init stream that sends nothing for stream_idle_seconds is aborted
     (DEADLINE_EXCEEDED), and its budget given back; a PushStream within a push likewise.
A PushStream's pushes are each read, checked and answered as a Push (a call per push costs
the shard more CPU than the push's work); a refusal ends it with Push's status.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar, cast

import grpc
from grpc_health.v1 import _async as aio_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from atoll.server import intake
from atoll.server.certificates import CertificateFiles, ReloadingCertificate
from atoll.server.config import ConfigError, ShardConfig, load_tokens
from atoll.server.guards import (
    LEARNER_ID,
    RefuseMalformed,
    TokenAuth,
    bearer_token,
    check_learner_id,
)
from atoll.server.health_log import health_changed, tick_failed
from atoll.server.intake import (
    describe_response,
    frame_need,
    push_response,
    read_chunks,
    read_frame,
    read_message,
)
from atoll.server.push_batch import PushBatches
from atoll.server.refusal import ShardError, Why, broken
from atoll.server.serving import (
    OWN_PORT,
    SERVICE,
    Budget,
    ServingMetrics,
    VersionBoard,
    Wake,
    bind_refusal,
    check_ports,
    event_loop,
    host_port,
    keepalive_policy,
    listen,
    malloc_trim,
    run_on_loop,
)
from atoll.server.shard import RecoveryError, Shard
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.client import CHUNK_BYTES, KEEPALIVE_MS
from atoll.wire.plan import FragmentMap

log = logging.getLogger("atoll.syncer")
T = TypeVar("T")
# what callers import from here, though it lives in serving.py and guards.py
__all__ = [
    "LEARNER_ID",
    "STATUS",
    "ServingMetrics",
    "SyncerServer",
    "SyncerServicer",
    "check_ports",
    "event_loop",
    "keepalive_policy",
]
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# The one place a refusal's reason becomes a gRPC status code.
STATUS = {
    Why.MALFORMED: grpc.StatusCode.INVALID_ARGUMENT,
    Why.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Why.OUT_OF_STEP: grpc.StatusCode.FAILED_PRECONDITION,
    Why.BUSY: grpc.StatusCode.UNAVAILABLE,
    Why.TOO_BIG: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Why.TIMED_OUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Why.DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Why.UNKNOWN_CALLER: grpc.StatusCode.UNAUTHENTICATED,
    Why.BROKEN: grpc.StatusCode.INTERNAL,
}
WORKERS = 8  # threads running domain calls; pushes to different fragments run side by side
PENDING_CALLS = 10_000  # new calls queued before the event loop takes them up, then refused
TICK_FAILURES_UNHEALTHY = 3  # round-timer failures in a row that make health NOT_SERVING
TICK_RETRY_SECONDS = 0.5  # the round timer's pause after a failure
TRIM_SECONDS = 10.0  # how often freed heap memory is handed back to the OS
# Learners ping every KEEPALIVE_MS (wire/client.py) so an idle Watch outlives NATs and
# load balancers. grpc's server default allows one ping per 5 min without data and answers
# the third early one with GOAWAY too_many_pings: a Watch that heard no new version for
# ~3 min was dropped.
LEARNER_KEEPALIVE_MS = KEEPALIVE_MS


# --- the servicer -------------------------------------------------------------------


class SyncerServicer(pb_grpc.SyncerServicer):
    """Translates requests into Shard calls and answers back; no math here."""

    def __init__(
        self,
        shard: Shard,
        cfg: ShardConfig,
        tokens: dict[str, str | None] | None,
        workers: concurrent.futures.Executor,
        metrics: ServingMetrics,
    ):
        self.shard, self.cfg, self.workers, self.metrics = shard, cfg, workers, metrics
        self.tokens = tokens  # token -> the learner it is bound to (None: any); None: no auth
        self.budget = Budget(
            cfg.max_inflight_bytes, cfg.max_connection_inflight_bytes, metrics.inflight_bytes
        )
        self.batches = PushBatches(shard, workers)  # whole pushes go to workers in batches
        self.board = VersionBoard(lambda: self._call(self.shard.versions, None))
        self.watching: collections.Counter[str] = (
            collections.Counter()
        )  # learner -> open Watch streams

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking domain call on the worker pool; an unexpected error becomes INTERNAL."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)
        except ShardError:
            raise
        except Exception as e:
            log.exception("%s failed", getattr(fn, "__name__", fn))
            raise broken(e) from None

    async def _refuse(
        self, context: grpc.aio.ServicerContext, method: str, e: ShardError
    ) -> NoReturn:
        code = STATUS[e.why]
        self.shard.metrics.refused.labels(method, code.name).inc()
        await context.abort(code, str(e), trailing_metadata=e.metadata)
        raise AssertionError("context.abort returned")  # it always raises

    def _check_caller(
        self, context: grpc.aio.ServicerContext, learner_id: str, named: bool = False
    ) -> None:
        """The id is well formed (and given, for a `named` call), and a token bound to a
        learner acts only as that learner (the interceptor checked the token itself)."""
        check_learner_id(learner_id, named=named)
        if self.tokens is None:
            return
        bound = self.tokens.get(bearer_token(context.invocation_metadata()) or "")
        if bound is not None and learner_id and learner_id != bound:  # empty: an anonymous reader
            raise ShardError(
                Why.DENIED,
                f"this token belongs to learner {bound!r}, not {learner_id!r}",
            )

    @contextlib.asynccontextmanager
    async def _intake(
        self, kind: str, context: grpc.aio.ServicerContext, first: Any = None
    ) -> AsyncIterator[tuple[Any, list[bytes]]]:
        """Reads a header (or takes `first`, a PushStream's) then chunks; yields (header,
        frame in its chunks) with its bytes held against the budgets until the block ends.
        Raises ShardError for a stream out of shape, oversize, stalled, or from a caller
        that may not send it."""
        if first is None:
            first = await read_message(context, kind, self.cfg.stream_idle_seconds)
        if first is grpc.aio.EOF:
            raise ShardError(Why.MALFORMED, f"empty {kind} stream: no header")
        if first.WhichOneof("kind") != "header":
            raise ShardError(Why.MALFORMED, "the first message must be the header")
        header = first.header
        self._check_caller(context, header.learner_id, named=True)  # Init and Push write
        declared, limit = header.frame_bytes, self.cfg.max_frame_bytes
        if declared > limit:
            raise ShardError(
                Why.TOO_BIG,
                f"frame of {declared} bytes exceeds this shard's limit of {limit}",
            )
        need = frame_need(header, self.shard.plan)
        if declared > need:
            raise ShardError(
                Why.MALFORMED,
                f"frame_bytes={declared} is more than fragment {header.fragment} can need "
                f"in codec {header.codec} ({need} bytes)",
            )
        with self.budget.hold(context.peer(), declared):
            idle, streamed = self.cfg.stream_idle_seconds, kind == "PushStream"
            frame = await read_frame(context, kind, header, idle, streamed)
            self.shard.metrics.bytes_in.inc(declared)
            yield header, frame

    @contextlib.contextmanager
    def _open(self, method: str) -> Iterator[None]:
        gauge = self.metrics.open_calls.labels(method)
        gauge.inc()
        try:
            yield
        finally:
            gauge.dec()

    # --- the RPCs ---

    async def Init(
        self, request_iterator: AsyncIterator[pb.InitRequest], context: grpc.aio.ServicerContext
    ) -> pb.InitResponse:
        with self._open("Init"):
            try:
                async with self._intake("Init", context) as (header, frame):
                    created, version, held = await self._call(self._init, header, b"".join(frame))
            except ShardError as e:
                await self._refuse(context, "Init", e)
            return pb.InitResponse(created=created, version=version, held=held)

    def _init(self, header: pb.InitHeader, frame: bytes) -> tuple[bool, int, bool]:
        self.shard.touch(header.learner_id)
        created: tuple[bool, int, bool] = self.shard.init_part(
            header.learner_id,
            header.fragment,
            header.plan_fingerprint,
            header.plan_json,
            frame,
            header.codec,
            header.num_params,
            intake.seed_part(header),
        )
        return created

    async def Push(
        self, request_iterator: AsyncIterator[pb.PushRequest], context: grpc.aio.ServicerContext
    ) -> pb.PushResponse:
        with self._open("Push"):
            try:
                async with self._intake("Push", context) as (header, frame):
                    h = intake.push_header(header)
                    a = await self.batches.push(h, frame)
            except ShardError as e:
                await self._refuse(context, "Push", e)
            return push_response(self.shard, h, a)

    async def PushStream(
        self, request_iterator: AsyncIterator[pb.PushRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PushResponse]:
        with self._open("PushStream"):
            while True:
                try:  # between pushes, no idle limit: a learner pushes once a period
                    first = await read_message(context, "PushStream", None)
                    if first is grpc.aio.EOF:
                        return
                    async with self._intake("PushStream", context, first) as (header, frame):
                        h = intake.push_header(header)
                        a = await self.batches.push(h, frame)
                except ShardError as e:
                    await self._refuse(context, "PushStream", e)
                yield push_response(self.shard, h, a)

    async def Pull(
        self, request: pb.PullRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.PullResponse]:
        have = request.have_version if request.HasField("have_version") else None
        with self._open("Pull"):
            try:
                self._check_caller(context, request.learner_id)
                version, snapshot, frames, size, last_seq = await self._call(
                    self._pull, request.learner_id, request.fragment, have, request.boxes
                )
            except ShardError as e:
                await self._refuse(context, "Pull", e)
            yield pb.PullResponse(
                header=pb.PullHeader(
                    fragment=request.fragment,
                    version=version,
                    snapshot=snapshot,
                    num_frames=len(frames),
                    num_params=size,
                    last_seq=last_seq,
                    next_due_seconds=self.shard.due_in(request.fragment, request.learner_id),
                )
            )
            for v, c, frame in frames:
                for start in range(0, max(len(frame), 1), CHUNK_BYTES):
                    piece = frame[start : start + CHUNK_BYTES]
                    yield pb.PullResponse(
                        chunk=pb.PullChunk(
                            version=v,
                            codec=cast(pb.Codec, int(c)),
                            data=piece,
                            last=start + CHUNK_BYTES >= len(frame),
                        )
                    )

    def _pull(
        self, learner: str, p: int, have: int | None, boxes: Sequence[pb.TensorBox] = ()
    ) -> tuple[int, bool, list[tuple[int, codec.Codec, bytes]], int, int]:
        self.shard.touch(learner)
        version, snapshot, frames = self.shard.pull(p, have, intake.boxes(boxes))
        return (
            version,
            snapshot,
            frames,
            self.shard.fragments[p].size,
            self.shard.newest_seq(learner, p),
        )

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        fragments = list(request.fragments) or None
        learner = request.learner_id
        with self._open("Watch"):
            waiter = self.board.subscribe()  # before the first read: no change slips between
            try:
                try:
                    self._check_caller(context, learner)
                    current = await self._call(self._watch_start, learner, fragments)
                except ShardError as e:
                    await self._refuse(context, "Watch", e)
                self.watching[learner] += 1
                wake: Wake | None = None
                try:
                    known: dict[int, int] = {}
                    while True:
                        for p, (version, contributors) in sorted(current.items()):
                            # versions only grow; a board read older than the first read is skipped
                            if version > known.get(p, -1):
                                known[p] = version
                                yield pb.WatchResponse(
                                    fragment=p, version=version, contributors=contributors
                                )
                        if wake is not None:  # resumed past the yields: the notices are sent
                            wake.release()
                            wake = None
                        wake = await waiter
                        waiter = self.board.subscribe()  # before reading the board, as above
                        current = self.board.view(fragments)
                        # a Watch of every fragment ends too when one it announced moves
                        moved = self.shard.moved_away(fragments or sorted(known))
                        if moved is not None:  # the watcher follows it to its new owner
                            await self._refuse(context, "Watch", moved)
                finally:
                    if wake is not None:
                        wake.release()
                    self.watching[learner] -= 1
                    if not self.watching[learner]:
                        del self.watching[learner]
            finally:
                self.board.unsubscribe(waiter)

    def _watch_start(self, learner: str, fragments: list[int] | None) -> dict[int, tuple[int, int]]:
        self.shard.touch(learner)
        versions: dict[int, tuple[int, int]] = self.shard.versions(fragments)
        return versions

    def touch_watchers(self) -> None:
        """Refreshes the lease of every learner with an open Watch (a worker thread)."""
        for learner in list(self.watching):
            self.shard.touch(learner)

    # --- moving fragments (docs/resharding.md): an operator's calls ---

    def _check_operator(self, context: grpc.aio.ServicerContext) -> None:
        """With tokens on, only a token bound to no learner may move fragments."""
        if self.tokens is None:
            return
        token = bearer_token(context.invocation_metadata()) or ""
        if self.tokens.get(token, "") is not None:  # bound to a learner (or unknown)
            raise ShardError(
                Why.DENIED,
                "moving fragments takes a token bound to no learner (an operator's)",
            )

    @staticmethod
    def _move_args(request: pb.MoveRequest) -> tuple[int, FragmentMap]:
        try:
            m = request.map
            return request.fragment, FragmentMap(m.version, tuple(m.owners), tuple(m.moved_at))
        except ValueError as e:
            raise ShardError(Why.MALFORMED, f"map: {e}") from None

    async def _move_step(
        self, method: str, request: pb.MoveRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveResponse:
        with self._open(method):
            try:
                self._check_operator(context)
                if method == "Unfreeze":
                    await self._call(self.shard.unfreeze, request.fragment)
                else:
                    p, new = self._move_args(request)
                    step = self.shard.freeze if method == "Freeze" else self.shard.commit_move
                    await self._call(step, p, new)
            except ShardError as e:
                await self._refuse(context, method, e)
            fmap = self.shard.fragment_map
            return pb.MoveResponse(map_version=fmap.version if fmap else 0)

    async def Freeze(
        self, request: pb.MoveRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveResponse:
        return await self._move_step("Freeze", request, context)

    async def Unfreeze(
        self, request: pb.MoveRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveResponse:
        return await self._move_step("Unfreeze", request, context)

    async def Commit(
        self, request: pb.MoveRequest, context: grpc.aio.ServicerContext
    ) -> pb.MoveResponse:
        return await self._move_step("Commit", request, context)

    async def Export(
        self, request: pb.MoveRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FragmentState]:
        with self._open("Export"):
            try:
                self._check_operator(context)
                meta, payload = await self._call(self.shard.export, request.fragment)
            except ShardError as e:
                await self._refuse(context, "Export", e)
            yield pb.FragmentState(
                header=pb.FragmentStateHeader(
                    meta_json=json.dumps(meta), payload_bytes=len(payload)
                )
            )
            for start in range(0, len(payload), CHUNK_BYTES):
                yield pb.FragmentState(chunk=payload[start : start + CHUNK_BYTES])

    async def Adopt(
        self, request_iterator: AsyncIterator[pb.FragmentState], context: grpc.aio.ServicerContext
    ) -> pb.MoveResponse:
        with self._open("Adopt"):
            try:
                self._check_operator(context)
                first = await read_message(context, "Adopt", self.cfg.stream_idle_seconds)
                if first is grpc.aio.EOF or first.WhichOneof("kind") != "header":
                    raise ShardError(Why.MALFORMED, "the first message must be the header")
                declared = first.header.payload_bytes
                with self.budget.hold(context.peer(), declared):
                    idle = self.cfg.stream_idle_seconds
                    parts = await read_chunks(context, "Adopt", declared, "payload_bytes", idle)
                    payload = b"".join(parts)
                    try:
                        meta = json.loads(first.header.meta_json)
                    except (ValueError, RecursionError) as e:
                        raise ShardError(Why.MALFORMED, f"meta_json: {e}") from None
                    await self._call(self.shard.adopt, meta, payload)
            except ShardError as e:
                await self._refuse(context, "Adopt", e)
            fmap = self.shard.fragment_map
            return pb.MoveResponse(map_version=fmap.version if fmap else 0)

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        with self._open("Describe"):
            try:
                return await self._call(describe_response, self.shard)
            except ShardError as e:
                await self._refuse(context, "Describe", e)


# --- the server ---------------------------------------------------------------------


class SyncerServer:
    """A running shard: gRPC server, health (and its optional plaintext port), round timer.

    `start()` serves at once as NOT_SERVING, recovers, then reports SERVING; `stop()`
    reports NOT_SERVING, stops serving and writes a final snapshot. Both are called
    from ordinary threads; the servers themselves live on the shared event loop.
    """

    def __init__(self, cfg: ShardConfig, shard: Shard | None = None):
        self.cfg = cfg
        self.shard = shard or Shard(cfg)
        self.loop = event_loop()
        self.metrics = ServingMetrics(self.shard.metrics.registry)
        self.workers = concurrent.futures.ThreadPoolExecutor(
            WORKERS, thread_name_prefix=f"shard{cfg.shard_index}-worker"
        )
        tokens = load_tokens(cfg.token_file) if cfg.token_file else None
        self.metrics_port: int | None = None
        self.health_port: int | None = None
        self.certificate: ReloadingCertificate | None = None  # with TLS on
        self._started = self._stopping = self._stopped = False
        self._tick_failures = 0
        self._published = False  # what health last said: SERVING or not
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._tick_loop, name="round-timer", daemon=True)
        self._housekeeping: concurrent.futures.Future[None] | None = None
        try:
            self.port = run_on_loop(self._build(tokens))
        except BaseException:  # a port this host refuses: give back what was taken
            self.workers.shutdown()
            if shard is None:
                self.shard.close()
            raise

        def listener() -> None:  # under the shard's lock: hand the poke to the event loop
            self.loop.call_soon_threadsafe(self.servicer.board.poke)

        self._listener = listener
        self.shard.listeners.append(self._listener)

    async def _build(self, tokens: dict[str, str | None] | None) -> int:
        """Makes the servers on the event loop (grpc.aio objects belong to the loop they
        are made on) and binds them; returns the gRPC port."""
        cfg = self.cfg
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
            # calls waiting for the event loop to take them: every learner's Watch
            # arrives at once after a restart, and past grpc's default (1,000, then
            # refused at random as CANCELLED) a tenth of a 2,000-stream crowd was lost
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", 2 * PENDING_CALLS),
            *keepalive_policy(LEARNER_KEEPALIVE_MS),
            *OWN_PORT,
        ]
        self.health = aio_health.HealthServicer()
        self.servicer = SyncerServicer(self.shard, cfg, tokens, self.workers, self.metrics)
        self.server = grpc.aio.server(
            options=options,
            interceptors=[TokenAuth(tokens), RefuseMalformed()] if tokens else [RefuseMalformed()],
        )
        pb_grpc.add_SyncerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), self.server
        )
        await self._publish_health()
        creds = None
        if cfg.tls:
            assert (
                cfg.tls_key is not None and cfg.tls_cert is not None
            )  # ShardConfig checks both are set
            # a ConfigError now when the files cannot be served; renewed files are taken
            # at the next handshake after they change (server/certificates.py)
            self.certificate = ReloadingCertificate(
                CertificateFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca),
                self.shard.metrics.registry,
            )
            creds = self.certificate.credentials()
        port = listen(self.server, "--listen", cfg.host, cfg.port, creds)
        self.health_server = None
        if cfg.health_port is not None:
            # Plaintext health only, mirroring the main port's: probes read NOT_SERVING
            # even where the main port needs TLS and client certificates.
            self.health_server = grpc.aio.server(options=OWN_PORT)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = listen(
                self.health_server, "--health-port", cfg.host, cfg.health_port
            )
        return port

    @property
    def serving(self) -> bool:
        """What health says: recovered, its log not failed since, not stopping, and the
        round timer making progress."""
        ticking = self._tick_failures < TICK_FAILURES_UNHEALTHY
        up = self._started and not self._stopping and self.shard.recovery_error is None
        return up and ticking

    async def _publish_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self._published = status == health_pb2.HealthCheckResponse.SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)
        self.metrics.serving.set(1 if self.serving else 0)

    async def _start_servers(self) -> None:
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    def start(self, stop: threading.Event | None = None) -> None:
        """Serves at once (NOT_SERVING), recovers, then reports SERVING; a ConfigError,
        serving nothing, when the metrics port cannot be had. Once `stop` is set the
        replay ends with RecoveryStopped (still NOT_SERVING: `stop()` follows)."""
        if self.cfg.metrics_port is not None:
            host, port = self.cfg.host, self.cfg.metrics_port
            try:
                self.metrics_port = self.shard.metrics.serve(port, host)
            except OSError as e:
                raise ConfigError(
                    f"--metrics-port: cannot listen on {host_port(host, port)}: {bind_refusal(e, host)}"
                ) from None
        run_on_loop(self._start_servers())
        try:
            replayed = self.shard.recover(stop)
        except RecoveryError as e:
            # Stay up and NOT_SERVING with the reason, rather than exit into a restart loop
            # that would replay the same record: the operator decides (see the message).
            log.error("shard %d/%d: %s", self.cfg.shard_index, self.cfg.num_shards, e)
            return
        log.info(
            "shard %d/%d recovered (%d log records replayed) on port %d",
            self.cfg.shard_index,
            self.cfg.num_shards,
            replayed,
            self.port,
        )
        self._started = True
        run_on_loop(self._publish_health())
        self._housekeeping = asyncio.run_coroutine_threadsafe(self._housekeep(), self.loop)
        self._timer.start()

    async def _housekeep(self) -> None:
        await asyncio.gather(self._refresh_leases(), self._give_back_memory())

    async def _refresh_leases(self) -> None:
        """An open Watch keeps its learner's lease, refreshed for all of them at once."""
        interval = min(max(self.cfg.lease_seconds / 3, 0.05), 5.0)
        while True:
            await asyncio.sleep(interval)
            if self.servicer.watching:
                with contextlib.suppress(ShardError):
                    await self.servicer._call(self.servicer.touch_watchers)

    async def _give_back_memory(self) -> None:
        """What a crowd of streams took goes back to the OS once it has left."""
        trim = malloc_trim()
        while trim is not None:
            await asyncio.sleep(TRIM_SECONDS)
            await asyncio.get_running_loop().run_in_executor(self.workers, trim, 0)

    def _tick_loop(self) -> None:
        """Closes rounds on time, and keeps health in step. Never dies: a failing tick is
        logged and counted; health says NOT_SERVING, and why, while ticks keep failing
        (rounds cannot close) or once the shard's log failed (server/health_log.py)."""
        while not self._stop.is_set():
            try:
                wake = self.shard.tick()
                delay = 0.5 if wake is None else max(0.0, min(0.5, wake - self.shard.clock()))
                self._tick_failures = 0
            except Exception as e:  # noqa: BLE001 - counted, said, and tried again
                self.metrics.tick_failures.inc()
                self._tick_failures += 1
                tick_failed(e, self._tick_failures)
                delay = TICK_RETRY_SECONDS
            if self._published != self.serving and not self._stopping:
                health_changed(self.serving, self.shard.recovery_error, self._tick_failures)
                run_on_loop(self._publish_health())
            self._stop.wait(delay)

    async def _stop_servers(self, grace: float) -> None:
        await self._publish_health()
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)

    def stop(self, grace: float = 2.0) -> None:
        """NOT_SERVING, stops serving (calls still open after `grace` seconds are
        cancelled), waits for domain calls in progress, then the final snapshot."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        self._stop.set()
        run_on_loop(self._stop_servers(grace))
        if self._timer.is_alive():
            self._timer.join()
        self.workers.shutdown(wait=True)
        with contextlib.suppress(ValueError):
            self.shard.listeners.remove(self._listener)
        self.shard.metrics.stop()
        self.shard.close()
