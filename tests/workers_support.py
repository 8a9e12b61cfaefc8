"""Shared helpers of the workers tests: a dense attention oracle and placement of a
sequence's K/V into pools (described by the control plane's SequenceView/Segment)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

from cache_service.control.block_manager import Segment, SequenceView
from workers.pool import KVPool

__all__ = [
    "Segment",
    "SequenceView",
    "dense_attention",
    "place_sequence",
    "rel_err",
    "write_tokens",
]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention of ``q [n, Hq, D]`` (the last n positions) over ``k, v [L, Hkv, D]``.

    Returns ``(out [n, Hq, D], lse [n, Hq])`` in float64.
    """
    n, hq, d = q.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)  # head h reads KV head h // group
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", qd, kd) * scale
    if causal:
        pos = torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), vd)
    return out, lse.transpose(0, 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def write_tokens(
    pool: KVPool,
    blocks: Sequence[int],
    first_token: int,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int | None = 0,
) -> None:
    """Write tokens ``first_token ..`` of a sequence, whose logical blocks from
    ``first_token // block_size`` on are the physical ``blocks`` of ``pool``.

    ``k, v``: ``[n, Hkv, D]`` (``[L, n, Hkv, D]`` when ``layer`` is None).
    """
    bs = pool.layout.block_size
    n = k.shape[0] if layer is not None else k.shape[1]
    base = (first_token // bs) * bs
    slots = [blocks[(first_token + i - base) // bs] * bs + (first_token + i) % bs for i in range(n)]
    pool.write(layer, torch.tensor(slots), k, v)


def place_sequence(
    pools: dict[str, KVPool],
    pieces: Sequence[tuple[str, int]],
    k: torch.Tensor,
    v: torch.Tensor,
    rng: random.Random,
    *,
    layer: int = 0,
    taken: dict[str, set[int]] | None = None,
) -> SequenceView:
    """Spread a sequence's tokens over workers and return its view.

    Args:
        pools: worker id -> pool.
        pieces: ``(worker_id, num_blocks)`` runs of the block table in logical order (a
            worker may appear twice, not in adjacent runs).
        k, v: ``[seq_len, Hkv, D]`` of the sequence.
        rng: picks the physical block ids (shuffled, so placement is arbitrary).
        taken: physical blocks already used per worker (updated).

    The pieces may hold more blocks than seq_len needs (reserved ahead).
    """
    taken = {} if taken is None else taken
    bs = next(iter(pools.values())).layout.block_size
    seq_len = k.shape[0]
    segments = []
    start = 0
    for worker, count in pieces:
        used = taken.setdefault(worker, set())
        free = [b for b in range(pools[worker].num_blocks) if b not in used]
        blocks = tuple(rng.sample(free, count))
        used.update(blocks)
        lo, hi = start, min(start + count * bs, seq_len)
        if hi > lo:
            write_tokens(pools[worker], blocks, lo, k[lo:hi], v[lo:hi], layer)
        segments.append(Segment(worker, start, blocks))
        start += count * bs
    return SequenceView(seq_len, tuple(segments))
