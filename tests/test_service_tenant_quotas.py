"""Per-tenant quotas from the token file, enforced through the real server.

`max_sequences` and `max_blocks` of a tenant refuse the call that would pass them with
RESOURCE_EXHAUSTED naming the tenant, its limit and its usage, and change nothing; other
tenants are not limited by them. With a metadata store the quotas are part of the
recovered control plane, and a restart with an edited token file applies the new ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from service_support import HQ, LAYOUT, ServiceHarness, local_workers, service_config

from cache_service.client import (
    AppendAttendItem,
    KVCacheClient,
    ResourceExhaustedError,
)
from cache_service.control.types import TenantQuota

pytestmark = pytest.mark.timeout(60)

D, HKV, NL, BS = LAYOUT.head_dim, LAYOUT.num_kv_heads, LAYOUT.num_layers, LAYOUT.block_size
TOKEN_A = "token-of-acme-0123456789"
TOKEN_B = "token-of-globex-abcdefgh"
GEN = torch.Generator().manual_seed(11)


def token_file(path: Path, acme: dict[str, int]) -> str:
    path.write_text(
        json.dumps({"tokens": {TOKEN_A: "acme", TOKEN_B: "globex"}, "tenants": {"acme": acme}})
    )
    return str(path)


def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NL, n, HKV, D)
    return torch.randn(shape, generator=GEN), torch.randn(shape, generator=GEN)


def refused(svc: ServiceHarness, call, *needles: str) -> None:
    before = svc.stats()
    with pytest.raises(ResourceExhaustedError) as info:
        call()
    for needle in needles:
        assert needle in info.value.message, info.value.message
    assert svc.stats() == before
    svc.check_integrity()


def test_token_file_quotas_are_enforced_per_tenant(tmp_path: Path) -> None:
    auth = token_file(tmp_path / "tokens.json", {"max_sequences": 2, "max_blocks": 3})
    with (
        ServiceHarness(service_config(auth_file=auth), local_workers(2, 16)) as svc,
        KVCacheClient(svc.address, token=TOKEN_A, timeout_s=20, max_attempts=1) as acme,
        KVCacheClient(svc.address, token=TOKEN_B, timeout_s=20, max_attempts=1) as globex,
    ):
        a1 = acme.create_sequence()
        acme.append(a1.seq_id, list(range(8)), *kv(8))  # 2 blocks
        a2 = acme.create_sequence()
        refused(svc, acme.create_sequence, "tenant 'acme'", "2 live sequences", "quota is 2")
        refused(svc, lambda: acme.fork(a1.seq_id), "tenant 'acme'", "quota is 2")
        # Blocks: one more fits, the next would pass 3 (an AppendAttend batch is refused
        # whole, so a2's block is not kept either).
        items = [
            AppendAttendItem(seq_id, [1], k[0], v[0], torch.randn(1, HQ, D, generator=GEN))
            for seq_id, (k, v) in ((a2.seq_id, kv(1)), (a1.seq_id, kv(1)))
        ]
        refused(
            svc,
            lambda: acme.append_attend(0, items),
            "tenant 'acme' holds 3 blocks; 1 more would pass its quota of 3",
        )
        acme.append_attend(0, items[:1])
        refused(svc, lambda: acme.append(a1.seq_id, [9], *kv(1)), "quota of 3")
        # globex has no quota of its own and no default: unlimited.
        for _ in range(4):
            g = globex.create_sequence()
            globex.append(g.seq_id, list(range(12)), *kv(12))
        # Freeing gives the room back.
        acme.free(a2.seq_id)
        acme.append(a1.seq_id, [9], *kv(1))
        acme.create_sequence()


def test_quotas_are_recovered_and_follow_the_edited_file(tmp_path: Path) -> None:
    store = str(tmp_path / "meta.db")
    auth_path = tmp_path / "tokens.json"
    workers = local_workers(1, 16)
    auth = token_file(auth_path, {"max_sequences": 1})
    svc = ServiceHarness(service_config(auth_file=auth, store_path=store), workers)
    try:
        with KVCacheClient(svc.address, token=TOKEN_A, timeout_s=20, max_attempts=1) as acme:
            kept = acme.create_sequence()
            refused(svc, acme.create_sequence, "quota is 1")
        quotas = svc.call(svc.coordinator.block_manager.tenant_quotas)
        assert quotas == {"acme": TenantQuota(None, 1)}
    finally:
        svc.workers = None  # the pools outlive the coordinator, like detached actors
        svc.stop()

    # An edited file: its new limits apply on restart, the old one is gone.
    token_file(auth_path, {"max_blocks": 1})
    svc = ServiceHarness(service_config(auth_file=auth, store_path=store), workers)
    try:
        quotas = svc.call(svc.coordinator.block_manager.tenant_quotas)
        assert quotas == {"acme": TenantQuota(1, None)}
        with KVCacheClient(svc.address, token=TOKEN_A, timeout_s=20, max_attempts=1) as acme:
            acme.append(kept.seq_id, list(range(4)), *kv(4))
            refused(svc, lambda: acme.append(kept.seq_id, [4], *kv(1)), "quota of 1")
            acme.create_sequence()  # no sequence limit any more
    finally:
        svc.stop()
