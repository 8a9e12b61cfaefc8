"""Tensors given in parts: one tensor's rows as a list of tensors, joined along dim 0.

A round that coalesces several callers' calls (``KVPool.run_round`` of a round in parts) takes
each caller's keys, values and queries where the caller put them (its shared region) and
writes each caller's output rows into that caller's slot, instead of the coordinator
joining the inputs into one tensor and splitting the output again on its event loop. The
pool validates the parts as the one tensor they stand for (:func:`stand_in`), joins them
on the way to the device (``workers.staging.HostStager`` packs them back to back) and
delivers the output's rows part by part (:func:`fill`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.errors import InvalidWorkerRequest

__all__ = [
    "TensorParts",
    "check_out_parts",
    "fill",
    "is_parts",
    "joined",
    "joined_shape",
    "on_host",
    "stand_in",
]

# One tensor's row blocks, in order (dim 0 of the tensor they stand for).
TensorParts = list[torch.Tensor]

# Stand-ins by (shape, dtype): a round's shapes repeat from layer to layer, and making a
# meta tensor is a dispatched op (tens of microseconds on a busy worker). Shared safely:
# a meta tensor holds no data and validation only reads its shape and dtype.
_STAND_INS: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = {}
_MAX_STAND_INS = 256


def is_parts(value: object) -> bool:
    """Whether `value` is a tensor given in parts (a list or tuple, not a tensor)."""
    return isinstance(value, (list, tuple))


def stand_in(name: str, value: object) -> torch.Tensor:
    """The tensor `value` stands for, for validation: `value` itself when it is not given
    in parts (the caller checks it as a tensor); for parts, a tensor on the meta device (no
    memory) of their joined shape and dtype, shared by calls of that shape (read it, never
    change it).

    Raises:
        InvalidWorkerRequest: no parts, a part that is not a tensor, or parts of different
            dtypes, devices, ranks or trailing dims (their rows could not be joined).
    """
    if not is_parts(value):
        return value  # type: ignore[return-value]
    tensors: list[torch.Tensor] = []
    for i, p in enumerate(value):  # type: ignore[arg-type]
        if not isinstance(p, torch.Tensor) or p.dim() == 0:
            raise InvalidWorkerRequest(
                f"{name} part {i} must be a torch.Tensor of rows, got {_described(p)}"
            )
        tensors.append(p)
    if not tensors:
        raise InvalidWorkerRequest(f"{name} is given in parts but has none")
    first = tensors[0]
    for i, p in enumerate(tensors):
        if p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]:
            raise InvalidWorkerRequest(
                f"{name} part {i} ({_described(p)}) cannot be joined to part 0 "
                f"({_described(first)}): parts share dtype, device and all dims but the first"
            )
    shape = joined_shape(tensors)
    key = (shape, first.dtype)
    meta = _STAND_INS.get(key)
    if meta is None:
        if len(_STAND_INS) >= _MAX_STAND_INS:
            _STAND_INS.clear()
        meta = _STAND_INS[key] = torch.empty(shape, dtype=first.dtype, device="meta")
    return meta


def joined_shape(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Size:
    """The shape of the tensor `value` stands for (parts already validated: `stand_in`)."""
    if not is_parts(value):
        return value.shape  # type: ignore[union-attr]
    parts = list(value)
    return torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))


def on_host(value: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """Whether a tensor, or every part of one, is in host memory."""
    if not is_parts(value):
        return value.is_cpu  # type: ignore[union-attr]
    return all(p.is_cpu for p in value)


def joined(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """One tensor of `value`'s rows: `value` itself, or its parts concatenated."""
    if not is_parts(value):
        return value  # type: ignore[return-value]
    parts = list(value)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def check_out_parts(out: object, output: torch.Tensor) -> TensorParts:
    """Validate host memory given for an output in parts and return it as a list (`out`
    itself when it is one).

    Args:
        out: the parts: host tensors, contiguous, of the output's dtype and trailing dims,
            whose rows add up to the output's.
        output: a tensor (or stand-in) of the output's shape ``[rows, ...]`` and dtype.

    Raises:
        InvalidWorkerRequest: anything else (nothing has run yet).
    """
    if not is_parts(out) or not out:  # type: ignore[truthy-bool]
        raise InvalidWorkerRequest("out must be a non-empty list of host tensors (the parts)")
    parts = out if type(out) is list else list(out)  # type: ignore[call-overload]
    for i, p in enumerate(parts):
        if not (
            isinstance(p, torch.Tensor)
            and p.device.type == "cpu"
            and p.is_contiguous()
            and p.dtype == output.dtype
            and p.dim() == output.dim()
            and p.shape[1:] == output.shape[1:]
        ):
            raise InvalidWorkerRequest(
                f"out part {i} must be a contiguous host tensor [rows, "
                f"{', '.join(str(d) for d in output.shape[1:])}] of {output.dtype}, got "
                f"{_described(p)}"
            )
    rows = sum(p.shape[0] for p in parts)
    if rows != output.shape[0]:
        raise InvalidWorkerRequest(
            f"out's parts hold {rows} rows, the output has {output.shape[0]}"
        )
    return parts


def fill(parts: TensorParts, source: torch.Tensor) -> TensorParts:
    """Copy `source`'s rows into `parts` in order (without waiting when `source` is on a
    device and the parts page-locked: the caller waits once for all of them)."""
    start = 0
    for p in parts:
        rows = p.shape[0]
        p.copy_(source[start : start + rows], non_blocking=True)
        start += rows
    return parts


def _described(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    layout = "" if t.is_contiguous() else " (not contiguous)"
    return f"{t.dtype} on {t.device}, shape {tuple(t.shape)}{layout}"
