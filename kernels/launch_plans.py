"""Launch plans of the paged-attention launcher: one per call shape.

The first call of a shape goes through the full launch (`kernels.attention`), which works
out the grid, the scalar arguments, the compile-time constants and the compiled kernel; a
:class:`LaunchPlan` keeps them, so later calls of that shape only read their tensors'
addresses and launch (:mod:`kernels.launch`'s direct launch).
"""

from __future__ import annotations

import torch

from kernels.launch import DirectLaunch, hooks_installed

__all__ = ["PLANS", "LaunchPlan", "keep_plan"]


class LaunchPlan:
    """The launch of one call shape with everything but the tensors' addresses worked out:
    grid, scalar arguments, compile-time constants, the compiled kernel, the split path's
    buffers (this stream's; kept alive here).

    Valid for calls whose plan key matches (see
    :func:`kernels.attention.paged_attention_triton`) and whose tensors all start on
    16-byte boundaries, as they did when the kernel was compiled (Triton specializes
    pointers on that); :meth:`launch` declines other calls, calls under CUDA-graph capture
    (which need buffers the graph owns) and calls a launch hook must see.
    """

    __slots__ = ("buffers", "grid", "head", "lse_shape", "out_shape", "part_ptrs", "run", "tail")

    def __init__(
        self,
        launch: DirectLaunch,
        grid: tuple[int, int, int],
        tail: tuple,
        out_shape: tuple[int, int, int],
        return_lse: bool,
        buffers: tuple[torch.Tensor, ...],
    ) -> None:
        self.run = launch.run
        self.head = launch.head
        self.grid = grid
        self.tail = tail
        self.out_shape = out_shape
        self.lse_shape = out_shape[:2] if return_lse else None
        self.buffers = buffers
        # Partial outputs, their LSEs and the merge counters; None unsplit (the kernel never
        # reads them then, the output's address stands in).
        self.part_ptrs = tuple(b.data_ptr() for b in buffers) if buffers else None

    def launch(
        self,
        stream: int,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        out: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Launch on ``stream`` (the current one, a raw handle); None (nothing launched) when
        the plan does not apply."""
        if torch.cuda.is_current_stream_capturing() or hooks_installed():
            return None
        q_ptr = query.data_ptr()
        k_ptr = key_cache.data_ptr()
        v_ptr = value_cache.data_ptr()
        bt_ptr = block_tables.data_ptr()
        sl_ptr = seq_lens.data_ptr()
        qsl_ptr = query_start_loc.data_ptr()
        if out is not None:
            o_ptr = out.data_ptr()
            if (q_ptr | k_ptr | v_ptr | bt_ptr | sl_ptr | qsl_ptr | o_ptr) & 15:
                return None
        elif (q_ptr | k_ptr | v_ptr | bt_ptr | sl_ptr | qsl_ptr) & 15:
            return None
        else:
            out = query.new_empty(self.out_shape)  # the caching allocator aligns it
            o_ptr = out.data_ptr()
        if self.lse_shape is not None:
            lse = query.new_empty(self.lse_shape, dtype=torch.float32)
            lse_ptr = lse.data_ptr()
        else:
            lse = None
            lse_ptr = o_ptr
        grid = self.grid
        self.run(
            grid[0], grid[1], grid[2], stream, *self.head,
            q_ptr, k_ptr, v_ptr, bt_ptr, sl_ptr, qsl_ptr, o_ptr, lse_ptr,
            *(self.part_ptrs or (o_ptr, o_ptr, o_ptr)), *self.tail,
        )  # fmt: skip
        return out, lse


# Plans by call shape (see paged_attention_triton). A service sees a few shapes per model;
# the bound only caps what unusual callers (a table width per step) can pin, buffers included.
PLANS: dict[tuple, LaunchPlan] = {}
_MAX_PLANS = 256


def keep_plan(plan_key: tuple, plan: LaunchPlan) -> None:
    """Keep `plan` under `plan_key` in :data:`PLANS` (all dropped when the bound is hit)."""
    if len(PLANS) >= _MAX_PLANS:
        PLANS.clear()
    PLANS[plan_key] = plan
