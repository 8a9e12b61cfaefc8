"""Which cached-free block leaves a worker's pool next: the eviction-policy seam.

A `BlockPool` keeps unreferenced blocks that are still findable in the prefix index
(cached-free) as eviction candidates. Its policy hears when a block joins the candidates
(`on_cached_free`: its last reference went and it stays published) and when one leaves
them without being evicted (`on_reused`: a prefix hit adopted it), and names the next
victim when the pool has no free block left (`pop_victim`). The policy sees block indices
only; the pool keeps the reference counts and the free list, the manager the index.

What every policy must keep, because the pool, its undo journal, snapshots and the
write-ahead log rely on it:

- Each operation is cheap and never O(candidates): they run on the request path (all of
  LRU's are O(1)).
- Deterministic: the same calls give the same victims, so a replayed log gets the same
  blocks it got when it was written.
- `order()` lists the candidates such that calling `on_cached_free` with each, in that
  order, on an empty policy gives one that makes the same choices (a snapshot stores only
  this list). A policy whose state is more than an order would need more in snapshots.
- `put_back(index)` undoes the latest `pop_victim()` that returned `index`: it is again the
  next victim. A failed batch puts its victims back last first, which restores the order.

`EVICTION_POLICIES` maps a configuration name (`coordinator.eviction_policy`,
`BlockManagerConfig.eviction_policy`) to a factory of empty policies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "DEFAULT_EVICTION_POLICY",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "LRUPolicy",
    "check_policy_name",
    "make_policy",
]


class EvictionPolicy(Protocol):
    """The eviction order over one pool's cached-free blocks (indices 0 .. num_blocks-1)."""

    def __len__(self) -> int:
        """Candidates held (the pool's cached-free block count)."""
        ...

    def __contains__(self, index: object) -> bool:
        """Whether block `index` is a candidate."""
        ...

    def on_cached_free(self, index: int) -> None:
        """Block `index` (not a candidate) became cached-free: it joins the candidates."""
        ...

    def on_reused(self, index: int) -> None:
        """Candidate `index` gained a reference (a prefix hit): it leaves the candidates.

        Raises:
            KeyError: `index` is not a candidate.
        """
        ...

    def pop_victim(self) -> int | None:
        """Remove and return the candidate to evict next; None when there is none."""
        ...

    def put_back(self, index: int) -> None:
        """Undo the latest `pop_victim()`, which returned `index`: it is the next victim
        again."""
        ...

    def order(self) -> list[int]:
        """Every candidate, in the order whose `on_cached_free` calls rebuild this policy
        (for LRU: next victim first)."""
        ...


class LRUPolicy:
    """Least recently released first: the block whose last reference went longest ago
    leaves first; a prefix hit takes a block out, and its next release puts it at the
    most recent end. O(1) per operation (an insertion-ordered dict as the queue)."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        """No candidates."""
        self._queue: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, index: object) -> bool:
        return index in self._queue

    def on_cached_free(self, index: int) -> None:
        self._queue[index] = None

    def on_reused(self, index: int) -> None:
        del self._queue[index]

    def pop_victim(self) -> int | None:
        if not self._queue:
            return None
        return self._queue.popitem(last=False)[0]

    def put_back(self, index: int) -> None:
        self._queue[index] = None
        self._queue.move_to_end(index, last=False)

    def order(self) -> list[int]:
        return list(self._queue)


DEFAULT_EVICTION_POLICY = "lru"
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}
"""Policies by configuration name. A new policy is added here (or registered by the code
that configures it) and then chosen by name."""


def check_policy_name(name: object) -> str:
    """`name` if it names a policy in EVICTION_POLICIES.

    Raises:
        ValueError: anything else; the message lists the known names.
    """
    if not isinstance(name, str) or name not in EVICTION_POLICIES:
        raise ValueError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return name


def make_policy(name: str) -> EvictionPolicy:
    """An empty policy of the registered name `name` (see `check_policy_name` for errors)."""
    return EVICTION_POLICIES[check_policy_name(name)]()
