"""CUDA-graph replay of decode steps (workers.decode_graphs): the bucketing rule on any
machine; on a GPU, decode steps through graphs against the same steps run eagerly, also
with the online check recomputing beside them on another thread."""

from __future__ import annotations

import asyncio
import gc
import math
import threading

import pytest
import torch
from round_calls import attend, write_and_attend
from service_support import ServiceHarness, service_config

from cache_service.client import KVCacheClient
from cache_service.client import shared_memory as client_shared_memory
from cache_service.config import SharedMemoryConfig
from cache_service.engine.worker_clients import LocalWorkerClient
from cache_service.wire.shared_regions import SharedRegions
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.decode_graphs import _packed_span, bucket_width
from workers.errors import NonFiniteInput
from workers.layout import KVLayout
from workers.pool import KVPool
from workers.staging import bytes_as, packed_offsets


def test_bucket_width_rounds_up_by_at_most_an_eighth_to_a_multiple_of_16():
    previous = 0
    for width in range(1, 5000):
        b = bucket_width(width)
        assert b >= max(width, 16)
        assert b % 16 == 0  # one kernel specialization of the table's width
        assert b >= previous  # monotone: a growing context never goes back a bucket
        if width >= 128:
            assert b <= width * 1.125
        else:
            assert b < width + 16
        previous = b
    # Few distinct buckets: a context growing to 4096 blocks meets about 8 per doubling.
    assert len({bucket_width(w) for w in range(1, 4097)}) <= 8 * 8 + 1


# key and value [3, 1, 24] float16: 144 bytes, which the graphs' packing (256-byte
# starts) and the client's former layout (64-byte starts: value at 192) place apart.
KV_SHAPE, Q_SHAPE = [3, 1, 24], [3, 4, 24]
PACKED = [0, 256, 512]  # byte starts of key, value, query as the graphs pack them
SPAN = 512 + 3 * 4 * 24 * 2  # the key's first byte to the query's last


def _laid_out(starts: list[int], size: int = 8192) -> tuple[torch.Tensor, ...]:
    """float16 key, value (KV_SHAPE) and query (Q_SHAPE) at byte `starts` of one uint8
    buffer of `size` bytes, filled with distinct values."""
    buffer = torch.arange(size, dtype=torch.int32).to(torch.uint8)
    return tuple(
        buffer[at : at + 2 * math.prod(shape)].view(torch.float16).view(shape)
        for at, shape in zip(starts, (KV_SHAPE, KV_SHAPE, Q_SHAPE), strict=True)
    )


def _packed(starts: list[int], size: int = 8192) -> torch.Tensor | None:
    """`_packed_span` of `_laid_out(starts, size)` for the graphs' class of these shapes."""
    return _packed_span(_laid_out(starts, size), tuple(PACKED), SPAN)


def test_bytes_as_views_each_packed_tensor_where_packed_offsets_put_it():
    tensors = [torch.arange(5, dtype=torch.int64), torch.randn(3, 2).half(), torch.empty(0, 4)]
    offsets, total = packed_offsets(tensors)
    buffer = torch.zeros(total, dtype=torch.uint8)

    def views() -> list[torch.Tensor]:
        return [
            bytes_as(buffer, off, t.dtype, t.shape) for t, off in zip(tensors, offsets, strict=True)
        ]

    for v, t, off in zip(views(), tensors, offsets, strict=True):
        assert v.shape == t.shape and v.dtype == t.dtype
        if t.numel():
            assert v.data_ptr() - buffer.data_ptr() == off
        v.copy_(t)
    assert all(torch.equal(v, t) for v, t in zip(views(), tensors, strict=True))


def test_the_test_layout_is_the_graphs_packing():
    offsets, _ = packed_offsets(_laid_out(PACKED))
    assert offsets == PACKED


