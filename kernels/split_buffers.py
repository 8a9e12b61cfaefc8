"""Scratch buffers of the split-KV attention path: float32 partial outputs and LSEs, and
the fused merge's arrival counters, kept per (device, stream)."""

from __future__ import annotations

import torch

from kernels.launch import current_stream_handle

__all__ = ["split_buffers"]


# Per (device, stream): the split path's float32 partials (outputs, then LSEs) and its
# zeroed int32 merge counters, one lookup for both.
_BUFFERS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(
    device: torch.device, rows: int, head_dim: int, n_counters: int, cached_in_capture: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(part_out [rows * head_dim], part_lse [rows], counters [n_counters])``: float32
    partial outputs and LSEs, and zeroed int32 arrival counters for the fused merge.

    Kept per (device, stream) and grown on demand: launches on one stream run in order, so
    a call's kernels cannot overwrite what the previous call's kernels still read; separate
    streams get separate buffers because their launches may overlap. The kernel leaves
    every counter it used at zero again, so one counter buffer serves every call on a
    stream. Under CUDA-graph capture the buffers are fresh allocations the graph owns (the
    counters' zero-fill then runs with every replay), unless ``cached_in_capture``
    (diagnostic only: the counters stay the per-device eager buffer, unsafe if two captured
    graphs or streams use it at once).
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        partials = torch.empty(max(rows * (head_dim + 1), 1), dtype=torch.float32, device=device)
        counters = None
        if not cached_in_capture:
            counters = torch.zeros(max(n_counters, 1), dtype=torch.int32, device=device)
    else:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            key = (device, current_stream_handle(index))
        else:
            key = (device, 0)
        partials, counters = _split_buffers_at(key, device, rows * (head_dim + 1), n_counters)
    if cached_in_capture:
        # One per-device counter buffer, eager and under capture alike (an eager call
        # creates it before capture, or the capture records its allocation).
        counters = _split_buffers_at((device, -1), device, 0, n_counters)[1]
    return (
        partials[: rows * head_dim],
        partials[rows * head_dim : rows * (head_dim + 1)],
        counters[:n_counters],
    )


def _split_buffers_at(
    key: tuple[torch.device, int], device: torch.device, numel: int, n_counters: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (partials, counters) pair under ``key``, each grown to at least its size."""
    pair = _BUFFERS.get(key)
    if pair is None or pair[0].numel() < numel or pair[1].numel() < n_counters:
        old_p, old_c = pair if pair is not None else (None, None)
        partials = (
            old_p
            if old_p is not None and old_p.numel() >= numel
            else torch.empty(max(numel, 1024), dtype=torch.float32, device=device)
        )
        counters = (
            old_c
            if old_c is not None and old_c.numel() >= n_counters
            else torch.zeros(max(n_counters, 1024), dtype=torch.int32, device=device)
        )
        pair = (partials, counters)
        _BUFFERS[key] = pair
    return pair
