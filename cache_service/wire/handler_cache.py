"""Wrapped gRPC method handlers, built once per method instead of once per call.

A grpc.aio server interceptor sees every call and returns the handler to run: ours wrap the
inner handler (timing, authentication, in-flight limits, request decoding). Building the
wrapper - closures plus a new `RpcMethodHandler` - on every call costs tens of
microseconds per interceptor on the hot path, though it depends only on the method and
the inner handler. :class:`HandlerCache` keeps it.

Only a wrapper built around the very inner handler object returned now is reused (an
identity check), so a server whose handlers change, or an interceptor below that builds a
new handler per call, simply gets a fresh wrapper. Whatever varies per call must be read
inside the wrapper (the context, the request) or be part of the key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["HandlerCache"]


class HandlerCache:
    """key (a method name, plus whatever else the wrapper depends on) -> the wrapper built
    around the inner handler.

    Args:
        max_entries: bound on cached wrappers; past it the cache starts over (keys are
            method names of registered handlers, times tenants for auth: normally few).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._max = max_entries
        self._entries: dict[Hashable, tuple[Any, Any]] = {}

    def get(self, key: Hashable, inner: Any, build: Callable[[Any], Any]) -> Any:
        """The wrapper of `inner` for `key`: the cached one if it wraps this very `inner`,
        else ``build(inner)`` (then cached)."""
        hit = self._entries.get(key)
        if hit is not None and hit[0] is inner:
            return hit[1]
        wrapped = build(inner)
        if len(self._entries) >= self._max:
            self._entries.clear()
        self._entries[key] = (inner, wrapped)
        return wrapped

    def __len__(self) -> int:
        return len(self._entries)
