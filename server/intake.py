"""What the servicer reads and writes beside its calls: a stream's messages (each within
the idle limit, none malformed), a push's header and its answer, a header's most frame
bytes, the chunks after a header, and the Describe answer."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import grpc
import numpy as np

from atoll.server.fragment import Answer
from atoll.server.guards import Malformed
from atoll.server.parts import Box
from atoll.server.refusal import ShardError, Why
from atoll.server.seed_parts import SeedPart
from atoll.server.shard import PushHeader, Shard
from atoll.wire import codec
from atoll.wire import syncer_pb2 as pb
from atoll.wire.plan import FragmentPlan


async def read_message(
    context: grpc.aio.ServicerContext, kind: str, idle_seconds: float | None
) -> Any:
    """The stream's next message, or EOF; a stream silent too long is aborted (None: a
    PushStream between pushes, which may wait as long as its learner likes)."""
    try:
        async with asyncio.timeout(idle_seconds):
            message = await context.read()
    except TimeoutError:
        raise ShardError(
            Why.TIMED_OUT,
            f"{kind} stream sent nothing for {idle_seconds:g} s; "
            "send the frame's chunks without pausing",
        ) from None
    if isinstance(message, Malformed):
        raise ShardError(Why.MALFORMED, f"{kind} stream: {message.reason}")
    return message


# The domain's PushHeader, read from the protobuf's fields of the same names (every one
# of them is there: tests/test_shard.py checks it).
PUSH_FIELDS = tuple(f.name for f in dataclasses.fields(PushHeader))


def push_header(header: pb.PushHeader) -> PushHeader:
    """The shard's PushHeader from a Push stream's header, field by name."""
    fields = {name: getattr(header, name) for name in PUSH_FIELDS}
    fields["boxes"] = boxes(header.boxes)
    return PushHeader(**fields)


REASONS = {
    "fresh": pb.PUSH_REASON_FRESH,
    "stale_discounted": pb.PUSH_REASON_STALE_DISCOUNTED,
    "duplicate": pb.PUSH_REASON_DUPLICATE,
    "too_stale": pb.PUSH_REASON_TOO_STALE,
    "already_in_round": pb.PUSH_REASON_ALREADY_IN_ROUND,
    "part_held": pb.PUSH_REASON_PART_HELD,
    "parts_dropped": pb.PUSH_REASON_PARTS_DROPPED,
}


def push_response(shard: Shard, h: PushHeader, a: Answer) -> pb.PushResponse:
    """A push's answer (Push's and PushStream's), naming the push it answers."""
    return pb.PushResponse(
        accepted=a.accepted,
        reason=REASONS[a.reason],
        detail=a.detail,
        version=a.version,
        staleness=max(0, a.staleness),
        weight=a.weight,
        cadence_seconds=shard.cadence_seconds or 0.0,
        next_due_seconds=shard.due_in(h.fragment, h.learner_id),
        fragment=h.fragment,
        seq=h.seq,
        part=h.part,
        header_frames=True,  # this shard takes a push's frame in its header: read_frame
    )


def boxes(messages: Sequence[pb.TensorBox]) -> tuple[Box, ...]:
    """The shard's Boxes of a push part's or a pull's TensorBoxes."""
    return tuple(Box(b.tensor, tuple(b.start), tuple(b.stop)) for b in messages)


def seed_part(header: pb.InitHeader) -> SeedPart | None:
    """The seed part an Init header names (values to come from its frame), or None."""
    if header.parts == 0:
        return None
    return SeedPart(header.run_id, header.part, header.parts, boxes(header.boxes), np.zeros(0))


def frame_need(header: pb.InitHeader | pb.PushHeader, plan: FragmentPlan | None) -> int:
    """Most frame bytes the header's fragment can need in its codec."""
    try:
        frame_codec = codec.Codec(header.codec)
    except ValueError:
        raise ShardError(Why.MALFORMED, f"codec {header.codec} is not accepted") from None
    if plan is None:  # the first Init brings the plan; the shard checks num_params against it
        values = header.num_params
    elif header.fragment < plan.num_fragments:
        values = plan.fragment_sizes[header.fragment]
    else:  # the shard refuses the fragment itself; until then no frame outgrows the largest
        values = max(plan.fragment_sizes)
    need: int = codec.max_frame_bytes(values, frame_codec)
    return need


