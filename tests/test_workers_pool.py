"""KVPool and PoolWorker in-process: layout, sizing, write/attend against a dense oracle,
block copies, export/import, debug poisoning, epoch fencing, and refusal of bad input."""

from __future__ import annotations

import asyncio
import math
import random
import re
import subprocess
import sys
import threading

import pytest
import torch
from round_calls import (
    attend,
    attend_pages,
    write_and_attend,
    write_and_attend_layers,
    write_and_attend_pages,
)
from workers_support import dense_attention, place_sequence, rel_err, write_tokens

import kernels
from cache_service.engine.worker_clients import LocalWorkerClient, transfer_blocks
from workers.actor import PoolWorker
from workers.config import PoolConfig
from workers.errors import (
    InvalidWorkerRequest,
    NonFiniteInput,
    PoolAllocationError,
    StaleEpochError,
    WorkerUnavailable,
)
from workers.layout import KVLayout
from workers.pool import KVPool

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def filled_pool(num_blocks: int = 16, seed: int = 0, device: str = "cpu", **kwargs) -> KVPool:
    pool = KVPool(LAYOUT, num_blocks, device, **kwargs)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


# The fingerprint tests also run on CUDA, where fingerprints come from a Triton kernel.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Triton on the CPU pools here runs through the interpreter, which conftest turns on only
# where there is no GPU (test_workers_gpu covers the real kernels there).
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() and not kernels.triton_interpreter_enabled(),
            reason="Triton on CPU tensors needs the interpreter (off where there is a GPU)",
        ),
    ),
]


# -- layout and package weight ---------------------------------------------------------


def test_layout_sizes_and_fingerprint():
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
    assert layout.block_shape == (32, 2, 8, 16, 128)
    assert layout.bytes_per_block == 32 * 2 * 8 * 16 * 128 * 2
    assert layout.bytes_per_token * 16 == layout.bytes_per_block
    assert layout.fingerprint() == KVLayout(32, 8, 128, 16, "bfloat16").fingerprint()
    others = [
        KVLayout(31, 8, 128, 16),
        KVLayout(32, 4, 128, 16),
        KVLayout(32, 8, 64, 16),
        KVLayout(32, 8, 128, 32),
        KVLayout(32, 8, 128, 16, "float16"),
    ]
    assert len({o.fingerprint() for o in others} | {layout.fingerprint()}) == 6
    assert layout.torch_dtype() is torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 2.0}, "head_dim"),
        ({"block_size": True}, "block_size"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_layout_refuses_bad_fields(kwargs, field):
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, **kwargs}
    with pytest.raises(ValueError, match=f"KVLayout.{field}"):
        KVLayout(**args)


