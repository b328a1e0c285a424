"""A typed client for one syncer shard: Init, Push, Pull, Watch, Describe.

Every call carries a deadline and the learner's bearer token; payloads go out in
chunks of `chunk_bytes`. Transient failures (UNAVAILABLE: a shard restarting, a
link dropping) are retried by the channel's service config with exponential
backoff; what remains surfaces as `grpc.RpcError` for the caller to branch on
`code()`. Pushes are idempotent by (learner, fragment, seq), so retrying one whose
ack was lost is always safe.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire import syncer_pb2_grpc as pb_grpc
from atoll.wire.parts import BoxLayout
from atoll.wire.plan import FragmentMap, FragmentPlan
from atoll.wire.push_stream import PushStreams

SYNCER_SERVICE = pb.DESCRIPTOR.services_by_name["Syncer"].full_name  # as its health names it
CHUNK_BYTES = 1 << 20  # payload bytes per stream message
MAX_MESSAGE_BYTES = 8 << 20  # must not exceed the shard's --max-message-bytes
# Trailing metadata of a shard's FAILED_PRECONDITION for a fragment it does not own: the
# owner's shard index and the fragment map version that put it there (docs/resharding.md).
OWNER_KEY, MAP_VERSION_KEY = "atoll-owner", "atoll-map-version"
FRAGMENT_KEY = "atoll-fragment"  # which fragment (a Watch of several ends on the first moved)

# Retries for a shard that is restarting or briefly unreachable: up to 5 attempts,
# 0.2 s doubling to 3 s, with gRPC's own jitter. Pushes are safe to retry (idempotent).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "atoll.v1.Syncer"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "3s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


# A learner pings its shards this often so an idle Watch outlives NATs and load balancers;
# the shard's keepalive policy (server/service.py) accepts pings this frequent.
KEEPALIVE_MS = 30_000


class IncompletePull(ConnectionError):
    """A Pull stream ended before its frames did; retry it like UNAVAILABLE."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    ca: pathlib.Path  # PEM CA bundle that signed the shards' certificates
    cert: pathlib.Path | None = None  # PEM client certificate, for mutual TLS
    key: pathlib.Path | None = None  # its PEM private key

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


@dataclasses.dataclass(frozen=True)
class Pulled:
    """A fragment at `version`: one FP32 snapshot frame, or deltas to apply in order."""

    fragment: int
    version: int
    snapshot: bool
    num_params: int
    frames: list[tuple[int, codec.Codec, bytes]]  # (version it leads to, codec, frame)
    last_seq: int = 0  # the newest seq the shard answered for this learner on the fragment
    next_due_seconds: float = (
        0.0  # until this learner's next push of the fragment is due (0: unknown)
    )


def described_map(d: pb.DescribeResponse) -> FragmentMap | None:
    """The fragment map a shard's Describe carries (None before it has a plan)."""
    if not d.owners:
        return None
    return FragmentMap(d.map_version, tuple(d.owners), tuple(d.moved_at))


