"""Paged-attention compute: Triton kernels for CUDA tensors, torch references for CPU tensors.

Public API (shapes, dtypes and units in each function's docstring):
``paged_attention``, ``merge_attention_states``, ``write_kv``, ``record_fingerprints``,
``copy_blocks``, ``gather_blocks``, ``scatter_blocks``; for callers that run one step's
metadata on several layers, ``paged_attention_plan`` / ``attend_planned`` and
``slot_rows`` / ``write_rows``.

Every function validates its arguments first (:mod:`kernels.validation`): a malformed
argument raises :class:`KernelArgumentError`, a ``ValueError`` naming the argument, and
nothing is written. Then it dispatches on ``backend``:

* ``None`` / ``"auto"``: Triton for CUDA tensors, torch for CPU tensors (so the service runs
  on machines without a GPU).
* ``"triton"``: the Triton kernels. On CPU tensors this needs Triton's interpreter
  (``TRITON_INTERPRET=1`` set before triton is first imported), which the tests use.
* ``"torch"``: torch on any device: the references (:mod:`kernels.reference`). Paged
  attention on CUDA tensors takes its batched torch path instead
  (:mod:`kernels.attention_torch`, tested against ``paged_attention_ref``): the
  reference's loop over sequences is launch-bound there. On CPU tensors a call whose
  padded work is small (a decode step, a short prefill) takes the same batched path (about
  twenty operations for the whole call; a handful when planned once for several calls,
  :func:`paged_attention_plan` and :func:`attend_planned`), a larger one the reference's
  loop. ``write_kv`` copies its tokens as rows (:mod:`kernels.kv_write_torch`).

The Triton modules are imported on first use, so importing this package stays cheap on
CPU-only machines.

``check_values`` also checks the index tensors' contents (block ids inside the pool, lengths
inside the block table, query offsets, ...). On CUDA that reads them back to the host, a
synchronisation that cost paged attention 2-6x its time on an H200, so
:func:`paged_attention`, a read-only call on the decode path, leaves it off by default
(``check_values=False``): a caller whose indices come from outside (an untrusted request)
passes ``check_values=True`` or validates them itself, as the pools do on the host
(``workers.checks``). The shape, dtype, stride and device checks read no device data and
always run. The writing calls (:func:`write_kv`, :func:`copy_blocks`, ...) keep
``check_values=True`` by default: a wrong index there overwrites other data.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from kernels.attention_torch import (
    MAX_CPU_ELEMENTS,
    AttentionPlan,
    attend_planned,
    padded_elements,
    paged_attention_torch,
    plan_paged_attention,
)
from kernels.kv_write_torch import slot_rows, write_kv_torch, write_rows
from kernels.reference import (
    copy_blocks_ref,
    gather_blocks_ref,
    merge_attention_states_ref,
    paged_attention_ref,
    record_fingerprints_ref,
    scatter_blocks_ref,
)
from kernels.validation import (
    KernelArgumentError,
    check_block_copy_args,
    check_gather_args,
    check_merge_args,
    check_paged_attention_args,
    check_record_fingerprints_args,
    check_scatter_args,
    check_write_kv_args,
)

__all__ = [
    "AttentionPlan",
    "Backend",
    "KernelArgumentError",
    "attend_planned",
    "copy_blocks",
    "gather_blocks",
    "merge_attention_states",
    "paged_attention",
    "paged_attention_plan",
    "record_fingerprints",
    "scatter_blocks",
    "slot_rows",
    "triton_interpreter_enabled",
    "write_kv",
    "write_rows",
]

Backend = Literal["auto", "triton", "torch"]


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run on CPU tensors through the interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _use_triton(backend: Backend | None, device: torch.device) -> bool:
    if backend is None or backend == "auto":
        return device.type == "cuda"
    if backend == "torch":
        return False
    if backend == "triton":
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise KernelArgumentError(
                f"backend='triton' on {device} tensors needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported"
            )
        return True
    raise KernelArgumentError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    backend: Backend | None = None,
    check_values: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new query tokens over a paged KV cache (decode, prefill, chunked prefill).

    Args:
        query: ``[T, Hq, D]`` fp16 / bf16 / fp32, last dim contiguous. Rows
            ``query_start_loc[s]:query_start_loc[s+1]`` are the last ``n_s`` tokens of sequence s:
            query i of n sits at position ``seq_len - n + i``.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]``, the query's dtype; any
            stride on dim 0, the last three dims contiguous. ``Hq`` must be a multiple of
            ``Hkv``; query head h reads KV head ``h // (Hq // Hkv)``.
        block_tables: int32 (or int64) ``[S, max_blocks]``: logical block j of sequence s is
            physical block ``block_tables[s, j]``. Entries past ``ceil(seq_len / block_size)``
            are never read.
        seq_lens: int32 ``[S]``: KV tokens of each sequence, the new ones included
            (``<= max_blocks * block_size``).
        query_start_loc: int32 ``[S + 1]``, non-decreasing from 0 to T; ``n_s <= seq_lens[s]``.
        scale: multiplier of ``q . k`` (default ``D ** -0.5``).
        causal: query at position p sees keys ``0..p`` (else every key of its sequence).
        sliding_window: if set (>= 1), a query at p sees only keys k with ``p - k < window``.
        softcap: if set (> 0), scores become ``softcap * tanh(score / softcap)``.
        return_lse: also return the float32 natural-log softmax denominator ``[T, Hq]``.
        out: optional ``[T, Hq, D]`` output tensor (query dtype, last dim contiguous).
        backend: ``None``/"auto", "triton" or "torch" (see the module docstring).
        check_values: also validate the index tensors' contents (block ids inside the pool,
            ``seq_lens`` inside the block table and >= 0, ``query_start_loc`` from 0 to T
            and non-decreasing, ``n_s <= seq_lens[s]``); reads them to the host (a device
            sync on CUDA). Off by default: with it off the indices must be valid (an
            out-of-range block id reads memory outside the pool).

    Returns:
        out ``[T, Hq, D]`` in the query's dtype, or ``(out, lse)`` with ``return_lse``. A row
        that sees no key gets 0 and LSE -inf.

    Raises:
        KernelArgumentError: a malformed argument (named in the message); nothing is written.
    """
    problem = check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale=scale, sliding_window=sliding_window, softcap=softcap, out=out,
        check_values=check_values,
    )  # fmt: skip
    if _use_triton(backend, query.device):
        from kernels.attention import paged_attention_triton

        o, lse = paged_attention_triton(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, problem,
            scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
            return_lse=return_lse, out=out,
        )  # fmt: skip
    else:
        o, lse = _attention_in_torch(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap, out=out,
        )  # fmt: skip
    return (o, lse) if return_lse else o


