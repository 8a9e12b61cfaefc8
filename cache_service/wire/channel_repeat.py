"""Repeats on a worker channel: a call that differs from the connection's last full call
only in plain arguments (a decode step's other layers: the layer) goes as a repeat of it, a
few bytes the worker answers without decoding anything (see ``workers.channel_wire``).

A repeat's tensors have the shapes and dtypes of the last call's, each where that call's
lay: at the same address of the same shared file, or in the arena, which a repeat refills
in place (a shared arena; the attention's index tensors are not even copied when the call's
unchanged ``step_key`` names them, since a key names one content). `sent_as` records
what a full call's repeat must match (`SentCall`); `repeat_changes` decides whether a call
is one and what it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from workers.channel_wire import KEYED_ARGUMENTS, ArenaTensor, FileTensor
from workers.description import FencedEpoch
from workers.shared_files import SHARED_FILES

__all__ = ["Parts", "Place", "SentCall", "repeat_changes", "sent_as"]


class Place(NamedTuple):
    """Where a tensor of the last full call went: a shared file at address `ptr`; or (ptr
    None) the arena, at `slot` when a repeat copies the new content there first, else (no
    slot) where the call's step_key names the content or, for the output, the content
    does not matter."""

    ptr: int | None
    shape: torch.Size
    dtype: torch.dtype
    slot: ArenaTensor | None = None


class Parts(NamedTuple):
    """Where the parts of a tensor given in parts lay (each in a shared file): a repeat's
    parts must lie at the same addresses, with the same shapes and dtypes."""

    places: tuple[Place, ...]


@dataclass(frozen=True)
class SentCall:
    """The connection's last full call, answered without error: what a repeat must match.

    Attributes:
        method: its method.
        args, kwargs: its arguments, each tensor replaced by its `Place`.
        out: the place of its output (None: it had none).
        out_ref: the output's reference when it lay in a shared file.
        files_version: SHARED_FILES.version when it was built (a repeat needs the same:
            the files mapped where they were).
    """

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Place | Parts | None
    out_ref: FileTensor | tuple[FileTensor, ...] | None
    files_version: int


# Values a repeat may replace (channel_wire._SCALARS; lists of them too).
REPLACEABLE = frozenset({int, float, bool, str, bytes, type(None)})


def sent_as(
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: torch.Tensor | list[torch.Tensor] | None,
    out_ref: FileTensor | tuple[FileTensor, ...] | None,
    in_arena: dict[int, ArenaTensor],
    files_version: int,
    refillable: bool,
) -> SentCall | None:
    """What a repeat of a full call must match, or None when it cannot be repeated: a
    value that is neither a tensor nor plain (a list of plain values at most), a tensor
    in parts with a part copied into the arena, an output in parts the worker did not
    write in place, or (not `refillable`: a private arena, whose bytes would have to
    travel) a tensor copied into the arena that its step_key does not name.

    Args:
        in_arena: the call's tensors copied into the arena, by id, with their slots (the
            others lie in shared files).
    """
    keyed = KEYED_ARGUMENTS.get(method, frozenset())
    if kwargs.get("step_key") is None:
        keyed = frozenset()

    def sent(value: Any, keyed_here: bool) -> Any:
        if type(value) is torch.Tensor:
            slot = in_arena.get(id(value))
            if slot is None:
                return Place(value.data_ptr(), value.shape, value.dtype)
            if keyed_here:
                return Place(None, value.shape, value.dtype)
            return Place(None, value.shape, value.dtype, slot) if refillable else None
        kind = type(value)
        if kind in REPLACEABLE or kind is FencedEpoch:
            return value
        if kind is list and value and all(type(v) is torch.Tensor for v in value):
            # A tensor in parts: repeatable where every part lies in a shared file.
            if any(id(v) in in_arena for v in value):
                return None
            return Parts(tuple(Place(v.data_ptr(), v.shape, v.dtype) for v in value))
        if (kind is list or kind is tuple) and all(type(v) in REPLACEABLE for v in value):
            return value
        return None

    plain_args = tuple(sent(a, i in keyed) for i, a in enumerate(args))
    plain_kwargs = {k: sent(v, False) for k, v in kwargs.items()}
    for given, plain in ((args, plain_args), (kwargs.values(), plain_kwargs.values())):
        if any(p is None and g is not None for g, p in zip(given, plain, strict=True)):
            return None
    place: Place | Parts | None = None
    if type(out) is list:
        if type(out_ref) is not tuple:
            return None  # the output in parts came back joined: nothing to repeat into
        place = Parts(tuple(Place(o.data_ptr(), o.shape, o.dtype) for o in out))
    elif out is not None:
        assert isinstance(out, torch.Tensor)
        place = Place(out.data_ptr() if out_ref is not None else None, out.shape, out.dtype)
    return SentCall(method, plain_args, plain_kwargs, place, out_ref, files_version)


def repeat_changes(
    sent: SentCall,
    method: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: torch.Tensor | list[torch.Tensor] | None,
) -> tuple[tuple[tuple[int | str, Any], ...], list[tuple[ArenaTensor, torch.Tensor]]] | None:
    """What makes this call a repeat of `sent`: the arguments to replace (``(position or
    keyword, value)`` each) and the tensors to copy into their arena slots first; None
    when it is not one (then it goes in full).

    A repeat has the same method, keywords and shared files (SHARED_FILES unchanged), each
    tensor of the shape and dtype `sent`'s had and where it lay (the same address of a
    shared file, or the arena), and equal plain values but for scalars and lists of them
    replaced by others of their type.
    """
    if (
        sent.method != method
        or len(args) != len(sent.args)
        or len(kwargs) != len(sent.kwargs)
        or SHARED_FILES.version != sent.files_version
        or not _fits(out, sent.out)
    ):
        return None
    changes: list[tuple[int | str, Any]] = []
    refills: list[tuple[ArenaTensor, torch.Tensor]] = []
    try:
        for i, (new, old) in enumerate(zip(args, sent.args, strict=True)):
            if not _matches(new, old, i, changes, refills):
                return None
        for name, old in sent.kwargs.items():
            new = kwargs.get(name, Place)  # Place: a value no call passes
            # The key vouches for the arena's index tensors, which are not refilled.
            if not _matches(new, old, name, changes, refills, fixed=name == "step_key"):
                return None
    except Exception:  # a comparison that is not a plain yes or no (a tensor in a list)
        return None
    return tuple(changes), refills


def _matches(
    new: object,
    old: object,
    where: int | str,
    changes: list[tuple[int | str, Any]],
    refills: list[tuple[ArenaTensor, torch.Tensor]],
    fixed: bool = False,
) -> bool:
    """Whether `new` may stand where the last call had `old` (a `Place`, or a plain value)
    in a repeat; records the refill or the change (at `where`) it takes. `fixed`: a plain
    value that must stay equal."""
    if type(old) is Place:
        if not _fits(new, old):
            return False
        if old.slot is not None:
            refills.append((old.slot, new))  # type: ignore[arg-type]
        return True
    if type(old) is Parts:
        return _fits(new, old)  # parts lie in shared files: nothing to refill
    if new is old or (type(new) is type(old) and new == old):
        return True
    if fixed or not _replaceable(new, old):
        return False
    changes.append((where, new))
    return True


def _replaceable(new: object, old: object) -> bool:
    """Whether a repeat may send `new` in place of `old`: a plain scalar, or a list of
    them, of `old`'s type (channel_wire.repeated's rule)."""
    kind = type(new)
    if kind is not type(old):
        return False
    return kind in REPLACEABLE or (
        kind is list and all(type(v) in REPLACEABLE for v in new)  # type: ignore[attr-defined]
    )


def _fits(t: object, place: Place | Parts | None) -> bool:
    """Whether `t` is a tensor where `place` says the last call's was (None: no tensor;
    `Parts`: a list of tensors, each where its part was)."""
    if place is None:
        return t is None
    if type(place) is Parts:
        return (
            type(t) is list
            and len(t) == len(place.places)
            and all(_fits(x, p) for x, p in zip(t, place.places, strict=True))
        )
    return (
        type(t) is torch.Tensor
        and t.shape == place.shape
        and t.dtype == place.dtype
        and (
            (place.slot is not None and t.is_cpu)
            or (place.ptr is None and place.slot is None)
            or (t.data_ptr() == place.ptr and t.is_contiguous())
        )
    )