class ShardClient:
    """One shard's channel. Cheap to keep open; `close()` when done."""

    def __init__(
        self,
        address: str,
        learner_id: str,
        *,
        token: str | None = None,
        tls: TlsFiles | None = None,
        deadline: float = 60.0,
        chunk_bytes: int = CHUNK_BYTES,
        push_stream: bool = True,
    ):
        """`push_stream`: pushes go on one PushStream kept open (wire/push_stream.py), or,
        False, each on a Push call of its own."""
        self.address, self.learner_id, self.deadline = address, learner_id, deadline
        self.chunk_bytes = chunk_bytes
        options = [
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.enable_retries", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.per_rpc_retry_buffer_size", 64 << 20),
        ]
        self.channel = (
            grpc.secure_channel(address, tls.credentials(), options)
            if tls
            else grpc.insecure_channel(address, options)
        )
        self.stub = pb_grpc.SyncerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.streams = PushStreams(
            lambda messages: self.stub.PushStream(
                messages, metadata=self.metadata, wait_for_ready=True
            ),
            deadline,
        )
        self.streams.offered = push_stream

    def _chunks(
        self, header_message: pb.InitRequest | pb.PushRequest, frame: bytes
    ) -> Iterator[pb.InitRequest | pb.PushRequest]:
        yield header_message
        kind = type(header_message)
        for start in range(0, len(frame), self.chunk_bytes):
            yield kind(chunk=frame[start : start + self.chunk_bytes])

    # --- moving a fragment (docs/resharding.md): an operator's calls ---

    @staticmethod
    def _move(fragment: int, fragment_map: FragmentMap) -> pb.MoveRequest:
        return pb.MoveRequest(
            fragment=fragment,
            map=pb.FragmentMap(
                version=fragment_map.version,
                owners=fragment_map.owners,
                moved_at=fragment_map.moved_at,
            ),
        )

    def freeze(self, fragment: int, fragment_map: FragmentMap) -> int:
        """Step 1 on the source; returns its map version."""
        response: pb.MoveResponse = self.stub.Freeze(
            self._move(fragment, fragment_map), timeout=self.deadline, metadata=self.metadata
        )
        return response.map_version

    def unfreeze(self, fragment: int) -> int:
        """Aborts a move on its source."""
        response: pb.MoveResponse = self.stub.Unfreeze(
            pb.MoveRequest(fragment=fragment), timeout=self.deadline, metadata=self.metadata
        )
        return response.map_version

    def export(self, fragment: int) -> tuple[str, bytes]:
        """Step 2 on the source: (meta JSON, payload) of the frozen fragment."""
        header: pb.FragmentStateHeader | None = None
        parts: list[bytes] = []
        for message in self.stub.Export(
            pb.MoveRequest(fragment=fragment), timeout=self.deadline, metadata=self.metadata
        ):
            if message.WhichOneof("kind") == "header":
                header = message.header
            else:
                parts.append(message.chunk)
        payload = b"".join(parts)
        if header is None or len(payload) != header.payload_bytes:
            raise IncompletePull(f"export of fragment {fragment} from {self.address} was cut short")
        return header.meta_json, payload

    def adopt(self, meta_json: str, payload: bytes) -> int:
        """Step 2 on the target; returns its map version."""
        header = pb.FragmentState(
            header=pb.FragmentStateHeader(meta_json=meta_json, payload_bytes=len(payload))
        )

        def messages() -> Iterator[pb.FragmentState]:
            yield header
            for start in range(0, len(payload), self.chunk_bytes):
                yield pb.FragmentState(chunk=payload[start : start + self.chunk_bytes])

        response: pb.MoveResponse = self.stub.Adopt(
            messages(), timeout=self.deadline, metadata=self.metadata
        )
        return response.map_version

    def commit(self, fragment: int, fragment_map: FragmentMap) -> int:
        """Step 3 on the source; returns its map version."""
        response: pb.MoveResponse = self.stub.Commit(
            self._move(fragment, fragment_map), timeout=self.deadline, metadata=self.metadata
        )
        return response.map_version

    def describe(self, timeout: float | None = None) -> pb.DescribeResponse:
        response: pb.DescribeResponse = self.stub.Describe(
            pb.DescribeRequest(),
            timeout=timeout or self.deadline,
            metadata=self.metadata,
            wait_for_ready=True,
        )
        return response

    def listening(self, timeout: float | None = None) -> bool:
        """Whether anything answers at this address, before asking a shard that may not be
        up (one past the last, or not started yet) to describe itself: False at once where
        the connection is refused, and after `timeout` s of silence. A health check asks,
        which fails on a refused connection where a Describe waits for the channel."""
        request = health_pb2.HealthCheckRequest(service=SYNCER_SERVICE)
        try:
            health_pb2_grpc.HealthStub(self.channel).Check(
                request, timeout=timeout or self.deadline
            )
        except grpc.RpcError as e:  # any other answer (NOT_SERVING, a refusal) is an answer
            unanswered = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            return e.code() not in unanswered
        return True

    def init(
        self,
        plan: FragmentPlan,
        fragment: int,
        frame: bytes,
        frame_codec: codec.Codec,
        part: pb.InitHeader | None = None,
    ) -> pb.InitResponse:
        """Offers the fragment's starting values; the first offer wins, later ones learn the
        version. `part`: a seed in parts, this call's (its parts, part, boxes and run_id)."""
        header = pb.InitHeader(
            learner_id=self.learner_id,
            fragment=fragment,
            plan_fingerprint=plan.fingerprint,
            plan_json=plan.to_json(),
            codec=cast(pb.Codec, int(frame_codec)),
            num_params=plan.fragment_sizes[fragment],
            frame_bytes=len(frame),
        )
        if part is not None:
            header.MergeFrom(part)
        response: pb.InitResponse = self.stub.Init(
            self._chunks(pb.InitRequest(header=header), frame),
            timeout=self.deadline,
            metadata=self.metadata,
            wait_for_ready=True,
        )
        return response

    def push(self, header: pb.PushHeader, frame: bytes) -> pb.PushResponse:
        """Streams one outer gradient; the ack comes once the shard has it on disk. Sent
        on the push stream where the shard offers one and it is free, else as a Push."""
        header.learner_id, header.frame_bytes = self.learner_id, len(frame)
        messages = list(self._chunks(pb.PushRequest(header=header), frame))
        streamed = self.streams.push(messages)
        if streamed is not None:
            return streamed
        response: pb.PushResponse = self.stub.Push(
            iter(messages),
            timeout=self.deadline,
            metadata=self.metadata,
            wait_for_ready=True,
        )
        return response

    def pull(
        self,
        fragment: int,
        have_version: int | None = None,
        boxes: Sequence[pb.TensorBox] = (),
    ) -> Pulled:
        """The fragment's newest version, as deltas from `have_version` when the shard still
        can; with `boxes`, of those elements only (`apply_boxes` rebuilds them)."""
        request = pb.PullRequest(fragment=fragment, learner_id=self.learner_id, boxes=boxes)
        if have_version is not None:
            request.have_version = have_version
        header, frames, parts = None, [], []
        for message in self.stub.Pull(
            request, timeout=self.deadline, metadata=self.metadata, wait_for_ready=True
        ):
            if message.WhichOneof("kind") == "header":
                header = message.header
                continue
            parts.append(message.chunk.data)
            if message.chunk.last:
                frames.append(
                    (message.chunk.version, codec.Codec(message.chunk.codec), b"".join(parts))
                )
                parts = []
        if header is None or len(frames) != header.num_frames or parts:
            raise IncompletePull(f"pull of fragment {fragment} from {self.address} ended early")
        return Pulled(
            fragment,
            header.version,
            header.snapshot,
            header.num_params,
            frames,
            header.last_seq,
            header.next_due_seconds,
        )

    def watch(self, fragments: list[int], timeout: float | None = None) -> Any:
        """A stream of WatchResponse (fragment, version, contributors); cancel() it to stop."""
        return self.stub.Watch(
            pb.WatchRequest(fragments=fragments, learner_id=self.learner_id),
            timeout=timeout,
            metadata=self.metadata,
            wait_for_ready=True,
        )

    def close(self) -> None:
        self.streams.close()
        self.channel.close()


