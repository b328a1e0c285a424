"""`atoll bench ingest`'s client processes: the simulated learners that push pre-encoded
frames to the shard (timing each push from its first message to its ack) and, as the
anchor, the no-op gRPC server that only drains the same messages."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np

from atoll.bench.ingest_limit import learner_frames
from atoll.local.processes import _die_with_parent
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.client import CHUNK_BYTES, ShardClient
from atoll.wire.plan import FragmentPlan

INNER_STEPS, TOKENS = 100, 100 * 8192  # what each push claims; sets the merge weight only
RAW_METHOD = "/atoll.bench.Raw/Drain"


def _chunked(header: pb.PushHeader, frame: bytes, chunk_bytes: int) -> Iterator[pb.PushRequest]:
    """The messages of one push, exactly as ShardClient.push sends them."""
    yield pb.PushRequest(header=header)
    for start in range(0, len(frame), chunk_bytes):
        yield pb.PushRequest(chunk=frame[start : start + chunk_bytes])


def row_boxes(plan: FragmentPlan, p: int, parts: int) -> list[list[pb.TensorBox]]:
    """Fragment p's tensors split by rows into `parts` boxes each: what each of `parts`
    processes holding the model FSDP-sharded over its first axis sends."""
    out: list[list[pb.TensorBox]] = [[] for _ in range(parts)]
    for t, slot in enumerate(plan.tensors_of(p)):
        shape = slot.spec.shape
        for k in range(parts):
            start = [shape[0] * k // parts] + [0] * (len(shape) - 1)
            stop = [shape[0] * (k + 1) // parts, *shape[1:]]
            out[k].append(pb.TensorBox(tensor=t, start=start, stop=stop))
    return out


def part_frames(plan: FragmentPlan, p: int, frame: bytes, parts: int) -> list[bytes]:
    """Each part's INT4 frame of fragment p's values in `frame` (`row_boxes` order)."""
    values, out = codec.decode(frame), []
    for boxes in row_boxes(plan, p, parts):
        pieces = []
        for box in boxes:
            slot = plan.tensors_of(p)[box.tensor]
            tensor = values[slot.offset : slot.end].reshape(slot.spec.shape)
            pieces.append(tensor[box.start[0] : box.stop[0]].reshape(-1))
        out.append(codec.encode(np.concatenate(pieces), codec.Codec.INT4))
    return out


def serve_raw(conn: Connection) -> None:
    """A no-op client-streaming gRPC server: drains each stream, acks its byte count."""
    _die_with_parent()  # a bench killed mid-phase takes its children with it

    def drain(requests: Iterable[bytes], context: grpc.ServicerContext) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64),
        options=[("grpc.max_receive_message_length", 8 << 20), ("grpc.max_concurrent_streams", 64)],
    )
    service, method = RAW_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                service, {method: grpc.stream_unary_rpc_method_handler(drain)}
            )
        ]
    )
    conn.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    conn.recv()  # any message, or the parent going away, stops it
    server.stop(0)


class _Versions:
    """A learner's view of fragment versions: raised by push acks and a Watch stream."""

    def __init__(self) -> None:
        self.known: dict[int, int] = {}
        self.cond = threading.Condition()

    def saw(self, p: int, version: int) -> None:
        with self.cond:
            if version > self.known.get(p, -1):
                self.known[p] = version
                self.cond.notify_all()

    def wait_for(self, p: int, version: int, timeout: float = 120.0) -> int:
        with self.cond:
            if not self.cond.wait_for(lambda: self.known.get(p, -1) >= version, timeout):
                raise TimeoutError(f"fragment {p} never reached version {version}")
            return self.known[p]


def _follow(watch: Iterable[Any], versions: _Versions) -> None:
    try:
        for w in watch:
            versions.saw(w.fragment, w.version)
    except grpc.RpcError:
        pass  # cancelled at the end, or the shard went away


def _channel(address: str) -> grpc.Channel:
    """A channel on a TCP connection of its own (gRPC otherwise shares one per process and address)."""
    return grpc.insecure_channel(
        address,
        [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_send_message_length", 8 << 20),
            ("grpc.max_receive_message_length", 8 << 20),
        ],
    )


def _tally() -> dict[str, Any]:
    """An empty count of pushes: bytes, accepted (and their params), refusals, latencies."""
    return {"bytes": 0, "accepted": 0, "accepted_params": 0, "refused": {}, "latency": []}


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key in ("bytes", "accepted", "accepted_params"):
        total[key] += part[key]
    total["latency"] += part["latency"]
    for k, v in part["refused"].items():
        total["refused"][k] = total["refused"].get(k, 0) + v