def test_pure_modules_import_neither_torch_nor_ray():
    code = (
        "import sys; import workers, workers.layout, workers.errors, workers.description, "
        "workers.config, cache_service.engine.worker_interface; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- sizing ------------------------------------------------------------------------------


def test_pool_config_needs_exactly_one_size():
    with pytest.raises(PoolAllocationError, match="exactly one"):
        PoolConfig(LAYOUT)
    with pytest.raises(PoolAllocationError, match="exactly one"):
        PoolConfig(LAYOUT, num_blocks=4, memory_fraction=0.5)
    with pytest.raises(PoolAllocationError, match="memory_fraction"):
        PoolConfig(LAYOUT, memory_fraction=1.5)
    with pytest.raises(PoolAllocationError, match="num_blocks"):
        PoolConfig(LAYOUT, num_blocks=0)
    with pytest.raises(ValueError, match="backend"):
        PoolConfig(LAYOUT, num_blocks=1, backend="cuda")


def test_memory_fraction_sizes_the_pool_from_free_memory():
    from workers.sizing import free_device_bytes

    free = free_device_bytes(torch.device("cpu"))
    fraction = (64 * LAYOUT.bytes_per_block) / free  # about 64 blocks
    pool = KVPool.from_config(PoolConfig(LAYOUT, memory_fraction=fraction), "cpu")
    assert 32 <= pool.num_blocks <= 96
    assert pool.nbytes == pool.num_blocks * LAYOUT.bytes_per_block


def test_pool_that_does_not_fit_is_refused_with_figures():
    huge = KVLayout(num_layers=1024, num_kv_heads=64, head_dim=256, block_size=256)
    with pytest.raises(PoolAllocationError, match=r"does not fit.*at most \d+ blocks fit"):
        KVPool(huge, 10_000, "cpu")
    with pytest.raises(PoolAllocationError, match="less than one block"):
        KVPool.from_config(PoolConfig(huge, memory_fraction=1e-9), "cpu")


def test_layer_views_are_strided_slices_of_one_tensor():
    pool = KVPool(LAYOUT, 5, "cpu")
    k, v = pool.key_cache(1), pool.value_cache(1)
    assert k.shape == (5, 2, 4, 16)
    assert k.stride() == (3 * 2 * 2 * 4 * 16, 4 * 16, 16, 1)
    assert k.data_ptr() == pool.data[0, 1, 0].data_ptr()
    assert v.data_ptr() == pool.data[0, 1, 1].data_ptr()


# -- write / attend ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_decode_and_prefill_match_dense(backend):
    """Three sequences (decode, chunked prefill, full prefill) in one launch, GQA 4:2,
    shuffled physical blocks; the Triton path runs through the interpreter here."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(LAYOUT, 24, "cpu", backend=backend)
    pools = {"w": pool}
    taken: dict[str, set[int]] = {}
    specs = [(13, 1), (9, 5), (6, 6)]  # (seq_len, new queries)
    tables, lens, qsl, queries, refs = [], [], [0], [], []
    for seq_len, n in specs:
        k = torch.randn(seq_len, 2, 16, generator=gen)
        v = torch.randn(seq_len, 2, 16, generator=gen)
        q = torch.randn(n, 4, 16, generator=gen)
        blocks = -(-seq_len // 4)
        view = place_sequence(pools, [("w", blocks)], k, v, rng, layer=2, taken=taken)
        tables.append(list(view.segments[0].block_indices) + [0] * (4 - blocks))
        lens.append(seq_len)
        qsl.append(qsl[-1] + n)
        queries.append(q)
        refs.append(dense_attention(q, k, v))
    out, lse = attend(pool, 2, torch.cat(queries), tables, lens, qsl, return_lse=True)
    assert rel_err(out, torch.cat([r[0] for r in refs])) < 1e-5
    assert torch.allclose(lse.double(), torch.cat([r[1] for r in refs]), atol=1e-4)
    # Other layers were not touched by the writes.
    assert pool.key_cache(0).abs().sum() == 0 and pool.value_cache(1).abs().sum() == 0


def test_write_all_layers_at_once():
    pool = KVPool(LAYOUT, 4, "cpu")
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(3, 5, 2, 16, generator=gen)
    v = torch.randn(3, 5, 2, 16, generator=gen)
    write_tokens(pool, [2, 0], 0, k, v, layer=None)
    for layer in range(3):
        got = pool.key_cache(layer)[[2, 2, 2, 2, 0], :, [0, 1, 2, 3, 0]]
        assert torch.equal(got, k[layer])
        assert torch.equal(pool.value_cache(layer)[0, :, 0], v[layer, 4])


def test_write_and_attend_equals_write_then_attend():
    gen = torch.Generator().manual_seed(3)
    a, b = filled_pool(seed=4), filled_pool(seed=4)
    k, v = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    q = torch.randn(2, 2, 16, generator=gen)
    args = ([[3, 7, 1]], [10], [0, 2])
    got = write_and_attend(a, 0, [7 * 4 + 0, 7 * 4 + 1], k, v, q, *args)
    b.write(0, [28, 29], k, v)
    assert torch.equal(got, attend(b, 0, q, *args))
    assert torch.equal(a.data, b.data)


def test_negative_slots_are_skipped():
    pool = KVPool(LAYOUT, 2, "cpu")
    k = torch.ones(3, 2, 16)
    pool.write(0, [-1, 5, -1], k, k)
    assert pool.key_cache(0).sum() == 2 * 16  # one token, two heads


# -- block operations ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_blocks_copies_every_layer_and_reads_sources_first(backend):
    pool = filled_pool(8, backend=backend)
    before = pool.data.clone()
    pool.copy_blocks([1, 2], [2, 5])  # block 2 is both a source and a destination
    assert torch.equal(pool.data[2], before[1]) and torch.equal(pool.data[5], before[2])
    untouched = [0, 1, 3, 4, 6, 7]
    assert torch.equal(pool.data[untouched], before[untouched])


def test_export_import_round_trip_is_bit_exact_between_pools():
    src = filled_pool(8, seed=5)
    dst = KVPool(LAYOUT, 6, "cpu")
    data = src.export_blocks([6, 0, 3])
    assert data.shape == (3, *LAYOUT.block_shape) and data.device.type == "cpu"
    dst.import_blocks([1, 5, 2], data)
    assert torch.equal(dst.data[[1, 5, 2]], src.data[[6, 0, 3]])
    assert torch.equal(dst.export_blocks([1, 5, 2]), data)
    assert dst.data[[0, 3, 4]].abs().sum() == 0


def test_debug_pool_starts_poisoned_and_poisons_released_blocks():
    pool = KVPool(LAYOUT, 4, "cpu", debug=True)
    assert torch.isnan(pool.data).all()
    k = torch.randn(8, 2, 16)
    write_tokens(pool, [1, 3], 0, k, k)
    q = torch.randn(1, 2, 16)
    assert not torch.isnan(attend(pool, 0, q, [[1, 3]], [8], [0, 1])).any()
    pool.release_blocks([3])
    assert torch.isnan(pool.data[3]).all() and not torch.isnan(pool.data[1, 0]).any()
    # A stale read of the released block shows up instead of passing silently.
    assert torch.isnan(attend(pool, 0, q, [[1, 3]], [8], [0, 1])).all()


def test_release_outside_debug_changes_nothing():
    pool = filled_pool(4)
    before = pool.data.clone()
    pool.release_blocks([0, 2])
    assert torch.equal(pool.data, before)


# -- bad input: a clear error naming the argument, nothing changed ---------------------------

Q = torch.zeros(2, 4, 16)
KV1 = torch.zeros(1, 2, 16)
BAD_CALLS = [
    ("write", (3, [0], KV1, KV1), "layer"),
    ("write", (0, [0, 1], KV1, KV1), "key"),
    ("write", (0, [0], KV1.double(), KV1.double()), "key dtype"),
    ("write", (0, [0], KV1, torch.zeros(1, 2, 8)), "value"),
    ("write", (0, [64], KV1, KV1), "slot_mapping holds slot 64"),
    ("write", (0, [1, 1], torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)), "more than once"),
    ("write", (0, [0.5], KV1, KV1), "slot_mapping"),
    ("write", (None, [0], KV1, KV1), "key must be [3, 1, 2, 16]"),
    ("attend", (0, Q, [[0, 1]], [5], [0, 2]), None),  # the valid baseline
    ("attend", (0, Q[:, :3], [[0]], [4], [0, 2]), "query has 3 heads"),
    ("attend", (0, Q.half(), [[0]], [4], [0, 2]), "query dtype"),
    ("attend", (0, torch.zeros(2, 4, 8), [[0]], [4], [0, 2]), "query must be"),
    ("attend", (0, Q, [[0, 16]], [5], [0, 2]), "block_tables[0, 1] = 16"),
    ("attend", (0, Q, [[0]], [5], [0, 2]), "seq_lens[0] exceeds"),
    ("attend", (0, Q, [[0]], [1], [0, 2]), "more query rows"),
    ("attend", (0, Q, [[0]], [4], [0, 1]), "query_start_loc[-1]"),
    ("attend", (0, Q, [[0]], [4, 4], [0, 2]), "seq_lens must be"),
    ("attend", (0, Q, [0], [4], [0, 2]), "block_tables must be 2-D"),
    ("attend", (-1, Q, [[0]], [4], [0, 2]), "layer"),
    ("copy_blocks", ([0], [16]), "dst[0] = 16"),
    ("copy_blocks", ([0, 1], [2, 2]), "dst names one block more than once"),
    ("copy_blocks", ([0], [1, 2]), "src has 1 entries"),
    ("export_blocks", ([-1],), "block_ids[0] = -1"),
    ("import_blocks", ([0], torch.zeros(1, 3, 2, 2, 4, 8)), "data must be"),
    ("import_blocks", ([0], torch.zeros(1, *LAYOUT.block_shape).half()), "data dtype"),
    ("import_blocks", ([0, 0], torch.zeros(2, *LAYOUT.block_shape)), "more than once"),
    ("release_blocks", ([99],), "block_ids[0] = 99"),
]


def _call(pool: KVPool, method: str, *args: object) -> object:
    """The pool's `method`, or the round of that name (round_calls)."""
    calls = {"attend": attend, "write_and_attend": write_and_attend}
    if method in calls:
        return calls[method](pool, *args)
    return getattr(pool, method)(*args)


@pytest.mark.parametrize(("method", "args", "message"), BAD_CALLS)
def test_bad_input_is_refused_and_changes_nothing(method, args, message):
    pool = filled_pool(16)
    before = pool.data.clone()
    if message is None:
        _call(pool, method, *args)
        return
    with pytest.raises(InvalidWorkerRequest) as info:
        _call(pool, method, *args)
    assert message in str(info.value)
    assert torch.equal(pool.data, before)


def test_write_and_attend_checks_the_attention_half_before_writing():
    pool = filled_pool(16)
    before = pool.data.clone()
    k = torch.ones(1, 2, 16)
    with pytest.raises(InvalidWorkerRequest, match="block_tables"):
        write_and_attend(pool, 0, [3], k, k, Q, [[0, 99]], [5], [0, 2])
    assert torch.equal(pool.data, before)


@pytest.mark.parametrize(
    ("option", "value"),
    [("scale", math.inf), ("softcap", -1.0), ("sliding_window", 0), ("causal", 1)],
)
def test_bad_attention_options_are_refused(option, value):
    pool = filled_pool(4)
    with pytest.raises(InvalidWorkerRequest, match=option):
        attend(pool, 0, Q, [[0]], [4], [0, 2], **{option: value})


# -- PoolWorker: epochs ---------------------------------------------------------------------


def test_worker_refuses_a_stale_epoch_and_changes_nothing():
    worker = PoolWorker("w0", PoolConfig(LAYOUT, num_blocks=8), "cpu")
    desc = worker.describe()
    assert desc.worker_id == "w0" and desc.num_blocks == 8 and desc.device == "cpu"
    assert desc.layout == LAYOUT and desc.epoch == worker.epoch() and len(desc.epoch) == 16
    k = torch.ones(1, 2, 16)
    with pytest.raises(StaleEpochError) as info:
        worker.write("not-the-epoch", 0, [0], k, k)
    assert info.value.worker_id == "w0" and info.value.actual == desc.epoch
    assert torch.equal(
        worker.export_blocks(desc.epoch, list(range(8))), torch.zeros(8, *LAYOUT.block_shape)
    )
    health = worker.health()
    assert health.ok and health.calls == 2 and health.failed_calls == 1


def test_each_start_draws_a_new_epoch():
    config = PoolConfig(LAYOUT, num_blocks=1)
    assert len({PoolWorker("w", config).epoch() for _ in range(5)}) == 5


def test_worker_returns_host_tensors_with_lse():
    worker = PoolWorker("w", PoolConfig(LAYOUT, num_blocks=4))
    out, lse = attend(worker, worker.epoch(), 0, Q, [[0, 1]], [5], [0, 2], True, True)
    assert out.device.type == "cpu" and lse.dtype == torch.float32 and lse.shape == (2, 4)


def _checked_worker() -> tuple[PoolWorker, str, tuple]:
    """A CPU worker with layer 0 of blocks 0 and 1 written (random K/V), and the arguments
    of an attend / reference_attend over their first 5 tokens (2 query rows, causal, lse)."""
    worker = PoolWorker("w", PoolConfig(LAYOUT, num_blocks=4), "cpu")
    epoch = worker.epoch()
    gen = torch.Generator().manual_seed(21)
    k, v = torch.randn(8, 2, 16, generator=gen), torch.randn(8, 2, 16, generator=gen)
    worker.write(epoch, 0, list(range(8)), k, v)
    q = torch.randn(2, 4, 16, generator=gen)
    return worker, epoch, (0, q, [[0, 1]], [5], [0, 2], True, True)


def test_a_checks_recomputation_runs_outside_the_workers_lock(monkeypatch):
    worker, epoch, args = _checked_worker()
    pool = worker._pool
    entered, release = threading.Event(), threading.Event()
    real = pool.reference_output

    def held(inputs):
        entered.set()
        assert release.wait(10)
        return real(inputs)

    monkeypatch.setattr(pool, "reference_output", held)
    checked: list = []
    check = threading.Thread(target=lambda: checked.append(worker.reference_attend(epoch, *args)))
    check.start()
    try:
        assert entered.wait(10)
        # While the recomputation is held, another call takes the lock and answers.
        answered: list = []
        other = threading.Thread(target=lambda: answered.append(attend(worker, epoch, *args)))
        other.start()
        other.join(5)
        assert answered, "the call waited for the check's recomputation"
    finally:
        release.set()
        check.join(10)
    (out, lse), (ref_out, ref_lse, bad) = answered[0], checked[0]
    assert ref_out.device.type == "cpu" and bad == []
    torch.testing.assert_close(ref_out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref_lse, lse, atol=1e-5, rtol=1e-5)


def test_a_check_with_a_stale_epoch_or_a_bad_argument_recomputes_nothing(monkeypatch):
    worker, epoch, args = _checked_worker()
    recomputed: list = []
    monkeypatch.setattr(worker._pool, "reference_output", recomputed.append)
    with pytest.raises(StaleEpochError):
        worker.reference_attend("not-the-epoch", *args)
    with pytest.raises(InvalidWorkerRequest, match="layer"):
        worker.reference_attend(epoch, LAYOUT.num_layers, *args[1:])
    assert recomputed == [] and worker.health().failed_calls == 2


# -- LocalWorkerClient --------------------------------------------------------------------


def test_local_client_restart_and_kill():
    async def scenario():
        client = LocalWorkerClient("w", PoolConfig(LAYOUT, num_blocks=4))
        try:
            epoch = (await client.describe()).epoch
            k = torch.ones(1, 2, 16)
            await client.write(epoch, 0, [1], k, k)
            result = await attend(client, epoch, 0, Q[:1], [[0]], [2], [0, 1])
            assert result.lse is None and result.out.shape == (1, 4, 16)
            client.restart()
            new_epoch = (await client.describe()).epoch
            assert new_epoch != epoch
            with pytest.raises(StaleEpochError):
                await attend(client, epoch, 0, Q[:1], [[0]], [2], [0, 1])
            assert (await client.export_blocks(new_epoch, [0])).abs().sum() == 0  # empty pool
            client.kill()
            with pytest.raises(WorkerUnavailable, match="killed"):
                await client.health()
        finally:
            client.close()

    asyncio.run(scenario())


def test_transfer_between_local_workers_is_bit_exact():
    async def scenario():
        config = PoolConfig(LAYOUT, num_blocks=6)
        a, b = LocalWorkerClient("a", config), LocalWorkerClient("b", config)
        try:
            ea, eb = (await a.describe()).epoch, (await b.describe()).epoch
            a.worker._pool.data.normal_()
            await transfer_blocks(a, ea, [4, 1], b, eb, [0, 5])
            assert torch.equal(await b.export_blocks(eb, [0, 5]), await a.export_blocks(ea, [4, 1]))
            with pytest.raises(StaleEpochError, match="'a'"):
                await transfer_blocks(a, eb, [4], b, eb, [1])
        finally:
            a.close()
            b.close()

    asyncio.run(scenario())


# -- attention metadata kept across calls (metadata_key) -----------------------------------


def _decode_args(pool: KVPool, seed: int):
    """A decode batch of 3 sequences over random blocks of `pool`: (slots, k, v, q, tables,
    lens, qsl)."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(pool.num_blocks, generator=gen)[:9].reshape(3, 3).int()
    lens = torch.tensor([5, 9, 12], dtype=torch.int32)
    slots = torch.tensor(
        [int(tables[s, (n - 1) // 4]) * 4 + (n - 1) % 4 for s, n in enumerate(lens)]
    )
    k = torch.randn(3, 2, 16, generator=gen)
    v = torch.randn(3, 2, 16, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    return slots, k, v, q, tables, lens, torch.arange(4, dtype=torch.int32)


def test_a_metadata_key_validates_once_and_answers_like_an_unkeyed_call(monkeypatch):
    import workers.pool as pool_mod

    keyed, plain = filled_pool(seed=3), filled_pool(seed=3)
    checks = []
    real = pool_mod.check_attend
    monkeypatch.setattr(pool_mod, "check_attend", lambda *a: checks.append(1) or real(*a))
    args = _decode_args(keyed, seed=4)
    for layer in range(LAYOUT.num_layers):  # one step: every layer, one key
        q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(layer))
        step = (*args[:3], q, *args[4:])
        a = write_and_attend(keyed, layer, *step, metadata_key=77)
        b = write_and_attend(plain, layer, *step)
        assert torch.equal(a, b)
        assert torch.equal(attend(keyed, layer, q, *args[4:], metadata_key=77), a)
    assert torch.equal(keyed.data, plain.data)
    assert len(checks) == 1 + LAYOUT.num_layers  # the keyed pool checked once; plain each call


@pytest.mark.parametrize("as_list", [False, True])
def test_a_keys_slots_are_validated_once_and_other_slots_as_usual(monkeypatch, as_list):
    import workers.pool as pool_mod

    keyed, plain = filled_pool(seed=3), filled_pool(seed=3)
    checks = []
    real = pool_mod.check_write
    monkeypatch.setattr(pool_mod, "check_write", lambda *a: checks.append(1) or real(*a))
    slots, k, v, q, tables, lens, qsl = _decode_args(keyed, seed=4)
    given = slots.tolist() if as_list else slots
    for layer in range(LAYOUT.num_layers):
        args = (layer, given, k + layer, v - layer, q, tables, lens, qsl)
        assert torch.equal(
            write_and_attend(keyed, *args, metadata_key=9), write_and_attend(plain, *args)
        )
    assert torch.equal(keyed.data, plain.data)
    assert len(checks) == 1 + LAYOUT.num_layers  # the keyed pool checked the slots once
    # Other slots under the same key: validated again (a slot past the pool is refused and
    # nothing is written), and good ones written where they say.
    bad = slots.clone()
    bad[1] = keyed.num_slots
    before = keyed.data.clone()
    with pytest.raises(InvalidWorkerRequest, match="slot_mapping holds slot"):
        write_and_attend(keyed, 0, bad, k, v, q, tables, lens, qsl, metadata_key=9)
    assert torch.equal(keyed.data, before)
    # The key's kept slots are not fooled by a key of the wrong shape either.
    with pytest.raises(InvalidWorkerRequest, match="key must be"):
        write_and_attend(keyed, 0, given, k[:2], v, q, tables, lens, qsl, metadata_key=9)
    assert torch.equal(keyed.data, before)


@pytest.mark.parametrize("change", ["rows", "tables", "key_type"])
def test_a_call_that_does_not_fit_its_keys_metadata_is_refused_and_writes_nothing(change):
    pool = filled_pool(seed=5)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=6)
    write_and_attend(pool, 0, slots, k, v, q, tables, lens, qsl, metadata_key=5)
    before = pool.data.clone()
    key: object = 5
    if change == "rows":  # another batch under the same key
        q = torch.randn(4, 4, 16)
        qsl = torch.tensor([0, 1, 2, 4], dtype=torch.int32)
    elif change == "tables":
        tables = torch.cat([tables, tables[:, :1]], dim=1)
    else:
        key = "5"
    with pytest.raises(InvalidWorkerRequest, match="step key"):
        write_and_attend(pool, 1, slots, k, v, q, tables, lens, qsl, metadata_key=key)
    assert torch.equal(pool.data, before)


def test_a_metadata_mismatch_names_both_shapes():
    pool = filled_pool(seed=5)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=6)
    write_and_attend(pool, 0, slots, k, v, q, tables, lens, qsl, metadata_key=5)
    wide = torch.cat([tables, tables[:, :1]], dim=1)
    with pytest.raises(InvalidWorkerRequest) as info:
        attend(pool, 1, q, wide, lens.tolist(), qsl, metadata_key=5)
    assert str(info.value) == (
        "step key 5 names metadata of 3 query rows and index shapes [[3, 3], [3], [4]]; "
        "this call has 3 rows and ((3, 4), None, (4,)): a key must name one content"
    )
    # Lists where tensors were passed at first: the same shapes, nothing to compare.
    with pytest.raises(InvalidWorkerRequest, match=r"3 rows and \(None, None, None\)"):
        attend(pool, 1, q, tables.tolist(), lens.tolist(), qsl.tolist(), metadata_key=5)


NEW_KV = torch.zeros(2, 2, 16)
NEW_KV_CASES = [
    (NEW_KV, NEW_KV, None),
    (torch.nn.Parameter(NEW_KV), NEW_KV, None),  # a tensor subclass is a tensor
    (
        NEW_KV[:1],
        NEW_KV,
        "key must be [2, 2, 16] (slot_mapping has 2 entries), got shape (1, 2, 16)",
    ),
    (
        NEW_KV,
        NEW_KV[:1],
        "value must be [2, 2, 16] (slot_mapping has 2 entries), got shape (1, 2, 16)",
    ),
    (NEW_KV[None], NEW_KV, "key must be [2, 2, 16] for this layout, got shape (1, 2, 2, 16)"),
    (NEW_KV[:, :1], NEW_KV, "key must be [2, 2, 16] for this layout, got shape (2, 1, 16)"),
    (NEW_KV, NEW_KV.double(), "value dtype torch.float64 differs from the pool's float32"),
    (NEW_KV.tolist(), NEW_KV, "key must be a torch.Tensor, got list"),
    (NEW_KV, None, "value must be a torch.Tensor, got NoneType"),
]


@pytest.mark.parametrize(("key", "value", "message"), NEW_KV_CASES)
def test_new_kv_of_one_layer_is_accepted_or_refused_with_its_message(key, value, message):
    from workers.checks import check_new_kv

    if message is None:
        check_new_kv(LAYOUT, 1, 2, key, value)
        return
    with pytest.raises(InvalidWorkerRequest) as info:
        check_new_kv(LAYOUT, 1, 2, key, value)
    assert str(info.value) == message


def test_the_metadata_cache_keeps_the_most_recent_keys():
    from workers.metadata_cache import CachedMetadata, MetadataCache

    cache = MetadataCache(capacity=2)
    entry = CachedMetadata(torch.zeros(1, 1), torch.zeros(1), torch.zeros(2), 1)
    for key in (1, 2):
        cache.put(key, entry)
    assert cache.get(1) is entry  # 1 is now the most recent
    cache.put(3, entry)
    assert cache.get(2) is None and cache.get(1) is entry and cache.get(3) is entry
    with pytest.raises(ValueError):
        MetadataCache(capacity=0)


@pytest.mark.parametrize("device", DEVICES)
def test_fingerprints_skip_negative_slots_and_still_catch_a_changed_slot(device: str):
    pool = filled_pool(device=device, fingerprints=True)
    gen = torch.Generator().manual_seed(8)
    k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    pool.write(1, torch.tensor([5, -1, 6]), k, v)  # the middle token is skipped
    tables = torch.tensor([[1, 0]], dtype=torch.int32)  # block 1 holds slots 4..7
    lens = torch.tensor([3], dtype=torch.int32)
    q = torch.randn(1, 4, 16, generator=gen)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    pool.write(1, torch.tensor([4]), k[:1], v[:1])
    _, _, bad = pool.reference_attend(1, q, tables, lens, qsl)
    assert bad == []  # slots 4, 5, 6 as written; the skipped token touched nothing
    pool.data[1, 1, 1, 0, 2, 0] += 1.0  # block 1, layer 1, V, head 0, offset 2 (slot 6)
    _, _, bad = pool.reference_attend(1, q, tables, lens, qsl)
    assert [(b.block, b.offset, b.kind) for b in bad] == [(1, 2, 1)]


# -- sequences of several layers in one call (pages) ---------------------------------------


def _as_pages(
    tables: torch.Tensor, slots: torch.Tensor, layers: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode batch addressed as pages (page ``block * num_layers + layer``), sequence i
    on ``layers[i]``: (int64 page tables ``[S, max_blocks]``, page slots ``[S]``)."""
    n, bs = LAYOUT.num_layers, LAYOUT.block_size
    per_seq = torch.tensor(layers)
    return tables.long() * n + per_seq[:, None], ((slots // bs) * n + per_seq) * bs + slots % bs


@pytest.mark.parametrize("device", DEVICES)
def test_page_addressed_calls_equal_per_layer_calls_and_keep_fingerprints(device: str):
    paged = filled_pool(seed=9, device=device, fingerprints=True)
    plain = filled_pool(seed=9, device=device, fingerprints=True)
    layers = [2, 0, 2]  # three sequences: two on layer 2, one on layer 0
    slots, k, v, q, tables, lens, qsl = _decode_args(paged, seed=10)
    pages, slot_pages = _as_pages(tables, slots, layers)
    out = write_and_attend_pages(paged, slot_pages, k, v, q, pages.int(), lens, qsl)
    for i, layer in enumerate(layers):  # the same, one sequence and layer at a time
        one = slice(i, i + 1)
        ref = write_and_attend(
            plain, layer, slots[one], k[one], v[one], q[one], tables[one], lens[one], qsl[:2]
        )
        assert torch.allclose(out[one], ref, atol=1e-6)
        assert torch.allclose(
            attend_pages(paged, q[one], pages[one].int(), lens[one], qsl[:2]), ref, atol=1e-6
        )
    assert torch.equal(paged.data, plain.data)
    for layer in sorted(set(layers)):
        rows = [i for i, lyr in enumerate(layers) if lyr == layer]
        starts = torch.arange(len(rows) + 1, dtype=torch.int32)
        args = (layer, q[rows], tables[rows], lens[rows], starts)
        # The filled pools' other slots were never fingerprinted (both report them); the
        # slots written here must be recorded under their own layers, as per-layer calls do.
        bad = paged.reference_attend(*args)[2]
        assert bad == plain.reference_attend(*args)[2]
        written = {(int(s) // 4, int(s) % 4) for s in slots[rows]}
        assert not written & {(b.block, b.offset) for b in bad}


def test_a_block_or_slot_outside_the_pool_in_a_round_over_layers_is_refused():
    pool = filled_pool(seed=11)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=12)
    seq_layers, slot_layers = [1, 0, 1], [1] * slots.shape[0]
    before = pool.data.clone()
    bad = tables.clone()
    bad[1, 0] = pool.num_blocks  # one past the last block (a page id of no layer)
    with pytest.raises(InvalidWorkerRequest, match="block_tables"):
        write_and_attend_layers(pool, seq_layers, slot_layers, slots, k, v, q, bad, lens, qsl)
    too_far = slots.clone()
    too_far[0] = pool.num_slots
    with pytest.raises(InvalidWorkerRequest, match="slot_mapping"):
        write_and_attend_layers(pool, seq_layers, slot_layers, too_far, k, v, q, tables, lens, qsl)
    assert torch.equal(pool.data, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("field", ["key", "value", "query"])
def test_a_checked_page_write_refuses_non_finite_values_and_writes_nothing(device, field):
    pool = filled_pool(seed=13, device=device, fingerprints=True)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=14)
    pages, slot_pages = _as_pages(tables, slots, [1, 0, 1])
    pages = pages.int()
    args = {"key": k, "value": v, "query": q}
    bad = dict(args)
    bad[field] = args[field].clone()
    bad[field].view(-1)[5] = float("nan")
    data = pool.data.clone()
    with pytest.raises(NonFiniteInput, match="nothing was written"):
        write_and_attend_pages(pool,
            slot_pages, bad["key"], bad["value"], bad["query"], pages, lens, qsl,
            check_finite=True,
        )  # fmt: skip
    assert torch.equal(pool.data, data)
    # Finite values: checked or not, the same answer and the same pool.
    unchecked = filled_pool(seed=13, device=device, fingerprints=True)
    got = write_and_attend_pages(pool, slot_pages, k, v, q, pages, lens, qsl, check_finite=True)
    ref = write_and_attend_pages(unchecked, slot_pages, k, v, q, pages, lens, qsl)
    assert torch.equal(got, ref)
    assert torch.equal(pool.data, unchecked.data)


def _in_parts(t: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """`t`'s rows as separate tensors (own memory, as callers' regions are), `rows` each."""
    return [p.clone() for p in t.split(rows)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_round_given_in_parts_answers_as_joined_and_fills_each_out_part(device, return_lse):
    # A coordinator's round of two callers (rows 1 and 2): key, value and query where each
    # caller put them, each caller's output rows into its own slot; the same answer and the
    # same pool as the call on joined tensors.
    parted = filled_pool(seed=21, device=device, fingerprints=True)
    joined = filled_pool(seed=21, device=device, fingerprints=True)
    slots, k, v, q, tables, lens, qsl = _decode_args(parted, seed=22)
    pages, slot_pages = _as_pages(tables, slots, [1, 0, 1])
    rows = [1, 2]
    out = [torch.full((n, 4, 16), float("nan")) for n in rows]
    got = write_and_attend_pages(parted,
        slot_pages, _in_parts(k, rows), _in_parts(v, rows), _in_parts(q, rows), pages.int(),
        lens, qsl, return_lse=return_lse, to_host=True, check_finite=True, out=out,
    )  # fmt: skip
    want = write_and_attend_pages(
        joined, slot_pages, k, v, q, pages.int(), lens, qsl, return_lse=return_lse, to_host=True
    )
    got_out, got_lse = got if return_lse else (got, None)
    want_out, want_lse = want if return_lse else (want, None)
    assert got_out is out  # the caller's memory, filled in place
    assert torch.equal(torch.cat(out), want_out)
    if return_lse:
        assert torch.equal(got_lse, want_lse)
    assert torch.equal(parted.data, joined.data)


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_in_parts_that_does_not_fit_is_refused_and_changes_nothing(device):
    pool = filled_pool(seed=23, device=device, fingerprints=True)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=24)
    pages, slot_pages = _as_pages(tables, slots, [0, 1, 1])
    rows = [2, 1]
    parts = {"key": _in_parts(k, rows), "value": _in_parts(v, rows), "query": _in_parts(q, rows)}
    good_out = [torch.full((n, 4, 16), 7.0) for n in rows]
    cases = [
        ("key", [parts["key"][0], parts["key"][1][:, :1]], None, "key part 1"),
        ("query", [parts["query"][0].double(), parts["query"][1]], None, "query part 1 .* joined"),
        ("value", [], None, "has none"),
        ("query", [parts["query"][0], "rows"], None, "query part 1 must be a torch.Tensor"),
        ("key", parts["key"][:1], None, "key must be"),  # rows short of the slots
        (None, None, [good_out[0]], "out's parts hold 2 rows, the output has 3"),
        (None, None, [good_out[0], torch.zeros(1, 4, 8)], "out part 1"),
        (None, None, [good_out[0], torch.zeros(4, 16, 1).transpose(0, 2)], "not contiguous"),
    ]
    data = pool.data.clone()
    for field, bad, out, message in cases:
        given = dict(parts)
        if field is not None:
            given[field] = bad
        with pytest.raises(InvalidWorkerRequest, match=message):
            write_and_attend_pages(pool,
                slot_pages, given["key"], given["value"], given["query"], pages.int(), lens,
                qsl, to_host=True, out=good_out if out is None else out,
            )  # fmt: skip
        assert torch.equal(pool.data, data)
        assert all(torch.equal(o, torch.full_like(o, 7.0)) for o in good_out)
    # A NaN in one caller's part: refused on the device, nothing written, out untouched.
    bad_q = [parts["query"][0], parts["query"][1].clone()]
    bad_q[1][0, 1, 2] = float("nan")
    with pytest.raises(NonFiniteInput, match="nothing was written"):
        write_and_attend_pages(pool,
            slot_pages, parts["key"], parts["value"], bad_q, pages.int(), lens, qsl,
            to_host=True, check_finite=True, out=good_out,
        )  # fmt: skip
    assert torch.equal(pool.data, data)
    assert all(torch.equal(o, torch.full_like(o, 7.0)) for o in good_out)


@pytest.mark.parametrize("device", DEVICES)
def test_rounds_over_layers_equal_per_layer_calls_under_one_key(device):
    # A coordinator's rounds of recorded steps whose callers are on different layers, the
    # layers changing from round to round under one metadata key (validated once; on CUDA
    # the third round replays a graph of the whole round), inputs and outputs in parts:
    # each round equals the same sequences' per-layer calls, and so do the pools.
    layered = filled_pool(seed=25, device=device, fingerprints=True)
    plain = filled_pool(seed=25, device=device, fingerprints=True)
    slots, _, _, q, tables, lens, qsl = _decode_args(layered, seed=26)
    gen = torch.Generator().manual_seed(27)
    rows = [1, 2]
    for layers in ([2, 0, 2], [1, 1, 0], [0, 2, 1], [2, 1, 1]):
        k, v = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
        q = torch.randn(3, 4, 16, generator=gen)
        out = [torch.full((n, 4, 16), float("nan")) for n in rows]
        got = write_and_attend_layers(layered,
            layers, layers, slots.tolist(), _in_parts(k, rows), _in_parts(v, rows),
            _in_parts(q, rows), tables, lens, qsl, metadata_key=77, to_host=True,
            check_finite=True, out=out,
        )  # fmt: skip
        assert [o.data_ptr() for o in got] == [o.data_ptr() for o in out]
        for i, layer in enumerate(layers):
            one = slice(i, i + 1)
            ref = write_and_attend(plain,
                layer, slots[one], k[one], v[one], q[one], tables[one], lens[one], qsl[:2],
                to_host=True,
            )  # fmt: skip
            assert torch.allclose(torch.cat(out)[one], ref, atol=1e-5), (layers, i)
    assert torch.equal(layered.data, plain.data)
    if device == "cuda":
        assert layered._graphs is not None and layered._graphs.replays >= 1


def test_a_round_over_layers_with_bad_layers_is_refused_and_writes_nothing():
    pool = filled_pool(seed=28)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=29)
    good = [0, 1, 2]
    write_and_attend_layers(pool, good, good, slots.tolist(), k, v, q, tables, lens, qsl,
                                 metadata_key=5)  # fmt: skip
    data = pool.data.clone()
    cases = [
        ([0, 1], good, "seq_layers must be a list of 3 layers"),
        (good, [0, 1, 2, 0], "slot_layers must be a list of 3 layers"),
        ([0, 1, LAYOUT.num_layers], good, r"seq_layers must hold layer indices in \[0, 3\)"),
        (good, [0, -1, 1], "slot_layers must hold layer indices"),
        (good, [0, 1.0, 1], "slot_layers must hold layer indices"),
        ((0, 1, 2), good, "seq_layers must be a list"),
    ]
    for key in (None, 5):  # validated afresh, and under the key's kept metadata
        for seq_layers, slot_layers, message in cases:
            with pytest.raises(InvalidWorkerRequest, match=message):
                write_and_attend_layers(pool,
                    seq_layers, slot_layers, slots.tolist(), k, v, q, tables, lens, qsl,
                    metadata_key=key,
                )  # fmt: skip
            assert torch.equal(pool.data, data)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checked_write_refuses_non_finite_values_and_leaves_out_and_the_pool_alone(device):
    pool = filled_pool(device=device, fingerprints=True)
    slots, k, v, q, tables, lens, qsl = _decode_args(pool, seed=6)
    out = torch.full((3, 4, 16), 7.0)
    for key in (None, 21, 21):  # the full path, then the key's kept metadata
        data = pool.data.clone()
        bad = q.clone()
        bad[1, 2, 3] = float("inf")
        with pytest.raises(NonFiniteInput, match="nothing was written"):
            write_and_attend(pool,
                0, slots, k, v, bad, tables, lens, qsl,
                metadata_key=key, to_host=True, out=out, check_finite=True,
            )  # fmt: skip
        assert torch.equal(pool.data, data)
        assert torch.equal(out, torch.full((3, 4, 16), 7.0))  # the caller's memory as it was
    got = write_and_attend(pool,
        0, slots, k, v, q, tables, lens, qsl, metadata_key=21, to_host=True, out=out,
        check_finite=True,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, write_and_attend(filled_pool(device=device),
        0, slots, k, v, q, tables, lens, qsl).cpu())  # fmt: skip


def test_index_checks_take_lists_and_tensors_alike_and_read_only_used_blocks() -> None:
    # The checks' short ways (a list of slots read in Python, a block table whose every
    # entry lies in the pool) refuse what the long ways refuse, with the same messages.
    from workers.checks import check_attend, check_write

    kv = torch.zeros(3, 2, 16)
    for form in (list, torch.tensor):
        assert check_write(LAYOUT, 8, 0, form([-1, 5, 31]), kv, kv).tolist() == [-1, 5, 31]
        with pytest.raises(InvalidWorkerRequest, match="holds slot 32, outside the pool's 32"):
            check_write(LAYOUT, 8, 0, form([-1, 32, 3]), kv, kv)
        with pytest.raises(InvalidWorkerRequest, match="names one slot more than once"):
            check_write(LAYOUT, 8, 0, form([4, -1, 4]), kv, kv)
    q = torch.zeros(2, 4, 16)
    lens, starts = torch.tensor([5, 1]), torch.tensor([0, 1, 2])
    # Entries past a row's used blocks (ceil(seq_len / block_size) of them) are not read.
    used = torch.tensor([[3, 7, -5], [0, 99, 99]], dtype=torch.int32)
    check_attend(LAYOUT, 8, 0, q, used, lens, starts)
    for bad, named in (([[3, 8, 0], [0, 0, 0]], "block_tables[0, 1] = 8"),
                       ([[3, 7, 0], [-1, 0, 0]], "block_tables[1, 0] = -1")):  # fmt: skip
        with pytest.raises(InvalidWorkerRequest, match=re.escape(named)):
            check_attend(LAYOUT, 8, 0, q, torch.tensor(bad), lens, starts)
    with pytest.raises(InvalidWorkerRequest, match="sequence 1 has more query rows"):
        check_attend(LAYOUT, 8, 0, q, used, torch.tensor([5, 0]), starts)


def test_finite_guard_reads_back_to_back_inputs_as_one_span():
    # A lease client's staging holds key, value and query back to back: the guard sums
    # them as one span, and a NaN in any of the three still masks the write.
    from workers.delivery import _adjacent_span, guard_finite

    flat = torch.randn(2 * 6 + 10)
    k, v, q = flat[:6].view(3, 2), flat[6:12].view(3, 2), flat[12:].view(5, 2)
    span = _adjacent_span((k, v, q))
    assert span is not None and span.data_ptr() == flat.data_ptr() and span.numel() == 22
    assert _adjacent_span((v, k, q)) is None  # out of order
    assert _adjacent_span((k, v, flat[13:21].view(4, 2))) is None  # a gap
    slots = torch.arange(3)
    for t in (k, v, q):
        t.view(-1)[1] = float("nan")
        masked, finite = guard_finite(slots, k, v, q, True)
        assert finite is not None and not bool(finite) and masked.tolist() == [-1, -1, -1]
        t.view(-1)[1] = 0.0
    masked, finite = guard_finite(slots, k, v, q, True)
    assert finite is not None and bool(finite) and masked.tolist() == [0, 1, 2]


def test_a_bound_cpu_step_writes_and_fingerprints_as_calls_do_and_refuses_non_finite():
    # A planned step's layers on fixed buffers (a lease client's path): the CPU pool reads
    # the finite flag on the spot and records fingerprints at places derived once per
    # step; data, fingerprints and outputs equal per-layer calls', and a layer with a NaN
    # input writes nothing (data and fingerprints as they were) and says so.
    bound = filled_pool(seed=15, fingerprints=True)
    calls = filled_pool(seed=15, fingerprints=True)
    slots, _, _, _, tables, lens, qsl = _decode_args(bound, seed=16)
    step = bound.step_metadata(tables, lens, qsl, slots.tolist(), 4)
    flat = torch.empty(3 * 2 * 16 * 2 + 3 * 4 * 16)  # key, value, query back to back
    k, v = flat[:96].view(3, 2, 16), flat[96:192].view(3, 2, 16)
    q = flat[192:].view(3, 4, 16)
    layers = bound.bind_step(step, k, v, q)
    gen = torch.Generator().manual_seed(17)
    for layer in range(LAYOUT.num_layers):
        flat.copy_(torch.randn(flat.shape, generator=gen))
        if layer == 2:
            k[1, 0, 3] = float("nan")
        before = (bound.data.clone(), bound.fingerprint_sums.clone())
        out, finite = layers.run(layer)
        assert finite is not None and bool(finite) == (layer != 2)
        if layer == 2:
            assert torch.equal(bound.data.nan_to_num(7.0), before[0].nan_to_num(7.0))
            assert torch.equal(bound.fingerprint_sums, before[1])
            continue
        ref = write_and_attend(calls, layer, slots, k, v, q, tables, lens, qsl, check_finite=True)
        assert torch.allclose(out, ref, atol=1e-6)
        assert torch.equal(bound.data[:, layer], calls.data[:, layer])
        assert torch.allclose(bound.fingerprint_sums, calls.fingerprint_sums, rtol=1e-12)
        # The filled pools' other slots were never fingerprinted (both report them).
        bad = bound.reference_attend(layer, q, tables, lens, qsl)[2]
        assert bad == calls.reference_attend(layer, q, tables, lens, qsl)[2]
        written = {(int(s) // 4, int(s) % 4) for s in slots}
        assert not written & {(b.block, b.offset) for b in bad}
