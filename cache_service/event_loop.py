"""Which asyncio event loop runs the service (server.event_loop): asyncio's own (default)
or uvloop (opt-in: `pip install 'paged-kvcache-service[uvloop]'`).

The coordinator is one event-loop thread, and under concurrent clients that thread is what
they share: every call's socket reads and writes (local sessions, the worker channel,
gRPC's completion queue), its task and future wake-ups and its timers go through the loop's
machinery, which uvloop implements in C over libuv. On the H200 host
(benchmarks/results/archive/service-h200.md) it gains nothing that stands out of the noise.
In process without sockets the coordinator spent more CPU per call on uvloop (296-315 us
against 217-288 us), with local-session clients over sockets its throughput was steadier
(552-571 against 368-575 tokens/s) but not higher at the median, and the Ray row's
concurrency ratio did not move. So asyncio stays the default; uvloop is there for hosts
and Python versions where it measures better.

`run` is what the service's entry points (`kvcache serve`, the embedded demo and bench,
benchmarks/bench_service.py) use instead of `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["EVENT_LOOPS", "EventLoopUnavailable", "loop_factory", "loop_name", "run"]

EVENT_LOOPS = ("asyncio", "uvloop")

_T = TypeVar("_T")


class EventLoopUnavailable(RuntimeError):
    """The configured event loop cannot be made here (uvloop asked for, not installed)."""


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A function making a new event loop of the kind `choice` (one of EVENT_LOOPS) names.

    Raises:
        ValueError: `choice` is not one of EVENT_LOOPS.
        EventLoopUnavailable: "uvloop" where it is not installed.
    """
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    if importlib.util.find_spec("uvloop") is None:
        raise EventLoopUnavailable(
            "server.event_loop is 'uvloop' but uvloop is not installed here: install it "
            "(pip install 'paged-kvcache-service[uvloop]') or set server.event_loop to "
            "'asyncio'"
        )
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, _T], choice: str = "asyncio") -> _T:
    """Run `main` to completion on a new event loop of the kind `choice` names (as
    `asyncio.run` does: the loop is closed afterwards); its result.

    Raises:
        what `loop_factory` raises (then `main` is closed without running), and what
        `main` raises.
    """
    try:
        factory = loop_factory(choice)
    except BaseException:
        main.close()
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """What runs `loop` (default: the running loop): "uvloop" or "asyncio"."""
    loop = asyncio.get_running_loop() if loop is None else loop
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
