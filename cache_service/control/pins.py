"""Pins: a tenant keeping the cached full blocks of a prefix from eviction.

A pin holds one pool reference per block (so pinned blocks count as used) and is recorded
in `BlockManager._pins` under (tenant, namespace, the pinned blocks' token bytes) and in
`BlockManager._pinned` (block -> pin references). Pins of the same prefix nest.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from cache_service.control.prefix_index import TOKEN_BYTES, pack_tokens, token_bytes
from cache_service.control.quotas import unref
from cache_service.control.state import Pin
from cache_service.control.validation import check_name, check_namespace
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["pin", "unpin"]


def pin(m: BlockManager, tenant: str, token_ids: SequenceABC[int], namespace: str) -> int:
    """`BlockManager.pin`: tokens pinned (0, recording nothing, if none is cached)."""
    check_name("tenant", tenant)
    check_namespace(namespace)
    prompt = pack_tokens(token_ids)
    m._check_length("token_ids", len(prompt))
    data = token_bytes(prompt)
    full = len(prompt) // m._bs
    key = _pin_key(tenant, namespace, data[: full * m._bs * TOKEN_BYTES])
    held = m._pins.get(key)
    if held is None:
        matched = m._index.match(m._salts_for(tenant, namespace), data, full)
        if not matched:
            return 0
        held = m._pins[key] = Pin([block for _, block in matched], 0)
    for block in held.blocks:
        m._pools[block.worker_id].incref(block.index)
        m._pinned[block] = m._pinned.get(block, 0) + 1
    held.count += 1
    return len(held.blocks) * m._bs


def unpin(m: BlockManager, tenant: str, token_ids: SequenceABC[int], namespace: str) -> None:
    """`BlockManager.unpin`: undo one pin of the same prefix by the same tenant."""
    check_name("tenant", tenant)
    check_namespace(namespace)
    prompt = pack_tokens(token_ids)
    data = token_bytes(prompt)
    key = _pin_key(tenant, namespace, data[: (len(prompt) // m._bs) * m._bs * TOKEN_BYTES])
    held = m._pins.get(key)
    if held is None:
        raise InvalidRequest(f"tenant {tenant!r} holds no pin of this {len(prompt)}-token prefix")
    # Tail first, as in `free`: the head of a prefix outlives its tail under LRU.
    for block in reversed(held.blocks):
        m._release(block)
        unref(m._pinned, block)
    held.count -= 1
    if held.count == 0:
        del m._pins[key]


def _pin_key(tenant: str, namespace: str, data: bytes) -> tuple[str, str, bytes]:
    """Key of a pin in `_pins`: (tenant, namespace, the pinned full blocks' token bytes)."""
    return (tenant, namespace, data)