class _Pusher:
    """One learner's connections: its Watch stream, and per connection a push stub to the
    shard and a drain stub to the no-op server; fragment p goes on connection p mod their
    number."""

    def __init__(
        self,
        plan: FragmentPlan,
        frames: list[bytes],
        learner_id: str,
        shard_address: str,
        raw_address: str,
        connections: int,
        parts: int = 1,
    ) -> None:
        self.plan, self.frames, self.learner_id = plan, frames, learner_id
        self.parts = parts
        # each fragment's pushes as [(boxes, frame)] (one whole push: no boxes)
        self.messages = [
            [([], f)]
            if parts == 1
            else list(zip(row_boxes(plan, p, parts), part_frames(plan, p, f, parts)))
            for p, f in enumerate(frames)
        ]
        self.shard = ShardClient(shard_address, learner_id)  # its Watch stream
        self.channels = [
            (_channel(shard_address), _channel(raw_address)) for _ in range(connections)
        ]
        self.pushes = [pb_grpc.SyncerStub(c).Push for c, _ in self.channels]
        self.drains = [
            r.stream_unary(RAW_METHOD, request_serializer=pb.PushRequest.SerializeToString)
            for _, r in self.channels
        ]
        self.versions = _Versions()
        self.watch: Any = None  # the Watch call (a grpc stream, untyped), once following
        self.joined = 0  # ingest rounds so far; also this learner's push sequence number
        self.pool = futures.ThreadPoolExecutor(connections)
        # a push's parts go at once, one stream each, as the processes of a sharded
        # learner send theirs (each waits for its own part's ack, not for the others')
        self.part_pool = futures.ThreadPoolExecutor(connections * parts) if parts > 1 else None

    def follow(self) -> None:
        """Watches every fragment until it has seen each one's first version."""
        P = self.plan.num_fragments
        self.watch = self.shard.watch(list(range(P)))
        threading.Thread(target=_follow, args=(self.watch, self.versions), daemon=True).start()
        for p in range(P):
            self.versions.wait_for(p, 0)

    def header(self, p: int, base: int, k: int = 0) -> pb.PushHeader:
        boxes, frame = self.messages[p][k]
        return pb.PushHeader(
            learner_id=self.learner_id,
            fragment=p,
            base_version=base,
            seq=self.joined,
            inner_steps=INNER_STEPS,
            tokens=TOKENS,
            codec=pb.CODEC_INT4,
            num_params=self.plan.fragment_sizes[p],
            plan_fingerprint=self.plan.fingerprint,
            frame_bytes=len(frame),
            parts=0 if self.parts == 1 else self.parts,
            part=k,
            boxes=boxes,
        )

    def send_share(self, phase: str, c: int) -> dict[str, Any]:
        """Connection c's fragments, one push (or drain) at a time, each timed to its ack."""
        out = _tally()
        for p in range(c, self.plan.num_fragments, len(self.channels)):
            # the round this learner joined last time must have closed: base = its version
            base = 0 if phase == "raw" else self.versions.wait_for(p, self.joined - 1)
            t0 = time.monotonic()
            out["bytes"] += sum(len(frame) for _, frame in self.messages[p])
            for ack in self._send(phase, c, p, base):
                if ack is None:  # drained by the no-op server
                    continue
                self.versions.saw(p, ack.version)
                if ack.reason == pb.PUSH_REASON_PART_HELD:
                    continue
                if ack.accepted:
                    out["accepted"] += 1
                    out["accepted_params"] += self.plan.fragment_sizes[p]
                else:
                    name = pb.PushReason.Name(ack.reason)
                    out["refused"][name] = out["refused"].get(name, 0) + 1
            out["latency"].append(time.monotonic() - t0)  # the whole push, every part
        return out

    def _send(self, phase: str, c: int, p: int, base: int) -> list[Any]:
        """Every part of fragment p's push on connection c, all at once: their acks (None
        for the no-op server's drains)."""

        def one(k: int) -> Any:
            chunks = _chunked(self.header(p, base, k), self.messages[p][k][1], CHUNK_BYTES)
            if phase == "raw":
                self.drains[c](chunks, timeout=120)
                return None
            return self.pushes[c](chunks, timeout=120)

        if self.part_pool is None:
            return [one(0)]
        return list(self.part_pool.map(one, range(len(self.messages[p]))))

    def rounds(self, phase: str, rounds: int) -> dict[str, Any]:
        """`rounds` rounds of `phase` ("raw" or "ingest") over every connection at once."""
        cpu0, started = time.process_time(), time.monotonic()
        total = _tally()
        for _ in range(rounds):
            if phase != "raw":
                self.joined += 1
            shares = range(len(self.channels))
            for part in self.pool.map(lambda c: self.send_share(phase, c), shares):
                _add(total, part)
        return {
            "started": started,
            "ended": time.monotonic(),
            **total,
            "cpu_seconds": time.process_time() - cpu0,
        }

    def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        self.pool.shutdown()
        if self.part_pool is not None:
            self.part_pool.shutdown()
        self.shard.close()
        for c, r in self.channels:
            c.close()
            r.close()


def learner(
    conn: Connection,
    index: int,
    shard_address: str,
    raw_address: str,
    plan_json: str,
    connections: int,
    parts: int = 1,
) -> None:
    """One simulated learner: encodes its frames once, then runs the phases it is sent.

    Its pushes go over `connections` connections of its own, one thread each, fragment p
    on connection p mod `connections`; each push is timed from its first message to its ack."""
    _die_with_parent()
    plan = FragmentPlan.from_json(plan_json)
    frames = learner_frames(plan, index)
    pusher = _Pusher(
        plan, frames, f"bench-learner-{index}", shard_address, raw_address, connections, parts
    )
    conn.send([sum(len(f) for _, f in m) for m in pusher.messages])  # bytes of each push
    while (command := conn.recv()) is not None:
        phase, rounds = command
        if phase == "watch":  # after Init; every learner is live before anyone pushes
            pusher.follow()
            conn.send({})
        else:
            conn.send(pusher.rounds(phase, rounds))
    pusher.close()
