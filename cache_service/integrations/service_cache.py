"""The ``past_key_values`` of a service session: a ``transformers.Cache`` that stores nothing.

It reports how many columns the model has already processed (from the session's plan), so
``generate()`` feeds only the columns still missing; the keys and values live in the service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from cache_service.integrations.generation_session import GenerationSession


class _ServiceCacheLayer(CacheLayerMixin):
    """One layer of :class:`ServiceKVCache`: keeps no tensors, reports the session's length."""

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, session: GenerationSession) -> None:
        super().__init__()
        self._session = session
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the keys and values live in the service."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the new keys/values unchanged: the attention layer sends them on."""
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) in columns, as if the processed columns were stored here."""
        return self._session.plan.consumed + query_length, 0

    def get_seq_length(self) -> int:
        """Columns of the padded batch the model has processed (or may skip)."""
        return self._session.plan.consumed

    def get_max_length(self) -> int:
        """No fixed maximum: the service grows sequences block by block."""
        return -1

    def reset(self) -> None:
        raise NotImplementedError("a service session cannot be reset; open a new session")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "beam search is not supported through the service (greedy/sampling only)"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the service cache cannot be cropped (no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "num_return_sequences > 1 / beams are not supported: open one row per sample"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the batch of a service session is fixed when it opens")


class ServiceKVCache(Cache):
    """The ``past_key_values`` to pass to ``generate()``: its KV lives in the service."""

    def __init__(self, session: GenerationSession, num_layers: int) -> None:
        super().__init__(layers=[_ServiceCacheLayer(session) for _ in range(num_layers)])
        self.session = session
