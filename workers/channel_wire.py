"""The worker channel's messages: a data call and its reply as small pickles whose tensors
lie in an arena both processes map. Pure (no I/O); the two ends are
:mod:`workers.channel_server` (in the worker) and ``cache_service.wire.worker_channel`` (in the
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
values in which every tensor was replaced by a reference to its bytes in the arena
(:class:`ArenaTensor`) or in a shared file (:class:`FileTensor`), sent as plain tuples
beside the value they were taken from (:func:`split`, :func:`join`). Pickles, because
both ends are processes of one cluster that already exchange pickles through Ray (an
actor call is one), and only once the hello named the token the worker handed out over
Ray; nothing is unpickled before.

* request: ``(method, free_from, files, forget, args, arg_refs, kwargs, kwarg_refs)``,
  the arguments split. ``free_from`` is the first arena byte the request does not use:
  the worker lays its results out from there. ``files`` announces shared files the
  request's :class:`FileTensor` refs name for the first time on this connection, as
  ``(number, path, size)`` (the worker maps them before it reads a tensor); ``forget``
  numbers the files the worker may unmap (the coordinator deleted them).
* repeat: ``(changes,)``: the connection's last full request again, that is its method,
  arguments and ``free_from`` as the worker decoded them, with ``changes``, a tuple of
  ``(position or keyword, value)``, replacing plain arguments (scalars, lists of them) by
  others of their type (a decode step's other layers: the same call but for its layer).
  Only after that request was answered without error; the tensors it named are read
  where they lie now: a shared file's as its owner left them, the arena's as the caller
  left them (nothing but the caller writes the arena's inputs). So the caller repeats a
  call whose tensors lie where the last one's did, in the same shared files or in the
  arena, having copied the new values into the arena first, except those
  :data:`KEYED_ARGUMENTS` names under an unchanged ``step_key`` (a key names one
  content: see ``workers.metadata_cache``). A worker holding no such request (none yet,
  or it unmapped a file since) answers :class:`RepeatUnavailable`: nothing ran.
* reply: ``(True, value, value_refs)``, the result split, or ``(False, exception)``.

A tensor given in parts (a list of tensors, e.g. the queries of a round's callers, each
where its caller put it, or their output slots: a round of several callers) travels
as a list of references, each part placed on its own.

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

from workers.description import FencedEpoch
from workers.round import WIRE_FIELDS
from workers.transport import dtype_name, dtype_named

__all__ = [
    "ALIGN",
    "HEADER",
    "KEYED_ARGUMENTS",
    "MAX_HELLO_BYTES",
    "ArenaFull",
    "ArenaLayout",
    "ArenaTensor",
    "ArenaViews",
    "ChannelProtocolError",
    "FileTensor",
    "RepeatUnavailable",
    "SharedFileUnavailable",
    "frame",
    "join",
    "split",
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


class RepeatUnavailable(ChannelProtocolError):
    """The worker holds no request to repeat on this connection (none answered yet since
    the last full request, or it unmapped a shared file meanwhile): nothing ran; the
    caller sends the call in full."""


# Values that are never tensors (split skips the isinstance test for them); a repeat may
# replace an argument of one of these types (or a list of them) by another of its type.
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})

# Per data method: the positions of its arguments whose content its `step_key` names (a
# round's index tensors: block tables, sequence lengths, query start offsets). A round
# travels as its epoch, then its fields (workers.round.Round.wire_fields).
KEYED_ARGUMENTS: dict[str, frozenset[int]] = {
    "run_round": frozenset(
        1 + WIRE_FIELDS.index(name) for name in ("block_tables", "seq_lens", "query_start_loc")
    ),
}


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


# Reference tags: what a plain tuple of the message names (a tensor in the arena, one in
# a shared file, a data call's FencedEpoch: every request carries one, and as a named
# tuple it would cost as much to pickle as the rest of the request; a tensor in parts: a
# list of the other tags' references).
_ARENA, _FILE, _EPOCH, _PARTS = "a", "f", "e", "p"
# The most parts one value may name (a round's callers: a few dozen at most).
MAX_PARTS = 1024


def repeated(args: tuple, kwargs: dict[str, Any], changes: object) -> tuple[tuple, dict[str, Any]]:
    """``args`` and ``kwargs`` with a repeat's ``changes`` applied: ``(where, value)`` each,
    `where` a position of ``args`` or a key of ``kwargs``, `value` a plain scalar or a list
    of them replacing one of its type (a list by a list).

    Raises:
        ChannelProtocolError: a malformed change, or one that would replace anything else.
    """
    if type(changes) is not tuple:
        raise ChannelProtocolError(f"a repeat's changes must be a tuple, got {changes!r}")
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for change in changes:
        if type(change) is not tuple or len(change) != 2:
            raise ChannelProtocolError(f"a malformed change {change!r}")
        where, value = change
        if type(where) is int and 0 <= where < len(new_args):
            target: dict[Any, Any] | list[Any] = new_args
        elif type(where) is str and where in new_kwargs:
            target = new_kwargs
        else:
            raise ChannelProtocolError(f"a change of no argument: {change!r}")
        old = target[where]  # type: ignore[index]
        kind = type(value)
        if kind is not type(old) or not (
            kind in _SCALARS or (kind is list and all(type(v) in _SCALARS for v in value))
        ):
            raise ChannelProtocolError(
                f"a repeat may replace a plain argument by one of its type, not {change!r}"
            )
        target[where] = value  # type: ignore[index]
    return tuple(new_args), new_kwargs


def split(
    value: Any, place: Callable[[torch.Tensor], ArenaTensor | FileTensor]
) -> tuple[Any, tuple]:
    """``value`` made plain for a message, and the references of its tensors.

    The tensors looked for are ``value`` itself, the items of a tuple or list, and the
    values of a dict; each is replaced by None in the plain value and named in the
    references as ``(where, tag, *fields)`` (``where``: None for the value itself, else
    the index or key), ``place(tensor)`` giving the reference (ArenaTensor and
    FileTensor items count as tensors already placed). A FencedEpoch there travels the
    same way. Plain tuples, not the named tuples: a named tuple pickles through a
    Python-level reduce (about 2.5 us each on the CPU VM, and a request names seven), a
    tuple in C. A tensor deeper down is pickled with the rest, by value (correct, slower;
    no data call sends one).

    Raises:
        What ``place`` raises (ArenaFull).
    """
    kind = type(value)
    if kind is tuple or kind is list or kind is dict:
        items = value.items() if kind is dict else enumerate(value)
        refs = tuple((k, *_ref(v, place)) for k, v in items if _is_tensor_like(v) or _is_parts(v))
        if not refs:
            return value, ()
        plain = dict(value) if kind is dict else list(value)
        for ref in refs:
            plain[ref[0]] = None
        return (tuple(plain) if kind is tuple else plain), refs
    if _is_tensor_like(value):
        return None, ((None, *_ref(value, place)),)
    return value, ()


def join(
    plain: Any, refs: Any, tensor_of: Callable[[ArenaTensor | FileTensor], torch.Tensor]
) -> Any:
    """The inverse of :func:`split`: every reference's tensor, ``tensor_of(ref)``, put
    back where it was.

    Raises:
        ChannelProtocolError: a malformed reference or place (and what ``tensor_of``
            raises).
    """
    if type(refs) is not tuple:
        raise ChannelProtocolError(f"malformed tensor references {refs!r}")
    if not refs:
        return plain
    kind = type(plain)
    if kind is tuple or kind is list or kind is dict:
        out = list(plain) if kind is not dict else dict(plain)
        for ref in refs:
            where = ref[0] if type(ref) is tuple and ref else None
            if kind is dict:
                if where not in out:
                    raise ChannelProtocolError(f"a tensor reference to no key: {ref!r}")
            elif type(where) is not int or not 0 <= where < len(out):
                raise ChannelProtocolError(f"a tensor reference to no item: {ref!r}")
            out[where] = _value(ref[1:], tensor_of)
        return tuple(out) if kind is tuple else out
    if plain is not None or len(refs) != 1 or type(refs[0]) is not tuple or refs[0][:1] != (None,):
        raise ChannelProtocolError(f"malformed tensor references {refs!r}")
    return _value(refs[0][1:], tensor_of)


def _is_tensor_like(v: Any) -> bool:
    kind = type(v)
    return (
        kind is torch.Tensor
        or kind is ArenaTensor
        or kind is FileTensor
        or kind is FencedEpoch
        or (kind not in _SCALARS and isinstance(v, torch.Tensor))
    )


def _is_parts(v: Any) -> bool:
    """Whether `v` is a tensor in parts: a non-empty list of tensors."""
    return type(v) is list and bool(v) and all(_is_tensor_like(t) for t in v)


def _ref(v: Any, place: Callable[[torch.Tensor], ArenaTensor | FileTensor]) -> tuple:
    kind = type(v)
    if kind is list:
        return (_PARTS, tuple(_ref(t, place) for t in v))
    if kind is FencedEpoch:
        return (_EPOCH, *v)
    ref = v if kind is ArenaTensor or kind is FileTensor else place(v)
    return (_ARENA, *ref) if type(ref) is ArenaTensor else (_FILE, *ref)


def _value(fields: tuple, tensor_of: Callable[[ArenaTensor | FileTensor], torch.Tensor]) -> Any:
    if len(fields) == 4 and fields[0] == _ARENA:
        return tensor_of(ArenaTensor(*fields[1:]))
    if len(fields) == 5 and fields[0] == _FILE:
        return tensor_of(FileTensor(*fields[1:]))
    if len(fields) == 3 and fields[0] == _EPOCH:
        return FencedEpoch(*fields[1:])
    if len(fields) == 2 and fields[0] == _PARTS and type(fields[1]) is tuple:
        parts = fields[1]
        if not 0 < len(parts) <= MAX_PARTS or not all(
            type(f) is tuple and f[:1] in ((_ARENA,), (_FILE,)) for f in parts
        ):
            raise ChannelProtocolError(f"a malformed tensor in parts {fields!r}")
        return [_value(f, tensor_of) for f in parts]
    raise ChannelProtocolError(f"an unknown tensor reference {fields!r}")
