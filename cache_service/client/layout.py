"""The service's KV layout as the client reports it (`KVCacheClient.info().layout`).

The client's own value type, read from the GetInfo reply, so that a model executor's
process does not import the data plane (`workers`) to learn the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ServiceLayout"]


@dataclass(frozen=True)
class ServiceLayout:
    """Shape and dtype of the service's KV cache.

    Attributes:
        num_layers: attention layers (L).
        num_kv_heads: key/value heads per layer (Hkv).
        head_dim: channels per head (D).
        block_size: token slots per block.
        dtype: element type, one of ``"float16" | "bfloat16" | "float32"``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype``."""
        return getattr(torch, self.dtype)
