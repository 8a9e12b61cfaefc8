"""On a CUDA device: a larger Llama-shaped model in bf16 generating through the service.

bf16 greedy decoding of a random model can legitimately part ways after a near-tie, so the
comparison is teacher-forced: the service run is fed the tokens transformers' own run
generated, step by step, and every step's logits must match transformers' own within bf16
tolerance; the greedy choice must agree wherever the reference's top-2 margin is clear.
Throughput figures are `benchmarks/bench_transformers.py --h200`'s job.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

transformers = pytest.importorskip("transformers")

from cache_service.client import KVCacheClient  # noqa: E402
from cache_service.config import (  # noqa: E402
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.integrations.embedded import EmbeddedService  # noqa: E402
from cache_service.integrations.transformers import ServiceModel  # noqa: E402

pytestmark = pytest.mark.gpu

NEW_TOKENS = 32
# Largest logit difference allowed, relative to the reference step's largest |logit|. bf16
# keeps 8 mantissa bits (relative step 2**-8 = 0.4 %); the two runs round differently in
# every layer (Triton paged kernel vs. SDPA), so allow a few steps' worth.
REL_TOL = 3e-2


def teacher_forced_logits(
    device: str, num_layers: int = 8, hidden: int = 1024, q_heads: int = 16, kv_heads: int = 4
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(reference per-step logits, service per-step logits), each ``[batch, vocab]`` float32."""
    torch.manual_seed(0)
    head_dim = hidden // q_heads
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).to(device).eval()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")

    g = torch.Generator().manual_seed(1)
    lengths = [200, 37, 129, 64]
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = torch.randint(1, 4096, (n,), generator=g)
        mask[b, width - n :] = 1
    with torch.no_grad():
        ref = reference.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )

    service_config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype="bfloat16"
        ),
        workers=WorkersConfig(num_workers=1, blocks_per_worker=512, device=device, in_process=True),
        server=ServerConfig(port=0),
        metrics=MetricsConfig(enabled=False),
        log_level="WARNING",
    )
    ours: list[torch.Tensor] = []
    with EmbeddedService(service_config) as svc, KVCacheClient(svc.address) as client:
        served = ServiceModel(model, client)
        with served.session(ids, mask) as session, torch.no_grad():
            step_ids, step_mask = ids.to(device), mask.to(device)
            for i in range(NEW_TOKENS):
                out: Any = model(
                    input_ids=step_ids, attention_mask=step_mask, past_key_values=session.cache
                )
                ours.append(out.logits[:, -1].float().cpu())
                # Feed the reference's token, whatever ours would have chosen.
                step_ids = ref.sequences[:, width + i : width + i + 1]
                step_mask = torch.cat([step_mask, torch.ones_like(step_ids)], dim=1)
    return [x.float().cpu() for x in ref.logits], ours


def test_bf16_llama_through_the_service_matches_transformers_step_by_step() -> None:
    ref, ours = teacher_forced_logits("cuda")
    assert len(ours) == len(ref) == NEW_TOKENS
    worst = 0.0
    for step, (r, o) in enumerate(zip(ref, ours, strict=True)):
        rel = ((o - r).abs().max() / r.abs().max()).item()
        worst = max(worst, rel)
        assert rel < REL_TOL, f"step {step}: logits differ by {rel:.2%} of the largest logit"
        top2 = r.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * REL_TOL * r.abs().max()
        assert torch.equal(o.argmax(-1)[clear], r.argmax(-1)[clear]), f"step {step}"
    print(f"worst relative logit difference over {NEW_TOKENS} steps: {worst:.3%}")
