"""The client connection a call arrived on, as the coordinator's batcher sees it.

A session (a gRPC Session stream, or a local session) names itself for the calls it
carries; the coordinator's batcher counts a client's parts by that name
(`engine.batching.Batcher`). Without it the batcher falls back to a part's first sequence, so
one client that alternates between two batches of sequences, each call waiting for the
one before, would look like two callers that never come together. Calls that name no
origin (unary RPCs, in-process callers) get that fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["current_origin", "origin_scope"]

_current: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "kvcache_call_origin", default=None
)


def current_origin() -> int | None:
    """The origin of the call being served in this context (None: not named)."""
    return _current.get()


@contextlib.contextmanager
def origin_scope(origin: int) -> Iterator[None]:
    """Name `origin` (an id that stays the same for one client connection) as the origin
    of the calls awaited inside the block."""
    token = _current.set(origin)
    try:
        yield
    finally:
        _current.reset(token)
