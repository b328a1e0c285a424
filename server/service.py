"""The gRPC face of a shard: a thin servicer, auth, health, reflection, TLS."""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.config import ShardConfig, load_tokens
from server.shard import PushHeader, Shard, ShardError
from wire import syncer_pb2 as pb
from wire import syncer_pb2_grpc as pb_grpc

log = logging.getLogger("atoll.syncer")
SERVICE = pb.DESCRIPTOR.services_by_name["Syncer"].full_name
_REASONS = {"fresh": pb.PUSH_REASON_FRESH, "stale_discounted": pb.PUSH_REASON_STALE_DISCOUNTED,
            "duplicate": pb.PUSH_REASON_DUPLICATE, "too_stale": pb.PUSH_REASON_TOO_STALE,
            "already_in_round": pb.PUSH_REASON_ALREADY_IN_ROUND}
CHUNK_BYTES = 1 << 20


def _collect(first_kind: str, requests, limit: int) -> tuple[object, bytes]:
    """Reads a header then chunks; raises ShardError for a stream out of shape or oversize."""
    header = None
    parts: list[bytes] = []
    received = 0
    for request in requests:
        kind = request.WhichOneof("kind")
        if header is None:
            if kind != "header":
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the header")
            header = request.header
            if header.frame_bytes > limit:
                raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"frame of {header.frame_bytes} bytes exceeds this shard's limit of {limit}")
            continue
        if kind != "chunk":
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "only chunks may follow the header")
        received += len(request.chunk)
        if received > header.frame_bytes:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                          f"chunks exceed the header's frame_bytes={header.frame_bytes}")
        parts.append(request.chunk)
    if header is None:
        raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"empty {first_kind} stream: no header")
    if received != header.frame_bytes:
        raise ShardError(grpc.StatusCode.INVALID_ARGUMENT,
                      f"truncated stream: {received} of {header.frame_bytes} frame bytes arrived")
    return header, b"".join(parts)


class SyncerServicer(pb_grpc.SyncerServicer):
    """Translates requests into Shard calls and answers back; no math here."""

    def __init__(self, shard: Shard, max_frame_bytes: int, tokens: dict[str, str | None] | None = None):
        self.shard = shard
        self.max_frame_bytes = max_frame_bytes
        self.tokens = tokens  # token -> the learner it is bound to (None: any); None: no auth

    def _check_learner(self, context: grpc.ServicerContext, learner_id: str) -> None:
        """A token bound to a learner may act only as that learner (the interceptor checked the token)."""
        if self.tokens is None:
            return
        bound = self.tokens.get(_bearer(context.invocation_metadata()) or "")
        if bound is not None and learner_id and learner_id != bound:  # empty: an anonymous reader
            raise ShardError(grpc.StatusCode.PERMISSION_DENIED,
                             f"this token belongs to learner {bound!r}, not {learner_id!r}")

    def _refuse(self, context: grpc.ServicerContext, method: str, e: ShardError):
        self.shard.metrics.refused.labels(method, e.code.name).inc()
        context.abort(e.code, str(e))

    def Init(self, request_iterator, context):
        try:
            header, frame = _collect("Init", request_iterator, self.max_frame_bytes)
            self.shard.metrics.bytes_in.inc(len(frame))
            self._check_learner(context, header.learner_id)
            self.shard.touch(header.learner_id)
            created, version = self.shard.init(header.learner_id, header.fragment, header.plan_fingerprint,
                                               header.plan_json, frame, header.codec, header.num_params)
        except ShardError as e:
            self._refuse(context, "Init", e)
        return pb.InitResponse(created=created, version=version)

    def Push(self, request_iterator, context):
        try:
            header, frame = _collect("Push", request_iterator, self.max_frame_bytes)
            self.shard.metrics.bytes_in.inc(len(frame))
            self._check_learner(context, header.learner_id)
            h = PushHeader(header.learner_id, header.fragment, header.base_version, header.seq,
                           header.inner_steps, header.tokens, header.codec, header.num_params,
                           header.plan_fingerprint, header.step_seconds, header.overlap_steps)
            with self.shard.metrics.push_seconds.time():
                a = self.shard.push(h, frame)
        except ShardError as e:
            self._refuse(context, "Push", e)
        return pb.PushResponse(accepted=a.accepted, reason=_REASONS[a.reason], detail=a.detail,
                               version=a.version, staleness=max(0, a.staleness), weight=a.weight)

    def Pull(self, request, context):
        have = request.have_version if request.HasField("have_version") else None
        try:
            self._check_learner(context, request.learner_id)
            self.shard.touch(request.learner_id)
            version, snapshot, frames = self.shard.pull(request.fragment, have)
        except ShardError as e:
            self._refuse(context, "Pull", e)
        yield pb.PullResponse(header=pb.PullHeader(fragment=request.fragment, version=version,
                                                   snapshot=snapshot, num_frames=len(frames),
                                                   num_params=self.shard.fragments[request.fragment].size))
        for v, c, frame in frames:
            for start in range(0, max(len(frame), 1), CHUNK_BYTES):
                piece = frame[start:start + CHUNK_BYTES]
                yield pb.PullResponse(chunk=pb.PullChunk(version=v, codec=int(c), data=piece,
                                                         last=start + CHUNK_BYTES >= len(frame)))

    def Watch(self, request, context):
        fragments = list(request.fragments) or None
        known: dict[int, int] = {}
        try:
            self._check_learner(context, request.learner_id)
        except ShardError as e:
            self._refuse(context, "Watch", e)
        while context.is_active():
            self.shard.touch(request.learner_id)
            try:
                current = self.shard.versions(fragments)
            except ShardError as e:
                self._refuse(context, "Watch", e)
            for p, (version, contributors) in sorted(current.items()):
                if known.get(p) != version:
                    known[p] = version
                    yield pb.WatchResponse(fragment=p, version=version, contributors=contributors)
            self.shard.wait_for_change(known, fragments, timeout=1.0)

    def Describe(self, request, context):
        d = self.shard.describe()
        cfg = self.shard.cfg
        plan = d["plan"]
        out = pb.DescribeResponse(
            shard_index=cfg.shard_index, num_shards=cfg.num_shards,
            plan_fingerprint=plan.fingerprint if plan else "",
            num_fragments=plan.num_fragments if plan else 0, live_learners=d["live"],
            settings=pb.Settings(quorum=cfg.quorum, grace_factor=cfg.grace_factor,
                                 max_staleness=cfg.max_staleness, staleness_discount=cfg.staleness_discount,
                                 outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                                 delta_ring=cfg.delta_ring, snapshot_every=cfg.snapshot_every,
                                 publish_codec=int(cfg.publish_codec)))
        for p, frag in sorted(d["fragments"].items()):
            out.fragments.add(
                fragment=p, initialized=frag.initialized, version=frag.version, num_params=frag.size,
                round_size=frag.round.count, oldest_delta_base=(frag.ring[0][0] - 1) if frag.ring else frag.version,
                tensors=[pb.TensorInfo(name=s.name, shape=list(s.spec.shape), embedding=s.spec.embedding)
                         for s in plan.tensors_of(p)])
        return out


