"""Malformed request bytes answered with INVALID_ARGUMENT: a grpc.aio server interceptor.

grpc decodes a request before the servicer runs, and a message that does not parse (a
truncated frame, garbage, another service's message) surfaces as UNKNOWN or INTERNAL, with
the parser's exception text. That tells the client nothing useful and reads like a server
bug. This interceptor takes the decoding over: handlers receive the raw bytes, it parses
them itself and refuses what does not parse with INVALID_ARGUMENT naming the message type.
In client-streaming calls (Append, ImportBlocks) a bad message raises InvalidRequest inside
the servicer's stream loop, which the servicer maps to INVALID_ARGUMENT as well.

Replies travel the other way as they come: a handler may return bytes it encoded itself
(the attention replies, `result_codec`), which go out unchanged; messages are serialized
as usual.

Install it innermost (last in the interceptor list): the interceptors outside it then see
raw bytes, and the authentication interceptor still refuses a call before anything is
parsed.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from cache_service.errors import InvalidRequest
from cache_service.wire.handler_cache import HandlerCache

__all__ = ["RequestDecodeInterceptor"]


def _message_name(method: str) -> str:
    return method.rsplit("/", 1)[-1] or method


def _explain(method: str, exc: Exception) -> str:
    return (
        f"the {_message_name(method)} request is not a valid protobuf message "
        f"({type(exc).__name__}): the bytes are truncated or corrupt, or the client uses "
        "another version of kvcache.v1"
    )


class RequestDecodeInterceptor(grpc.aio.ServerInterceptor):
    """Decode requests of methods under `service_prefix` in the handler, refusing bytes
    that do not parse with INVALID_ARGUMENT (see the module docstring)."""

    def __init__(self, service_prefix: str) -> None:
        self._prefix = service_prefix
        self._handlers = HandlerCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (
            handler is None
            or handler.request_deserializer is None
            or not method.startswith(self._prefix)
        ):
            return handler
        return self._handlers.get(method, handler, lambda h: _decoding(h, method))


def _decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` taking raw bytes and decoding them itself (INVALID_ARGUMENT if they do
    not parse)."""
    decode = handler.request_deserializer
    out = _passing_bytes(handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _unary_request(handler.unary_unary, decode, method), response_serializer=out
        )
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _unary_request_streaming(handler.unary_stream, decode, method),
            response_serializer=out,
        )
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _stream_request(handler.stream_unary, decode, method), response_serializer=out
        )
    return grpc.stream_stream_rpc_method_handler(
        _stream_request(handler.stream_stream, decode, method), response_serializer=out
    )


def _passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """`serialize`, except that replies already encoded (bytes) go out as they are."""
    if serialize is None:
        return None

    def serialize_or_pass(reply: Any) -> bytes:
        return reply if type(reply) is bytes else serialize(reply)

    return serialize_or_pass


def _unary_request(
    behavior: Callable[..., Any], decode: Callable[[bytes], Any], method: str
) -> Callable[..., Any]:
    async def wrapped(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = decode(raw)
        except Exception as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _explain(method, exc))
        result = behavior(request, context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return wrapped


def _unary_request_streaming(
    behavior: Callable[..., Any], decode: Callable[[bytes], Any], method: str
) -> Callable[..., Any]:
    if not (inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior)):
        return _unary_request(behavior, decode, method)
    is_async = inspect.isasyncgenfunction(behavior)

    async def wrapped_gen(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = decode(raw)
        except Exception as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _explain(method, exc))
        if is_async:
            async for response in behavior(request, context):
                yield response
        else:
            for response in behavior(request, context):
                yield response

    return wrapped_gen


def _stream_request(
    behavior: Callable[..., Any], decode: Callable[[bytes], Any], method: str
) -> Callable[..., Any]:
    async def decoded(raw_messages: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        index = 0
        async for raw in raw_messages:
            try:
                message = decode(raw)
            except Exception as exc:
                raise InvalidRequest(
                    f"message {index} of the stream: {_explain(method, exc)}"
                ) from None
            index += 1
            yield message

    if inspect.isasyncgenfunction(behavior):

        async def wrapped_gen(
            raw_messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async for response in behavior(decoded(raw_messages), context):
                yield response

        return wrapped_gen

    # A coroutine function: grpc.aio runs plain functions on a thread pool instead.
    async def wrapped(raw_messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        result = behavior(decoded(raw_messages), context)
        if inspect.isawaitable(result):
            result = await result
        return result

    return wrapped
