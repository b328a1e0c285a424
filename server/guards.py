"""Who may call and what may be parsed: learner ids, bearer tokens, and request bytes
that do not parse (INVALID_ARGUMENT, where grpc itself would answer UNKNOWN)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from atoll.server.learner_ids import LEARNER_ID as LEARNER_ID  # re-exported for service.py
from atoll.server.learner_ids import learner_id_problem
from atoll.server.refusal import ShardError, Why
from atoll.server.serving import SERVICE


def bearer_token(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` header, if any."""
    value = dict(metadata or ()).get("authorization", "")
    return value[7:] if value.startswith("Bearer ") else None


def check_learner_id(learner_id: str, *, named: bool = False) -> None:
    """A caller's learner id obeys server/learner_ids.py; INVALID_ARGUMENT otherwise.
    Empty is an anonymous reader (Pull, Watch) unless the call must be `named` (Init and
    Push: what they write is a learner's)."""
    problem = learner_id_problem(learner_id) if learner_id or named else None
    if problem is not None:
        raise ShardError(Why.MALFORMED, problem)


# --- bearer tokens ------------------------------------------------------------------


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Checks `authorization: Bearer TOKEN` on every call except health and reflection."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, tokens: dict[str, str | None]):
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN):
            return handler
        if bearer_token(details.invocation_metadata) in self.tokens:
            return handler
        return denying(handler)


# --- malformed requests ---------------------------------------------------------------


class Malformed:
    """What request bytes that do not parse deserialize to: the call is then refused as
    INVALID_ARGUMENT (grpc's own answer to a deserializer that raises is UNKNOWN)."""

    def __init__(self, error: Exception):
        self.reason = f"the request does not parse ({type(error).__name__}: {error})"


_CHUNK_TAG = 0x12  # field 2 (`bytes chunk` of every streamed request), length-delimited


class Chunk:
    """A streamed request that is a `chunk` and nothing else (PushRequest, InitRequest and
    FragmentState alike), its bytes a view into the message grpc received: the full parse
    copies them twice more (into protobuf's arena, and out of it on each read of the field).
    Reads as the parsed message does where the servicer reads it."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: memoryview):
        self.chunk = chunk

    def WhichOneof(self, group: str) -> str | None:  # noqa: N802  # protobuf's name
        return "chunk" if group == "kind" else None


def only_chunk(data: bytes) -> Chunk | None:
    """`data` as a Chunk when it is exactly one `chunk` field (its tag, the varint length
    and that many bytes to the end), else None (the full parse decides what it is).

    Example:
      >>> bytes(only_chunk(b"\x12\x03abc").chunk), only_chunk(b"\x12\x03ab")
      (b'abc', None)
    """
    if len(data) < 2 or data[0] != _CHUNK_TAG:
        return None
    size, shift, i = 0, 0, 1
    while True:  # the length: a varint of at most 10 bytes
        if i >= len(data) or i > 10:
            return None
        byte = data[i]
        size |= (byte & 0x7F) << shift
        shift, i = shift + 7, i + 1
        if byte < 0x80:
            break
    return Chunk(memoryview(data)[i:]) if i + size == len(data) else None


def lenient(deserialize: Callable[[bytes], Any], chunks: bool = False) -> Callable[[bytes], Any]:
    """`deserialize` answering Malformed instead of raising; with `chunks` (a streamed
    request type whose field 2 is `bytes chunk`), a bare chunk is read without a copy."""

    def parse(data: bytes) -> Any:
        if chunks and (chunk := only_chunk(data)) is not None:
            return chunk
        try:
            return deserialize(data)
        except (DecodeError, RecursionError, ValueError) as e:
            return Malformed(e)

    return parse


class RefuseMalformed(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    """Every Syncer call parses its request bytes leniently: a single request that does
    not parse is refused here; a stream's message, by the servicer's `_read`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE}/"):
            return handler
        return parsing(handler)


def parsing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a lenient deserializer, refusing a single request that did not parse."""
    # every streamed Syncer request (Init, Push, Adopt) is a header, then `bytes chunk = 2`
    parse = lenient(handler.request_deserializer, chunks=handler.request_streaming)
    serialize = handler.response_serializer
    if handler.request_streaming:
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        inner = handler.stream_stream if handler.response_streaming else handler.stream_unary
        return make(inner, request_deserializer=parse, response_serializer=serialize)

    async def refuse(request: Malformed, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        raise AssertionError("context.abort returned")

    if handler.response_streaming:
        streaming = handler.unary_stream

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            if isinstance(request, Malformed):
                await refuse(request, context)
            # closed with this one: a cancelled Watch runs its cleanup at once
            async with contextlib.aclosing(streaming(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=parse, response_serializer=serialize
        )
    unary = handler.unary_unary

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await refuse(request, context)
        return await unary(request, context)

    return grpc.unary_unary_rpc_method_handler(
        unary_unary, request_deserializer=parse, response_serializer=serialize
    )


def denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def deny(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")

    async def deny_stream(
        request_or_iterator: object, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        yield  # pragma: no cover

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    fn = deny_stream if handler.response_streaming else deny
    return make(
        fn,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
