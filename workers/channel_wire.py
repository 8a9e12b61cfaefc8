"""The worker channel's messages: a data call and its reply as small pickles whose tensors
lie in an arena both processes map. Pure (no I/O); the two ends are
:mod:`workers.channel_server` (in the worker) and ``cache_service.worker_channel`` (in the
coordinator).

Why a channel beside Ray's own calls: an actor call carrying a decode step's tensors
(about 400 KB for 32 sequences of Llama-3-8B) costs milliseconds (serialisation, the
object store, several threads on each side), several times the step's work on the GPU.
Over the channel the coordinator copies the tensors into the arena (page-locked for CUDA
on the worker's side, so the pool copies them to the GPU by DMA) and the call itself is a
few hundred bytes on a Unix socket.

The same messages also travel between nodes, over TCP (no shared memory there): each end
then has an arena of its own, and a message carries the bytes of the tensors it names (its
payload: a run of the sender's arena, received into the same offsets of the receiver's).

A frame is a :data:`HEADER` (message bytes, payload bytes, payload offset in the arena;
little-endian), the message, then the payload. The first message of a connection (the
hello) and its answer are JSON; every later message is a pickle (protocol 5) of plain
values in which every tensor was replaced by an :class:`ArenaTensor` naming its bytes in
the arena. Pickles, because both ends are processes of one cluster that already exchange
pickles through Ray (an actor call is one), and only once the hello named the token the
worker handed out over Ray; nothing is unpickled before.

* request: ``(method, args, kwargs, free_from, files, forget)``; ``free_from`` is the
  first arena byte the request does not use: the worker lays its results out from there.
  ``files`` announces shared files the request's :class:`FileTensor` refs name for the
  first time on this connection, as ``(number, path, size)``; ``forget`` numbers the
  files the worker may unmap (the coordinator deleted them).
* reply: ``(True, value)`` or ``(False, exception)``.

Shared files (same node only): a tensor the coordinator holds in a client's shared region
(a /dev/shm file both the client and the coordinator map) travels as a :class:`FileTensor`:
the worker maps the file itself, once per connection, and reads the tensor where it lies,
as the client wrote it; an output produced into such a region is written there by the
worker. No copy into the arena and out again.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from workers.transport import dtype_name, dtype_named

__all__ = [
    "ALIGN",
    "HEADER",
    "MAX_HELLO_BYTES",
    "ArenaFull",
    "ArenaLayout",
    "ArenaTensor",
    "ArenaViews",
    "ChannelProtocolError",
    "FileTensor",
    "SharedFileUnavailable",
    "decode",
    "encode",
    "frame",
    "view",
]

# Tensor starts in the arena: kernels want 16-byte aligned rows, and workers.staging lays a
# call's tensors out at the same alignment, so a decode step's key, value and query placed
# in turn sit exactly as a decode graph's input buffer wants them (one copy to the GPU).
ALIGN = 256
HEADER = struct.Struct("<IIQ")  # message bytes, payload bytes, payload offset
MAX_HELLO_BYTES = 4096


class ArenaFull(Exception):
    """The call's tensors do not fit in the arena (the caller sends it another way)."""


class ChannelProtocolError(Exception):
    """A message that does not follow the channel's format (a tensor outside the arena, an
    unknown dtype, a frame of 4 GiB or more)."""


class ArenaTensor(NamedTuple):
    """A contiguous tensor at byte ``offset`` of the arena. (A named tuple: it pickles and
    hashes as fast as a tuple.)"""

    offset: int
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        """Its size, bytes (raises ChannelProtocolError for an unknown dtype)."""
        n = _itemsize(self.dtype)
        for d in self.shape:
            n *= d
        return n


class FileTensor(NamedTuple):
    """A contiguous tensor at byte ``offset`` of shared file number ``file`` (announced on
    the connection: the request's ``files``)."""

    file: int
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        """Its size, bytes (raises ChannelProtocolError for an unknown dtype)."""
        return ArenaTensor.nbytes(self)  # type: ignore[arg-type]


