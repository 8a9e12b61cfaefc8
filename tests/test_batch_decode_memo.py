"""The servicer's memo of decoded AppendAttendBatch requests (cache_service.api.batch_decode_memo).

Real shared-memory regions in a temporary directory, real requests as a client encodes
them: a decode step's later layers reuse the first layer's decode and hold the regions as
a fresh decode does; anything else that differs decodes again; a dropped region takes its
entries with it and unmaps cleanly; another tenant never reaches an entry; requests whose
tensors travel as bytes, and registries that copy inputs, are never kept.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from pathlib import Path

import pytest
import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.api.batch_decode_memo import BatchDecodeMemo
from cache_service.config import SharedMemoryConfig
from cache_service.engine.worker_interface import AttentionResult
from cache_service.errors import InvalidRequest, SharedRegionNotFound
from cache_service.wire.request_codec import SharedTensor, encode_append_attend_batch
from cache_service.wire.shared_regions import SharedRegions
from workers.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
B, HQ = 3, 4
_K, _V, _Q, _OUT, _LSE = 0, 1024, 2048, 3072, 4096


def _regions(tmp_path: Path, zero_copy: bool = True) -> SharedRegions:
    return SharedRegions(SharedMemoryConfig(), directory=str(tmp_path), zero_copy=zero_copy)


def _create(regions: SharedRegions, tenant: str = "t") -> str:
    return asyncio.run(regions.create(tenant, 8192)).region_id


def _request(
    region_id: str,
    layer: int = 0,
    token: int = 5,
    *,
    query_at: int = _Q,
    lse: bool = False,
    bytes_key: bool = False,
) -> pb.AppendAttendBatchRequest:
    def shared(shape: tuple[int, ...], offset: int) -> SharedTensor:
        return SharedTensor(torch.float32, shape, region_id, offset)

    kv = (B, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    key = torch.ones(kv) if bytes_key else shared(kv, _K)
    body = encode_append_attend_batch(
        layer,
        [f"s{i}" for i in range(B)],
        [[token]] * B,
        key,
        shared(kv, _V),
        shared((B, 1, HQ, LAYOUT.head_dim), query_at),
        lse,
        output_to=(region_id, _OUT),
        lse_to=(region_id, _LSE) if lse else None,
    )
    return pb.AppendAttendBatchRequest.FromString(body)


def test_later_layers_reuse_the_decode_and_hold_the_region(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    region = regions._regions[rid]
    memo = BatchDecodeMemo(regions, LAYOUT)
    with memo.decode("t", _request(rid, layer=0, lse=True)) as first:
        assert region.users == 5  # three input views and two output slots
        batch = first.batch
        assert batch.seq_ids == ["s0", "s1", "s2"] and batch.token_ids == [5, 5, 5]
        assert first.output_view is not None and first.output_view.shape == (B, HQ, 8)
    assert region.users == 0 and (memo.hits, memo.misses) == (0, 1)
    request = _request(rid, layer=3, lse=True)
    with memo.decode("t", request) as again:
        assert request.layer == 3  # the key is taken without the layer, which stays
        assert again.batch is batch and again.output_view is first.output_view
        assert region.users == 5
        # The views read the region's bytes as they are now (each layer's new values).
        with open(regions._regions[rid].path, "r+b") as f, mmap.mmap(f.fileno(), 8192) as mm:
            mm[_Q : _Q + 4] = torch.tensor([7.0]).numpy().tobytes()
        assert again.batch.query[0, 0, 0, 0].item() == 7.0
        assert again.outputs.out is not None and again.outputs.lse is not None
        assert again.outputs.lse.offset == _LSE
    assert region.users == 0 and (memo.hits, memo.misses) == (1, 1)
    regions.close()


def test_anything_else_that_differs_decodes_again(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT)
    with memo.decode("t", _request(rid)) as first:
        pass
    for other in (_request(rid, token=6), _request(rid, query_at=_Q + 512)):
        with memo.decode("t", other) as decoded:
            assert decoded.batch is not first.batch
    assert (memo.hits, memo.misses, len(memo)) == (0, 3, 3)
    regions.close()


def test_a_dropped_region_takes_its_entries_and_unmaps(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid, other = _create(regions), _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT)
    with memo.decode("t", _request(rid)):
        pass
    with memo.decode("t", _request(other)):
        pass
    region = regions._regions[rid]
    regions.release("t", rid)
    # The entry's views went before the unmap: no view was left to block it.
    assert region.mm.closed and len(memo) == 1
    with pytest.raises(SharedRegionNotFound, match=r"key\.shared: shared region .* not found"):
        memo.decode("t", _request(rid, layer=1))
    regions.close()  # server stop drops the rest
    assert len(memo) == 0 and not os.listdir(tmp_path)


def test_another_tenant_never_reaches_an_entry(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions, "a")
    memo = BatchDecodeMemo(regions, LAYOUT)
    with memo.decode("a", _request(rid)):
        pass
    region = regions._regions[rid]
    with pytest.raises(SharedRegionNotFound, match="not found"):
        memo.decode("b", _request(rid, layer=2))
    assert region.users == 0 and memo.hits == 0
    regions.close()


def test_bytes_payloads_and_copying_registries_are_never_kept(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT)
    for layer in (0, 1):
        with memo.decode("t", _request(rid, layer=layer, bytes_key=True)) as decoded:
            assert decoded.batch.key.sum().item() == B * 2 * 8
    assert len(memo) == 0 and memo.hits == 0
    os.makedirs(tmp_path / "copy")
    copying = _regions(tmp_path / "copy", zero_copy=False)
    rid2 = _create(copying)
    memo2 = BatchDecodeMemo(copying, LAYOUT)
    for layer in (0, 1):
        with memo2.decode("t", _request(rid2, layer=layer)):
            pass
    assert len(memo2) == 0 and memo2.hits == 0
    regions.close()
    copying.close()


def test_a_failed_decode_keeps_and_holds_nothing(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    region = regions._regions[rid]
    memo = BatchDecodeMemo(regions, LAYOUT)
    with pytest.raises(InvalidRequest, match=r"query\.shared: .* do not fit"):
        memo.decode("t", _request(rid, query_at=8192 - 64))
    assert region.users == 0 and len(memo) == 0
    regions.close()


def test_the_least_recently_used_entry_goes_first(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT, capacity=2)
    for token in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 goes
        with memo.decode("t", _request(rid, token=token)):
            pass
    assert (memo.hits, memo.misses, len(memo)) == (1, 3, 2)
    with memo.decode("t", _request(rid, token=1)):
        pass
    assert memo.hits == 2
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        BatchDecodeMemo(regions, LAYOUT, capacity=-1)
    regions.close()


def test_an_output_in_place_gets_the_steps_one_reply(tmp_path: Path) -> None:
    regions = _regions(tmp_path)
    rid = _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT)
    replies = []
    for layer in range(3):
        with memo.decode("t", _request(rid, layer=layer)) as call:
            assert call.output_view is not None
            call.output_view.fill_(float(layer))  # as a worker writing in place would
            replies.append(call.reply(AttentionResult(call.output_view, None)))
    assert replies[0] is replies[1] is replies[2]
    reply = pb.AppendAttendBatchResponse.FromString(replies[0])
    assert reply.output.shared.offset == _OUT and list(reply.output.shape) == [B, 1, HQ, 8]
    # An output elsewhere is copied into the slot and encoded for this call.
    with memo.decode("t", _request(rid, layer=3)) as call:
        elsewhere = torch.full((B, HQ, 8), 9.0)
        again = call.reply(AttentionResult(elsewhere, None))
        assert again == replies[0]
        assert call.output_view is not None and bool((call.output_view == 9.0).all())
    regions.close()


def test_the_rows_are_made_once_per_entry_as_views_of_the_batch(tmp_path: Path) -> None:
    # The coordinator hands its worker the batch as rows ([b * m, Hq, D], [b * n, Hkv, D]);
    # an entry makes them once, so every later layer of the step skips three views.
    regions = _regions(tmp_path)
    rid = _create(regions)
    memo = BatchDecodeMemo(regions, LAYOUT)
    hkv, d = LAYOUT.num_kv_heads, LAYOUT.head_dim
    with memo.decode("t", _request(rid, layer=0)) as first:
        rows = first.rows
        assert rows is not None
        query, key, value = rows
        assert (query.shape, key.shape, value.shape) == ((B, HQ, d), (B, hkv, d), (B, hkv, d))
        batch = first.batch
        for flat, full in zip(rows, (batch.query, batch.key, batch.value), strict=True):
            assert flat.data_ptr() == full.data_ptr() and flat.dtype == full.dtype
        assert first.rows is rows
    with memo.decode("t", _request(rid, layer=2)) as again:
        assert again.rows is rows
    # A request with a tensor as bytes has no entry: its rows are the coordinator's to make.
    with memo.decode("t", _request(rid, layer=1, bytes_key=True)) as plain:
        assert plain.rows is None
    regions.close()
