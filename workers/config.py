"""How big a pool is and how it behaves. Pure."""

from __future__ import annotations

import math
from dataclasses import dataclass

from workers.errors import PoolAllocationError
from workers.layout import KVLayout

__all__ = ["KERNEL_BACKENDS", "PoolConfig"]

KERNEL_BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class PoolConfig:
    """One pool's size and options.

    Exactly one of ``num_blocks`` and ``memory_fraction`` is set.

    Attributes:
        layout: the KV layout.
        num_blocks: blocks in the pool.
        memory_fraction: size the pool to this fraction (0, 1] of the device memory that is
            free when the pool is created (CUDA: ``torch.cuda.mem_get_info``; CPU: available
            physical memory).
        debug: fill the fresh pool and every freed block with NaN, so a read of a slot that
            was never written (or was freed) poisons the output instead of passing silently.
        backend: kernels backend, "auto" (Triton on CUDA, torch reference on CPU), "triton"
            (CPU needs TRITON_INTERPRET=1) or "torch".
        fingerprints: keep a fingerprint of every written slot so the online correctness
            check can tell a block whose contents changed after the write (costs one small
            reduction per write and 8 bytes per slot, layer and K/V).
        cuda_graphs: on CUDA, replay a decode step's per-layer write-and-attend as a CUDA
            graph once it repeats (:mod:`workers.decode_graphs`).
        warm_up_query_heads: on CUDA, compile the decode kernels for these query head
            counts when the pool is made (`KVPool.warm_up`), so serving meets no compile
            (each about a second); empty: compile on first use.
        warm_up_max_batch: the most sequences one call will carry (the coordinator's
            max_batch_items), for the warm-up.
        host_blocks: blocks of the worker's host tier (workers.host_tier): host memory
            (page-locked for a CUDA pool) that evicted prefix blocks move to instead of
            being dropped. 0: no host tier.

    Raises:
        PoolAllocationError: the size is malformed.
        ValueError: the backend is unknown.
    """

    layout: KVLayout
    num_blocks: int | None = None
    memory_fraction: float | None = None
    debug: bool = False
    backend: str = "auto"
    fingerprints: bool = False
    cuda_graphs: bool = True
    warm_up_query_heads: tuple[int, ...] = ()
    warm_up_max_batch: int = 256
    host_blocks: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise PoolAllocationError(
                f"PoolConfig.layout must be a KVLayout, got {type(self.layout).__name__}"
            )
        if (self.num_blocks is None) == (self.memory_fraction is None):
            raise PoolAllocationError(
                "PoolConfig needs exactly one of num_blocks and memory_fraction, got "
                f"num_blocks={self.num_blocks!r}, memory_fraction={self.memory_fraction!r}"
            )
        if self.num_blocks is not None and (
            isinstance(self.num_blocks, bool)
            or not isinstance(self.num_blocks, int)
            or self.num_blocks < 1
        ):
            raise PoolAllocationError(
                f"PoolConfig.num_blocks must be a positive int, got {self.num_blocks!r}"
            )
        if self.memory_fraction is not None and not (
            isinstance(self.memory_fraction, int | float)
            and not isinstance(self.memory_fraction, bool)
            and math.isfinite(self.memory_fraction)
            and 0 < self.memory_fraction <= 1
        ):
            raise PoolAllocationError(
                "PoolConfig.memory_fraction must be a number in (0, 1], got "
                f"{self.memory_fraction!r}"
            )
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"PoolConfig.backend must be one of {KERNEL_BACKENDS}, got {self.backend!r}"
            )
        heads = self.warm_up_query_heads
        if not isinstance(heads, tuple) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 1 or h % self.layout.num_kv_heads
            for h in heads
        ):
            raise ValueError(
                "PoolConfig.warm_up_query_heads must be a tuple of positive multiples of the "
                f"layout's {self.layout.num_kv_heads} KV heads, got {heads!r}"
            )
        if (
            isinstance(self.warm_up_max_batch, bool)
            or not isinstance(self.warm_up_max_batch, int)
            or self.warm_up_max_batch < 1
        ):
            raise ValueError(
                f"PoolConfig.warm_up_max_batch must be a positive int, got "
                f"{self.warm_up_max_batch!r}"
            )
        if (
            isinstance(self.host_blocks, bool)
            or not isinstance(self.host_blocks, int)
            or self.host_blocks < 0
        ):
            raise PoolAllocationError(
                f"PoolConfig.host_blocks must be an int >= 0, got {self.host_blocks!r}"
            )