@pytest.mark.parametrize("base", [0, 64, 4096])
def test_inputs_laid_out_as_the_buffers_are_one_span_of_their_bytes(base):
    tensors = _laid_out([base + at for at in PACKED])
    span = _packed_span(tensors, tuple(PACKED), SPAN)
    assert span is not None and span.dtype == torch.uint8 and span.shape == (SPAN,)
    assert span.data_ptr() == tensors[0].data_ptr()  # a view: no copy
    # Where the buffers' views read, the span holds each tensor's bytes (compared as
    # bytes: some are NaN as float16).
    for t, at in zip(tensors, PACKED, strict=True):
        raw = t.view(torch.uint8).reshape(-1)
        assert torch.equal(span[at : at + raw.numel()], raw)


def test_inputs_laid_out_otherwise_are_copied_one_by_one():
    assert _packed([0, 192, 384]) is None  # the client's former layout (64-byte starts)
    assert _packed([256, 0, 512]) is None  # the right distances, the order swapped
    assert _packed([0, 512, 1024]) is None  # apart
    # Separate allocations, however they happen to lie.
    apart = tuple(t.clone() for t in _laid_out(PACKED))
    assert _packed_span(apart, tuple(PACKED), SPAN) is None
    # Not contiguous: a transposed query of the same shape.
    k, v, q = _laid_out(PACKED)
    q_t = q.view(24, 4, 3).permute(2, 1, 0)
    assert q_t.shape == q.shape and _packed_span((k, v, q_t), tuple(PACKED), SPAN) is None
    # A lazy negation (a copy would apply it, a byte copy would not).
    assert _packed_span((k, v, torch._neg_view(q)), tuple(PACKED), SPAN) is None
    # The span must lie within the storage: a query ending at the storage's end is fine,
    # a byte more is not.
    assert _packed(PACKED, size=SPAN) is not None
    assert _packed_span(_laid_out(PACKED, size=SPAN), tuple(PACKED), SPAN + 1) is None
    # Not on the host.
    meta = tuple(t.to("meta") for t in _laid_out(PACKED))
    assert _packed_span(meta, tuple(PACKED), SPAN) is None


def test_the_clients_shared_region_lays_inputs_out_as_the_graphs_pack_them():
    # Whatever the sizes, the client's offsets of key, value and query (its request
    # order) are the graphs' packed offsets, so a pool loads the three in one copy.
    for batch, hkv, d, dtype in [
        (3, 2, 64, torch.float16),
        (1, 1, 8, torch.float32),
        (32, 8, 128, torch.bfloat16),
        (5, 3, 24, torch.float16),
    ]:
        k = torch.zeros(batch, 1, hkv, d, dtype=dtype)
        q = torch.zeros(batch, 1, 4 * hkv, d, dtype=dtype)
        layout = client_shared_memory._layout([k, k, q], [(dtype, tuple(q.shape))])
        assert layout.offsets[:3] == packed_offsets([k, k, q])[0]


# -- on a GPU ------------------------------------------------------------------------------

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16")
HQ = 8
# Three sequences' starting lengths: the run's contexts cross block boundaries and a
# bucket (16 -> 18 blocks).
START = (250, 240, 17)
MAX_BLOCKS = 20


def _tables(pool: KVPool) -> torch.Tensor:
    """int32 [3, MAX_BLOCKS]: random distinct blocks of `pool` for the three sequences."""
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(pool.num_blocks, generator=gen)[: len(START) * MAX_BLOCKS]
    return perm.reshape(len(START), MAX_BLOCKS).int()


