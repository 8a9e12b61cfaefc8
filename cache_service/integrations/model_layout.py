"""A transformers model's attention shape and identity, as the service sees them.

:func:`model_layout` reads the shape the service's layout must match,
:func:`check_service_layout` compares it with a running service, and
:func:`model_namespace` names the model's weights for the prefix cache (so two models never
share cached prefixes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from cache_service.integrations.model_features import describe_model

# The service's KV dtype names (``ServiceInfo.layout.dtype``) and the torch dtypes that travel.
KV_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelLayout:
    """The attention shape of a model, as the service's layout must match it.

    Attributes:
        num_layers: attention layers (service layers ``0 .. num_layers - 1``).
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (``num_q_heads`` is a multiple: GQA/MQA).
        head_dim: channels per head.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def model_layout(model: PreTrainedModel) -> ModelLayout:
    """Read the attention shape of a decoder-only transformers model from its config."""
    cfg = model.config.get_text_config(decoder=True)
    try:
        num_q = int(cfg.num_attention_heads)
        num_layers = int(cfg.num_hidden_layers)
        num_kv = int(getattr(cfg, "num_key_value_heads", None) or num_q)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_q
    except Exception as e:
        raise ValueError(
            f"{describe_model(model)}: its config gives no single attention shape (layers, "
            f"heads, head_dim) for the service's layout ({type(e).__name__}: {e})"
        ) from e
    return ModelLayout(
        num_layers=num_layers,
        num_q_heads=num_q,
        num_kv_heads=num_kv,
        head_dim=int(head_dim),
    )


_SAMPLES_PER_TENSOR = 64  # strided elements of each weight tensor in the model fingerprint


def model_namespace(model: PreTrainedModel) -> str:
    """A prefix-cache namespace naming this model: ``"hf-model:<hex sha256 prefix>"``.

    Digests the config (``to_json_string``), ``name_or_path`` and, for every parameter
    and buffer, its name, shape, dtype and up to 64 evenly strided elements, so two models
    of one config with different weights (two random initialisations, two fine-tunes)
    differ, while the same weights give the same namespace in any process. Costs one small
    gather per tensor (about a millisecond per hundred tensors on a GPU).
    """
    h = hashlib.sha256()
    config = model.config
    h.update(config.to_json_string(use_diff=False).encode())
    h.update(str(getattr(config, "name_or_path", "")).encode())
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::stride][:_SAMPLES_PER_TENSOR].to("cpu", torch.float64)
            h.update(sample.numpy().tobytes())
    return "hf-model:" + h.hexdigest()[:48]


def check_service_layout(info: Any, layout: ModelLayout) -> torch.dtype:
    """Compare the service's layout (``client.info()``) with the model's; return its KV dtype."""
    svc = getattr(info, "layout", info)
    mismatches = [
        f"{name}: service {getattr(svc, name, None)} != model {want}"
        for name, want in (
            ("num_layers", layout.num_layers),
            ("num_kv_heads", layout.num_kv_heads),
            ("head_dim", layout.head_dim),
        )
        if getattr(svc, name, None) != want
    ]
    if mismatches:
        raise ValueError("the service layout does not fit the model: " + "; ".join(mismatches))
    dtype = getattr(svc, "dtype", None)
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown service KV dtype {dtype!r}")
    return KV_DTYPES[dtype]
