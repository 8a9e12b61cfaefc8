"""Every causal-LM family of the installed transformers, through a real service.

For each family (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) a tiny random float32 model
(:mod:`tests.transformers_families`) must either be refused by ``ServiceModel(...)`` with
a message naming the model, or generate greedily, for a left-padded batch of two prompts,
exactly the tokens of transformers' own generation through a real coordinator and gRPC
server on a loopback port (in-process KV pools, one service per layout). Generating other
tokens without an error is the failure this module exists to catch. Families whose tiny
config or model cannot be built here are skipped with the reason.
"""

from __future__ import annotations

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
    ModelLayout,
    ServiceModel,
    SessionConfig,
    model_layout,
)
from tests.transformers_families import FAMILIES, FamilyUnavailable, tiny_model

NEW_TOKENS = 5
LOGIT_ATOL = 1e-3  # float32 model and float32 KV on both sides


class Services:
    """One embedded service per model layout, started on first use."""

    def __init__(self) -> None:
        self._services: dict[ModelLayout, EmbeddedService] = {}

    def address(self, layout: ModelLayout) -> str:
        svc = self._services.get(layout)
        if svc is None:
            config = ServiceConfig(
                layout=LayoutConfig(
                    num_layers=layout.num_layers,
                    num_kv_heads=layout.num_kv_heads,
                    head_dim=layout.head_dim,
                    block_size=16,
                    dtype="float32",
                ),
                workers=WorkersConfig(num_workers=1, blocks_per_worker=64, in_process=True),
                server=ServerConfig(host="127.0.0.1", port=0),
                metrics=MetricsConfig(enabled=False),
                log_level="WARNING",
            )
            svc = self._services[layout] = EmbeddedService(config).__enter__()
        return svc.address

    def close(self) -> None:
        for svc in self._services.values():
            svc.__exit__(None, None, None)


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    s = Services()
    try:
        yield s
    finally:
        s.close()


def _batch(vocab: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of 9 and 5 tokens: (input_ids, attention_mask) ``[2, 9]``."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, min(vocab, 120), (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :4] = pad
    mask[1, :4] = 0
    return ids, mask


def _generate_kwargs(pad: int) -> dict[str, Any]:
    return dict(
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=None,
        return_dict_in_generate=True,
        output_logits=True,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_refused_or_generates_the_same_tokens(family: str, services: Services) -> None:
    try:
        model = tiny_model(family, seed=3)
    except FamilyUnavailable as e:
        pytest.skip(f"{family}: {e}")
    reference = copy.deepcopy(model)
    try:
        layout = model_layout(model)
    except ValueError as refused:
        assert type(model).__name__ in str(refused)
        return
    pad = 0
    ids, mask = _batch(int(model.config.get_text_config(decoder=True).vocab_size), pad)
    with KVCacheClient(services.address(layout), timeout_s=30) as client:
        try:
            served = ServiceModel(model, client)
        except ValueError as refused:
            # Refused up front: the message names the model class and its model_type.
            assert type(model).__name__ in str(refused), refused
            assert repr(model.config.model_type) in str(refused), refused
            assert model.config._attn_implementation != "kvcache_service"
            return
        with torch.no_grad():
            ref = reference.generate(input_ids=ids, attention_mask=mask, **_generate_kwargs(pad))
            ours, _ = served.generate(
                ids, mask, SessionConfig(reuse_prefix=False), **_generate_kwargs(pad)
            )
        served.detach()
    assert torch.equal(ours.sequences, ref.sequences), (family, ours.sequences, ref.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(ours.logits, ref.logits, strict=True))
    assert worst < LOGIT_ATOL, f"{family}: logits differ by up to {worst}"