class SharedFileUnavailable(ChannelProtocolError):
    """The worker could not map a shared file a request announced (it is gone, or not a
    file of this user): nothing ran, and the request's other files were not kept; the
    caller sends the call again with that file's tensors copied.

    Attributes:
        path: the file.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(path, reason)
        self.path = path

    def __str__(self) -> str:
        return f"cannot map {self.args[0]}: {self.args[1]}"


_REFS = (ArenaTensor, FileTensor)
# Values encode and decode leave as they are without looking further.
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})


def frame(message: bytes, payload_bytes: int = 0, payload_offset: int = 0) -> bytes:
    """``message`` as it goes on the socket: the header, then its bytes (the payload, when
    there is one, is sent right after: ``payload_bytes`` of the arena from
    ``payload_offset``)."""
    if len(message) > 0xFFFFFFFF or payload_bytes > 0xFFFFFFFF:
        raise ChannelProtocolError(f"a message of {len(message)} bytes does not fit a frame")
    return HEADER.pack(len(message), payload_bytes, payload_offset) + message


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _itemsize(name: str) -> int:
    try:
        return dtype_named(name).itemsize
    except TypeError as exc:
        raise ChannelProtocolError(str(exc)) from None


class ArenaViews:
    """Tensors over ``arena`` (uint8, 1-D), one per :class:`ArenaTensor`, made once and
    reused: a decode loop names the same offsets, dtypes and shapes call after call, and a
    view costs a few torch calls where a dictionary lookup costs a fraction of one."""

    def __init__(self, arena: torch.Tensor, max_views: int = 256) -> None:
        self.arena = arena
        self.size = arena.numel()
        self._views: dict[ArenaTensor, torch.Tensor] = {}
        self._max = max_views

    def __call__(self, ref: ArenaTensor) -> torch.Tensor:
        """The tensor ``ref`` names (a view: it changes with the arena).

        Raises:
            ChannelProtocolError: ``ref`` lies outside the arena or names an unknown dtype.
        """
        t = self._views.get(ref)
        if t is None:
            t = view(self.arena, ref)
            if len(self._views) >= self._max:
                self._views.clear()
            self._views[ref] = t
        return t


class ArenaLayout:
    """Tensors placed one after another in an arena from byte ``start``, each start
    aligned to :data:`ALIGN` bytes."""

    def __init__(self, views: ArenaViews, start: int = 0) -> None:
        self._views = views
        self.end = _round_up(start)

    def reserve(
        self, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[ArenaTensor, torch.Tensor]:
        """Room for a tensor of ``shape`` and ``dtype``: its reference and a view of it.

        Raises:
            ArenaFull: it does not fit.
        """
        ref = ArenaTensor(self.end, dtype_name(dtype), tuple(shape))
        nbytes = ref.nbytes()
        if self.end + nbytes > self._views.size:
            raise ArenaFull(
                f"{nbytes} bytes at offset {self.end} do not fit an arena of "
                f"{self._views.size} bytes"
            )
        self.end = _round_up(self.end + nbytes)
        return ref, self._views(ref)

    def put(self, t: torch.Tensor) -> ArenaTensor:
        """``t`` copied into the arena.

        Raises:
            ArenaFull: it does not fit.
        """
        ref, room = self.reserve(tuple(t.shape), t.dtype)
        room.copy_(t)
        return ref

    def place(self, t: torch.Tensor) -> ArenaTensor:
        """:meth:`put`, except that a tensor already in the arena (contiguous) is only named."""
        return self.find(t) or self.put(t)

    def find(self, t: torch.Tensor) -> ArenaTensor | None:
        """The reference of ``t`` when it is a contiguous view of the arena, else None."""
        if not t.is_cpu or not t.is_contiguous():
            return None
        offset = t.data_ptr() - self._views.arena.data_ptr()
        if offset < 0 or offset + t.nbytes > self._views.size:
            return None
        return ArenaTensor(offset, dtype_name(t.dtype), tuple(t.shape))


def view(arena: torch.Tensor, ref: ArenaTensor) -> torch.Tensor:
    """The tensor ``ref`` names in ``arena`` (a view: it changes with the arena).

    Raises:
        ChannelProtocolError: ``ref`` lies outside the arena or names an unknown dtype.
    """
    nbytes = ref.nbytes()
    if ref.offset < 0 or ref.offset + nbytes > arena.numel() or any(d < 0 for d in ref.shape):
        raise ChannelProtocolError(
            f"a tensor of {nbytes} bytes at offset {ref.offset} lies outside the arena of "
            f"{arena.numel()} bytes"
        )
    raw = arena[ref.offset : ref.offset + nbytes]
    return raw.view(dtype_named(ref.dtype)).view(ref.shape)


def encode(value: Any, place: Callable[[torch.Tensor], ArenaTensor]) -> Any:
    """``value`` with every tensor in it (itself, or inside tuples, lists and dict values,
    at any depth) replaced by ``place(tensor)``."""
    if isinstance(value, torch.Tensor):
        return place(value)
    kind = type(value)
    if kind is tuple or kind is list:
        for v in value:
            if type(v) not in _SCALARS:
                return kind(encode(v, place) for v in value)
        return value  # nothing to replace (a slot mapping's ints): as it is
    if kind is dict:
        return {k: encode(v, place) for k, v in value.items()}
    return value


def decode(value: Any, tensor_of: Callable[[ArenaTensor], torch.Tensor]) -> Any:
    """The inverse of :func:`encode`: every ArenaTensor and FileTensor replaced by
    ``tensor_of(ref)``."""
    if type(value) in _REFS:
        return tensor_of(value)
    kind = type(value)
    if kind is tuple or kind is list:
        for v in value:
            if type(v) not in _SCALARS:
                return kind(decode(v, tensor_of) for v in value)
        return value
    if kind is dict:
        return {k: decode(v, tensor_of) for k, v in value.items()}
    return value