def _decode_steps(pool: KVPool, steps: int, *, return_lse: bool, seed: int = 0):
    """Run `steps` decode steps of 3 sequences (every layer per step, one metadata key per
    step, as the coordinator calls a pool); the results per (step, layer) on the host."""
    gen = torch.Generator().manual_seed(seed)
    bs, n_seqs = LAYOUT.block_size, len(START)
    lens = list(START)
    tables_full = _tables(pool)
    results = []
    for step in range(steps):
        lens = [n + 1 for n in lens]
        width = max(-(-n // bs) for n in lens)
        tables = tables_full[:, :width].contiguous()
        slots = torch.tensor(
            [int(tables_full[s, (n - 1) // bs]) * bs + (n - 1) % bs for s, n in enumerate(lens)]
        )
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        qsl = torch.arange(n_seqs + 1, dtype=torch.int32)
        key = 1000 + step
        for layer in range(LAYOUT.num_layers):
            k = torch.randn(n_seqs, 2, 64, generator=gen).half()
            v = torch.randn(n_seqs, 2, 64, generator=gen).half()
            q = torch.randn(n_seqs, HQ, 64, generator=gen).half()
            r = write_and_attend(pool,
                layer, slots, k, v, q, tables, seq_lens, qsl,
                return_lse=return_lse, metadata_key=key,
            )  # fmt: skip
            r = r if isinstance(r, tuple) else (r,)
            results.append(tuple(t.cpu() for t in r))
    return results


def _filled(graphs: bool, fingerprints: bool = False) -> KVPool:
    """A pool holding START tokens of context per sequence (written, so fingerprinted)."""
    return _fill(KVPool(LAYOUT, 96, "cuda", cuda_graphs=graphs, fingerprints=fingerprints))


def _fill(pool: KVPool) -> KVPool:
    """`pool` with START tokens of context per sequence written (the same on every pool)."""
    gen = torch.Generator().manual_seed(1)
    tables, bs = _tables(pool), LAYOUT.block_size
    for s, n in enumerate(START):
        slots = [int(tables[s, t // bs]) * bs + t % bs for t in range(n)]
        kv = torch.randn(LAYOUT.num_layers, n, 2, 64, generator=gen).half()
        pool.write(None, slots, kv, -kv)
    return pool


@pytest.mark.gpu
@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_steps_through_graphs_equal_the_same_steps_run_eagerly(return_lse):
    graphed, eager = _filled(True, fingerprints=True), _filled(False, fingerprints=True)
    steps = 12
    a = _decode_steps(graphed, steps, return_lse=return_lse)
    b = _decode_steps(eager, steps, return_lse=return_lse)
    graphs = graphed._graphs
    assert graphs is not None and eager._graphs is None
    # Layer 0 of a step is the first call under its key (the full path). The other layers:
    # step 0 runs them eagerly (first sighting), step 1 captures, the rest replay, through
    # the 16 -> 18 block bucket change (one more sighting and capture) as well.
    others = LAYOUT.num_layers - 1
    assert graphs.captures >= others
    assert graphs.replays >= (steps - 4) * others
    # The writes are copies: the pools hold the same bits.
    assert torch.equal(graphed.data, eager.data)
    for ra, rb in zip(a, b, strict=True):
        assert ra[0].dtype == rb[0].dtype and ra[0].shape == rb[0].shape
        # The padded table may pick another split of the keys: equal up to rounding.
        torch.testing.assert_close(ra[0], rb[0], atol=2e-3, rtol=2e-3)
        if return_lse:
            torch.testing.assert_close(ra[1], rb[1], atol=1e-4, rtol=1e-4)
    # Every slot read, the run's tokens (written by the graphs) included, matches its
    # fingerprint.
    lens = torch.tensor([n + steps for n in START], dtype=torch.int32)
    q = torch.randn(len(START), HQ, 64).half()
    qsl = torch.arange(len(START) + 1, dtype=torch.int32)
    for layer in range(LAYOUT.num_layers):
        _, _, bad = graphed.reference_attend(layer, q, _tables(graphed), lens, qsl)
        assert bad == []


def _turns(graphs: bool) -> tuple[KVPool, list[torch.Tensor]]:
    """Two groups of three sequences, of equal shapes but their own blocks and lengths,
    calling in turns layer by layer for 6 decode steps (a key per group and step); the
    pool and every result on the host."""
    bs, n_blocks = LAYOUT.block_size, 192
    pool = KVPool(LAYOUT, n_blocks, "cuda", cuda_graphs=graphs)
    gen = torch.Generator().manual_seed(3)
    tables = torch.randperm(n_blocks, generator=gen)[: 2 * 3 * 16].reshape(2, 3, 16).int()
    lens = [list(START), [100, 249, 40]]  # both 16 blocks wide throughout: one class
    for g in range(2):
        for s, n in enumerate(lens[g]):
            slots = [int(tables[g, s, t // bs]) * bs + t % bs for t in range(n)]
            kv = torch.randn(LAYOUT.num_layers, n, 2, 64, generator=gen).half()
            pool.write(None, slots, kv, -kv)
    qsl = torch.arange(4, dtype=torch.int32)
    results = []
    for step in range(6):
        args = []
        for g in range(2):
            lens[g] = [n + 1 for n in lens[g]]
            slots = [int(tables[g, s, (n - 1) // bs]) * bs + (n - 1) % bs
                     for s, n in enumerate(lens[g])]  # fmt: skip
            args.append((slots, tables[g], torch.tensor(lens[g], dtype=torch.int32)))
        for layer in range(LAYOUT.num_layers):
            for g, (slots, group_tables, seq_lens) in enumerate(args):
                k, v = (torch.randn(3, 2, 64, generator=gen).half() for _ in range(2))
                q = torch.randn(3, HQ, 64, generator=gen).half()
                out = write_and_attend(pool,
                    layer, slots, k, v, q, group_tables, seq_lens, qsl,
                    metadata_key=100 * step + g,
                )  # fmt: skip
                results.append(out.cpu())
    return pool, results


@pytest.mark.gpu
def test_callers_taking_turns_in_one_shape_class_each_replay_with_their_own_metadata():
    # Each replay after the other group's loads this group's metadata (kept packed per
    # key): the results and the pool's bits equal the same calls run eagerly.
    graphed, a = _turns(True)
    eager, b = _turns(False)
    graphs = graphed._graphs
    assert graphs is not None and graphs.replays >= 2 * (LAYOUT.num_layers - 1) * 4
    assert graphs.metadata_loads >= graphs.replays
    assert torch.equal(graphed.data, eager.data)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_a_replayed_result_is_the_callers_own():
    pool = _filled(True)
    results = _decode_steps(pool, 6, return_lse=False)
    assert pool._graphs is not None and pool._graphs.replays > 0
    # On the device (to_host False), a result is a copy, not the graph's buffer that the
    # next replay overwrites: run more steps and compare with what was returned.
    before = [r[0].clone() for r in results]
    _decode_steps(pool, 2, return_lse=False, seed=9)
    for r, saved in zip(results, before, strict=True):
        assert torch.equal(r[0], saved)


@pytest.mark.gpu
def test_a_worker_returns_pinned_host_results_equal_to_the_pools():
    worker = PoolWorker("w", PoolConfig(LAYOUT, num_blocks=96), "cuda")
    epoch = worker.epoch()
    worker.pool.data.copy_(
        torch.randn(worker.pool.data.shape, generator=torch.Generator().manual_seed(1)).half()
    )
    gen = torch.Generator().manual_seed(2)
    tables = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    lens = torch.tensor([20, 25, 32], dtype=torch.int32)
    slots = torch.tensor(
        [int(tables[s, (n - 1) // 16]) * 16 + (n - 1) % 16 for s, n in enumerate([20, 25, 32])]
    )
    qsl = torch.arange(4, dtype=torch.int32)
    for step_key in (1, 2, 3, 4):
        for layer in range(LAYOUT.num_layers):
            k = torch.randn(3, 2, 64, generator=gen).half()
            q = torch.randn(3, HQ, 64, generator=gen).half()
            out = write_and_attend(
                worker, epoch, layer, slots, k, k, q, tables, lens, qsl, metadata_key=step_key
            )
            assert out.device.type == "cpu" and out.is_pinned()
            ref = attend(worker.pool, layer, q, tables, lens, qsl)
            torch.testing.assert_close(out, ref.cpu(), atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["packed", "spread"])
def test_inputs_in_a_pinned_shared_region_reach_the_pool_without_staging(layout):
    # The service's directory (/dev/shm: memory-backed pages, which CUDA can lock).
    regions = SharedRegions(SharedMemoryConfig(), pin_for_cuda=True)
    info = asyncio.run(regions.create("t", 1 << 20))
    assert regions._regions[info.region_id].mapping.pinned
    reader = regions.reader("t")
    shapes = {"key": [3, 2, 64], "value": [3, 2, 64], "query": [3, HQ, 64], "out": [3, HQ, 64]}
    # "packed": key, value and query as the graphs' buffers hold them (as the client lays
    # them out): one copy loads the three. "spread": 64 KiB apart, a copy each.
    starts = _packed_starts(shapes) if layout == "packed" else [i << 16 for i in range(4)]
    views = {
        name: reader(info.region_id, at, torch.float16, shape, name)
        for (name, shape), at in zip(shapes.items(), starts, strict=True)
    }
    assert all(v.is_pinned() for v in views.values())
    graphed, eager = _filled(True), _filled(False)
    staged = []
    real = graphed._stager.to_device
    graphed._stager.to_device = lambda ts, **kw: staged.append(len(ts)) or real(ts, **kw)
    gen = torch.Generator().manual_seed(3)
    tables, bs = _tables(graphed), LAYOUT.block_size
    lens = list(START)
    steps = 5
    for step in range(steps):
        lens = [n + 1 for n in lens]
        width = max(-(-n // bs) for n in lens)
        slots = [int(tables[s, (n - 1) // bs]) * bs + (n - 1) % bs for s, n in enumerate(lens)]
        args = (tables[:, :width].contiguous(), torch.tensor(lens, dtype=torch.int32))
        qsl = torch.arange(4, dtype=torch.int32)
        for layer in range(LAYOUT.num_layers):
            for v in views.values():  # new inputs (and a stale output to overwrite)
                v.copy_(torch.randn(v.shape, generator=gen).half())
            k, v, q = views["key"], views["value"], views["query"]
            a = write_and_attend(graphed,
                layer, slots, k, v, q, *args, qsl, metadata_key=step, to_host=True,
                out=views["out"],
            )  # fmt: skip
            assert a.data_ptr() == views["out"].data_ptr()  # produced in the region
            b = write_and_attend(
                eager, layer, slots, k.clone(), v.clone(), q.clone(), *args, qsl, metadata_key=step
            )
            torch.testing.assert_close(a, b.cpu(), atol=2e-3, rtol=2e-3)
    assert torch.equal(graphed.data, eager.data)
    # Only the first layer of each step (its full path, with host slots) was staged.
    assert len(staged) == steps
    graphs = graphed._graphs
    assert graphs.replays >= (steps - 3) * (LAYOUT.num_layers - 1)
    # Every load into the buffers (each replay, and each capture's own run) read the region.
    loads = graphs.replays + graphs.captures
    assert graphs.packed_loads == (loads if layout == "packed" else 0)
    views.clear()
    reader.close()
    regions.close()


def _packed_starts(shapes: dict[str, list[int]]) -> list[int]:
    """Byte offsets of float16 tensors of `shapes` packed as the graphs pack them."""
    tensors = [torch.empty(shape, dtype=torch.float16) for shape in shapes.values()]
    offsets, _ = packed_offsets(tensors)
    return offsets


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["key", "query"])
def test_a_checked_replay_refuses_non_finite_inputs_and_writes_nothing(where):
    pool = _filled(True, fingerprints=True)
    gen = torch.Generator().manual_seed(4)
    tables, bs = _tables(pool), LAYOUT.block_size
    qsl = torch.arange(4, dtype=torch.int32)
    lens = list(START)
    for step in range(4):  # step 2 captures, step 3 replays
        lens = [n + 1 for n in lens]
        width = max(-(-n // bs) for n in lens)
        slots = [int(tables[s, (n - 1) // bs]) * bs + (n - 1) % bs for s, n in enumerate(lens)]
        args = (tables[:, :width].contiguous(), torch.tensor(lens, dtype=torch.int32), qsl)
        for layer in range(LAYOUT.num_layers):
            k, v = (torch.randn(3, 2, 64, generator=gen).half() for _ in range(2))
            q = torch.randn(3, HQ, 64, generator=gen).half()
            if step == 3 and layer == 1:
                data = pool.data.clone()
                # (Masked slots' fingerprints land in a spare block past the pool's.)
                sums = pool._fingerprints._sums[: pool.num_slots].clone()
                bad = {"key": k, "query": q}[where]
                bad[1, 0, 5] = float("nan")
                with pytest.raises(NonFiniteInput, match="nothing was written"):
                    write_and_attend(
                        pool, layer, slots, k, v, q, *args, metadata_key=step, check_finite=True
                    )
                assert torch.equal(pool.data, data)
                assert torch.equal(pool._fingerprints._sums[: pool.num_slots], sums)
                bad[1, 0, 5] = 0.0  # the same call, repaired, goes through
            write_and_attend(
                pool, layer, slots, k, v, q, *args, metadata_key=step, check_finite=True
            )
    assert pool._graphs.replays > 0


def test_captures_hold_the_collector_off_until_the_last_one_ends():
    # Pools capture from several threads: the collector stays off while any capture
    # runs, and comes back as it was before the first began.
    from workers.decode_graphs import _collector_held

    was = gc.isenabled()
    try:
        gc.enable()
        first, second = _collector_held(), _collector_held()
        first.__enter__()
        second.__enter__()
        assert not gc.isenabled()
        first.__exit__(None, None, None)
        assert not gc.isenabled()  # the second capture still runs
        second.__exit__(None, None, None)
        assert gc.isenabled()
        gc.disable()
        with _collector_held():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before: left off
    finally:
        (gc.enable if was else gc.disable)()


@pytest.mark.gpu
def test_a_pool_collected_during_a_capture_does_not_break_it():
    # A dropped pool (its graphs kept alive by a reference cycle) collected by the garbage
    # collector in the middle of another pool's capture would destroy CUDA graphs while the
    # stream captures: the capture breaks. Captures run with the collector held off.
    old = _filled(True)
    _decode_steps(old, 4, return_lse=False)
    assert old._graphs is not None and old._graphs.captures > 0
    del old  # garbage now, but only a collection frees it
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # collect at almost every allocation, the capture's included
    try:
        new = _filled(True)
        a = _decode_steps(new, 5, return_lse=False, seed=1)
    finally:
        gc.set_threshold(*threshold)
    graphs = new._graphs
    assert graphs is not None and graphs.captures > 0 and graphs.replays > 0
    assert not any(cls.failed for cls in graphs._classes.values())
    b = _decode_steps(_filled(False), 5, return_lse=False, seed=1)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x[0], y[0], atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_a_clients_shared_region_reaches_the_graphs_in_one_copy():
    # The service with a CUDA pool in its process pins its regions; the client lays key,
    # value and query out as the graphs pack them (384-byte keys: the client's former
    # 64-byte starts did not), so every replay of a shared-memory call loads in one copy.
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, block_size=16, dtype="float16")
    worker = LocalWorkerClient("w0", PoolConfig(layout, num_blocks=64), "cuda")
    config = service_config(layout, **{"workers.device": "cuda"})
    gen = torch.Generator().manual_seed(5)
    with ServiceHarness(config, [worker]) as harness:
        assert harness.service.shared_regions._pin_for_cuda
        graphs = worker.worker.pool._graphs
        assert graphs is not None
        with (
            KVCacheClient(harness.address) as shm,
            KVCacheClient(harness.address, shared_memory=False) as plain,
        ):
            ids = [shm.create_sequence().seq_id for _ in range(3)]
            twins = [plain.create_sequence().seq_id for _ in range(3)]
            one_copy = []  # per shared-memory call: (replayed, loaded in one copy)
            for _ in range(6):
                tokens = torch.randint(0, 50000, (3, 1), generator=gen)
                for layer in range(layout.num_layers):
                    k, v = (torch.randn(3, 1, 1, 64, generator=gen).half() for _ in range(2))
                    q = torch.randn(3, 1, 4, 64, generator=gen).half()
                    replays, packed = graphs.replays, graphs.packed_loads
                    got = shm.append_attend_batch(layer, ids, tokens, k, v, q)
                    assert shm.shared_memory_active
                    one_copy.append((graphs.replays > replays, graphs.packed_loads > packed))
                    want = plain.append_attend_batch(layer, twins, tokens, k, v, q)
                    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
            replayed = [packed for hit, packed in one_copy if hit]
            assert replayed and all(replayed)


@pytest.mark.gpu
def test_checks_beside_the_first_replays_disturb_neither_the_steps_nor_the_checks():
    # A worker recomputes a checked round outside its lock (PoolWorker.reference_attend),
    # so on a GPU the recomputation overlaps the next calls on another thread, among them
    # the ones that capture CUDA graphs (a step's first replays, a new table bucket).
    # Neither may disturb the other: the steps equal the same steps on an eager pool, and
    # every check answers the reference of the context it reads, with no bad slot.
    worker = PoolWorker("w", PoolConfig(LAYOUT, num_blocks=96, fingerprints=True), "cuda")
    epoch = worker.epoch()
    _fill(worker.pool)
    eager = _filled(False, fingerprints=True)
    tables = _tables(eager)
    lens = torch.tensor(START, dtype=torch.int32)  # the context before the steps' tokens
    qsl = torch.arange(len(START) + 1, dtype=torch.int32)
    q = torch.randn(len(START), HQ, 64, generator=torch.Generator().manual_seed(4)).half()
    layers = range(LAYOUT.num_layers)
    expected = [eager.reference_attend(layer, q, tables, lens, qsl)[0].cpu() for layer in layers]

    class ThroughTheWorker:
        """The pool's data call as the worker's channel thread makes it (under its lock)."""

        num_blocks = worker.pool.num_blocks
        pool_like = True  # called as a pool is (round_calls): no epoch argument

        def run_round(self, rnd, to_host=False):
            return worker.run_round(epoch, rnd)

    stop, checks, errors = threading.Event(), [], []

    def check_all_the_time() -> None:
        try:
            while True:  # one pass over the layers at least, however fast the steps are
                for layer in range(LAYOUT.num_layers):
                    out, _, bad = worker.reference_attend(epoch, layer, q, tables, lens, qsl)
                    checks.append((layer, out, bad))
                if stop.is_set():
                    break
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    checker = threading.Thread(target=check_all_the_time)
    checker.start()
    try:
        graphed = _decode_steps(ThroughTheWorker(), 12, return_lse=True)  # type: ignore[arg-type]
    finally:
        stop.set()
        checker.join(60)
    assert errors == [] and not checker.is_alive()
    graphs = worker.pool._graphs
    assert graphs is not None and graphs.captures >= LAYOUT.num_layers - 1
    for ra, rb in zip(graphed, _decode_steps(eager, 12, return_lse=True), strict=True):
        torch.testing.assert_close(ra[0], rb[0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(ra[1], rb[1], atol=1e-4, rtol=1e-4)
    for layer, out, bad in checks:
        assert bad == []
        torch.testing.assert_close(out, expected[layer], atol=1e-3, rtol=1e-3)