def paged_attention_plan(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    backend: Backend | None = None,
) -> AttentionPlan | None:
    """The plan (:func:`kernels.attention_torch.plan_paged_attention`) of the calls of
    :func:`paged_attention` with this metadata, for queries like `query` and caches of the
    geometry of `key_cache` and `value_cache` (any layer of a pool), where such a call takes
    the batched torch path; run it with :func:`attend_planned` (arguments as
    :func:`paged_attention` takes them, already validated). None where the call takes
    another path: Triton (its kernels read the metadata on the device), or a CPU call too
    large to pad (the reference's loop)."""
    if _use_triton(backend, query.device):
        return None
    if query.device.type != "cuda" and not _small(query, key_cache, seq_lens, query_start_loc):
        return None
    return plan_paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        causal=causal, sliding_window=sliding_window,
    )  # fmt: skip


def _small(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> bool:
    """Whether a call's padded work fits the batched torch path on CPU."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    return padded_elements(query.shape[1], key_cache.shape[2], starts, lens) <= MAX_CPU_ELEMENTS


def _attention_in_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None,
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention`'s torch backend on validated arguments (the batched torch
    path on CUDA, and elsewhere when its padded work is small; the reference's loop
    otherwise): ``(out, lse)``, the output copied into `out` when given."""
    batched = query.device.type == "cuda" or _small(query, key_cache, seq_lens, query_start_loc)
    torch_path = paged_attention_torch if batched else paged_attention_ref
    o, lse = torch_path(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


def merge_attention_states(
    outputs: torch.Tensor, lses: torch.Tensor, *, backend: Backend | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partial attention results over disjoint key sets.

    Args:
        outputs: ``[P, T, H, D]`` fp16 / bf16 / fp32, each part normalised by its own softmax
            denominator.
        lses: float32 ``[P, T, H]``, natural-log denominators; -inf marks a part that saw no
            key for that row (its output is ignored).
        backend: see the module docstring.

    Returns:
        ``(out [T, H, D] in outputs' dtype, lse float32 [T, H])``; rows where every part is
        -inf get 0 and -inf.
    """
    check_merge_args(outputs, lses)
    if _use_triton(backend, outputs.device):
        from kernels.merge_states import merge_attention_states_triton

        return merge_attention_states_triton(outputs, lses)
    return merge_attention_states_ref(outputs, lses)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """Write new tokens' K/V into their cache slots, in place (vLLM's reshape_and_cache).

    Args:
        key, value: ``[n, Hkv, D]`` in the caches' dtype.
        key_cache, value_cache: ``[num_blocks, Hkv, block_size, D]`` (inner dims contiguous).
        slot_mapping: int64 (or int32) ``[n]``: token i goes to flat slot
            ``block * block_size + offset``; negative slots are skipped; slots must be distinct.
        backend, check_values: see the module docstring.
    """
    check_write_kv_args(key, value, key_cache, value_cache, slot_mapping, check_values=check_values)
    if _use_triton(backend, key_cache.device):
        from kernels.kv_write import write_kv_triton

        write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_torch(key, value, key_cache, value_cache, slot_mapping)


def record_fingerprints(
    key: torch.Tensor,
    value: torch.Tensor,
    weights: torch.Tensor,
    sums: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer: int | None,
    block_size: int,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """Fingerprint a write, in place: each token's K and V rows summed with `weights` in
    float64, stored at its slot's row and layer of `sums` (workers.fingerprints).

    Args:
        key, value: ``[n, Hkv, D]``, float16 / bfloat16 / float32 (as written).
        weights: float64 ``[Hkv, D]``.
        sums: float64 ``[rows, L, 2]``, contiguous (index 0: K, 1: V). Its last
            `block_size` rows are a spare block: tokens with a negative slot land there.
        slot_mapping: int64 (or int32) ``[n]``: flat slots ``block * block_size + offset``;
            with `layer` None, slots of pages (page ``block * L + layer``); negative:
            skipped (spare row). Row ``slot`` (or ``block * block_size + offset`` of the
            page) must lie below the spare block.
        layer: the layer of every token, or None for page slots (each token on its own).
        block_size: tokens per block.
        backend, check_values: see the module docstring.
    """
    check_record_fingerprints_args(
        key, value, weights, sums, slot_mapping, layer, block_size, check_values=check_values
    )
    if _use_triton(backend, sums.device):
        from kernels.slot_fingerprints import record_fingerprints_triton

        record_fingerprints_triton(
            key.contiguous(), value.contiguous(), weights, sums, slot_mapping, layer, block_size
        )
    else:
        record_fingerprints_ref(key, value, weights, sums, slot_mapping, layer, block_size)


def copy_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` in both caches (copy-on-write), in place.

    Args:
        key_cache, value_cache: tensors whose dim 0 indexes blocks (one layer's cache, or a
            whole pool tensor / its K and V halves).
        src, dst: int ``[n]`` block ids in ``[0, num_blocks)``; ``dst`` ids distinct. Sources
            are read before any destination is written, so ids may appear on both sides.
        backend, check_values: see the module docstring.
    """
    overlap = check_block_copy_args(key_cache, value_cache, src, dst, check_values=check_values)
    if not _use_triton(backend, key_cache.device):
        copy_blocks_ref(key_cache, value_cache, src, dst)
        return
    from kernels.block_copy import copy_block_rows

    for cache in (key_cache, value_cache) if value_cache is not key_cache else (key_cache,):
        if overlap:
            # Stage through a buffer so every source is read before any destination changes.
            staged = torch.empty(
                (src.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device
            )
            ids = torch.arange(src.shape[0], device=cache.device)
            copy_block_rows(cache, src, staged, ids)
            copy_block_rows(staged, ids, cache, dst)
        else:
            copy_block_rows(cache, src, cache, dst)


def gather_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the listed blocks out (export).

    Returns:
        ``(k, v)``, new contiguous tensors ``[len(block_ids), *key_cache.shape[1:]]`` on the
        caches' device, in their dtype.
    """
    check_gather_args(key_cache, value_cache, block_ids, check_values=check_values)
    if not _use_triton(backend, key_cache.device):
        return gather_blocks_ref(key_cache, value_cache, block_ids)
    from kernels.block_copy import copy_block_rows

    n = block_ids.shape[0]
    ids = torch.arange(n, device=key_cache.device)
    result = []
    for cache in (key_cache, value_cache):
        buf = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        copy_block_rows(cache, block_ids, buf, ids)
        result.append(buf)
    return result[0], result[1]


def scatter_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    key_blocks: torch.Tensor,
    value_blocks: torch.Tensor,
    *,
    backend: Backend | None = None,
    check_values: bool = True,
) -> None:
    """Write whole blocks back (import; the inverse of :func:`gather_blocks`), in place.

    Args:
        block_ids: int ``[n]`` distinct block ids in ``[0, num_blocks)``.
        key_blocks, value_blocks: ``[n, *key_cache.shape[1:]]`` in the caches' dtype, on
            their device.
    """
    check_scatter_args(
        key_cache, value_cache, block_ids, key_blocks, value_blocks, check_values=check_values
    )
    if not _use_triton(backend, key_cache.device):
        scatter_blocks_ref(key_cache, value_cache, block_ids, key_blocks, value_blocks)
        return
    from kernels.block_copy import copy_block_rows

    ids = torch.arange(block_ids.shape[0], device=key_cache.device)
    copy_block_rows(key_blocks, ids, key_cache, block_ids)
    copy_block_rows(value_blocks, ids, value_cache, block_ids)
