"""Tests for server/guards.py's reading of streamed requests: a bare chunk is read in
place, and reads as protobuf's own parse of the same bytes does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.server.guards import Chunk, Malformed, lenient, only_chunk
from atoll.wire import syncer_pb2 as pb

STREAMED = [pb.InitRequest, pb.PushRequest, pb.FragmentState]


def test_every_streamed_request_is_a_header_or_bytes_chunk_2():
    """What `lenient(..., chunks=True)` relies on, for every client-streaming Syncer call."""
    service = pb.DESCRIPTOR.services_by_name["Syncer"]
    streamed = {m.input_type.full_name for m in service.methods if m.client_streaming}
    assert streamed == {t.DESCRIPTOR.full_name for t in STREAMED}
    for t in STREAMED:
        field = t.DESCRIPTOR.fields_by_number[2]
        assert (field.name, field.type) == ("chunk", field.TYPE_BYTES)
        assert field.containing_oneof.name == "kind"


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=300), kind=st.sampled_from(STREAMED))
def test_a_bare_chunk_reads_as_protobufs_parse_of_it(payload, kind):
    data = kind(chunk=payload).SerializeToString()
    got = lenient(kind.FromString, chunks=True)(data)
    assert isinstance(got, Chunk) and isinstance(got.chunk, memoryview)
    want = kind.FromString(data)
    assert bytes(got.chunk) == want.chunk and got.WhichOneof("kind") == want.WhichOneof("kind")


@pytest.mark.parametrize(
    "data",
    [
        pb.PushRequest(header=pb.PushHeader(fragment=3, frame_bytes=9)).SerializeToString(),
        pb.PushRequest(chunk=b"ab").SerializeToString() * 2,  # two chunks: protobuf keeps the last
        pb.PushRequest(chunk=b"abc").SerializeToString()[:-1],  # cut short
        b"\x12" + b"\xff" * 11,  # a length no varint holds
        b"\x12",
        b"",
    ],
)
def test_anything_else_goes_to_the_full_parse(data):
    assert only_chunk(data) is None
    got = lenient(pb.PushRequest.FromString, chunks=True)(data)
    try:
        want = pb.PushRequest.FromString(data)
    except Exception:
        assert isinstance(got, Malformed)
    else:
        assert got == want


def test_single_requests_are_never_read_as_chunks():
    """A unary request whose only field is field 2 is the request, not a chunk."""
    data = pb.MoveRequest(fragment=0).SerializeToString() + b"\x12\x01x"
    assert not isinstance(lenient(pb.MoveRequest.FromString)(data), Chunk)