def apply_boxes(pulled: Pulled, layout: BoxLayout, held: np.ndarray | None = None) -> np.ndarray:
    """The boxes' values at `pulled.version`, from a pull by those boxes.

    Every value is bit for bit what a whole pull of the fragment gives for that element:
    a delta's blocks go through the same `codec.decode_into` as a whole delta's.

    Args:
      pulled: what `ShardClient.pull(fragment, have, boxes)` returned.
      layout: `BoxLayout.of(shapes, boxes)` of the same boxes (shapes: the fragment's
        tensors' shapes, in `FragmentPlan.tensors_of` order).
      held: the boxes' values at the version pulled from (float32, `layout.size` of them,
        box after box, C order); updated in place. Needed unless `pulled` is a snapshot.

    Returns:
      `held` (a new array when None was given).

    Example:
      >>> lay = BoxLayout.of(shapes, boxes)
      >>> mine = apply_boxes(client.pull(p, None, boxes), lay)  # a snapshot
      >>> apply_boxes(client.pull(p, version, boxes), lay, mine)  # deltas, in place
    """
    if pulled.snapshot:
        values = codec.decode(pulled.frames[0][2], codec=codec.Codec.FP32, num_values=layout.size)
        if held is None:
            return values
        held[...] = values.reshape(held.shape)
        return held
    if held is None:
        raise ValueError(f"fragment {pulled.fragment}: deltas need the values they apply to")
    if held.dtype != np.float32 or held.size != layout.size or not held.flags.c_contiguous:
        raise ValueError(
            f"held: {layout.size} C-contiguous float32 values, got {held.size} {held.dtype}"
        )
    work = held.reshape(
        -1
    ).copy()  # written back once every frame applied: a bad one changes nothing
    for _, frame_codec, frame in pulled.frames:
        codes = layout.delta_codes(frame)
        at = layout.positions(codes.info.block)
        blocks = np.zeros(codes.num_values, np.float32)
        blocks[at] = work  # values outside the boxes are never read back
        codec.decode_into(codes, blocks, 1.0, codec=frame_codec)
        work = blocks[at]
    held.reshape(-1)[...] = work
    return held


def pull_boxes(
    client: ShardClient,
    plan: FragmentPlan,
    fragment: int,
    boxes: Sequence[pb.TensorBox],
    held: np.ndarray | None = None,
    have_version: int | None = None,
) -> tuple[int, np.ndarray]:
    """(version, the boxes' values at it): a process pulls only what it holds of a fragment.

    Args:
      client: the fragment's shard.
      plan: the run's plan; boxes name tensors by position in `plan.tensors_of(fragment)`.
      boxes: the pieces to pull (`wire.parts.tensor_box` of each jax shard), not overlapping.
      held, have_version: the boxes' values at `have_version`, updated in place by deltas
        (both None: a snapshot into a new array).

    Example:
      >>> v, mine = pull_boxes(client, plan, 0, [tensor_box(0, shard.index, shape)])
      >>> v, mine = pull_boxes(client, plan, 0, boxes, mine, v)  # later: deltas only
    """
    layout = BoxLayout.of([s.spec.shape for s in plan.tensors_of(fragment)], boxes)
    pulled = client.pull(fragment, have_version if held is not None else None, boxes)
    return pulled.version, apply_boxes(pulled, layout, held)
