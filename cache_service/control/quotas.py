"""Tenant quotas and the per-tenant block reference counts they limit.

A tenant's block count is the number of distinct blocks its sequences' tables reference
(`BlockManager._tenant_blocks`, block -> table entries); pinned blocks do not count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_service.control.types import PhysicalBlock, TenantQuota
from cache_service.control.validation import check_name
from cache_service.errors import InvalidRequest, QuotaExceeded

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager

__all__ = ["check_block_quota", "check_sequence_quota", "ref", "set_tenant_quota", "unref"]


def ref(counts: dict[PhysicalBlock, int], block: PhysicalBlock) -> None:
    """Count one more reference to `block` in `counts`."""
    counts[block] = counts.get(block, 0) + 1


def unref(counts: dict[PhysicalBlock, int], block: PhysicalBlock) -> None:
    """Count one reference to `block` less in `counts`, dropping it at zero."""
    left = counts[block] - 1
    if left:
        counts[block] = left
    else:
        del counts[block]


def check_sequence_quota(m: BlockManager, tenant: str) -> None:
    """Raise QuotaExceeded if `tenant` may not start one more sequence."""
    own = m._quotas.get(tenant)
    quota = own.max_sequences if own is not None else None
    if quota is None:
        quota = m.config.tenant_quota_sequences
    if quota is not None and m._tenant_seqs.get(tenant, 0) >= quota:
        live = m._tenant_seqs.get(tenant, 0)
        raise QuotaExceeded(
            f"tenant {tenant!r} has {live} live sequences, its quota is {quota} sequences"
        )


def check_block_quota(m: BlockManager, tenant: str, new_blocks: int) -> None:
    """Raise QuotaExceeded if `tenant` may not reference `new_blocks` more blocks."""
    own = m._quotas.get(tenant)
    quota = own.max_blocks if own is not None else None
    if quota is None:
        quota = m.config.tenant_quota_blocks
    if quota is not None and new_blocks > 0:
        held = len(m._tenant_blocks.get(tenant, ()))
        if held + new_blocks > quota:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {held} blocks; {new_blocks} more would pass its "
                f"quota of {quota}"
            )


def set_tenant_quota(
    m: BlockManager, tenant: str, max_blocks: int | None, max_sequences: int | None
) -> None:
    """`BlockManager.set_tenant_quota`."""
    check_name("tenant", tenant)
    for name, value in (("max_blocks", max_blocks), ("max_sequences", max_sequences)):
        if value is not None and (type(value) is not int or value < 1):
            raise InvalidRequest(f"{name} must be None or a positive int, got {value!r}")
    if max_blocks is None and max_sequences is None:
        m._quotas.pop(tenant, None)
    else:
        m._quotas[tenant] = TenantQuota(max_blocks, max_sequences)
