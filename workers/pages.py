"""Page addressing of a pool: one launch over sequences of different layers.

The pool tensor ``[num_blocks, L, 2, Hkv, block_size, D]`` viewed as
``[num_blocks * L, 2, Hkv, block_size, D]`` makes page ``block * L + layer`` block ``block``
of layer ``layer``; block tables and slots written in page ids let one kernel launch serve
sequences (and new tokens) of different layers (`KVPool.run_round` of a round over
several layers). The pool makes the page ids on its device from the round's per-layer
block ids and slots and each sequence's and new token's layer.
"""

from __future__ import annotations

import torch

from workers.errors import InvalidWorkerRequest
from workers.layout import KVLayout

__all__ = ["check_page_count", "layer_vector", "page_caches", "page_tables", "to_pages"]

_INT32_MAX = 2**31 - 1


def check_page_count(num_blocks: int, layout: KVLayout) -> None:
    """Refuse a pool whose pages do not fit the kernels' int32 page ids.

    Raises:
        InvalidWorkerRequest: ``num_blocks * num_layers`` above ``2**31 - 1``.
    """
    if num_blocks * layout.num_layers > _INT32_MAX:
        raise InvalidWorkerRequest(
            f"{num_blocks} blocks x {layout.num_layers} layers are too many pages for "
            "one launch (int32 page ids); call per layer"
        )


def page_caches(
    data: torch.Tensor, num_blocks: int, layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer of the pool tensor `data` as pages
    ``[num_blocks * L, Hkv, block_size, D]`` (views: page ``b * L + l`` is block b of layer
    l; dim 0 strides over the K/V pair)."""
    pages = data.view(
        num_blocks * layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_dim
    )
    return pages[:, 0], pages[:, 1]


def layer_vector(
    seq_layers: object, slot_layers: object, num_seqs: int, num_slots: int, layout: KVLayout
) -> torch.Tensor:
    """Host int32 ``[num_seqs + num_slots]``: each sequence's layer then each new token's,
    validated (one per sequence and per token, each within the layout).

    Raises:
        InvalidWorkerRequest: anything else.
    """
    for name, given, count in (
        ("seq_layers", seq_layers, num_seqs),
        ("slot_layers", slot_layers, num_slots),
    ):
        if type(given) is not list or len(given) != count:
            shown = len(given) if isinstance(given, list) else type(given).__name__
            raise InvalidWorkerRequest(
                f"{name} must be a list of {count} layers (one per "
                f"{'sequence' if name == 'seq_layers' else 'new token'}), got {shown}"
            )
        if given and (
            not all(type(x) is int for x in given)
            or min(given) < 0
            or max(given) >= layout.num_layers
        ):
            raise InvalidWorkerRequest(
                f"{name} must hold layer indices in [0, {layout.num_layers}), got {given}"
            )
    return torch.tensor(seq_layers + slot_layers, dtype=torch.int32)  # type: ignore[operator]


def to_pages(
    block_tables: torch.Tensor, slots: torch.Tensor, layers: torch.Tensor, layout: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer block tables ``[S, max_blocks]`` and flat slots ``[n]`` as page tables and
    page slots, on their device: `layers` is int32 ``[S + n]``, each sequence's then each
    new token's layer. Negative slots (skipped by the write) stay as they are."""
    n_layers, bs = layout.num_layers, layout.block_size
    num_seqs = block_tables.shape[0]
    slot_layers = layers[num_seqs:]
    tables = page_tables(block_tables, layers, layout)
    pages = torch.where(
        slots >= 0, ((slots // bs) * n_layers + slot_layers) * bs + slots % bs, slots
    )
    return tables, pages


def page_tables(block_tables: torch.Tensor, layers: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Per-layer block tables ``[S, max_blocks]`` as page tables on their device; `layers`
    int32 ``[S + ...]`` starts with each sequence's layer."""
    # Padded table entries (past a sequence's length, never read) stay valid pages.
    return block_tables * layout.num_layers + layers[: block_tables.shape[0], None]
