"""The commit deadline of the call being served, and the check at its commit point.

A call either commits entirely and answers OK, or answers an error and commits nothing,
also when its deadline passes mid-call. The servicer sets the call's commit deadline
(`deadline_scope`) from the gRPC deadline and the request's ``timeout_us``; the
coordinator calls `check_deadline` right before it commits (and before it starts), inside
the block whose failure undoes what the call reserved. Nothing between that check and the
commit awaits, so a call that passed the check commits before anything else runs.

A context variable, like `call_origin`: each asyncio task has its own copy, and a done
callback registered by the call (a local session's callback path) runs in a copy of the
call's context, deadline included.
"""

from __future__ import annotations

import contextvars
import time

from cache_service.errors import DEADLINE_VERDICT, DeadlinePassed

__all__ = [
    "REPLY_MARGIN_S",
    "REPLY_MARGIN_SHARE",
    "check_deadline",
    "commit_deadline",
    "current_deadline",
    "deadline_scope",
]

# Without timeout_us, the commit deadline is the gRPC deadline less this much (seconds, at
# most this share of the time left): the reply's way back to a client that gives up at its
# own gRPC deadline.
REPLY_MARGIN_S = 0.05
REPLY_MARGIN_SHARE = 0.2
# Monotonic seconds (time.monotonic) past which the call must not commit; 0.0: none.
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("kvcache_deadline", default=0.0)


def commit_deadline(timeout_us: int, time_remaining_s: float | None = None) -> float:
    """The monotonic commit deadline of a call received now.

    Args:
        timeout_us: the request's timeout_us (microseconds from now; 0: none).
        time_remaining_s: the gRPC call's remaining time, seconds (None: no gRPC deadline,
            e.g. a Session message). Without timeout_us it counts less the reply margin
            (REPLY_MARGIN_S, at most REPLY_MARGIN_SHARE of it).

    Returns:
        time.monotonic() seconds, or 0.0 for no deadline.
    """
    budgets = []
    if timeout_us:
        budgets.append(timeout_us * 1e-6)
    if time_remaining_s is not None:
        if not timeout_us:
            # A client that sent no commit deadline gives up at its gRPC deadline itself:
            # commit early enough for the reply to reach it first.
            time_remaining_s -= min(REPLY_MARGIN_S, time_remaining_s * REPLY_MARGIN_SHARE)
        budgets.append(time_remaining_s)
    if not budgets:
        return 0.0
    return time.monotonic() + min(budgets)


class deadline_scope:
    """Make `deadline` (monotonic seconds; 0.0: none) the current call's commit deadline
    inside the `with` block. A class rather than a contextlib generator: it is entered on
    every per-layer call."""

    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __enter__(self) -> None:
        self._token = _DEADLINE.set(self._deadline)

    def __exit__(self, *exc: object) -> None:
        _DEADLINE.reset(self._token)


def current_deadline() -> float:
    """The current call's commit deadline (monotonic seconds), 0.0 for none."""
    return _DEADLINE.get()


def check_deadline(deadline: float | None = None) -> None:
    """Refuse to commit past the deadline (one comparison on the hot path).

    Args:
        deadline: monotonic seconds; None: the current call's (`deadline_scope`).

    Raises:
        DeadlinePassed: the deadline has passed.
    """
    if deadline is None:
        deadline = _DEADLINE.get()
    if deadline and time.monotonic() > deadline:
        raise DeadlinePassed(f"the call's deadline {DEADLINE_VERDICT}")
