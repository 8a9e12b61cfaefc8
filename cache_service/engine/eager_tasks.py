"""Tasks that start running at once (eager tasks) where Python has them."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["EAGER_TASKS", "start_eagerly"]

EAGER_TASKS = sys.version_info >= (3, 12)  # asyncio.Task(..., eager_start=True)

_T = TypeVar("_T")


def start_eagerly(coro: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """A task for `coro`, run at once up to its first suspension where Python has eager
    tasks (3.12+), else scheduled as usual.

    An in-process GPU pool answers a batch without suspending (its call runs inline on the
    loop), so eagerly the whole worker round is done before the caller awaits its result:
    two event-loop turns fewer per call (the task's first step, then the caller's wake-up).
    """
    loop = asyncio.get_running_loop()
    if EAGER_TASKS:
        return asyncio.Task(coro, loop=loop, eager_start=True)  # type: ignore[call-arg]
    return loop.create_task(coro)
