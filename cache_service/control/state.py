"""The block manager's settings and the records its state is made of besides the pools,
tables and index: what a snapshot (`records`) carries and the manager (`block_manager`)
keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cache_service.control.eviction import DEFAULT_EVICTION_POLICY, check_policy_name
from cache_service.control.types import PhysicalBlock

__all__ = ["BlockManagerConfig", "LostSequence", "Pin"]


@dataclass(frozen=True, slots=True)
class BlockManagerConfig:
    """Static settings of a block manager.

    Attributes:
        block_size: token slots per block (> 0).
        num_layers: model layers each block holds K/V for (> 0).
        layout_fingerprint: `KVLayout.fingerprint()`; salts every prefix key.
        tenant_quota_blocks: most distinct blocks one tenant's sequences may reference
            (a block shared by several of its sequences counts once); None: no limit.
            The default for tenants without a quota of their own (`set_tenant_quota`).
        tenant_quota_sequences: most live sequences per tenant; None: no limit. Same
            default rule.
        eviction_policy: name of the policy choosing which cached-free block each pool
            evicts next (cache_service.control.eviction.EVICTION_POLICIES; "lru": least
            recently released first).
    """

    block_size: int
    num_layers: int
    layout_fingerprint: str
    tenant_quota_blocks: int | None = None
    tenant_quota_sequences: int | None = None
    eviction_policy: str = DEFAULT_EVICTION_POLICY

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"BlockManagerConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.layout_fingerprint, str) or not self.layout_fingerprint:
            raise ValueError("BlockManagerConfig.layout_fingerprint must be a non-empty str")
        for name in ("tenant_quota_blocks", "tenant_quota_sequences"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(
                    f"BlockManagerConfig.{name} must be None or a positive int, got {value!r}"
                )
        try:
            check_policy_name(self.eviction_policy)
        except ValueError as exc:
            raise ValueError(f"BlockManagerConfig.eviction_policy: {exc}") from None


class LostSequence(NamedTuple):
    """Tombstone of a sequence failed by a lost worker (kept until its client frees it)."""

    tenant: str
    worker_id: str


@dataclass(slots=True)
class Pin:
    """One pinned prefix of one tenant: the blocks it holds a reference on, and how many
    times it was pinned (each pin adds one reference per block)."""

    blocks: list[PhysicalBlock]
    count: int