class _TokenAuth(grpc.ServerInterceptor):
    """Checks `authorization: Bearer TOKEN` on every call except health and reflection."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, tokens: dict[str, str | None]):
        self.tokens = tokens

    def intercept_service(self, continuation, details):
        if details.method.startswith(self.OPEN):
            return continuation(details)
        token = _bearer(details.invocation_metadata)
        if token is None or token not in self.tokens:
            handler = continuation(details)
            if handler is None:
                return None
            return _denying(handler)
        return continuation(details)


def _bearer(metadata) -> str | None:
    """The token of an `authorization: Bearer TOKEN` header, if any."""
    value = dict(metadata or ()).get("authorization", "")
    return value[7:] if value.startswith("Bearer ") else None


def _denying(handler):
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""
    def deny(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")

    def deny_stream(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        yield  # pragma: no cover

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    fn = deny_stream if handler.response_streaming else deny
    return make(fn, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class SyncerServer:
    """A running shard: gRPC server, health, timer thread. `start()` then `stop()`."""

    def __init__(self, cfg: ShardConfig, shard: Shard | None = None):
        self.cfg = cfg
        self.shard = shard or Shard(cfg)
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.max_concurrent_streams", cfg.max_concurrent_streams)]
        tokens = load_tokens(cfg.token_file) if cfg.token_file else None
        interceptors = [_TokenAuth(tokens)] if tokens else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max(8, cfg.max_concurrent_streams)),
                                  options=options, interceptors=interceptors)
        pb_grpc.add_SyncerServicer_to_server(SyncerServicer(self.shard, cfg.max_message_bytes * 64, tokens), self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._bind()
        self.metrics_port: int | None = None
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._tick_loop, name="round-timer", daemon=True)

    def _bind(self) -> int:
        cfg = self.cfg
        if cfg.tls:
            creds = grpc.ssl_server_credentials(
                [(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())],
                root_certificates=cfg.tls_client_ca.read_bytes() if cfg.tls_client_ca else None,
                require_client_auth=cfg.tls_client_ca is not None)
            port = self.server.add_secure_port(cfg.listen, creds)
        else:
            port = self.server.add_insecure_port(cfg.listen)
        if port == 0:
            raise OSError(f"could not listen on {cfg.listen}")
        return port

    def start(self) -> None:
        """Serves at once (NOT_SERVING), recovers, then reports SERVING."""
        self.server.start()
        if self.cfg.metrics_port is not None:
            host = self.cfg.listen.rsplit(":", 1)[0].strip("[]")
            self.metrics_port = self.shard.metrics.serve(self.cfg.metrics_port, host)
        replayed = self.shard.recover()
        log.info("shard %d/%d recovered (%d log records replayed) on port %d",
                 self.cfg.shard_index, self.cfg.num_shards, replayed, self.port)
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._timer.start()

    def _tick_loop(self) -> None:
        while not self._stop.is_set():
            wake = self.shard.tick()
            delay = 0.5 if wake is None else max(0.0, min(0.5, wake - self.shard.clock()))
            self._stop.wait(delay)

    def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.stop(grace).wait()
        self.shard.metrics.stop()
        self.shard.close()
