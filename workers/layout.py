"""The KV layout every pool of a deployment shares. Pure: torch is imported only on demand."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_SIZES", "KVLayout"]

# Bytes per element of each supported KV dtype.
DTYPE_SIZES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class KVLayout:
    """Shape and dtype of the KV cache.

    Attributes:
        num_layers: attention layers (L).
        num_kv_heads: key/value heads per layer (Hkv).
        head_dim: channels per head (D).
        block_size: token slots per block.
        dtype: element type, one of ``"float16" | "bfloat16" | "float32"``.

    Raises:
        ValueError: a field is out of range (the message names it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _require_positive_int(name, getattr(self, name))
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}"
            )

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_SIZES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one physical block: ``(L, 2, Hkv, block_size, D)`` (2 = K and V)."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def elements_per_block(self) -> int:
        """Elements in one block, all layers, K and V."""
        n = 1
        for dim in self.block_shape:
            n *= dim
        return n

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return self.elements_per_block * self.element_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers."""
        return self.bytes_per_block // self.block_size

    def fingerprint(self) -> str:
        """Short hex digest of every field; equal layouts give equal fingerprints.

        It salts the prefix hashes so caches of different layouts never match.
        """
        text = (
            f"kvlayout/v1:L={self.num_layers}:Hkv={self.num_kv_heads}:D={self.head_dim}"
            f":bs={self.block_size}:dtype={self.dtype}"
        )
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.dtype)
