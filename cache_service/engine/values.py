"""Values the coordinator takes and returns: a call's items, a batch as the batch RPC
carries it, a worker's state, an exported or imported sequence.

Plain values, apart from the coordinator, so the servicer's decoders build them without
importing the coordinator itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "AppendAttendItem",
    "AttendItem",
    "ExportedSequence",
    "ImportedSequence",
    "JoinedFields",
    "StackedAppendAttend",
    "WorkerState",
]


class AttendItem(NamedTuple):
    """One sequence of an attend call: query ``[m, Hq, D]`` (its last m positions)."""

    seq_id: str
    query: torch.Tensor


class AppendAttendItem(NamedTuple):
    """One sequence of an append-and-attend call.

    token_ids: n >= 1 new token ids; key, value ``[n, Hkv, D]``; query ``[m, Hq, D]``.
    (NamedTuples, not dataclasses: the servicer builds one per sequence per call.)
    """

    seq_id: str
    token_ids: Sequence[int]
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor


@dataclass(frozen=True)
class WorkerState:
    """A worker as the coordinator sees it (`up`: registered in the control plane)."""

    worker_id: str
    device: str
    num_blocks: int
    epoch: str
    up: bool


@dataclass(frozen=True)
class ExportedSequence:
    """A sequence's first `num_tokens` positions (written on every layer) as whole blocks.

    blocks: ``[ceil(num_tokens / block_size), L, 2, Hkv, block_size, D]`` in the layout's
    dtype, logical order; slots past num_tokens in the last block are unspecified.
    """

    token_ids: list[int]
    num_tokens: int
    blocks: torch.Tensor


@dataclass(frozen=True)
class ImportedSequence:
    """Result of an import: the new sequence, its cached (shared) and total tokens."""

    seq_id: str
    num_cached_tokens: int
    num_tokens: int


@dataclass(frozen=True)
class JoinedFields:
    """The keys, values and queries of an append-and-attend's items, each field as one
    flat tensor: what `tensor_codec.joined_view` of that field's tensors is (the servicer
    decodes each field of a request into one buffer and knows it). None for a field
    whose tensors do not lie back to back."""

    key: torch.Tensor | None
    value: torch.Tensor | None
    query: torch.Tensor | None

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter((self.key, self.value, self.query))


class StackedAppendAttend(NamedTuple):
    """An append-and-attend batch as the batch RPC carries it: row i of every tensor is
    sequence i's (b sequences, n new tokens and m query rows each).

    seq_ids: the b sequences; token_ids: b * n ids, sequence by sequence; key, value
    ``[b, n, Hkv, D]`` and query ``[b, m, Hq, D]``, each contiguous, float16 / bfloat16 /
    float32.
    """

    seq_ids: list[str]
    token_ids: list[int]
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor

    def items(self) -> list[AppendAttendItem]:
        """The batch as one item per sequence (views of the rows)."""
        n = self.key.shape[1]
        flat = self.token_ids
        rows = (
            [[t] for t in flat]
            if n == 1
            else [flat[i * n : (i + 1) * n] for i in range(len(self.seq_ids))]
        )
        return [
            AppendAttendItem(s, r, k, v, q)
            for s, r, k, v, q in zip(
                self.seq_ids,
                rows,
                self.key.unbind(0),
                self.value.unbind(0),
                self.query.unbind(0),
                strict=True,
            )
        ]

    def joined(self) -> JoinedFields:
        """Each field as one flat view (None for a field that is not contiguous)."""
        return JoinedFields(*(t.view(-1) if t.is_contiguous() else None for t in self[2:]))
