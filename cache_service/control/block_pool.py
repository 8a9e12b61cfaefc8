"""One worker's block pool as bookkeeping: reference counts, a free list, cached-free blocks.

A block is in exactly one of three states:
- used: reference count > 0 (block tables and pins hold it);
- cached-free: count 0 but still published in the prefix index, so a later prompt can adopt
  it; evictable, in the order the pool's eviction policy gives (cache_service.control.eviction);
- free: count 0 and holds nothing anyone can find.

Free blocks are handed out before any cached-free one is evicted. Every operation is O(1):
the free list is a stack, and eviction policies are O(1) per operation.
"""

from __future__ import annotations

from cache_service.control.eviction import EvictionPolicy, LRUPolicy
from cache_service.errors import InvalidRequest, PoolExhausted

__all__ = ["BlockPool"]


class BlockPool:
    """Reference counts and free / cached-free tracking for `num_blocks` blocks of one worker.

    The pool knows nothing about the prefix index: the caller says, when a count drops to
    zero, whether the block stays findable (cached-free) or becomes free, and removes a
    block's index entries when `take` reports that it evicted one.
    """

    __slots__ = ("_free", "_policy", "_refcount", "_used", "num_blocks", "worker_id")

    def __init__(
        self, worker_id: str, num_blocks: int, policy: EvictionPolicy | None = None
    ) -> None:
        """Create a pool of `num_blocks` free blocks (ids 0 .. num_blocks-1) whose
        cached-free blocks leave in `policy`'s order (an empty policy; None: LRUPolicy)."""
        if type(num_blocks) is not int or num_blocks < 1:
            raise InvalidRequest(f"num_blocks must be a positive int, got {num_blocks!r}")
        if policy is None:
            policy = LRUPolicy()
        elif len(policy):
            raise InvalidRequest(f"worker {worker_id!r}: a new pool needs an empty policy")
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # Reversed so that pops hand out 0, 1, 2, ...: deterministic and easy to read in tests.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._policy = policy
        self._used = 0

    # ---- counts -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still findable in the prefix index (evictable)."""
        return len(self._policy)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above zero."""
        return self._used

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free plus evictable cached-free."""
        return len(self._free) + len(self._policy)

    def refcount(self, index: int) -> int:
        """Reference count of block `index`."""
        return self._refcount[index]

    def is_cached(self, index: int) -> bool:
        """Whether block `index` is cached-free."""
        return index in self._policy

    # ---- transitions --------------------------------------------------------------------

    def take(self) -> tuple[int, bool]:
        """Allocate one block with reference count 1.

        Returns:
            (index, evicted): evicted is True when the block was a cached-free one (the
            policy's next victim), in which case the caller must drop its prefix-index
            entries.

        Raises:
            PoolExhausted: nothing free or cached-free (callers check `available` first, so
                an all-or-nothing operation never gets here half way).
        """
        if self._free:
            index = self._free.pop()
            evicted = False
        else:
            victim = self._policy.pop_victim()
            if victim is None:
                raise PoolExhausted(
                    f"worker {self.worker_id!r}: all {self.num_blocks} blocks in use"
                )
            index = victim
            evicted = True
        self._refcount[index] = 1
        self._used += 1
        return index, evicted

    def untake(self, index: int, evicted: bool) -> None:
        """Undo a `take` of block `index` whose batch failed: the block goes back exactly
        where it came from (end of the free list, or the policy's next victim again).

        Undoing several takes in reverse order restores both orders exactly, so the next
        allocation returns what it would have returned without the failed batch.

        Raises:
            InvalidRequest: the block does not hold exactly the one reference `take` gave.
        """
        if self._refcount[index] != 1:
            raise InvalidRequest(
                f"worker {self.worker_id!r}: block {index} has {self._refcount[index]} "
                "references; only a block just taken (1 reference) can be put back"
            )
        self._refcount[index] = 0
        self._used -= 1
        if evicted:
            self._policy.put_back(index)
        else:
            self._free.append(index)

    def incref(self, index: int) -> None:
        """Add a reference; a cached-free block becomes used again (a prefix hit)."""
        count = self._refcount[index]
        if count == 0:
            try:
                self._policy.on_reused(index)
            except KeyError:
                raise InvalidRequest(
                    f"worker {self.worker_id!r}: block {index} is free; only used or "
                    "cached-free blocks can gain a reference"
                ) from None
            self._used += 1
        self._refcount[index] = count + 1

    def decref(self, index: int, keep_cached: bool) -> None:
        """Drop a reference. At zero the block becomes cached-free (an eviction candidate)
        if `keep_cached`, else free."""
        count = self._refcount[index] - 1
        if count < 0:
            raise InvalidRequest(f"worker {self.worker_id!r}: block {index} has no reference")
        self._refcount[index] = count
        if count == 0:
            self._used -= 1
            if keep_cached:
                self._policy.on_cached_free(index)
            else:
                self._free.append(index)

    def evict_next(self) -> int | None:
        """Move the policy's next victim from the cached-free blocks to the free list.

        Returns:
            its index, or None when nothing is cached-free.
        """
        index = self._policy.pop_victim()
        if index is not None:
            self._free.append(index)
        return index

    # ---- views for integrity checks and snapshots --------------------------------------

    def free_order(self) -> list[int]:
        """The free list, next to be handed out last."""
        return list(self._free)

    def cached_order(self) -> list[int]:
        """Cached-free blocks in the eviction policy's `order()` (LRU: next evicted first),
        which rebuilds the policy on `restore`."""
        return self._policy.order()

    def refcounts(self) -> list[int]:
        """A copy of every block's reference count."""
        return list(self._refcount)

    @classmethod
    def restore(
        cls,
        worker_id: str,
        num_blocks: int,
        refcounts: list[int],
        free_order: list[int],
        cached_order: list[int],
        policy: EvictionPolicy | None = None,
    ) -> BlockPool:
        """Rebuild a pool from a snapshot (see `free_order`, `cached_order`, `refcounts`),
        its cached-free blocks fed to `policy` (empty; None: LRUPolicy) in `cached_order`.

        Raises:
            InvalidRequest: the three parts do not describe every block exactly once.
        """
        pool = cls(worker_id, num_blocks, policy)
        if len(refcounts) != num_blocks or any(type(c) is not int or c < 0 for c in refcounts):
            raise InvalidRequest(
                f"worker {worker_id!r}: need {num_blocks} non-negative reference counts"
            )
        used = [i for i, c in enumerate(refcounts) if c > 0]
        seen = sorted([*used, *free_order, *cached_order])
        if seen != list(range(num_blocks)):
            raise InvalidRequest(
                f"worker {worker_id!r}: used ({len(used)}), free ({len(free_order)}) and "
                f"cached-free ({len(cached_order)}) blocks do not partition 0..{num_blocks - 1}"
            )
        pool._refcount = list(refcounts)
        pool._free = list(free_order)
        for index in cached_order:
            pool._policy.on_cached_free(index)
        pool._used = len(used)
        return pool
