"""Host memory the process page-locked for CUDA itself, as address ranges told by the code
that locks it, so a hot path can ask "is this tensor pinned?" without asking the driver.

Why: ``Tensor.is_pinned()`` asks the CUDA driver every time (torch looks for a device with
a primary context, then calls cudaPointerGetAttributes): about 5 us per tensor on the
H200 host, three tensors per decode-graph replay. The inputs on that path are views into
a few long-lived shared regions that the server registered with ``cudaHostRegister``
(workers.cuda_pinning). The owner of each registration tells this registry:
`PinnedRanges.add` right after cudaHostRegister succeeded, `PinnedRanges.remove` right
before cudaHostUnregister. So the registry is exact for the memory it holds, and never
needs invalidating by guesswork (an address range learned from ``is_pinned()`` answers
could not tell when its memory is unmapped and the address reused).

What it is not: a record of all pinned memory (torch's own pinned allocations are not in
it); a miss means "ask ``is_pinned()``", not "pageable". And correctness never depends on
it: a pool given "pinned" for pageable memory copies with ``non_blocking=True``, which
CUDA then performs synchronously with respect to the host (cudaMemcpyAsync from pageable
memory returns once the bytes left it), and the pool waits for its copies before it
returns anyway; given "not pinned" for pinned memory, it stages the bytes through its own
pinned buffer (a CPU copy). Either is slower, neither is wrong.
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["REGISTERED", "PinnedRanges"]


class PinnedRanges:
    """Disjoint address ranges ``[start, start + nbytes)`` of page-locked host memory.

    Thread-safe: changes take a lock and publish a new immutable snapshot, which readers
    (`covers`) take with one attribute read, lock-free.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ends: dict[int, int] = {}  # start address -> end address (exclusive)
        # (starts sorted, ends in the same order): what `covers` reads.
        self._snapshot: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def __len__(self) -> int:
        """Ranges held."""
        return len(self._snapshot[0])

    def add(self, start: int, nbytes: int) -> None:
        """Record ``[start, start + nbytes)`` (addresses and bytes) as page-locked: call
        after the registration succeeded.

        A range overlapping one held is not recorded (CUDA refuses overlapping
        registrations, so this is a caller's mistake; `covers` then keeps answering from
        the ranges it has, and a tensor in the new one is asked about as a miss).

        Raises:
            ValueError: nbytes < 1 or start < 0.
        """
        if nbytes < 1 or start < 0:
            raise ValueError(f"a pinned range needs start >= 0 and nbytes >= 1: {start}, {nbytes}")
        end = start + nbytes
        with self._lock:
            if any(s < end and start < e for s, e in self._ends.items()):
                return
            self._ends[start] = end
            self._publish()

    def remove(self, start: int) -> None:
        """Forget the range starting at `start` (a no-op when none does): call before the
        memory is unregistered, so the registry never names memory CUDA no longer pins."""
        with self._lock:
            if self._ends.pop(start, None) is not None:
                self._publish()

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether ``[start, start + nbytes)`` (nbytes >= 1) lies within one range held."""
        starts, ends = self._snapshot
        i = bisect.bisect_right(starts, start) - 1
        return i >= 0 and start + nbytes <= ends[i]

    def _publish(self) -> None:
        """A new snapshot of `_ends` (under the lock)."""
        starts = tuple(sorted(self._ends))
        self._snapshot = (starts, tuple(self._ends[s] for s in starts))


# The process's registrations (workers.cuda_pinning keeps it up to date).
REGISTERED = PinnedRanges()
