"""Rounds (workers.round.Round) for tests: the one data call of a pool, a worker or a
worker client, built from the arguments a test has at hand.

Each function takes the target first: a ``KVPool`` (arguments as below), a ``PoolWorker``
or a ``WorkerClient`` (the epoch first, then the same arguments; a client's call returns
a coroutine). ``to_host`` applies to a pool only. Page ids (``*_pages``) are turned back
into block ids and layers here: the pool makes the pages itself.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.actor import PoolWorker
from workers.checks import AttendOptions
from workers.pool import KVPool
from workers.round import Round

__all__ = [
    "attend",
    "attend_pages",
    "round_form",
    "run",
    "write_and_attend",
    "write_and_attend_layers",
    "write_and_attend_pages",
]

_OPTION_NAMES = ("causal", "return_lse", "scale", "sliding_window", "softcap")


def run(target: Any, round: Round, to_host: bool = False) -> Any:
    """`round` on `target`: ``KVPool.run_round``, ``PoolWorker.run_round`` (the round's
    epoch as the fence) or ``WorkerClient.run_round`` (a coroutine)."""
    if isinstance(target, KVPool) or getattr(target, "pool_like", False):
        return target.run_round(round, to_host=to_host)
    if isinstance(target, PoolWorker):
        return target.run_round(round.epoch, round)
    return target.run_round(round)


def round_form(round: Round) -> str:
    """How the pool runs `round`: "attend" (no write), "one_layer" (one layer, whole
    tensors) or "over_layers" (several layers or in parts: over pages)."""
    if round.slot_mapping is None:
        return "attend"
    in_parts = type(round.query) is list or type(round.key) is list
    return "one_layer" if type(round.layers) is int and not in_parts else "over_layers"


def _split(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], positional: int) -> Any:
    """(epoch, the call's own positional args, options, step key, to_host, the rest)."""
    pool = isinstance(target, KVPool) or getattr(target, "pool_like", False)
    epoch = "" if pool else args[0]
    own = args if pool else args[1:]
    # A worker's or a client's causal and return_lse may come positionally after the call's.
    for name, value in zip(("causal", "return_lse"), own[positional:], strict=False):
        kwargs[name] = value
    own = own[:positional]
    options = AttendOptions(**{k: kwargs.pop(k) for k in _OPTION_NAMES if k in kwargs})
    step_key = kwargs.pop("metadata_key", kwargs.pop("step_key", None))
    to_host = kwargs.pop("to_host", False)
    return epoch, own, options, step_key, to_host, kwargs


def write_and_attend(target: Any, *args: Any, **kwargs: Any) -> Any:
    """A round on one layer: ``(layer, slot_mapping, key, value, query, block_tables,
    seq_lens, query_start_loc)``, options, ``metadata_key``, ``out``, ``check_finite``."""
    epoch, own, options, key, to_host, rest = _split(target, args, kwargs, 8)
    layer, slots, k, v, q, tables, lens, starts = own
    r = Round(
        epoch, layer, q, tables, lens, starts, slots, k, v, None, options,
        rest.pop("check_finite", False), key, rest.pop("out", None),
    )  # fmt: skip
    assert not rest, rest
    return run(target, r, to_host)


def attend(target: Any, *args: Any, **kwargs: Any) -> Any:
    """An attend-only round on one layer: ``(layer, query, block_tables, seq_lens,
    query_start_loc)``, options, ``metadata_key``."""
    epoch, own, options, key, to_host, rest = _split(target, args, kwargs, 5)
    layer, q, tables, lens, starts = own
    assert not rest, rest
    return run(
        target, Round(epoch, layer, q, tables, lens, starts, options=options, step_key=key), to_host
    )


def write_and_attend_layers(target: Any, *args: Any, **kwargs: Any) -> Any:
    """A round over layers: ``(seq_layers, slot_layers, slot_mapping, key, value, query,
    block_tables, seq_lens, query_start_loc)`` (block ids and slots per layer), options,
    ``metadata_key``, ``out``, ``check_finite``."""
    epoch, own, options, key, to_host, rest = _split(target, args, kwargs, 9)
    seq_layers, slot_layers, slots, k, v, q, tables, lens, starts = own
    r = Round(
        epoch, seq_layers, q, tables, lens, starts, slots, k, v, slot_layers,
        options, rest.pop("check_finite", False), key, rest.pop("out", None),
    )  # fmt: skip
    assert not rest, rest
    return run(target, r, to_host)


def _num_layers(target: Any) -> tuple[int, int]:
    """(layers, block size) of `target`'s layout."""
    if isinstance(target, KVPool):
        layout = target.layout
    elif isinstance(target, PoolWorker):
        layout = target.pool.layout
    else:
        layout = target.worker.pool.layout
    return layout.num_layers, layout.block_size


def _unpaged(target: Any, page_tables: Any) -> tuple[torch.Tensor, list[int]]:
    """Page tables as (per-layer block tables, each sequence's layer: its first page's)."""
    n, _ = _num_layers(target)
    pages = torch.as_tensor(page_tables, dtype=torch.int64)
    layers = (pages[:, 0] % n).tolist() if pages.shape[0] else []
    return (pages // n).to(torch.int32), layers


def _unpaged_slots(target: Any, page_slots: Any) -> tuple[list[int], list[int]]:
    """Page slots as (per-layer slots, each new token's layer); negative slots kept."""
    n, bs = _num_layers(target)
    slots, layers = [], []
    for s in torch.as_tensor(page_slots).tolist():
        if s < 0:
            slots.append(s)
            layers.append(0)
            continue
        page = s // bs
        slots.append((page // n) * bs + s % bs)
        layers.append(page % n)
    return slots, layers


def write_and_attend_pages(target: Any, *args: Any, **kwargs: Any) -> Any:
    """A round over layers addressed by page ids: ``(slot_mapping, key, value, query,
    block_tables, seq_lens, query_start_loc)`` in pages, options, ``out``,
    ``check_finite``."""
    epoch, own, options, key, to_host, rest = _split(target, args, kwargs, 7)
    page_slots, k, v, q, page_tables, lens, starts = own
    tables, seq_layers = _unpaged(target, page_tables)
    slots, slot_layers = _unpaged_slots(target, page_slots)
    r = Round(
        epoch, seq_layers, q, tables, lens, starts, slots, k, v, slot_layers, options,
        rest.pop("check_finite", False), key, rest.pop("out", None),
    )  # fmt: skip
    assert not rest, rest
    return run(target, r, to_host)


def attend_pages(target: Any, *args: Any, **kwargs: Any) -> Any:
    """An attend-only round over layers addressed by page ids: ``(query, block_tables,
    seq_lens, query_start_loc)`` in pages, options."""
    epoch, own, options, key, to_host, rest = _split(target, args, kwargs, 4)
    q, page_tables, lens, starts = own
    tables, seq_layers = _unpaged(target, page_tables)
    assert not rest, rest
    r = Round(epoch, seq_layers, q, tables, lens, starts, options=options, step_key=key)
    return run(target, r, to_host)


def _round_of_call(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Round:
    """The round a worker call of one of the removed per-form methods would be: `args`
    with the epoch first, as ``PoolWorker`` took them."""
    kwargs = dict(kwargs)
    epoch, own = args[0], args[1:]
    sizes = {"write_and_attend": 8, "attend": 5, "write_and_attend_layers": 9}
    n = sizes[method]
    for name, value in zip(("causal", "return_lse"), own[n:], strict=False):
        kwargs[name] = value
    own = own[:n]
    options = AttendOptions(**{k: kwargs.pop(k) for k in _OPTION_NAMES if k in kwargs})
    key = kwargs.pop("metadata_key", None)
    finite = kwargs.pop("check_finite", False)
    assert not kwargs, kwargs
    if method == "attend":
        layer, q, tables, lens, starts = own
        return Round(epoch, layer, q, tables, lens, starts, options=options, step_key=key)
    if method == "write_and_attend":
        layer, slots, k, v, q, tables, lens, starts = own
        return Round(epoch, layer, q, tables, lens, starts, slots, k, v, None, options, finite, key)
    seq_layers, slot_layers, slots, k, v, q, tables, lens, starts = own
    return Round(
        epoch, seq_layers, q, tables, lens, starts, slots, k, v, slot_layers, options,
        finite, key,
    )  # fmt: skip


def wire_call(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """A call as the worker channel sends it: a round as ``run_round`` with its epoch then
    its fields (``Round.wire_fields``) and its step key; other methods as they are."""
    if method not in ("write_and_attend", "attend", "write_and_attend_layers"):
        return method, args, kwargs
    r = _round_of_call(method, args, kwargs)
    return "run_round", (r.epoch, *r.wire_fields()), {"step_key": r.step_key}


def channel_call(
    target: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any = None
) -> Any:
    """``target.call`` (a WorkerChannel or ChannelPool) of the call `wire_call` makes."""
    return target.call(*wire_call(method, args, kwargs), out)
