"""One worker's host tier: a bounded pool of KV blocks in host memory that cached prefix
blocks leave the device pool for, and come back from.

The tier is one tensor ``[num_host_blocks, L, 2, Hkv, block_size, D]`` (a block has the
device pool's block shape, all layers, K and V), page-locked when the device pool is on
CUDA so every copy is a DMA, plain memory on CPU. Which host block holds what is the
coordinator's business (cache_service.control.host_tier); this module only moves bytes.

`offload` (device -> host) and `restore` (host -> device) each move a batch of blocks in
one call: pairs are sorted and cut into runs where both the device and the host ids are
consecutive, one copy per run (a fresh tier restoring into a fresh pool is one copy). On
CUDA they run on a side stream that first waits for the work already queued on the
current stream (earlier writes of the blocks), and the current stream then waits for the
copies' event: later kernels, attention over restored blocks among them, see the copied
bytes, while the copy overlaps with the host's work until then.
"""

from __future__ import annotations

import torch

from workers.errors import InvalidWorkerRequest, PoolAllocationError
from workers.layout import KVLayout

__all__ = ["HostTier", "check_move", "copy_runs"]


def copy_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """The pairs ``src_ids[i] -> dst_ids[i]`` as runs ``(src_start, dst_start, length)``
    where both sides are consecutive, in ascending source order."""
    pairs = sorted(zip(src_ids, dst_ids, strict=True))
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


class HostTier:
    """Host blocks for one device pool.

    Args:
        layout: the pool's layout (block shape and dtype).
        num_blocks: host blocks (>= 1).
        device: the pool's device: CUDA gets page-locked host memory and a side stream.

    Raises:
        PoolAllocationError: the host memory could not be allocated.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise PoolAllocationError(f"host tier blocks must be an int >= 1, got {num_blocks!r}")
        self._layout = layout
        self._device = device
        self._cuda = device.type == "cuda"
        shape = (num_blocks, *layout.block_shape)
        try:
            self._data = torch.zeros(shape, dtype=layout.torch_dtype(), pin_memory=self._cuda)
        except RuntimeError as exc:
            raise PoolAllocationError(
                f"allocating a host tier of {num_blocks} blocks "
                f"({num_blocks * layout.bytes_per_block} bytes) failed: {exc}"
            ) from None
        self._stream = torch.cuda.Stream(device) if self._cuda else None

    @property
    def num_blocks(self) -> int:
        """Host blocks in the tier."""
        return self._data.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the tier holds."""
        return self._data.numel() * self._data.element_size()

    @property
    def data(self) -> torch.Tensor:
        """The tier tensor ``[num_blocks, L, 2, Hkv, block_size, D]`` (shared)."""
        return self._data

    def offload(self, pool: torch.Tensor, block_ids: list[int], host_ids: list[int]) -> int:
        """Copy device blocks ``pool[block_ids[i]] -> host[host_ids[i]]``.

        Args:
            pool: the device pool tensor ``[num_blocks, L, 2, Hkv, bs, D]``.
            block_ids: device block ids (any order, may repeat).
            host_ids: host block ids, distinct, one per device id.

        Returns:
            Bytes copied.
        """
        return self._copy(pool, block_ids, self._data, host_ids)

    def restore(self, pool: torch.Tensor, host_ids: list[int], block_ids: list[int]) -> int:
        """Copy host blocks ``host[host_ids[i]] -> pool[block_ids[i]]`` (block ids
        distinct); later work on the current stream sees them. Returns bytes copied."""
        return self._copy(self._data, host_ids, pool, block_ids)

    def _copy(
        self, src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]
    ) -> int:
        runs = copy_runs(src_ids, dst_ids)
        if self._stream is None:
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n])
        else:
            current = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                for s, d, n in runs:
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            current.wait_event(done)
        return len(src_ids) * self._layout.bytes_per_block


def check_move(
    name: str, ids: list[int] | torch.Tensor, limit: int, *, distinct: bool
) -> list[int]:
    """``ids`` as a list of ints in ``[0, limit)`` (pairwise distinct when ``distinct``).

    Raises:
        InvalidWorkerRequest: not 1-D ints in range, or a repeated id where distinct.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidWorkerRequest(f"{name} must be a 1-D integer tensor")
        ids = ids.tolist()
    if not isinstance(ids, list | tuple) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in ids
    ):
        raise InvalidWorkerRequest(f"{name} must be a list of ints")
    for i, v in enumerate(ids):
        if not 0 <= v < limit:
            raise InvalidWorkerRequest(f"{name}[{i}] = {v} is not in [0, {limit})")
    if distinct and len(set(ids)) != len(ids):
        raise InvalidWorkerRequest(f"{name} names one block more than once")
    return list(ids)
