"""A Hugging Face transformers model generating through the KV-cache service.

What a model executor does: build (or load) a causal LM, connect a client, wrap the model in
``ServiceModel`` and call ``generate``. Its attention layers then send each step's new
keys/values and queries to the service (one ``AppendAttend`` RPC per layer for the whole
batch) instead of keeping a KV cache; a second request sharing a prompt prefix computes only
the uncached suffix.

The model here is a small Llama (4 query heads, 2 KV heads) with random weights, so nothing
is downloaded; a real checkpoint (``AutoModelForCausalLM.from_pretrained``) works the same
when the service layout fits it. Without ``--target`` the script starts a service in this
process (a real gRPC server on a loopback port, in-process CPU pools) with a fitting layout.

Usage (from the repository root):
    .venv/bin/python examples/transformers_generate.py [--target HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cache_service.client import KVCacheClient
from cache_service.config import (
    LayoutConfig,
    MetricsConfig,
    ServerConfig,
    ServiceConfig,
    WorkersConfig,
)
from cache_service.integrations.embedded import EmbeddedService
from cache_service.integrations.transformers import ServiceModel, model_layout

PAD = 0


def build_model(seed: int) -> LlamaForCausalLM:
    """A 2-layer Llama with GQA (4 query heads, 2 KV heads, head_dim 16), random weights."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask ``[len(prompts), longest]``, padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.tensor(p)
        mask[b, width - len(p) :] = 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="host:port of a running service (default: start one)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    model = build_model(seed=0)
    reference = copy.deepcopy(model)  # the same weights with transformers' own KV cache
    layout = model_layout(model)

    with contextlib.ExitStack() as stack:
        target = args.target
        if target is None:
            service = stack.enter_context(
                EmbeddedService(
                    ServiceConfig(
                        layout=LayoutConfig(
                            num_layers=layout.num_layers,
                            num_kv_heads=layout.num_kv_heads,
                            head_dim=layout.head_dim,
                            dtype="float32",
                        ),
                        workers=WorkersConfig(num_workers=1, in_process=True),
                        server=ServerConfig(port=0),
                        metrics=MetricsConfig(enabled=False),
                        log_level="WARNING",
                    )
                )
            )
            target = service.address
        client = stack.enter_context(KVCacheClient(target))
        served = ServiceModel(model, client)  # raises if the service layout does not fit
        print(f"service at {target}: {client.info().layout}")

        g = torch.Generator().manual_seed(1)
        system = torch.randint(1, 512, (40,), generator=g).tolist()  # a shared "system prompt"
        first = [system + torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 11, 20)]
        second = [system + torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 8)]
        settings = dict(max_new_tokens=args.new_tokens, do_sample=False)

        for name, prompts in (("request 1", first), ("request 2 (same system prompt)", second)):
            ids, mask = left_pad(prompts)
            with torch.no_grad():
                out, stats = served.generate(ids, mask, **settings)
                own = reference.generate(input_ids=ids, attention_mask=mask, **settings)
            print(f"\n{name}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens")
            print(f"  cached prompt tokens per row : {stats.cached_tokens}")
            print(f"  prefill tokens sent per row  : {stats.prefill_tokens}")
            print(f"  RPCs (one per layer per step): {stats.rpc_calls}, {stats.rpc_seconds:.3f} s")
            print(f"  first row's new tokens       : {out[0, ids.shape[1] :].tolist()}")
            print(f"  same tokens as transformers' own cache: {torch.equal(out, own)}")

        s = client.stats()
        print(
            f"\nservice: prefix hit rate {s.prefix_hit_rate:.2f}, utilization "
            f"{s.utilization:.2f}, fragmentation {s.fragmentation:.2f}, "
            f"active sequences {s.active_sequences}"
        )


if __name__ == "__main__":
    main()
