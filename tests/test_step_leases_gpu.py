"""On a CUDA device: a model generating through the service with step leases, every layer
run in the model's process on the worker's pool: `kvcache serve` in another process (the
pool mapped through CUDA IPC, the streams ordered by interprocess events), or the service
embedded in the model's process (the pool's very tensors).

float32 throughout, so the comparison with transformers' own cache is exact in the tokens
and close in the logits; the run must have sent most layers under leases (not fallen back
to calls).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
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
from cache_service.integrations.transformers import ServiceModel, SessionConfig  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

LAYERS, HIDDEN, Q_HEADS, KV_HEADS = 4, 256, 8, 2
NEW_TOKENS = 24


@contextlib.contextmanager
def served_on_cuda() -> Iterator[str]:
    """`kvcache serve` on the GPU in a process of its own; yields its address."""
    root = Path(__file__).resolve().parent.parent
    command = [
        sys.executable, "-m", "cache_service.cli", "serve", "--port", "0",
        "--metrics-port", "0", "--log-level", "INFO", "--log-format", "json",
        "--num-layers", str(LAYERS), "--num-kv-heads", str(KV_HEADS),
        "--head-dim", str(HIDDEN // Q_HEADS), "--block-size", "16", "--dtype", "float32",
        "--num-workers", "1", "--blocks-per-worker", "512", "--device", "cuda", "--in-process",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=drain, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=180)
            if line is None:
                raise RuntimeError("kvcache serve exited before serving")
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("msg") == "serving":
                    break
        yield record["address"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def embedded_on_cuda() -> Iterator[str]:
    """The service in this process, its pool on the GPU; yields its address."""
    config = ServiceConfig(
        layout=LayoutConfig(
            num_layers=LAYERS,
            num_kv_heads=KV_HEADS,
            head_dim=HIDDEN // Q_HEADS,
            block_size=16,
            dtype="float32",
        ),
        workers=WorkersConfig(num_workers=1, blocks_per_worker=512, device="cuda", in_process=True),
        server=ServerConfig(port=0),
        metrics=MetricsConfig(port=0),
        log_level="WARNING",
    )
    with EmbeddedService(config) as service:
        yield service.address


@pytest.mark.parametrize("where", [served_on_cuda, embedded_on_cuda], ids=["serve", "embedded"])
def test_leased_generation_on_a_gpu_equals_transformers(where) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // Q_HEADS,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(config).to("cuda").eval()
    own = copy.deepcopy(model)
    own.set_attn_implementation("sdpa")
    batch, width = 4, 40
    ids = torch.randint(1, 1024, (batch, width))
    mask = torch.ones_like(ids)
    settings = dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.no_grad():
        ref = own.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), **settings)
    with where() as address, KVCacheClient(address) as client:
        served = ServiceModel(model, client)
        with torch.no_grad():
            ours, stats = served.generate(ids, mask, SessionConfig(reuse_prefix=False), **settings)
        served.detach()
    assert torch.equal(ours.sequences.cpu(), ref.sequences.cpu())
    worst = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits, strict=True))
    assert worst < 1e-3, worst
    # The unpadded prefill and every decode step: planned once, every layer leased; the
    # decode steps up to SessionConfig.lease_steps to a lease (their CUDA graphs replayed
    # on each step's metadata).
    assert stats.leased_calls == LAYERS * NEW_TOKENS
    assert stats.rpc_calls == 0
    assert stats.lease_forwards == NEW_TOKENS
    assert stats.leases == 1 + -(-(NEW_TOKENS - 1) // SessionConfig.lease_steps)
