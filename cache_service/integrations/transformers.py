"""Hugging Face transformers causal LMs whose KV cache and attention live in the service.

How a forward pass reaches the service:

1. :class:`ServiceModel` routes every attention layer of the model to
   :func:`service_attention_forward` (registered in transformers' ``AttentionInterface``
   as ``"kvcache_service"``) and installs a forward pre-hook on the model.
2. A :class:`GenerationSession` owns one service sequence per batch row. Its
   :class:`ServiceKVCache` is what ``generate()`` gets as ``past_key_values``: a
   ``transformers.Cache`` that stores nothing and reports how many columns the model has
   already processed, so ``generate()`` feeds only the columns still missing (after a
   prefix hit the prefill starts at the first uncached prompt token).
3. Per forward, the pre-hook reads the step's token ids and attention mask, checks them
   against the session, plans which columns of each row are new to the service (padding
   and cached columns are skipped) and hands the plan to the attention layers through a
   forward keyword.
4. Each attention layer, after the model applied its rotary embedding, sends the new
   keys/values and queries of every row in one RPC (``append_attend_batch`` when every row
   sends as many tokens, as in decode; ``append_attend`` otherwise) and returns the
   service's output in the layout transformers expects ``[batch, q_len, q_heads,
   head_dim]``. Columns that were not sent (padding, cached prefix) get zeros: nothing
   downstream reads them, because later layers' keys for those columns are never sent and
   only the last column's logits pick the next token.

Only the model's own computation (embeddings, projections, rotary, MLP, sampling) stays
local; the cache and the attention are the service's.

Where each part lives: :mod:`.service_model` (:class:`ServiceModel`, its construction checks
and hooks), :mod:`.generation_session` (:class:`GenerationSession`, :class:`SessionConfig`,
:class:`SessionStats`), :mod:`.service_cache` (:class:`ServiceKVCache`),
:mod:`.service_attention` (:func:`service_attention_forward`), :mod:`.model_layout`
(:class:`ModelLayout`, :func:`model_layout`, :func:`model_namespace`). This module gathers
their public names, the ones users import.
"""

from __future__ import annotations

from cache_service.integrations.generation_session import (
    GenerationSession,
    SessionConfig,
    SessionStats,
)
from cache_service.integrations.model_layout import ModelLayout, model_layout, model_namespace
from cache_service.integrations.service_attention import (
    SERVICE_ATTENTION,
    service_attention_forward,
)
from cache_service.integrations.service_cache import ServiceKVCache
from cache_service.integrations.service_model import ServiceModel

__all__ = [
    "SERVICE_ATTENTION",
    "GenerationSession",
    "ModelLayout",
    "ServiceKVCache",
    "ServiceModel",
    "SessionConfig",
    "SessionStats",
    "model_layout",
    "model_namespace",
    "service_attention_forward",
]
