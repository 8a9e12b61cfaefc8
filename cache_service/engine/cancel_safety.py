"""Letting worker calls in flight settle before a cancellation (a client deadline) lands.

grpc.aio cancels a handler's task when its call's deadline passes or the client goes away.
If that cancellation interrupted the coordinator between "the control plane reserved blocks
and the worker calls were sent" and "the calls came back", it would release the sequence's
lock while a copy-on-write copy or a K/V write was still queued on a worker: a later call
could then free and reuse those blocks before the stale write lands on them. So the worker
part of a call runs to completion; the cancellation is delivered afterwards, before the
write is committed; the coordinator then cancels the reservation (``cancel_write``), which
leaves the sequence as before the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["run_to_completion"]

_T = TypeVar("_T")


async def run_to_completion(aw: Awaitable[_T]) -> _T:
    """Await `aw` to its end even if the calling task is cancelled meanwhile.

    Returns:
        `aw`'s result (its exception is raised as usual).

    Raises:
        asyncio.CancelledError: the caller was cancelled while waiting; raised only once
            `aw` has finished (its own result or error is then dropped).
    """
    task = asyncio.ensure_future(aw)
    if task.done():  # e.g. a round that ran while the call was submitted: nothing to wait
        return task.result()
    loop = asyncio.get_running_loop()
    interrupted = False
    while not task.done():
        # A waiter of our own: cancelling this task cancels the waiter, never `task` (what
        # asyncio.wait does, with less to build for a single awaitable).
        waiter = loop.create_future()

        def wake(_: object, waiter: asyncio.Future[None] = waiter) -> None:
            if not waiter.done():
                waiter.set_result(None)

        task.add_done_callback(wake)
        try:
            await waiter
        except asyncio.CancelledError:
            interrupted = True
        finally:
            task.remove_done_callback(wake)
    if interrupted:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" warning
        raise asyncio.CancelledError
    return task.result()
