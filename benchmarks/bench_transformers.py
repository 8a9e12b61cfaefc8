"""Tokens/s of a transformers model generating through the service vs. its own KV cache.

For each batch size: random prompts of different lengths (left-padded), greedy generation of
``new_tokens`` tokens, timed end to end (prefill + decode) with

* ``own``     - transformers' own attention (sdpa) and DynamicCache, the same weights;
* ``service`` - ``ServiceModel``: every layer's K/V and attention in the service, one
                ``AppendAttend`` RPC per layer per step, fresh sequences (no prefix reuse);
* ``prefix``  - the same prompts again with prefix reuse: the prefill sends only what the
                first service run did not leave cached (whole blocks).

Also reported: the share of the service run spent inside the RPCs, and how many generated
tokens equal the ``own`` run's (bf16 runs may legitimately diverge after a near-tie).
The service is a real gRPC server on a loopback port in this process with in-process KV
pools (``--ray``: pools in Ray actors) on the same device as the model; the server then
shares this process's GIL with the model. ``--target`` uses a service started elsewhere
(e.g. ``kvcache serve``) whose layout fits the profile's model.

Usage (from the repository root):
    .venv/bin/python benchmarks/bench_transformers.py            # CPU, fp32, tiny Llama
    .venv/bin/python benchmarks/bench_transformers.py --smoke    # the same, smallest (seconds)
    python3 benchmarks/bench_transformers.py --h200 --out benchmarks/results
        # CUDA, bf16, a 1.1B-parameter Llama-shaped config (16 layers, 32 query / 8 KV heads)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import transformers

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
    ServiceModel,
    SessionConfig,
    model_layout,
)


@dataclass(frozen=True)
class Profile:
    """Model, service and workload of one benchmark run."""

    name: str
    device: str
    dtype: str  # model and KV dtype: "float32" | "bfloat16" | "float16"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    batch_sizes: tuple[int, ...]
    prompt_len: int  # longest prompt; others are 50..100 % of it
    new_tokens: int
    repeats: int
    blocks_per_worker: int


CPU = Profile(
    name="cpu-smoke",
    device="cpu",
    dtype="float32",
    num_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_q_heads=8,
    num_kv_heads=4,
    head_dim=32,
    vocab_size=1024,
    batch_sizes=(1, 4),
    prompt_len=64,
    new_tokens=32,
    repeats=2,
    blocks_per_worker=256,
)

SMOKE = replace(
    CPU,
    name="cpu-smoke-min",
    num_layers=2,
    batch_sizes=(2,),
    prompt_len=16,
    new_tokens=4,
    repeats=1,
)

H200 = Profile(
    name="h200-llama-1.1b-bf16",
    device="cuda",
    dtype="bfloat16",
    num_layers=16,
    hidden_size=2048,
    intermediate_size=5632,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=32000,
    batch_sizes=(1, 8, 32),
    prompt_len=512,
    new_tokens=128,
    repeats=3,
    blocks_per_worker=8192,
)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(p: Profile) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=p.vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_q_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, p.dtype)).to(p.device)
    return model.eval()


def prompts(p: Profile, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(p.prompt_len // 2, p.prompt_len + 1, (batch,), generator=g).tolist()
    lengths[0] = p.prompt_len
    ids = torch.zeros((batch, p.prompt_len), dtype=torch.long)
    mask = torch.zeros((batch, p.prompt_len), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, p.prompt_len - n :] = torch.randint(1, p.vocab_size, (n,), generator=g)
        mask[b, p.prompt_len - n :] = 1
    return ids, mask


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, device: str) -> tuple[float, Any]:
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def run(p: Profile, use_ray: bool, target: str | None) -> dict[str, Any]:
    external = target is not None
    model = build_model(p)
    own = copy.deepcopy(model)
    own.set_attn_implementation("sdpa")
    layout = model_layout(model)
    service_config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            block_size=16,
            dtype=p.dtype,
        ),
        workers=WorkersConfig(
            num_workers=1,
            blocks_per_worker=p.blocks_per_worker,
            device=p.device,
            in_process=not use_ray,
            ray_num_cpus=2 if use_ray else None,
        ),
        server=ServerConfig(port=0),
        metrics=MetricsConfig(enabled=False),
        log_level="WARNING",
    )
    settings = dict(max_new_tokens=p.new_tokens, min_new_tokens=p.new_tokens, do_sample=False)
    rows = []
    with contextlib.ExitStack() as stack:
        if target is None:
            target = stack.enter_context(EmbeddedService(service_config)).address
        client = stack.enter_context(KVCacheClient(target, timeout_s=120))
        served = ServiceModel(model, client)
        for batch in p.batch_sizes:
            ids, mask = prompts(p, batch, seed=batch)
            dev_ids, dev_mask = ids.to(p.device), mask.to(p.device)
            tokens = batch * p.new_tokens
            with torch.no_grad():
                # Warm-up both paths once (kernels, allocator, gRPC channel).
                own.generate(input_ids=dev_ids, attention_mask=dev_mask, **settings)
                served.generate(ids, mask, SessionConfig(reuse_prefix=False), **settings)
                own_t, svc_t, rpc_t, pre_t = [], [], [], []
                for _ in range(p.repeats):
                    t, ref = timed(
                        functools.partial(
                            own.generate, input_ids=dev_ids, attention_mask=dev_mask, **settings
                        ),
                        p.device,
                    )
                    own_t.append(t)
                    cold = SessionConfig(reuse_prefix=False)
                    t, (out, stats) = timed(
                        functools.partial(served.generate, ids, mask, cold, **settings), p.device
                    )
                    svc_t.append(t)
                    rpc_t.append(stats.rpc_seconds / t)
                    t, (out_prefix, pstats) = timed(
                        functools.partial(served.generate, ids, mask, **settings), p.device
                    )
                    pre_t.append(t)
            width = ids.shape[1]
            same = (out[:, width:].cpu() == ref[:, width:].cpu()).float().mean().item()
            same_prefix = (
                (out_prefix[:, width:].cpu() == out[:, width:].cpu()).float().mean().item()
            )
            row = dict(
                batch=batch,
                prompt_tokens=int(mask.sum()),
                new_tokens=tokens,
                own_tok_s=tokens / statistics.median(own_t),
                service_tok_s=tokens / statistics.median(svc_t),
                prefix_tok_s=tokens / statistics.median(pre_t),
                rpc_share=statistics.median(rpc_t),
                rpcs_per_run=stats.rpc_calls,
                prefix_cached_tokens=sum(pstats.cached_tokens),
                prefix_prefill_tokens=sum(pstats.prefill_tokens),
                same_tokens_as_own=same,
                prefix_same_tokens=same_prefix,
            )
            rows.append(row)
            log(
                f"batch {batch:3d}: own {row['own_tok_s']:8.1f} tok/s | service "
                f"{row['service_tok_s']:8.1f} tok/s ({row['rpc_share']:.0%} in RPCs, "
                f"{row['rpcs_per_run']} RPCs) | prefix reuse {row['prefix_tok_s']:8.1f} tok/s "
                f"(prefill {row['prefix_prefill_tokens']} of {row['prompt_tokens']} tokens) | "
                f"same tokens as own {same:.1%}, prefix run vs service {same_prefix:.1%}"
            )
        served.detach()
    return dict(
        profile=asdict(p),
        service="external " + target
        if external
        else ("ray" if use_ray else "in-process") + " pools",
        rows=rows,
        device=torch.cuda.get_device_name(0)
        if p.device == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
    )


def report(result: dict[str, Any]) -> str:
    """The Markdown table of a `run` result, with its date, command and device first."""
    p = result["profile"]
    lines = [
        f"# transformers through the service ({p['name']})",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- device: {result['device']}; torch {result['torch']}, transformers "
        f"{result['transformers']}, python {result['python']}",
        f"- model: Llama-shaped, {p['num_layers']} layers, {p['num_q_heads']} query / "
        f"{p['num_kv_heads']} KV heads, head_dim {p['head_dim']}, {p['dtype']}; prompts up to "
        f"{p['prompt_len']} tokens, {p['new_tokens']} new tokens, greedy; median of "
        f"{p['repeats']}; service: {result['service']}",
        "",
        "| batch | own tok/s | service tok/s | share in RPCs | prefix reuse tok/s "
        "| prefilled with reuse | same tokens as own |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['own_tok_s']:.1f} | {r['service_tok_s']:.1f} | "
            f"{r['rpc_share']:.0%} | {r['prefix_tok_s']:.1f} | "
            f"{r['prefix_prefill_tokens']} of {r['prompt_tokens']} | {r['same_tokens_as_own']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--h200", action="store_true", help="CUDA bf16 1.1B Llama-shaped config")
    size.add_argument(
        "--smoke", action="store_true", help="the smallest CPU run (seconds; figures mean nothing)"
    )
    parser.add_argument("--ray", action="store_true", help="KV pools in Ray actors")
    parser.add_argument(
        "--target",
        help="host:port of a running service whose layout fits the profile's model "
        "(default: start one in this process)",
    )
    parser.add_argument("--batch-sizes", help="comma-separated, overrides the profile's")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--out", type=Path, help="directory for bench_transformers_<profile>.json and .md"
    )
    args = parser.parse_args()

    p = H200 if args.h200 else SMOKE if args.smoke else CPU
    if p.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--h200 needs a CUDA device")
    if args.batch_sizes:
        p = replace(p, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")))
    for name in ("prompt_len", "new_tokens", "repeats"):
        if getattr(args, name) is not None:
            p = replace(p, **{name: getattr(args, name)})
    log(f"profile {p.name}: {p}")
    result = run(p, args.ray, args.target)
    text = report(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"bench_transformers_{p.name}.json"
        path.write_text(json.dumps(result, indent=2))
        path.with_suffix(".md").write_text(text)
        log(f"wrote {path} and its .md")
    print(text, flush=True)


if __name__ == "__main__":
    main()
