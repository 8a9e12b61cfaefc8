"""Where a sequence's new blocks go. Pure functions of per-worker availability.

Rules: a new sequence goes to the worker that holds its longest cached prefix if that
worker can take the rest of its prompt, else to the worker with the most available blocks
(free + cached-free). Growth stays on the sequence's home worker while it has room and then
spills to the worker with the most room, which becomes the new home. Ties go to the worker
added first, so the same calls always give the same placement (the write-ahead log replays
them).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["choose_home", "most_room", "plan_growth"]


def most_room(available: Mapping[str, int]) -> str | None:
    """The worker with the most available blocks (first added on ties); None if no workers."""
    best: str | None = None
    best_room = -1
    for worker_id, room in available.items():
        if room > best_room:
            best, best_room = worker_id, room
    return best


def choose_home(
    prefix_worker: str | None, blocks_needed: int, available: Mapping[str, int]
) -> str | None:
    """Home worker of a new sequence.

    Args:
        prefix_worker: worker of the last block of the adopted cached prefix, if any.
        blocks_needed: blocks the rest of the prompt needs (at least 1).
        available: free + cached-free blocks per live worker, after the prefix's blocks
            were adopted.

    Returns:
        The prefix's worker if it has room for `blocks_needed`, else the worker with the
        most room; None when there are no workers.
    """
    if prefix_worker is not None and available.get(prefix_worker, 0) >= blocks_needed:
        return prefix_worker
    return most_room(available)


def plan_growth(
    home: str | None, count: int, available: Mapping[str, int]
) -> list[tuple[str, int]] | None:
    """How many of `count` new blocks come from which worker, in allocation order.

    Args:
        home: the sequence's current home worker (None or unknown: start at most room).
        count: blocks to allocate (> 0).
        available: blocks each worker can supply right now.

    Returns:
        [(worker_id, n), ...] summing to `count` (the last worker is the new home), or None
        if all workers together cannot supply `count`.
    """
    if sum(available.values()) < count:
        return None
    room = dict(available)
    if home is None or home not in room:
        home = most_room(room)
    plan: list[tuple[str, int]] = []
    while count > 0:
        assert home is not None  # guaranteed by the sum check above
        take = min(count, room[home])
        if take > 0:
            plan.append((home, take))
            room[home] -= take
            count -= take
        if count > 0:
            home = most_room(room)
    return plan
