"""The host tier's benchmark (benchmarks/bench_service.py --phases host_tier): restoring
blocks from a worker's host tier against a plain pinned-memory copy of the same bytes, and
the prefix hit rate of a workload whose shared prefixes are 4x the GPU pool, with and
without the tier, against an unbounded pool.

Restore: `KVPool.restore_blocks` of `nbytes` of blocks (contiguous host ids into
contiguous pool ids: one copy; and scattered ids: one copy per block) and, in the same
process, alternating with it, one ``copy_`` of the same bytes from a pinned host buffer
into a device buffer; medians of `repeats` runs, GB/s and the ratio.

Hit rate (measured by benchmarks/bench_service.py, which may drive a coordinator): a
coordinator over one real in-process pool on the device; `num_prefixes`
prefixes of `prefix_blocks` blocks each, computed once, then `requests` requests for a
random prefix (seeded) plus one own token: create the sequence (adopting what is cached,
restoring from the host tier), append the rest of the prompt's K/V on every layer, free.
The hit rate is cached prefix tokens over prefix tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.layout import KVLayout
from workers.pool import KVPool

__all__ = ["HitRates", "RestoreFigures", "report_lines", "restore_vs_copy"]


@dataclass(frozen=True)
class RestoreFigures:
    """Medians of one restore measurement, seconds, and the bytes each run moved."""

    nbytes: int
    blocks: int
    restore_s: float
    scattered_s: float
    pinned_copy_s: float

    @staticmethod
    def gbps(nbytes: int, seconds: float) -> float:
        """Bytes per second in GB/s (1e9)."""
        return nbytes / seconds / 1e9


@dataclass(frozen=True)
class HitRates:
    """Prefix hit rates (0..1) of one workload under three pools."""

    gpu_blocks: int
    host_blocks: int
    prefix_blocks: int
    num_prefixes: int
    requests: int
    unbounded: float
    tiered: float
    gpu_only: float


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def restore_vs_copy(
    layout: KVLayout, device: str, nbytes: int, repeats: int, seed: int = 0
) -> RestoreFigures:
    """Time host -> device restores of `nbytes` of blocks against a pinned copy of the
    same bytes (see the module docstring); `repeats` alternating runs of each."""
    dev = torch.device(device)
    blocks = max(1, nbytes // layout.bytes_per_block)
    moved = blocks * layout.bytes_per_block
    pool = KVPool(layout, blocks, dev, cuda_graphs=False, host_blocks=blocks)
    pool.offload_blocks(list(range(blocks)), list(range(blocks)))  # host tier filled
    ids = list(range(blocks))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    pinned = torch.empty(moved, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    target = torch.empty(moved, dtype=torch.uint8, device=dev)
    runs: dict[str, list[float]] = {"restore": [], "scattered": [], "copy": []}
    for _ in range(repeats + 1):  # the first round warms up
        runs["restore"].append(_timed(lambda: pool.restore_blocks(ids, ids), dev))
        runs["copy"].append(
            _timed(lambda: target.copy_(pinned, non_blocking=dev.type == "cuda"), dev)
        )
        runs["scattered"].append(_timed(lambda: pool.restore_blocks(shuffled, ids), dev))
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}
    return RestoreFigures(moved, blocks, med["restore"], med["scattered"], med["copy"])


def report_lines(restore: RestoreFigures, rates: HitRates) -> list[str]:
    """The host tier section of the Markdown report."""
    g = RestoreFigures.gbps
    n = restore.nbytes
    copy = g(n, restore.pinned_copy_s)
    share = rates.gpu_blocks / (rates.num_prefixes * rates.prefix_blocks)
    return [
        "## Host tier: restore host -> device, and the prefix hit rate at 4x the pool",
        "",
        f"Restoring {restore.blocks} blocks ({n / 2**20:.1f} MiB) from the host tier "
        "(`KVPool.restore_blocks`) against one `copy_` of the same bytes from pinned host "
        "memory, alternating in the same process; medians.",
        "",
        "| copy | ms | GB/s | of the pinned copy |",
        "| --- | ---: | ---: | ---: |",
        f"| plain pinned-memory copy | {restore.pinned_copy_s * 1e3:.3f} | {copy:.2f} | 1.00 |",
        f"| restore, contiguous ids (one run) | {restore.restore_s * 1e3:.3f} | "
        f"{g(n, restore.restore_s):.2f} | {g(n, restore.restore_s) / copy:.2f} |",
        f"| restore, scattered ids (one run per block) | {restore.scattered_s * 1e3:.3f} | "
        f"{g(n, restore.scattered_s):.2f} | {g(n, restore.scattered_s) / copy:.2f} |",
        "",
        f"Prefix hit rate of {rates.requests} random requests over {rates.num_prefixes} "
        f"prefixes of {rates.prefix_blocks} blocks ({rates.num_prefixes * rates.prefix_blocks} "
        f"blocks: 4x a GPU pool of {rates.gpu_blocks}); share of the prefixes that fits the "
        f"pool {share:.2f}.",
        "",
        "| pool | prefix hit rate |",
        "| --- | ---: |",
        f"| unbounded GPU pool | {rates.unbounded:.3f} |",
        f"| GPU pool + host tier of {rates.host_blocks} blocks | {rates.tiered:.3f} |",
        f"| GPU pool alone | {rates.gpu_only:.3f} |",
    ]
