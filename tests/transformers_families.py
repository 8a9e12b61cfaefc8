"""Tiny random float32 models of every causal-LM family transformers ships.

``tiny_model(model_type)`` builds the family's config with small sizes (2 layers, hidden
64, 4 query / 2 KV heads of 16 channels where the config has those fields, vocab 128) and
the model class ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` names for it. Sizes are set only on
fields the family's default config has (on its text sub-config too), so one recipe serves
every family; a family whose tiny config or model cannot be built raises
:class:`FamilyUnavailable` with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["FAMILIES", "TINY", "FamilyUnavailable", "tiny_model"]

FAMILIES: tuple[str, ...] = tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
"""Every model_type with a causal-LM class in the installed transformers."""

VOCAB = 128
LAYERS = 2
Q_HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
HIDDEN = Q_HEADS * HEAD_DIM

TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "n_embd": HIDDEN,
    "d_model": HIDDEN,
    "n_embed": HIDDEN,
    "embed_dim": HIDDEN,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "n_inner": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "n_layer": LAYERS,
    "n_layers": LAYERS,
    "num_layers": LAYERS,
    "decoder_layers": LAYERS,
    "num_attention_heads": Q_HEADS,
    "n_head": Q_HEADS,
    "n_heads": Q_HEADS,
    "decoder_attention_heads": Q_HEADS,
    "num_key_value_heads": KV_HEADS,
    "n_kv_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "rotary_dim": HEAD_DIM,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "n_ctx": 256,
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "use_cache": True,
}


MAX_PARAMETERS = 40_000_000

_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}

FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # Families whose config needs more than the generic sizes to be tiny and valid.
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "activation_sparsity_pattern": [0.0] * 4,
        "num_kv_shared_layers": 2,  # layers 2-3 reuse layers 0-1's keys/values
        "laurel_rank": 8,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB,
    },
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gemma3": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        "mm_tokens_per_image": 4,
    },
    "deepseek_v2": {**_MLA, "v_head_dim": 16},
    "deepseek_v3": {**_MLA, "v_head_dim": 16},
    "glm4_moe_lite": {**_MLA, "v_head_dim": 16},
    "dots1": {"n_shared_experts": 1},
}


class FamilyUnavailable(Exception):
    """The family's tiny config or model cannot be built here (the message says why)."""


def _has(config: Any, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # per-layer attributes raise on access: the field exists
        return True


def _overrides(default: Any) -> dict[str, Any]:
    kwargs = {k: v for k, v in TINY.items() if _has(default, k)}
    try:
        layer_types = getattr(default, "layer_types", None)
    except Exception:
        layer_types = None
    if isinstance(layer_types, list | tuple) and len(layer_types) > LAYERS:
        kwargs["layer_types"] = list(layer_types[:LAYERS])
    return kwargs


def tiny_config(model_type: str, **fields: Any) -> Any:
    """The family's config with the tiny sizes applied to the fields it has, then ``fields``.

    A size the config refuses (a derived field without a setter, say) is dropped and the
    config built again without it.
    """
    try:
        config_cls = CONFIG_MAPPING[model_type]
        default = config_cls()
        kwargs = _overrides(default)
        text = getattr(default, "text_config", None)
        if text is not None and text is not default:
            kwargs["text_config"] = {**text.to_dict(), **_overrides(text)}
        kwargs.update(fields)
    except Exception as e:
        raise FamilyUnavailable(f"default config: {type(e).__name__}: {e}") from e
    while True:
        try:
            cfg = config_cls(**kwargs)
            cfg.is_decoder = True
            return cfg
        except Exception as e:
            culprit = next(
                (k for k in kwargs if k in str(e) and k != "text_config" and k not in fields),
                None,
            )
            if culprit is None and "layer_types" in kwargs and "layer_types" not in fields:
                culprit = "layer_types"  # derived from other fields in some families
            if culprit is None:
                raise FamilyUnavailable(f"tiny config: {type(e).__name__}: {e}") from e
            del kwargs[culprit]


def tiny_model(model_type: str, seed: int = 0, **fields: Any) -> Any:
    """A float32 random model of the family in eval mode, on CPU (config ``fields`` set
    after the tiny sizes)."""
    cfg = tiny_config(model_type, **{**FAMILY_FIELDS.get(model_type, {}), **fields})
    try:
        model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        with torch.device("meta"):
            size = sum(p.numel() for p in model_cls(cfg).parameters())
    except Exception as e:
        raise FamilyUnavailable(f"tiny model: {type(e).__name__}: {e}") from e
    if size > MAX_PARAMETERS:
        raise FamilyUnavailable(
            f"tiny config is not tiny: {size} parameters (fields the recipe does not set)"
        )
    try:
        torch.manual_seed(seed)
        model = model_cls(cfg).to(torch.float32).eval()
    except Exception as e:
        raise FamilyUnavailable(f"tiny model: {type(e).__name__}: {e}") from e
    return model
