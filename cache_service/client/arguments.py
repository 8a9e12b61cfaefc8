"""The client's checks of call arguments before anything is sent (token ids, batch shapes,
empty calls), with the errors the server would give; and the timeout_us of a budget."""

from __future__ import annotations

from collections.abc import Iterable, Sequence, Sized

import grpc
import torch

from cache_service.client.errors import InvalidArgumentError

__all__ = ["check_batch", "check_not_empty", "micros", "token_id_list", "token_id_rows"]


def micros(seconds: float) -> int:
    """A timeout_us: `seconds` in whole microseconds, at least 1 (0 would mean none)."""
    return max(1, int(seconds * 1e6))


def token_id_list(token_ids: Iterable[int]) -> list[int]:
    """Token ids as a list of ints (accepts lists, tuples, 1-D tensors)."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    return [int(t) for t in token_ids]


def token_id_rows(token_ids: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """``[batch, n]`` token ids (rows of ints, or an integer tensor) as lists of ints."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be [batch, n], got shape {tuple(token_ids.shape)}")
        return token_ids.tolist()
    rows = []
    for i, row in enumerate(token_ids):
        # A decode step's rows: lists of one int, used as they are (the request is
        # encoded from them before the call returns; nothing keeps them).
        if type(row) is list and len(row) == 1 and type(row[0]) is int:
            rows.append(row)
            continue
        if not isinstance(row, Sequence | torch.Tensor) or isinstance(row, str | bytes):
            raise ValueError(
                f"token_ids[{i}] must be the row's token ids, got {type(row).__name__}"
            )
        rows.append(token_id_list(row))
    return rows


def check_not_empty(values: Sized, field: str, call: str, what: str) -> None:
    """Refuse a call with nothing in ``field`` before sending it, with the error the
    server's INVALID_ARGUMENT gives (an empty call is a caller's mistake, not a request
    for nothing), so every form of every call fails alike."""
    if len(values) == 0:
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{field} is empty: {call} needs at least one {what} (refused by the client; "
            "nothing was sent)",
        )


def check_batch(
    call: str,
    seq_ids: Sequence[str],
    token_ids: Sequence[Sequence[int]] | None,
    **tensors: torch.Tensor,
) -> None:
    """Refuse a batch call whose `seq_ids`, `token_ids` rows and 4-D `tensors`
    (``[batch, rows, heads, head_dim]``) disagree on the batch or the new tokens."""
    check_not_empty(seq_ids, "seq_ids", call, "sequence")
    batch = len(seq_ids)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D tensor [batch, rows, heads, head_dim], got {shape}"
            )
        if t.shape[0] != batch:
            raise ValueError(f"{name} holds {t.shape[0]} sequences, seq_ids {batch}")
    if token_ids is not None:
        if len(token_ids) != batch:
            raise ValueError(f"token_ids holds {len(token_ids)} sequences, seq_ids {batch}")
        # The request carries the ids flat: a ragged row would hand tokens to its neighbour.
        n = tensors["key"].shape[1]
        for i, row in enumerate(token_ids):
            if len(row) != n:
                raise ValueError(
                    f"token_ids[{i}] holds {len(row)} ids but key has {n} new tokens per "
                    "sequence (dimension 1)"
                )
