"""A grpc.aio server interceptor that times every RPC and records its final status code.

Kept apart from the metric definitions so the wrapping logic (four handler shapes, status
resolution) can be read on its own; ServiceMetrics owns the Counter and Histogram it feeds.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter, Histogram

from cache_service.wire.handler_cache import HandlerCache

__all__ = ["RpcMetricsInterceptor", "split_method"]


def split_method(full_method: str) -> tuple[str, str]:
    """Split a gRPC path "/pkg.Service/Method" into ("pkg.Service", "Method").

    Anything that does not look like a gRPC path is reported whole as the method with an
    empty service, so a malformed name never raises inside the serving path.
    """
    parts = full_method.lstrip("/").split("/")
    if len(parts) == 2 and parts[0] and parts[1]:
        return parts[0], parts[1]
    return "", full_method


def _status_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The status the client sees, as its enum name ("OK", "NOT_FOUND", ...)."""
    code = context.code()
    if code is None:
        if error is None:
            return "OK"
        # grpc.aio turns an uncaught servicer exception into UNKNOWN, a cancelled
        # handler into CANCELLED; abort() always sets the code first.
        return "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"
    if isinstance(code, grpc.StatusCode):
        return code.name
    for member in grpc.StatusCode:
        if member.value[0] == code:
            return member.name
    return "UNKNOWN"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Observe latency (seconds, wall clock) and count every handled RPC by method and code.

    Unknown methods (no handler) are not recorded: their names come from the client and
    would let any caller create unbounded label values.
    """

    def __init__(self, requests: Counter, duration: Histogram) -> None:
        self._requests = requests
        self._duration = duration
        # Wrapped handlers per method, and the labelled children per (service, method,
        # code): `labels()` validates and locks on every call, the children never change.
        self._handlers = HandlerCache()
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def _record(self, service: str, method: str, code: str, seconds: float) -> None:
        key = (service, method, code)
        children = self._children.get(key)
        if children is None:
            children = (self._duration.labels(*key), self._requests.labels(*key))
            self._children[key] = children
        children[0].observe(seconds)
        children[1].inc()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        full_method = handler_call_details.method
        return self._handlers.get(full_method, handler, lambda h: self._wrap(h, full_method))

    def _wrap(self, handler: grpc.RpcMethodHandler, full_method: str) -> grpc.RpcMethodHandler:
        """`handler` timed and counted under `full_method`'s labels."""
        service, method = split_method(full_method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, service, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_unary(handler.stream_unary, service, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_streaming(handler.unary_stream, service, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_streaming(handler.stream_stream, service, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _wrap_unary(self, behavior: Callable[..., Any], service: str, method: str):
        """Wrap a handler that returns one response (unary or client-streaming request)."""

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            except BaseException as exc:
                error = exc
                raise
            finally:
                seconds = time.perf_counter() - start
                self._record(service, method, _status_name(context, error), seconds)

        return wrapped

    def _wrap_streaming(self, behavior: Callable[..., Any], service: str, method: str):
        """Wrap a server-streaming handler; its time runs until the last response is sent.

        Such a handler is a (sync or async) generator or a coroutine that writes through
        context.write(); the wrapper keeps the same shape as the wrapped one.
        """
        if inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior):
            is_async = inspect.isasyncgenfunction(behavior)

            async def wrapped_gen(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                start = time.perf_counter()
                error: BaseException | None = None
                try:
                    if is_async:
                        async for response in behavior(request, context):
                            yield response
                    else:
                        for response in behavior(request, context):
                            yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    seconds = time.perf_counter() - start
                    self._record(service, method, _status_name(context, error), seconds)

            return wrapped_gen
        return self._wrap_unary(behavior, service, method)
