"""The warm-up of a CUDA pool's decode kernels: which launches it makes (pure), that its
configuration is checked, and (on a GPU) that a warmed pool serves decode shapes without
compiling and gives the same results."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from round_calls import attend

from cache_service.config import ConfigError, ServiceConfig
from kernels.attention import choose_config
from kernels.validation import AttentionProblem
from workers.config import PoolConfig
from workers.kernel_warmup import (
    TABLE_WIDTH_MULTIPLE,
    decode_warm_up_launches,
    dummy_decode_inputs,
    table_width,
)
from workers.layout import KVLayout
from workers.pool import KVPool

LLAMA = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def _config(layout: KVLayout, hq: int, seqs: int, width: int, sm: int):
    problem = AttentionProblem(
        num_q_tokens=seqs,
        num_q_heads=hq,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_blocks=1,
        block_size=layout.block_size,
        num_seqs=seqs,
        max_blocks=width,
    )
    return choose_config(problem, layout.torch_dtype(), sm)


def test_one_launch_per_distinct_configuration_each_the_smallest() -> None:
    launches = decode_warm_up_launches(LLAMA, 32, max_batch=64, sm_count=132, max_context=8192)
    configs = [launch.config for launch in launches]
    assert len(set(configs)) == len(configs)
    # Every configuration a served decode shape picks is among them.
    for seqs in (1, 3, 8, 17, 48, 64):
        for width in (16, 48, 144, 512):
            assert _config(LLAMA, 32, seqs, width, 132) in configs, (seqs, width)
    for launch in launches:
        # The launch picks the configuration it stands for, with the fewest sequences.
        width = table_width(launch.context, LLAMA.block_size)
        assert _config(LLAMA, 32, launch.num_seqs, width, 132) == launch.config
        assert width * LLAMA.block_size == launch.context
        for fewer in range(1, launch.num_seqs):
            for w in range(TABLE_WIDTH_MULTIPLE, 8192 // 16 + 1, TABLE_WIDTH_MULTIPLE):
                assert _config(LLAMA, 32, fewer, w, 132) != launch.config
    # Both unsplit and split launches, so the merge variants are warmed too.
    assert {launch.config.num_partitions > 1 for launch in launches} == {True, False}


def test_dummy_inputs_read_block_0_only() -> None:
    (launch,) = [la for la in decode_warm_up_launches(LLAMA, 32, 4, 132, 4096) if la.num_seqs == 1][
        :1
    ]
    q, tables, lens, starts = dummy_decode_inputs(launch, LLAMA, torch.device("cpu"))
    assert q.shape == (1, 32, 128) and q.dtype == torch.bfloat16 and not q.any()
    assert tables.dtype == torch.int32 and not tables.any()
    assert tables.shape[1] % TABLE_WIDTH_MULTIPLE == 0
    assert tables.shape[1] * LLAMA.block_size >= int(lens[0]) == launch.context
    assert starts.tolist() == [0, 1]


@pytest.mark.parametrize(
    ("heads", "batch", "match"),
    [
        ((30,), 8, "multiples"),
        ((0,), 8, "multiples"),
        ((True,), 8, "multiples"),
        ((32,), 0, "max_batch"),
    ],
)
def test_bad_warm_up_settings_are_refused(heads, batch, match) -> None:
    with pytest.raises(ValueError, match=match):
        PoolConfig(LLAMA, num_blocks=8, warm_up_query_heads=heads, warm_up_max_batch=batch)
    if batch > 0:
        with pytest.raises(ValueError, match="positive multiple"):
            decode_warm_up_launches(LLAMA, heads[0] if heads[0] else 0, 4, 132)


def test_service_config_takes_a_list_of_query_heads() -> None:
    base = ServiceConfig()
    config = base.with_overrides(
        {"layout.num_kv_heads": 8, "workers.warm_up_query_heads": [32, 64]}
    )
    assert config.workers.warm_up_query_heads == (32, 64)
    with pytest.raises(ConfigError, match=r"multiples of layout\.num_kv_heads"):
        base.with_overrides({"layout.num_kv_heads": 8, "workers.warm_up_query_heads": [12]})
    with pytest.raises(ConfigError, match="must be a list"):
        base.with_overrides({"workers.warm_up_query_heads": 32})
    with pytest.raises(ConfigError, match="positive integers"):
        base.with_overrides({"workers.warm_up_query_heads": [-8]})


def test_a_cpu_pool_has_nothing_to_warm() -> None:
    pool = KVPool.serving(
        dataclasses.replace(
            PoolConfig(KVLayout(2, 2, 16, 4, "float32"), num_blocks=8), warm_up_query_heads=(4,)
        ),
        "cpu",
    )
    assert pool.warm_up((4,), 8) == 0


@pytest.mark.gpu
def test_a_warmed_pool_serves_decode_without_compiling() -> None:
    import kernels.attention as ka

    layout = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    config = PoolConfig(layout, num_blocks=512, warm_up_query_heads=(32,), warm_up_max_batch=64)
    pool = KVPool.serving(config, "cuda")
    sm = ka.num_sms(torch.device("cuda"))
    assert pool.warm_up((32,), 64) == len(decode_warm_up_launches(layout, 32, 64, sm))

    def variants() -> int:
        # Triton 3.x keeps (kernel_cache, key_cache, target, backend, binder) per device.
        caches = getattr(ka._paged_attention_kernel, "device_caches", None)
        if not caches or not all(isinstance(c[0], dict) for c in caches.values()):
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        return sum(len(c[0]) for c in caches.values())

    before = variants()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for seqs in (1, 5, 8, 24, 40, 64):
        for ctx in (100, 700, 2100):
            width = table_width(ctx, layout.block_size)  # as served tables are padded
            tables = torch.randint(
                0, 512, (seqs, width), dtype=torch.int32, device="cuda", generator=gen
            )
            q = torch.randn(seqs, 32, 128, dtype=torch.bfloat16, device="cuda", generator=gen)
            lens = torch.full((seqs,), ctx, dtype=torch.int32, device="cuda")
            qsl = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
            out = attend(pool, 0, q, tables, lens, qsl)
            assert torch.isfinite(out.float()).all()
    assert variants() == before  # every decode shape found its kernel compiled
