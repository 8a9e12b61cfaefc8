"""What a transformers model's config says about attention the service cannot compute.

The service computes plain causal softmax attention with scale ``head_dim ** -0.5`` and
contiguous GQA groups, with no bias, no sinks, no softcap and no window. This module reads
a model's config (and its parameters' names) for the features that make a model's attention
differ from that, so :class:`~cache_service.integrations.transformers.ServiceModel` can
refuse the model by name before any forward. What a config does not say is caught by the
construction probe (:mod:`cache_service.integrations.model_probe`).

Pure inspection: reads the config and module attributes, runs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AttentionSpan", "attention_span", "describe_model", "unsupported_features"]

# Layer types whose attention the service computes (a window/chunk is handled by bounding
# the sequence length, see attention_span).
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "global"}

# Families whose attention biases scores by distance (ALiBi) without a config flag saying so.
_ALIBI_MODEL_TYPES = {"bloom", "mpt", "jais", "baichuan"}

# Families built of recurrent / state-space layers (all or some layers are not attention).
_RECURRENT_MODEL_TYPES = {
    "mamba",
    "mamba2",
    "falcon_mamba",
    "rwkv",
    "recurrent_gemma",
    "xlstm",
    "jamba",
    "zamba",
    "zamba2",
    "falcon_h1",
    "bamba",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "nemotron_h",
    "plamo2",
    "minimax",
    "qwen3_next",
    "mimi",
}


def describe_model(model: torch.nn.Module) -> str:
    """``ClassName (model_type 'x')`` for error messages."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type {model_type!r})"


def _text_config(model: torch.nn.Module) -> Any:
    cfg = model.config
    getter = getattr(cfg, "get_text_config", None)
    return getter(decoder=True) if getter is not None else cfg


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """``getattr(cfg, name, default)``, also ``default`` where the config refuses a global
    value (per-layer attributes raise on access)."""
    try:
        return getattr(cfg, name, default)
    except Exception:
        return default


def unsupported_features(model: torch.nn.Module) -> list[str]:
    """Attention features of ``model`` the service cannot compute, each named with its source.

    Returns:
        Human-readable feature descriptions (empty when the config shows none).
    """
    try:
        cfg = _text_config(model)
    except Exception as e:
        return [f"no decoder text config ({type(e).__name__}: {e})"]
    top = model.config
    found: list[str] = []
    if _get(top, "is_encoder_decoder", False):
        found.append("encoder-decoder attention (config.is_encoder_decoder)")
    model_type = str(_get(cfg, "model_type", "") or "")
    if model_type in _RECURRENT_MODEL_TYPES or str(_get(top, "model_type", "")) in (
        _RECURRENT_MODEL_TYPES
    ):
        found.append(
            f"recurrent / hybrid layers (model_type {model_type!r}: some layers are not attention)"
        )
    layer_types = _get(cfg, "layer_types", None) or []
    other = sorted({str(t) for t in layer_types if str(t) not in _ATTENTION_LAYER_TYPES})
    if other:
        found.append(f"non-attention layers (config.layer_types has {other})")
    if (
        model_type in _ALIBI_MODEL_TYPES
        or _get(cfg, "alibi", False)
        or _get(cfg, "position_embedding_type", None) == "alibi"
        or getattr(_get(cfg, "attn_config", None), "alibi", False)
        or (isinstance(_get(cfg, "attn_config", None), dict) and cfg.attn_config.get("alibi"))
    ):
        found.append("ALiBi position biases")
    if _get(cfg, "kv_lora_rank", None) or _get(cfg, "qk_rope_head_dim", None):
        found.append("multi-head latent attention (MLA: config.kv_lora_rank / qk_rope_head_dim)")
    v_dim = _get(cfg, "v_head_dim", None)
    qk_dim = _get(cfg, "head_dim", None)
    if v_dim and qk_dim and v_dim != qk_dim:
        found.append(f"value head_dim {v_dim} differs from key head_dim {qk_dim}")
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if _get(cfg, name, None):
            found.append(f"attention logit softcapping (config.{name}={_get(cfg, name)})")
    if _get(cfg, "is_causal", True) is False:
        found.append("non-causal attention (config.is_causal=False)")
    sinks = sorted(
        {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters() if _is_sink(name)}
    )
    if sinks or _get(cfg, "use_sink", False) or _get(cfg, "attention_sinks", None):
        found.append("attention sinks (learned per-head softmax sink terms)")
    return found


def _is_sink(parameter_name: str) -> bool:
    leaf = parameter_name.rsplit(".", 1)[-1]
    return leaf in {"sinks", "sink", "s_aux", "attn_sinks"}


@dataclass(frozen=True)
class AttentionSpan:
    """The smallest sliding window or attention chunk of a model, in tokens.

    Full causal attention equals windowed/chunked attention while every sequence holds at
    most ``size`` tokens, so the integration keeps sequences within it.

    Attributes:
        size: tokens a sequence may hold (prompt + generated).
        source: the config field it comes from, for messages.
    """

    size: int
    source: str


# Config fields that bound how far back a token attends in some layer.
_SPAN_FIELDS = ("sliding_window", "attention_chunk_size", "window_size", "local_window_size")


def attention_span(model: torch.nn.Module) -> AttentionSpan | None:
    """The smallest window/chunk any layer of ``model`` may use, or None for full attention.

    Conservative: a field counts unless the config switches it off (``use_sliding_window``
    False, or ``layer_types`` listing no sliding/chunked layer for it).
    """
    cfg = _text_config(model)
    layer_types = {str(t) for t in (_get(cfg, "layer_types", None) or [])}
    spans: list[AttentionSpan] = []
    for name in _SPAN_FIELDS:
        value = _get(cfg, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if name == "sliding_window" and _get(cfg, "use_sliding_window", True) is False:
            continue
        if layer_types and layer_types <= {"full_attention"}:
            continue  # every layer is declared full attention
        spans.append(AttentionSpan(int(value), f"config.{name}"))
    return min(spans, key=lambda s: s.size) if spans else None
