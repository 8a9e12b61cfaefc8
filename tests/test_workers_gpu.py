"""The workers on a CUDA device: Triton kernels behind the pool's strided per-layer views,
block copies, sizing from free GPU memory, and PoolWorker actors on GPUs (one per GPU, and
two sharing one GPU for a sequence spanning workers). Marked ``gpu``: skipped without CUDA.

Run on the GPU machine (see ../shared/device/README.md) with Ray carried:
    source .device/env.sh && python3 -m pytest tests/test_workers_gpu.py -q
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid

import pytest
import torch
from round_calls import attend, attend_pages, write_and_attend
from workers_support import dense_attention, place_sequence, rel_err

from cache_service.engine.attention_plan import plan_attention, run_attention
from cache_service.engine.worker_clients import RayWorkerClient
from workers.config import PoolConfig
from workers.errors import PoolAllocationError
from workers.layout import KVLayout
from workers.pool import KVPool
from workers.round import Round

pytestmark = pytest.mark.gpu

# Llama-3-8B attention heads (32 query over 8 KV, head_dim 128); two layers keep it small.
TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}


def llama_layout(dtype: str) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)


def batch_case(pool: KVPool, layer: int, seed: int):
    """Decode, chunked-prefill and full-prefill sequences written into ``pool``; returns the
    attention arguments (host) and the float64 dense reference outputs."""
    layout = pool.layout
    dtype = layout.torch_dtype()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    specs = [(1000, 1), (333, 64), (77, 77), (4096, 1)]  # (seq_len, new queries)
    width = max(-(-s // layout.block_size) for s, _ in specs)
    taken: dict[str, set[int]] = {}
    tables, lens, starts, queries, refs = [], [], [0], [], []
    for seq_len, n in specs:
        k = torch.randn(seq_len, 8, 128, generator=gen).to(dtype)
        v = torch.randn(seq_len, 8, 128, generator=gen).to(dtype)
        q = torch.randn(n, 32, 128, generator=gen).to(dtype)
        blocks = -(-seq_len // layout.block_size)
        view = place_sequence({"w": pool}, [("w", blocks)], k, v, rng, layer=layer, taken=taken)
        tables.append(list(view.segments[0].block_indices) + [0] * (width - blocks))
        lens.append(seq_len)
        starts.append(starts[-1] + n)
        queries.append(q)
        refs.append(dense_attention(q, k, v)[0])
    args = (torch.cat(queries), torch.tensor(tables), torch.tensor(lens), torch.tensor(starts))
    return args, torch.cat(refs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_pool_attention_matches_dense(dtype):
    pool = KVPool(llama_layout(dtype), 800, "cuda")
    args, ref = batch_case(pool, layer=1, seed=0)
    out, lse = attend(pool, 1, *args, return_lse=True)
    assert out.is_cuda and lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    assert rel_err(out.cpu(), ref) < TOLERANCE[dtype]
    # The other layer stayed zero: the strided layer views do not overlap.
    assert pool.key_cache(0).abs().sum().item() == 0


def test_staged_write_and_attend_matches_separate_copies():
    # write_and_attend moves its host tensors in one staged copy (workers.staging); run a
    # decode loop through it and the same loop through an unstaged pool (device tensors in,
    # no staging) and compare bit for bit, step after step (the staging buffers are reused).
    layout = llama_layout("bfloat16")
    staged, direct = KVPool(layout, 300, "cuda"), KVPool(layout, 300, "cuda")
    gen = torch.Generator().manual_seed(7)
    seqs, bs = 5, layout.block_size
    tables = torch.randperm(300, generator=gen)[: seqs * 40].reshape(seqs, 40).int()
    lengths = [1, 15, 16, 17, 300]
    for step in range(40):
        slots = torch.tensor([int(tables[s, n // bs]) * bs + n % bs for s, n in enumerate(lengths)])
        k = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
        v = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
        q = torch.randn(seqs, 32, 128, generator=gen).to(torch.bfloat16)
        lens = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        # Every third step a column-major (non-contiguous) copy of the same table.
        view = tables.t().contiguous().t() if step % 3 == 0 else tables
        a = write_and_attend(staged, 1, slots, k, v, q, view, lens, qsl)
        b = write_and_attend(direct, 1, *(t.cuda() for t in (slots, k, v, q, view, lens, qsl)))
        assert torch.equal(a, b), f"step {step}"
        lengths = [n + 1 for n in lengths]
    assert torch.equal(staged.data, direct.data)


def test_stager_copies_mixed_dtypes_and_large_requests():
    from workers.staging import HostStager

    stager = HostStager(torch.device("cuda"), initial_bytes=1024, max_bytes=1 << 20)
    parts = [
        torch.arange(7, dtype=torch.int64),
        torch.randn(3, 5).to(torch.bfloat16).t(),  # non-contiguous
        torch.tensor([], dtype=torch.int32),
        torch.randn(2000, 10),  # grows the buffers
    ]
    for _ in range(3):
        out = stager.to_device(parts)
        assert all(torch.equal(o.cpu(), p) for o, p in zip(out, parts, strict=True))
    big = [torch.randn(1 << 19), torch.arange(5)]  # 2 MB: beyond max_bytes, copied directly
    out = stager.to_device(big)
    assert all(torch.equal(o.cpu(), p) for o, p in zip(out, big, strict=True))
    # Tensors in parts (a round's callers' rows) arrive joined, beside whole ones, both
    # in the stager's buffer and beyond max_bytes.
    rows = [torch.randn(n, 3, 8).to(torch.bfloat16) for n in (1, 4, 2)]
    for extra in ([], [torch.randn(1 << 19)]):
        got = stager.to_device([torch.arange(3), rows, *extra])
        assert torch.equal(got[0].cpu(), torch.arange(3))
        assert got[1].shape == (7, 3, 8) and torch.equal(got[1].cpu(), torch.cat(rows))
    # Parts a byte copy cannot take (strided; past the held-GIL limit) are copied by torch.
    from workers.host_bytes import MAX_HELD_BYTES

    wide = HostStager(torch.device("cuda"), max_bytes=8 << 20)
    odd = [torch.randn(4, 2, 3).transpose(1, 2),
           torch.randn(MAX_HELD_BYTES // 12 + 1, 3, 2), torch.randn(1, 3, 2)]  # fmt: skip
    assert not odd[0].is_contiguous()
    got = wide.to_device([odd, torch.arange(4)])
    assert torch.equal(got[0].cpu(), torch.cat(odd)) and torch.equal(got[1].cpu(), torch.arange(4))


def test_stager_delivers_rows_into_parts_unless_the_flag_is_false():
    from workers.host_bytes import MAX_HELD_BYTES
    from workers.staging import HostStager

    stager = HostStager(torch.device("cuda"), max_bytes=8 << 20)
    for rows in ([3, 1, 4], [0, 2], [MAX_HELD_BYTES // 64 + 1, 5]):  # the last: torch's copy
        source = torch.randn(sum(rows), 4, 8, device="cuda").to(torch.bfloat16)
        parts = [torch.full((n, 4, 8), 7.0).to(torch.bfloat16) for n in rows]
        for flag in (None, torch.tensor(True, device="cuda")):
            assert stager.to_host_parts(source, parts, flag) is True
            assert torch.equal(torch.cat(parts), source.cpu())
        for p in parts:
            p.fill_(7.0)
        assert stager.to_host_parts(source, parts, torch.tensor(False, device="cuda")) is False
        assert all(torch.equal(p, torch.full_like(p, 7.0)) for p in parts)  # untouched
    with pytest.raises(ValueError, match="more than the stager's"):
        stager.to_host_parts(torch.zeros(9 << 20, dtype=torch.uint8, device="cuda"), [])


def test_cuda_block_copy_export_import_are_bit_exact():
    layout = llama_layout("bfloat16")
    pool = KVPool(layout, 64, "cuda")
    pool.data.copy_(torch.randn(pool.data.shape, device="cuda").to(torch.bfloat16))
    before = pool.data.clone()
    pool.copy_blocks([3, 4, 5], [4, 9, 10])  # 4 is both source and destination
    assert torch.equal(pool.data[[4, 9, 10]], before[[3, 4, 5]])
    data = pool.export_blocks([9, 1])
    assert data.device.type == "cpu"
    other = KVPool(layout, 8, "cuda")
    other.import_blocks([7, 0], data)
    assert torch.equal(other.data[[7, 0]].cpu(), data)


def test_pool_sized_from_free_gpu_memory_and_refused_when_too_big():
    layout = llama_layout("bfloat16")
    free, total = torch.cuda.mem_get_info()
    pool = KVPool.from_config(PoolConfig(layout, memory_fraction=0.01), "cuda")
    expected = int(free * 0.01) // layout.bytes_per_block
    assert abs(pool.num_blocks - expected) <= max(2, expected // 20)
    too_many = 2 * total // layout.bytes_per_block
    with pytest.raises(PoolAllocationError, match="does not fit"):
        KVPool(layout, too_many, "cuda")


@pytest.fixture(scope="module")
def gpu_ray():
    ray = pytest.importorskip("ray")
    from workers.ray_startup import start_local_ray

    namespace = f"kvcache-gpu-test-{uuid.uuid4().hex[:8]}"
    started = not ray.is_initialized()
    if started:
        start_local_ray(namespace, num_cpus=4)
    yield ray, namespace
    if started:
        ray.shutdown()


def test_one_worker_per_gpu_matches_the_in_process_pool(gpu_ray):
    ray, namespace = gpu_ray
    from workers.launcher import LaunchConfig, launch_workers, shutdown_workers

    layout = llama_layout("bfloat16")
    prefix = "per-gpu-"
    handles = launch_workers(
        LaunchConfig(PoolConfig(layout, num_blocks=800), namespace=namespace, name_prefix=prefix)
    )
    try:
        assert len(handles) == torch.cuda.device_count()
        descriptions = ray.get([h.describe.remote() for h in handles])
        assert all(d.device.startswith("cuda") for d in descriptions)
        local = KVPool(layout, 800, "cuda")
        args, ref = batch_case(local, layer=0, seed=1)
        epoch = descriptions[0].epoch
        ids = list(range(800))
        ray.get(handles[0].import_blocks.remote(epoch, ids, local.export_blocks(ids)))
        out = ray.get(handles[0].run_round.remote(epoch, Round(epoch, 0, *args)))
        assert out.device.type == "cpu"
        assert torch.equal(out, attend(local, 0, *args).cpu())
        assert rel_err(out, ref) < TOLERANCE["bfloat16"]
    finally:
        shutdown_workers(namespace, prefix)


def test_sequence_spanning_two_gpu_workers_matches_dense(gpu_ray):
    _, namespace = gpu_ray
    from workers.launcher import LaunchConfig, launch_workers, shutdown_workers

    layout = llama_layout("bfloat16")
    prefix = "half-gpu-"
    handles = launch_workers(
        LaunchConfig(
            PoolConfig(layout, num_blocks=256),
            num_workers=2,
            gpus_per_worker=0.5,
            namespace=namespace,
            name_prefix=prefix,
        )
    )

    async def scenario():
        clients = {c.worker_id: c for c in [await RayWorkerClient.connect(h) for h in handles]}
        epochs = {w: (await c.describe()).epoch for w, c in clients.items()}
        gen = torch.Generator().manual_seed(2)
        seq_len, n = 1500, 40  # a 40-token chunk crossing the boundary at token 1472
        k = torch.randn(seq_len, 8, 128, generator=gen).to(torch.bfloat16)
        v = torch.randn(seq_len, 8, 128, generator=gen).to(torch.bfloat16)
        q = torch.randn(n, 32, 128, generator=gen).to(torch.bfloat16)
        segments, start = [], 0
        for worker, count, first in ((f"{prefix}0", 92, 10), (f"{prefix}1", 2, 100)):
            blocks = tuple(range(first, first + count))
            hi = min(start + count * 16, seq_len)
            slots = [blocks[i // 16] * 16 + i % 16 for i in range(hi - start)]
            await clients[worker].write(epochs[worker], 1, slots, k[start:hi], v[start:hi])
            segments.append((worker, start, blocks))
            start += count * 16
        from cache_service.control.block_manager import Segment, SequenceView

        view = SequenceView(seq_len, tuple(Segment(*s) for s in segments))
        plan = plan_attention([view], [n], 16)
        assert plan.needs_merge
        got = await run_attention(plan, q, 1, clients, epochs)
        assert rel_err(got.out, dense_attention(q, k, v)[0]) < TOLERANCE["bfloat16"]

    try:
        asyncio.run(scenario())
    finally:
        shutdown_workers(namespace, prefix)


def test_keyed_metadata_on_the_gpu_answers_like_unkeyed_calls():
    # The pool keeps a step's validated block tables, lengths and offsets on the GPU under
    # its metadata_key (workers.metadata_cache); a decode step through it must equal the
    # same step without a key, bit for bit, on every layer.
    layout = llama_layout("bfloat16")
    keyed, plain = KVPool(layout, 300, "cuda"), KVPool(layout, 300, "cuda")
    gen = torch.Generator().manual_seed(11)
    seqs, bs = 4, layout.block_size
    tables = torch.randperm(300, generator=gen)[: seqs * 40].reshape(seqs, 40).int()
    lengths = [3, 16, 31, 200]
    for step in range(20):
        slots = torch.tensor([int(tables[s, n // bs]) * bs + n % bs for s, n in enumerate(lengths)])
        lens = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        for layer in range(layout.num_layers):
            k = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
            q = torch.randn(seqs, 32, 128, generator=gen).to(torch.bfloat16)
            a = write_and_attend(keyed, layer, slots, k, k, q, tables, lens, qsl, metadata_key=step)
            b = write_and_attend(plain, layer, slots, k, k, q, tables, lens, qsl)
            assert torch.equal(a, b), (step, layer)
        lengths = [n + 1 for n in lengths]
    assert torch.equal(keyed.data, plain.data)


def test_leased_layers_on_bound_buffers_answer_like_calls():
    # A lease's layers run from one connection's staging buffers, through graphs captured
    # on those buffers (workers.decode_graphs, bound): the first sighting eager, the second
    # captured, the later ones replayed. Each must answer as the same step made by calls,
    # and write the pool bit for bit as they do; a layer's output stays as it was while
    # the step's other layers run (each replayed layer answers in its graph's own memory).
    layout = llama_layout("bfloat16")
    leased, plain = KVPool(layout, 300, "cuda"), KVPool(layout, 300, "cuda")
    gen = torch.Generator().manual_seed(12)
    seqs, bs = 4, layout.block_size
    staging = {
        "key": torch.zeros(8, 8, 128, dtype=torch.bfloat16, device="cuda"),
        "value": torch.zeros(8, 8, 128, dtype=torch.bfloat16, device="cuda"),
        "query": torch.zeros(8, 32, 128, dtype=torch.bfloat16, device="cuda"),
    }
    tables = torch.randperm(300, generator=gen)[: seqs * 40].reshape(seqs, 40).int()
    lengths = [3, 16, 31, 200]
    for step_index in range(6):
        slots = [int(tables[s, n // bs]) * bs + n % bs for s, n in enumerate(lengths)]
        lens = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
        qsl = torch.arange(seqs + 1, dtype=torch.int32)
        step = leased.step_metadata(tables, lens, qsl, slots, 32)
        views = [staging[n][:seqs] for n in ("key", "value", "query")]
        layers = leased.bind_step(step, *views)
        answers = []
        for layer in range(layout.num_layers):
            k = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
            v = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
            q = torch.randn(seqs, 32, 128, generator=gen).to(torch.bfloat16)
            for view, t in zip(views, (k, v, q), strict=True):
                view.copy_(t)
            out, flag = layers.run(layer)
            expected = write_and_attend(
                plain, layer, torch.tensor(slots), k, v, q, tables, lens, qsl
            )
            assert flag is not None and bool(flag)
            assert rel_err(out.cpu(), expected.cpu()) < TOLERANCE["bfloat16"], (
                step_index,
                layer,
            )
            answers.append((out, expected.cpu()))
        for layer, (out, expected) in enumerate(answers):
            assert rel_err(out.cpu(), expected) < TOLERANCE["bfloat16"], (step_index, layer)
        lengths = [n + 1 for n in lengths]
    assert leased._graphs is not None and leased._graphs.replays > 0
    assert torch.equal(leased.data, plain.data)


def test_a_prefill_step_is_never_captured():
    # More than MAX_GRAPH_ROWS_PER_SEQUENCE query rows per sequence: eager every time, as
    # often as the same shape comes (a capture costs far more than a prefill's launches).
    layout = llama_layout("bfloat16")
    pool = KVPool(layout, 64, "cuda")
    rows = 64
    tables = torch.arange(4, dtype=torch.int32).reshape(1, 4)
    for _ in range(3):
        step = pool.step_metadata(tables, [rows], [0, rows], list(range(rows)), 32)
        kv = torch.randn(rows, 8, 128, device="cuda").to(torch.bfloat16)
        q = torch.randn(rows, 32, 128, device="cuda").to(torch.bfloat16)
        layers = pool.bind_step(step, kv, kv, q)
        for layer in range(2):
            assert bool(layers.run(layer)[1])
    assert pool._graphs is not None and pool._graphs.captures == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_page_addressed_launch_serves_sequences_of_different_layers(dtype):
    # The coordinator merges concurrent calls for different layers into one call over the
    # pool's pages (page = block * num_layers + layer): decode and prefill rows of sequences
    # on layer 0 and layer 1 in one launch, each equal to dense attention over its own layer.
    layout = llama_layout(dtype)
    pool = KVPool(layout, 800, "cuda")
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    torch_dtype = layout.torch_dtype()
    specs = [(1000, 1, 0), (333, 17, 1), (4096, 1, 1), (77, 77, 0)]  # (seq_len, rows, layer)
    width = max(-(-s // layout.block_size) for s, _, _ in specs)
    taken: dict[str, set[int]] = {}
    tables, lens, starts, queries, refs = [], [], [0], [], []
    for seq_len, n, layer in specs:
        k = torch.randn(seq_len, 8, 128, generator=gen).to(torch_dtype)
        v = torch.randn(seq_len, 8, 128, generator=gen).to(torch_dtype)
        q = torch.randn(n, 32, 128, generator=gen).to(torch_dtype)
        blocks = -(-seq_len // layout.block_size)
        view = place_sequence({"w": pool}, [("w", blocks)], k, v, rng, layer=layer, taken=taken)
        ids = list(view.segments[0].block_indices) + [0] * (width - blocks)
        tables.append([b * layout.num_layers + layer for b in ids])
        lens.append(seq_len)
        starts.append(starts[-1] + n)
        queries.append(q)
        refs.append(dense_attention(q, k, v)[0])
    out = attend_pages(
        pool, torch.cat(queries), torch.tensor(tables), torch.tensor(lens), torch.tensor(starts)
    )
    assert out.is_cuda and not torch.isnan(out).any()
    assert rel_err(out.cpu(), torch.cat(refs)) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("tcp", "in_file"),
    [(False, False), (True, False), (False, True)],
    ids=["shared-memory", "tcp", "shared-file"],
)
def test_decode_steps_over_the_worker_channel_equal_ray_calls(gpu_ray, tcp, in_file):
    # A CUDA worker reached over its channel (same node: a shared arena; or over TCP, as
    # from another node: the worker's own pinned arena): the arena is page-locked on the
    # worker's side, a decode step's key, value and query reach a replayed graph in one
    # copy, and every layer's output equals the same call through Ray, bit for bit (a
    # step's later layers go as repeats of its first call). With `in_file`, key, query and
    # output lie in a shared file (as a client's region does): the worker maps and
    # page-locks it and reads and writes them there.
    ray, namespace = gpu_ray
    from cache_service.wire.worker_channel import ChannelOptions
    from workers.launcher import LaunchConfig, launch_workers, shutdown_workers
    from workers.shared_files import SHARED_FILES, create_mapped
    from workers.staging import packed_offsets

    layout = llama_layout("bfloat16")
    prefix = f"channel-gpu-{'tcp' if tcp else 'file' if in_file else 'shm'}-"
    path, mm = create_mapped("/dev/shm", "kvcache-test-", 4 << 20)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    if in_file:
        SHARED_FILES.add(base.data_ptr(), 4 << 20, (path, 4 << 20))

    def placed(t: torch.Tensor, offset: int) -> torch.Tensor:
        if not in_file:
            return t
        return base[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)

    (handle,) = launch_workers(
        LaunchConfig(
            PoolConfig(layout, num_blocks=600),
            num_workers=1,
            namespace=namespace,
            name_prefix=prefix,
        )
    )

    def file_pinned_here(path: str) -> bool:
        """Whether this process (the actor) maps `path` and page-locked the mapping for
        CUDA. (Nested: Ray sends it by value; the actor cannot import this module.)"""
        from workers.pinned_ranges import REGISTERED

        with open("/proc/self/maps") as maps:
            starts = [int(line.split("-")[0], 16) for line in maps if path in line]
        return bool(starts) and all(REGISTERED.covers(start, 1) for start in starts)

    async def scenario():
        options = ChannelOptions(8 << 20, force_tcp=tcp)
        fast = await RayWorkerClient.connect(handle, channel=options)
        slow = await RayWorkerClient.connect(handle)
        epoch = (await slow.describe()).epoch
        gen = torch.Generator().manual_seed(5)
        seqs, bs = 8, layout.block_size
        tables = torch.arange(seqs * 64).reshape(seqs, 64).int()
        lengths = [5, 17, 100, 300, 640, 1, 33, 900]
        for s, n in enumerate(lengths):  # the contexts, through Ray
            slots = [int(tables[s, i // bs]) * bs + i % bs for i in range(n)]
            kv = torch.randn(n, 8, 128, generator=gen).to(torch.bfloat16)
            await slow.write(epoch, None, slots, kv.repeat(2, 1, 1, 1), kv.repeat(2, 1, 1, 1))
        for step in range(4):
            slots = torch.tensor(
                [int(tables[s, n // bs]) * bs + n % bs for s, n in enumerate(lengths)]
            )
            lens = torch.tensor([n + 1 for n in lengths], dtype=torch.int32)
            qsl = torch.arange(seqs + 1, dtype=torch.int32)
            for layer in range(layout.num_layers):
                k = torch.randn(seqs, 8, 128, generator=gen).to(torch.bfloat16)
                q = torch.randn(seqs, 32, 128, generator=gen).to(torch.bfloat16)
                # In the file as a client's region lays a call out (packed_offsets), so the
                # graph loads the three from there in one copy.
                (at_k, at_v, at_q), _ = packed_offsets((k, k, q))
                k, v, q = placed(k, at_k), placed(k.clone(), at_v), placed(q, at_q)
                out = placed(torch.empty_like(q), 1 << 20)
                got = await write_and_attend(
                    fast,
                    epoch,
                    layer,
                    slots,
                    k,
                    v,
                    q,
                    tables,
                    lens,
                    qsl,
                    metadata_key=step,
                    out=out,
                )
                want = await attend(slow, epoch, layer, q, tables, lens, qsl)
                assert got.out is out and torch.equal(out, want.out), (step, layer)
            lengths = [n + 1 for n in lengths]
        assert fast.channel_calls == 8 and fast.ray_data_calls == 0
        # Each step's second layer repeats its first (its tensors refilled in the shared
        # arena, or read where they lie in the file); a private arena's bytes would have
        # to travel, so over TCP every call goes in full.
        assert fast.channel_repeats == (0 if tcp else 4)
        pinned = await asyncio.to_thread(
            ray.get,
            handle.__ray_call__.remote(
                lambda w: (
                    w._channel is not None,
                    w.pool._graphs.replays,
                    w.pool._graphs.packed_loads,
                    file_pinned_here(path) if in_file else True,
                )
            ),
        )
        assert pinned[0] and pinned[1] > 0 and pinned[2] > 0 and pinned[3], pinned
        fast.close()

    try:
        asyncio.run(scenario())
    finally:
        shutdown_workers(namespace, prefix)
        SHARED_FILES.remove(base.data_ptr())
        os.unlink(path)
