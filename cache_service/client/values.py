"""What the client's calls return, and the items they take: plain frozen records (service
info and stats, sequences, attention items) and `ExportedBlocks` (a sequence's blocks as
bytes, self-describing)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client.layout import ServiceLayout
from cache_service.wire.tensor_codec import dtype_from_proto, tensor_from_bytes

__all__ = [
    "AppendAttendItem",
    "AttendItem",
    "ExportedBlocks",
    "SequenceEntry",
    "ServiceInfo",
    "ServiceStats",
    "WorkerInfo",
    "WorkerStats",
]


@dataclass(frozen=True)
class WorkerInfo:
    """One worker pool: id, device ("cuda:0", "cpu"), blocks, epoch, whether it serves, and
    how the coordinator's per-layer calls reach it (`data_path`: "in_process"; for a Ray
    worker the last call's "channel_unix", "channel_tcp" or "ray"; "" before the first, or
    from a server that does not say)."""

    worker_id: str
    device: str
    num_blocks: int
    epoch: str
    up: bool
    data_path: str = ""


@dataclass(frozen=True)
class ServiceInfo:
    """What `info()` returns.

    Attributes:
        layout: the cache layout (`ServiceLayout`).
        workers: the worker pools.
        total_blocks: blocks over all serving workers.
        capacity_tokens: total_blocks * block_size.
        max_message_bytes: the largest message the server accepts, bytes.
        server_version: the server package's version.
        fingerprint: the layout's fingerprint (exports carry it).
        local_session_socket: the server's local session socket ("" when it offers
            none); see `KVCacheClient`'s local_session.
    """

    layout: ServiceLayout
    workers: tuple[WorkerInfo, ...]
    total_blocks: int
    capacity_tokens: int
    max_message_bytes: int
    server_version: str
    fingerprint: str
    local_session_socket: str = ""


@dataclass(frozen=True)
class WorkerStats:
    """Block accounting of one live worker (see WorkerStats in kvcache.proto); the host
    tier's blocks (0: none) and those of them holding an evicted prefix block last."""

    worker_id: str
    total_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int
    allocated_slots: int
    filled_slots: int
    host_tier_blocks: int = 0
    host_tier_used_blocks: int = 0


@dataclass(frozen=True)
class ServiceStats:
    """What `stats()` returns: utilization and fragmentation are ratios in 0..1;
    prefix maps tenant -> (prompt tokens looked up, tokens found cached); host_hit_tokens:
    of the cached tokens, those restored from a host tier; host_evictions: host tier
    blocks given up for room."""

    workers: tuple[WorkerStats, ...]
    utilization: float
    fragmentation: float
    prefix: dict[str, tuple[int, int]]
    evictions: int
    cow_copies: int
    pinned_blocks: int
    active_sequences: int
    lost_sequences: int
    host_hit_tokens: int = 0
    host_evictions: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Cached / looked-up prompt tokens over all tenants (0 when nothing was looked up)."""
        queried = sum(q for q, _ in self.prefix.values())
        return sum(h for _, h in self.prefix.values()) / queried if queried else 0.0


@dataclass(frozen=True)
class SequenceEntry:
    """One sequence of the tenant (`list_sequences`).

    seq_id: its id; num_tokens: reserved positions; written: per layer, tokens whose K/V
    are stored; lost: its blocks were on a worker that died (free it).
    """

    seq_id: str
    num_tokens: int
    written: tuple[int, ...]
    lost: bool


@dataclass(frozen=True)
class AttendItem:
    """One sequence of an attend batch: query ``[n, num_q_heads, head_dim]``."""

    seq_id: str
    query: torch.Tensor


@dataclass(frozen=True)
class AppendAttendItem:
    """One sequence of an append-and-attend batch.

    Attributes:
        seq_id: the sequence.
        token_ids: ids of the n new tokens.
        key, value: ``[n, num_kv_heads, head_dim]``, float16 / bfloat16 / float32.
        query: ``[m, num_q_heads, head_dim]``: the last m positions after the write.
    """

    seq_id: str
    token_ids: Sequence[int]
    key: torch.Tensor
    value: torch.Tensor
    query: torch.Tensor


@dataclass
class ExportedBlocks:
    """A sequence's blocks, as exported (`export_blocks`) and importable (`import_blocks`).

    Attributes:
        header: the export header (layout, token ids, block shape).
        data: the raw block bytes: ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
            head_dim]`` in the layout's dtype, little-endian.
    """

    header: pb.ExportHeader
    data: bytes = field(repr=False)

    @property
    def token_ids(self) -> list[int]:
        """Token ids of the exported positions."""
        return list(self.header.token_ids)

    @property
    def num_tokens(self) -> int:
        """Exported positions."""
        return int(self.header.num_tokens)

    def blocks(self) -> torch.Tensor:
        """The blocks as a tensor ``[num_blocks, num_layers, 2, Hkv, block_size, head_dim]``."""
        dtype = dtype_from_proto(self.header.layout.kv_dtype, "header.layout.kv_dtype")
        return tensor_from_bytes(self.data, dtype, list(self.header.block_shape), "export")

    def to_bytes(self) -> bytes:
        """One self-describing byte string (4-byte header length, header, data)."""
        head = self.header.SerializeToString()
        return struct.pack("<I", len(head)) + head + self.data

    @classmethod
    def from_bytes(cls, blob: bytes) -> ExportedBlocks:
        """The inverse of `to_bytes`; raises ValueError on a truncated or foreign blob."""
        if len(blob) < 4:
            raise ValueError("exported blob is shorter than its 4-byte header length")
        (n,) = struct.unpack_from("<I", blob)
        if 4 + n > len(blob):
            raise ValueError(f"exported blob announces a {n}-byte header but has {len(blob) - 4}")
        header = pb.ExportHeader.FromString(blob[4 : 4 + n])
        data = blob[4 + n :]
        if len(data) != header.total_bytes:
            raise ValueError(
                f"exported blob holds {len(data)} data bytes, header says {header.total_bytes}"
            )
        return cls(header, data)