async def read_frame(
    context: grpc.aio.ServicerContext,
    kind: str,
    header: pb.InitHeader | pb.PushHeader,
    idle_seconds: float,
    streamed: bool,
) -> list[bytes]:
    """A header's frame, its `frame_bytes` long: carried in the header itself (a push's
    PushHeader.frame: one message, no chunk may follow), or the chunks after it."""
    declared = header.frame_bytes
    inline = header.frame if isinstance(header, pb.PushHeader) else b""
    if not inline:
        return await read_chunks(context, kind, declared, "frame_bytes", idle_seconds, streamed)
    if len(inline) != declared:
        raise ShardError(
            Why.MALFORMED,
            f"the header carries {len(inline)} frame bytes, its frame_bytes says {declared}",
        )
    if not streamed and await read_message(context, kind, idle_seconds) is not grpc.aio.EOF:
        raise ShardError(Why.MALFORMED, "no chunk may follow a frame carried in the header")
    return [inline]


async def read_chunks(
    context: grpc.aio.ServicerContext,
    kind: str,
    declared: int,
    field: str,
    idle_seconds: float,
    until_declared: bool = False,
) -> list[bytes]:
    """The chunks that follow a stream's header, as they arrived: exactly the `declared`
    bytes its header's `field` announced (the caller holds them against the budgets), up
    to the stream's end, or `until_declared` are in (a PushStream's next push follows). Not
    joined: a push's frame is checked, logged and merged in its pieces (a joined frame
    above the allocator's mmap threshold faulted in fresh zeroed pages on every push)."""
    parts: list[bytes] = []
    received = 0
    while (
        not (until_declared and received == declared)
        and (request := await read_message(context, kind, idle_seconds)) is not grpc.aio.EOF
    ):
        if request.WhichOneof("kind") != "chunk":
            raise ShardError(Why.MALFORMED, "only chunks may follow the header")
        chunk = request.chunk  # each read of the field is a fresh copy of its bytes
        received += len(chunk)
        if received > declared:
            raise ShardError(
                Why.MALFORMED,
                f"chunks exceed the header's {field}={declared}",
            )
        parts.append(chunk)
    if received != declared:
        raise ShardError(
            Why.MALFORMED,
            f"truncated stream: {received} of {declared} {field.split('_')[0]} bytes arrived",
        )
    return parts


def describe_response(shard: Shard) -> pb.DescribeResponse:
    """A Describe answer from the shard's plan, map, fragments, moves and settings."""
    d = shard.describe()
    cfg = shard.cfg
    plan = d["plan"]
    out = pb.DescribeResponse(
        shard_index=cfg.shard_index,
        num_shards=cfg.num_shards,
        plan_fingerprint=plan.fingerprint if plan else "",
        num_fragments=plan.num_fragments if plan else 0,
        live_learners=d["live"],
        map_version=d["fragment_map"].version if d["fragment_map"] else 0,
        owners=d["fragment_map"].owners if d["fragment_map"] else (),
        moved_at=d["fragment_map"].moved_at if d["fragment_map"] else (),
        settings=pb.Settings(
            quorum=cfg.quorum,
            grace_factor=cfg.grace_factor,
            max_staleness=cfg.max_staleness,
            staleness_discount=cfg.staleness_discount,
            outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum,
            momentum_delay=cfg.momentum_delay,
            delta_ring=cfg.delta_ring,
            snapshot_every=cfg.snapshot_every,
            publish_codec=cast(pb.Codec, int(cfg.publish_codec)),
        ),
    )
    for p, frag in sorted(d["fragments"].items()):
        out.fragments.add(
            fragment=p,
            initialized=frag.initialized,
            version=frag.version,
            num_params=frag.size,
            round_size=frag.round.count,
            oldest_delta_base=(frag.ring[0][0] - 1) if frag.ring else frag.version,
            moving_version=d["frozen"][p].version if p in d["frozen"] else 0,
            moving_to=d["frozen"][p].owner(p) if p in d["frozen"] else 0,
            tensors=[
                pb.TensorInfo(name=s.name, shape=list(s.spec.shape), embedding=s.spec.embedding)
                for s in plan.tensors_of(p)
            ],
        )
    return out
