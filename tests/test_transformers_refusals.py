"""Models whose attention the service does not compute: refused up front, by name.

Issue 35 items 1, 2 and 8: sinks were dropped, mask-only windows and chunks became full
attention, ALiBi / MLA models were accepted and failed at the first forward, StableLM was
told to use ServiceModel (which it did), LFM2 failed inside transformers, Mistral's window
was refused part way through generation. Each case runs against a real service (a
coordinator and gRPC server on a loopback port, in-process KV pools).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

pytest.importorskip("transformers")

from cache_service.client import KVCacheClient
from cache_service.config import (
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.integrations.embedded import EmbeddedService
from cache_service.integrations.transformers import (
    SERVICE_ATTENTION,
    ServiceModel,
)
from tests.transformers_families import tiny_model


def _service(num_kv_heads: int) -> EmbeddedService:
    config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=2, num_kv_heads=num_kv_heads, head_dim=16, block_size=16, dtype="float32"
        ),
        workers=WorkersConfig(num_workers=1, blocks_per_worker=64, in_process=True),
        server=ServerConfig(host="127.0.0.1", port=0),
        metrics=MetricsConfig(enabled=False),
        log_level="WARNING",
    )
    return EmbeddedService(config)


@pytest.fixture(scope="module")
def service() -> Iterator[EmbeddedService]:
    with _service(2) as svc:  # the tiny models' 4 query / 2 KV heads
        yield svc


@pytest.fixture(scope="module")
def mha_service() -> Iterator[EmbeddedService]:
    with _service(4) as svc:  # families without GQA: 4 KV heads
        yield svc


@pytest.fixture
def client(service: EmbeddedService) -> Iterator[KVCacheClient]:
    with KVCacheClient(service.address, timeout_s=30) as c:
        yield c


def _refused(model: Any, client: KVCacheClient, *words: str) -> str:
    """ServiceModel(model) must raise ValueError naming the model and each of `words`,
    and leave the model as it was (its own attention, no hooks)."""
    before = model.config._attn_implementation
    with pytest.raises(ValueError) as info:
        ServiceModel(model, client)
    message = str(info.value)
    assert type(model).__name__ in message and repr(model.config.model_type) in message
    for word in words:
        assert word.lower() in message.lower(), message
    assert model.config._attn_implementation == before != SERVICE_ATTENTION
    assert not model._forward_pre_hooks and not model._forward_hooks
    return message


def _prompt(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(1, 120, (n,), generator=g)
        mask[b, width - n :] = 1
    return ids, mask


def test_attention_sinks_are_refused(client: KVCacheClient) -> None:
    _refused(tiny_model("gpt_oss", sliding_window=64), client, "sinks")
    _refused(tiny_model("granite_swa"), client, "sinks")


def test_alibi_and_mla_models_are_refused_at_construction(client: KVCacheClient) -> None:
    _refused(tiny_model("bloom"), client, "ALiBi")
    _refused(tiny_model("falcon", alibi=True), client, "ALiBi")
    _refused(tiny_model("mpt"), client, "ALiBi")
    deepseek = tiny_model(
        "deepseek_v3",
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
    )
    _refused(deepseek, client, "MLA")


def test_stablelm_is_told_its_layers_do_not_pass_keyword_arguments(
    client: KVCacheClient,
) -> None:
    message = _refused(tiny_model("stablelm"), client, "keyword arguments")
    assert "run the model through ServiceModel" not in message


def test_hybrid_models_are_refused_by_service_model(client: KVCacheClient) -> None:
    _refused(tiny_model("lfm2"), client, "recurrent")


@pytest.mark.parametrize(
    ("family", "fields"),
    [
        ("mistral", {"sliding_window": 16}),
        (
            "qwen2_moe",
            {
                "use_sliding_window": True,
                "sliding_window": 16,
                "max_window_layers": 2,
                "layer_types": None,
            },
        ),
        ("phimoe", {"sliding_window": 16}),
        ("llama4_text", {"attention_chunk_size": 16}),
    ],
)
def test_windows_and_chunks_refuse_up_front_and_are_exact_within(
    family: str, fields: dict[str, Any], client: KVCacheClient
) -> None:
    model = tiny_model(family, seed=5, **fields)
    reference = copy.deepcopy(model)
    served = ServiceModel(model, client)
    assert served.span is not None and served.span.size == 16
    ids, mask = _prompt([10, 7])
    active = client.stats().active_sequences

    # Prompt 10 + 8 new > 16: refused before any sequence or forward.
    with pytest.raises(ValueError, match=r"16 tokens.*10 tokens plus up to 8 new"):
        served.generate(ids, mask, max_new_tokens=8, do_sample=False)
    long_ids, long_mask = _prompt([17])
    with pytest.raises(ValueError, match="17 tokens"):
        served.session(long_ids, long_mask)
    with served.session(ids, mask) as s, pytest.raises(ValueError, match="16 tokens"):
        s.generate(max_new_tokens=7, do_sample=False)
    assert client.stats().active_sequences == active

    # Within the window: token-identical to transformers (windowed = full attention).
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref = reference.generate(input_ids=ids, attention_mask=mask, **kwargs)
        ours, _ = served.generate(ids, mask, **kwargs)
    assert torch.equal(ours, ref)


def test_each_forward_still_checks_the_window(client: KVCacheClient) -> None:
    model = tiny_model("mistral", seed=6, sliding_window=16)
    served = ServiceModel(model, client)
    ids, mask = _prompt([14])
    with served.session(ids, mask) as s, torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=s.cache)
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        model(input_ids=nxt, attention_mask=mask, past_key_values=s.cache)  # 15 tokens
        nxt = torch.ones_like(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        model(input_ids=nxt, attention_mask=mask, past_key_values=s.cache)  # 16 tokens
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
        with pytest.raises(NotImplementedError, match="16 tokens"):
            model(input_ids=nxt, attention_mask=mask, past_key_values=s.cache)


@pytest.mark.parametrize(("family", "adopts"), [("bart", False), ("llama", True)])
def test_prefixes_are_adopted_only_where_padding_does_not_move_positions(
    family: str, adopts: bool, client: KVCacheClient, mha_service: EmbeddedService
) -> None:
    # BART-style decoders count positions from the first column, padding included: a
    # prefix cached unpadded holds K/V at other positions than the same prompt padded.
    model = tiny_model(family, seed=8)
    reference = copy.deepcopy(model)
    stack = contextlib.ExitStack()
    if family == "bart":
        client = stack.enter_context(KVCacheClient(mha_service.address, timeout_s=30))
    with stack:
        _generate_twice(model, reference, client, adopts)


def _generate_twice(model: Any, reference: Any, client: KVCacheClient, adopts: bool) -> None:
    served = ServiceModel(model, client)
    assert served.padding_moves_positions is not adopts
    first, first_mask = _prompt([20], seed=9)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        served.generate(first, first_mask, **kwargs)
    ids, mask = _prompt([25, 20], seed=10)
    ids[1], mask[1] = 0, 0
    ids[1, 5:], mask[1, 5:] = first[0], 1
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = reference.generate(input_ids=ids, attention_mask=mask, **kwargs)
        ours, stats = served.generate(ids, mask, **kwargs)
    assert torch.equal(ours.sequences, ref.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits, strict=True))
    assert worst < 1e-3, f"logits differ by up to {worst}"
    assert stats.cached_tokens[1] == (16 if adopts else 0)
