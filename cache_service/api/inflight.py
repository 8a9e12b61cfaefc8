"""Per-client limit on requests in flight: a grpc.aio server interceptor.

One client that floods the server (a runaway retry loop, a batch job without a semaphore)
would otherwise fill the coordinator's queues and the workers' batches and push every other
client's latency up. Past `max_in_flight` concurrent calls, a client's next call is refused
at once with RESOURCE_EXHAUSTED and a message saying what to do; nothing is queued for it.

A client is one connection (the gRPC peer address, "ipv4:127.0.0.1:54321"), tagged with its
tenant when the call is authenticated: what one SDK instance (one channel) sends. The
tenant-wide bounds are the quotas (blocks, sequences). Only the KV-cache service counts:
health checks and reflection are never refused.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from cache_service.api.auth import current_principal
from cache_service.wire.handler_cache import HandlerCache

__all__ = ["InFlightLimitInterceptor", "InFlightLimiter"]


class InFlightLimiter:
    """Counts calls in flight per client key. Pure bookkeeping; used from one event loop.

    Args:
        max_in_flight: calls one client may have in flight (>= 1).

    Raises:
        ValueError: max_in_flight < 1.
    """

    def __init__(self, max_in_flight: int) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
            raise ValueError(f"max_in_flight must be an int, got {max_in_flight!r}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._counts: dict[str, int] = {}
        self.refused = 0

    def try_acquire(self, client: str) -> bool:
        """Count one more call of `client`; False (and nothing counted) past the limit."""
        n = self._counts.get(client, 0)
        if n >= self.max_in_flight:
            self.refused += 1
            return False
        self._counts[client] = n + 1
        return True

    def release(self, client: str) -> None:
        """One call of `client` finished."""
        n = self._counts.get(client, 0) - 1
        if n > 0:
            self._counts[client] = n
        else:
            self._counts.pop(client, None)

    def in_flight(self, client: str | None = None) -> int:
        """Calls in flight of one client, or of all clients (None)."""
        if client is None:
            return sum(self._counts.values())
        return self._counts.get(client, 0)


def _client_key(context: grpc.aio.ServicerContext) -> str:
    principal = current_principal()
    peer = context.peer() or "unknown-peer"
    return f"{principal.tenant}@{peer}" if principal is not None else peer


class InFlightLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuse a client's call with RESOURCE_EXHAUSTED while it has `max_in_flight` others.

    Place it after the authentication interceptor, so the tenant is known when it counts.

    Args:
        limiter: the counts (shared so tests and metrics can read them).
        service_prefix: only methods starting with it are limited ("/kvcache.v1.KVCache/").
    """

    def __init__(self, limiter: InFlightLimiter, service_prefix: str) -> None:
        self._limiter = limiter
        self._prefix = service_prefix
        self._handlers = HandlerCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        # The client key is computed per call inside the wrapper: one wrapper per method.
        return self._handlers.get(method, handler, self._wrap_handler)

    def _wrap_handler(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        common = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._wrap(handler.unary_unary), **common)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._wrap(handler.stream_unary), **common)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream), **common
            )
        return grpc.stream_stream_rpc_method_handler(
            self._wrap_stream(handler.stream_stream), **common
        )

    def _refuse_message(self, client: str) -> str:
        return (
            f"too many requests in flight from this client ({self._limiter.max_in_flight} "
            "allowed per connection): wait for answers before sending more, or retry later"
        )

    def _wrap(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        limiter = self._limiter

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            client = _client_key(context)
            if not limiter.try_acquire(client):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, self._refuse_message(client)
                )
            try:
                result = behavior(request, context)
                if inspect.isawaitable(result):
                    result = await result
                return result
            finally:
                limiter.release(client)

        return wrapped

    def _wrap_stream(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if not (inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior)):
            return self._wrap(behavior)
        limiter = self._limiter
        is_async = inspect.isasyncgenfunction(behavior)

        async def wrapped_gen(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            client = _client_key(context)
            if not limiter.try_acquire(client):
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, self._refuse_message(client)
                )
            try:
                if is_async:
                    async for response in behavior(request, context):
                        yield response
                else:
                    for response in behavior(request, context):
                        yield response
            finally:
                limiter.release(client)

        return wrapped_gen
