"""The prefix cache's side of the manager: salts, publishing full blocks in the prefix
index, matching prompts against it and adopting what matched, and evicting its cached-free
blocks.

A block is published under its tenant's salt once it is full and written on every layer
(`publish`), and under the public salt on request (`publish_public`); `lookup` answers
what `BlockManager.create_sequence` would adopt without adopting anything; `evict` reclaims
unreferenced published blocks ahead of need.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING

from cache_service.control.host_tier import HostBlock, evict_blocks, restorable, restore_blocks
from cache_service.control.prefix_index import (
    ROOT_KEY,
    IndexEntry,
    Salt,
    chain_keys,
    encode_tokens,
    make_salt,
    pack_tokens,
    token_bytes,
)
from cache_service.control.quotas import ref
from cache_service.control.types import PhysicalBlock
from cache_service.control.validation import check_name, check_namespace
from cache_service.errors import InvalidRequest

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager
    from cache_service.control.sequence import Sequence

__all__ = ["adopt", "evict", "lookup", "match_prompt", "publish", "publish_public", "salts_for"]


def salts_for(m: BlockManager, tenant: str, namespace: str = "") -> tuple[Salt, Salt]:
    """(the tenant's salt, the public salt) of one namespace, cached."""
    salts = m._salts.get((tenant, namespace))
    if salts is None:
        fingerprint = m.config.layout_fingerprint
        public = m._public if not namespace else make_salt(None, fingerprint, namespace)
        salts = (make_salt(tenant, fingerprint, namespace), public)
        m._salts[(tenant, namespace)] = salts
    return salts


def publish(m: BlockManager, seq: Sequence, upto: int) -> None:
    """Publish blocks len(seq.keys) .. upto-1 of `seq` under its tenant's salt."""
    salt = salts_for(m, seq.tenant, seq.namespace)[0].salt
    keys = seq.keys
    bs = m._bs
    first = len(keys)
    data = encode_tokens(seq.tokens[first * bs : upto * bs])
    chain = chain_keys(keys[-1] if keys else ROOT_KEY, salt, data, bs)
    entries = [
        (key, IndexEntry(seq.table[i], parent, seq.tenant, chunk, seq.namespace))
        for i, (parent, key, chunk) in enumerate(chain, start=first)
    ]
    m._index.publish_chain(entries)
    keys.extend(key for key, _ in entries)


def publish_public(m: BlockManager, tenant: str, seq_id: str) -> int:
    """`BlockManager.publish_public`: blocks newly published as public."""
    seq = m._resolve(tenant, seq_id)
    data = encode_tokens(seq.tokens[: len(seq.keys) * m._bs])
    public = salts_for(m, tenant, seq.namespace)[1].salt
    return m._index.publish_chain(
        (key, IndexEntry(seq.table[i], parent, None, chunk, seq.namespace))
        for i, (parent, key, chunk) in enumerate(chain_keys(ROOT_KEY, public, data, m._bs))
    )


def lookup(m: BlockManager, tenant: str, token_ids: SequenceABC[int], namespace: str) -> int:
    """`BlockManager.lookup`: tokens of the prompt `create_sequence` would adopt now."""
    check_name("tenant", tenant)
    check_namespace(namespace)
    prompt = pack_tokens(token_ids)
    m._check_length("token_ids", len(prompt))
    return len(match_prompt(m, tenant, namespace, prompt, token_bytes(prompt))) * m._bs


def match_prompt(
    m: BlockManager, tenant: str, namespace: str, prompt: array, data: bytes
) -> list[tuple[bytes, PhysicalBlock | HostBlock]]:
    """(key, block) of the longest cached prefix of `prompt`'s full blocks (its last token
    always left to compute), on the GPU or restorable from a host tier; `data` is
    ``token_bytes(prompt)``."""
    if not prompt:
        return []
    host = m._host.entries or None
    found = m._index.match(salts_for(m, tenant, namespace), data, (len(prompt) - 1) // m._bs, host)
    return restorable(m, found)


def adopt(
    m: BlockManager, tenant: str, matched: list[tuple[bytes, PhysicalBlock | HostBlock]]
) -> tuple[list[PhysicalBlock], int]:
    """Reference `match_prompt`'s blocks for `tenant`, restoring host ones to the GPU;
    returns (the GPU blocks in prefix order, how many were restored)."""
    tenant_blocks = m._tenant_blocks.setdefault(tenant, {})
    gpu = [b for _, b in matched if type(b) is PhysicalBlock]
    # GPU blocks are referenced first, so restoring the others cannot evict them.
    for block in gpu:
        m._pools[block.worker_id].incref(block.index)
    restored = len(matched) - len(gpu)
    blocks = restore_blocks(m, matched) if restored else gpu
    for block in blocks:
        ref(tenant_blocks, block)
    return blocks, restored


def evict(m: BlockManager, max_blocks: int | None, worker_id: str | None) -> int:
    """`BlockManager.evict`: blocks evicted (their keys go to the host tier if the worker
    has one, see cache_service.control.host_tier)."""
    if max_blocks is not None and (type(max_blocks) is not int or max_blocks < 0):
        raise InvalidRequest(f"max_blocks must be None or an int >= 0, got {max_blocks!r}")
    if worker_id is not None and worker_id not in m._pools:
        raise InvalidRequest(f"unknown worker {worker_id!r}")
    pools = [m._pools[worker_id]] if worker_id is not None else m._pools.values()
    left = max_blocks
    evicted: list[PhysicalBlock] = []
    for pool in pools:
        while left is None or left > 0:
            index = pool.evict_next()
            if index is None:
                break
            block = PhysicalBlock(pool.worker_id, index)
            evicted.append(block)
            m._note_released(block)
            if left is not None:
                left -= 1
    evict_blocks(m, evicted)
    m._counters.evictions += len(evicted)
    return len(evicted)
