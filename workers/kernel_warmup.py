"""Which decode launches compile every kernel variant a serving pool will meet. Pure.

Triton compiles a kernel variant the first time a launch needs it: about a second each on
the H200 host, on the thread that launches, so on a server's event loop. The decode
attention kernel's variant follows its launch configuration (`kernels.attention.
choose_config`: the split count from the batch size and the context length), and a server
that coalesces concurrent calls meets new batch sizes while serving: a py-spy profile of
the service's concurrency benchmark found most of its session calls' time in compiles
(benchmarks/results/archive/service-h200.md). A pool that knows its model's query
heads launches one small attention per distinct configuration before it serves
(`KVPool.warm_up`); these are those launches' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention import AttentionConfig, choose_config
from kernels.validation import AttentionProblem
from workers.layout import KVLayout

__all__ = [
    "TABLE_WIDTH_MULTIPLE",
    "WarmUpLaunch",
    "decode_warm_up_launches",
    "dummy_decode_inputs",
    "padded_table_width",
    "table_width",
]

# The longest context tried, tokens (the split count stops changing long before: it is
# capped by the programs per SM).
_MAX_CONTEXT_TOKENS = 1 << 17
# Block tables reach the kernels padded to a multiple of this many columns (the
# coordinator's plans, the decode graphs' buckets; `padded_table_width`): the kernels
# specialize on the table's width and row stride being divisible by 16, and a width that
# followed the longest sequence would switch between the two variants (a compile each,
# while serving) as contexts grow. The extra columns are zeros, never read past a
# sequence's length. The launch configuration follows the width: the widths warmed.
TABLE_WIDTH_MULTIPLE = 16


def padded_table_width(blocks: int) -> int:
    """Columns of a block table whose longest row holds `blocks` block ids: `blocks`
    rounded up to a multiple of `TABLE_WIDTH_MULTIPLE` (0 stays 0)."""
    return -(-blocks // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE


@dataclass(frozen=True)
class WarmUpLaunch:
    """One decode attention launch to warm with: `num_seqs` sequences of one query row each
    (``num_q_heads`` heads) over `context` tokens, and the configuration it compiles."""

    num_q_heads: int
    num_seqs: int
    context: int
    config: AttentionConfig


def decode_warm_up_launches(
    layout: KVLayout,
    num_q_heads: int,
    max_batch: int,
    sm_count: int,
    max_context: int = _MAX_CONTEXT_TOKENS,
) -> list[WarmUpLaunch]:
    """The smallest decode launch (fewest sequences, then shortest context) of every
    distinct configuration `choose_config` picks for batches of 1..`max_batch` sequences
    over block tables of every padded width (`TABLE_WIDTH_MULTIPLE` columns at a time) up
    to `max_context` tokens. About half a second of host time for 256 sequences.

    Args:
        layout: the pool's layout (its dtype, KV heads, head_dim, block size).
        num_q_heads: the model's query heads (a multiple of the layout's KV heads).
        max_batch: the most sequences one launch serves (the coordinator's
            max_batch_items).
        sm_count: the device's multiprocessors (the split heuristic fills them).
        max_context: the longest context tried, tokens.

    Raises:
        ValueError: num_q_heads not a positive multiple of the KV heads, or max_batch < 1.
    """
    hkv = layout.num_kv_heads
    if num_q_heads < 1 or num_q_heads % hkv:
        raise ValueError(
            f"num_q_heads must be a positive multiple of the layout's {hkv} KV heads, got "
            f"{num_q_heads}"
        )
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    dtype = layout.torch_dtype()
    found: dict[AttentionConfig, WarmUpLaunch] = {}
    widths = range(
        TABLE_WIDTH_MULTIPLE,
        max(max_context // layout.block_size, TABLE_WIDTH_MULTIPLE) + 1,
        TABLE_WIDTH_MULTIPLE,
    )
    for num_seqs in range(1, max_batch + 1):
        for width in widths:
            problem = AttentionProblem(
                num_q_tokens=num_seqs,
                num_q_heads=num_q_heads,
                num_kv_heads=hkv,
                head_dim=layout.head_dim,
                num_blocks=1,
                block_size=layout.block_size,
                num_seqs=num_seqs,
                max_blocks=width,
            )
            config = choose_config(problem, dtype, sm_count)
            if config not in found:
                context = width * layout.block_size
                found[config] = WarmUpLaunch(num_q_heads, num_seqs, context, config)
    return list(found.values())


def table_width(context: int, block_size: int) -> int:
    """Columns of a warm-up launch's block table: the context's blocks rounded up to
    `TABLE_WIDTH_MULTIPLE`, as served tables are padded, so the launch compiles the
    variant serving uses."""
    return padded_table_width(-(-context // block_size))


def dummy_decode_inputs(
    launch: WarmUpLaunch, layout: KVLayout, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query zeros ``[S, Hq, D]``, block tables of block 0 ``int32 [S, w]``, seq_lens
    ``int32 [S]`` = context, query_start_loc ``int32 [S + 1]``) on `device`: a launch
    that reads only block 0 of the pool and changes nothing."""
    s = launch.num_seqs
    query = torch.zeros(
        (s, launch.num_q_heads, layout.head_dim), dtype=layout.torch_dtype(), device=device
    )
    tables = torch.zeros(
        (s, table_width(launch.context, layout.block_size)), dtype=torch.int32, device=device
    )
    seq_lens = torch.full((s,), launch.context, dtype=torch.int32, device=device)
    starts = torch.arange(s + 1, dtype=torch.int32, device=device)
    return query, tables, seq_lens, starts
