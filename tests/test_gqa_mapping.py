"""The query-head -> KV-head mapping of grouped-query attention, pinned (issue 35, item 9):
query head h attends KV head h // (num_q_heads // num_kv_heads), contiguous groups, as
documented on KVLayout.num_kv_heads in kvcache.proto and in docs/contracts.md.

A real service call (and the kernels on both paths) is compared with dense attention under
that mapping, and the other natural guess (interleaved, h % num_kv_heads) is shown to give
a different answer on the same data, so a change of mapping fails here.
"""

from __future__ import annotations

import pytest
import torch
from service_support import ServiceHarness, local_workers, service_config

import kernels
from cache_service.client import AppendAttendItem, AttendItem, KVCacheClient
from kernels.testing import make_paged_batch
from workers.layout import KVLayout

HKV, HQ, D = 2, 8, 16  # groups of 4 query heads
LAYOUT = KVLayout(num_layers=1, num_kv_heads=HKV, head_dim=D, block_size=4, dtype="float32")


def contiguous(h: int) -> int:
    return h // (HQ // HKV)


def interleaved(h: int) -> int:
    return h % HKV


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_head) -> torch.Tensor:
    """Causal attention of the last ``m`` positions: q ``[m, HQ, D]``, k / v ``[n, HKV, D]``
    (float64 result ``[m, HQ, D]``), query head h reading KV head ``kv_head(h)``."""
    m, n = q.shape[0], k.shape[0]
    heads = torch.tensor([kv_head(h) for h in range(q.shape[1])])
    kh, vh = k.double()[:, heads], v.double()[:, heads]  # [n, HQ, D]
    scores = torch.einsum("mhd,nhd->hmn", q.double(), kh) * q.shape[-1] ** -0.5
    pos = torch.arange(n - m, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), vh)


def test_the_service_maps_query_heads_to_kv_heads_in_contiguous_groups() -> None:
    g = torch.Generator().manual_seed(9)
    n, m = 11, 3
    k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
    q = torch.randn(m, HQ, D, generator=g)
    config = service_config(LAYOUT)
    with ServiceHarness(config, local_workers(1, 16, LAYOUT)) as svc:
        with KVCacheClient(svc.address, timeout_s=20) as client:
            seq = client.create_sequence().seq_id
            (out,) = client.append_attend(0, [AppendAttendItem(seq, list(range(n)), k, v, q)])
            (again,) = client.attend(0, [AttendItem(seq, q)])
    want = dense(q, k, v, contiguous)
    other = dense(q, k, v, interleaved)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again.double(), want, rtol=1e-5, atol=1e-5)
    # The interleaved guess is a different answer on this data: the test can tell them apart.
    assert (other - want).abs().max() > 0.1
    assert (out.double() - other).abs().max() > 0.1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_kernels_use_the_same_mapping(backend: str) -> None:
    b = make_paged_batch(
        [9, 6], [2, 1], num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=4, seed=5
    )
    out = kernels.paged_attention(*b.args(), backend=backend, check_values=True)
    starts = b.query_start_loc.tolist()
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        blocks = b.block_tables[s, : -(-seq_len // 4)].long()
        # The pool's [blocks, Hkv, bs, D] back to the sequence's [n, Hkv, D].
        k = b.key_cache[blocks].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:seq_len]
        v = b.value_cache[blocks].permute(0, 2, 1, 3).reshape(-1, HKV, D)[:seq_len]
        q = b.query[starts[s] : starts[s + 1]]
        got = out[starts[s] : starts[s + 1]].double()
        torch.testing.assert_close(got, dense(q, k, v, contiguous), rtol=1e-4, atol=1e-4)
        assert (got - dense(q, k, v, interleaved)).abs().max() > 0.1
