"""Argument checks the control plane's calls share: names, namespaces, batches, and, against
a manager's state, the sequence a call names, a layer, and a length against capacity.

Each check raises the error its call documents, with a message saying what was wrong; none
changes anything. The functions taking the manager are also `BlockManager`'s private methods
of the same name with a leading underscore (`_resolve`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

from cache_service.errors import InvalidRequest, LayerNotWritten, SequenceLost, SequenceNotFound

if TYPE_CHECKING:
    from cache_service.control.block_manager import BlockManager
    from cache_service.control.sequence import Sequence

__all__ = [
    "MAX_NAME",
    "MAX_NAMESPACE",
    "batch_items",
    "check_layer",
    "check_length",
    "check_name",
    "check_namespace",
    "not_found",
    "resolve",
    "start_of",
    "written_on",
]

# Ids and tenant names are echoed in messages and stored in snapshots: keep them bounded.
MAX_NAME = 256
"""Characters a sequence id, tenant or worker id may have."""

MAX_NAMESPACE = 256
"""Characters a prefix-cache namespace may have."""


def check_name(what: str, value: object) -> None:
    """Raise InvalidRequest naming `what` unless `value` is a non-empty str of at most
    `MAX_NAME` characters."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise InvalidRequest(f"{what} must be a non-empty str of at most {MAX_NAME} characters")


def check_namespace(namespace: object) -> None:
    """Raise InvalidRequest unless `namespace` is a printable str of at most 256 characters
    ("" is the default namespace)."""
    if not isinstance(namespace, str):
        raise InvalidRequest(f"namespace must be a str, got {type(namespace).__name__}")
    if len(namespace) > MAX_NAMESPACE or not namespace.isprintable():
        raise InvalidRequest(
            f"namespace must be printable and at most {MAX_NAMESPACE} characters, got "
            f"{len(namespace)} characters{'' if namespace.isprintable() else ' (unprintable)'}"
        )


def batch_items(writes: SequenceABC[Any], *fields: str) -> list[tuple[Any, ...]]:
    """A batch of ``(seq_id, <fields>...)`` items as a list, each sequence at most once.

    Raises:
        InvalidRequest: an item of another shape, a seq_id that is not a str, a sequence
            named twice.
    """
    items = list(writes)
    seen: set[str] = set()
    shape = "pair" if len(fields) == 1 else "tuple"
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 1 + len(fields):
            raise InvalidRequest(f"each write must be a (seq_id, {', '.join(fields)}) {shape}")
        if not isinstance(item[0], str):
            raise InvalidRequest("each write's seq_id must be a str")
        if item[0] in seen:
            raise InvalidRequest(f"sequence {item[0]!r} appears twice in one batch")
        seen.add(item[0])
    return items


def not_found(seq_id: object) -> SequenceNotFound:
    """The error for a seq_id this tenant has no sequence under."""
    # One message for unknown ids and ids of other tenants: nothing to probe.
    shown = seq_id if isinstance(seq_id, str) and len(seq_id) <= MAX_NAME else "<invalid>"
    return SequenceNotFound(f"no sequence {shown!r} for this tenant")


def resolve(m: BlockManager, tenant: str, seq_id: str) -> Sequence:
    """The tenant's live sequence `seq_id`.

    Raises:
        SequenceLost: its blocks went with a lost worker.
        SequenceNotFound: no such sequence for this tenant.
    """
    seq = m._seqs.get(seq_id) if isinstance(seq_id, str) else None
    if seq is not None and seq.tenant == tenant:
        return seq
    lost = m._lost.get(seq_id) if isinstance(seq_id, str) else None
    if lost is not None and lost.tenant == tenant:
        raise SequenceLost(
            f"sequence {seq_id!r} lost its KV blocks with worker {lost.worker_id!r}; "
            "free it and recompute"
        )
    raise not_found(seq_id)


def written_on(m: BlockManager, seq: Sequence, layer: int, caller: str) -> int:
    """written(layer) of a resolved sequence, refusing None, a bad layer and nothing
    written (what attending over one layer needs)."""
    if layer is None:
        raise InvalidRequest(f"{caller} needs one layer, got None")
    check_layer(m, layer)
    seq_len = seq.written[layer]
    if seq_len == 0:
        raise LayerNotWritten(f"layer {layer} of sequence {seq.seq_id!r} has nothing written")
    return seq_len


def check_layer(m: BlockManager, layer: object) -> None:
    """Raise InvalidRequest unless `layer` is an int in [0, num_layers)."""
    if type(layer) is not int or not 0 <= layer < m._num_layers:
        raise InvalidRequest(f"layer must be an int in [0, {m._num_layers}) or None, got {layer!r}")


def start_of(m: BlockManager, seq: Sequence, layer: int | None) -> int:
    """written(layer) of a resolved sequence; for None, the length every layer shares.

    Raises:
        InvalidRequest: a bad layer, or None while the layers' lengths differ.
    """
    written = seq.written
    if layer is None:
        first = written[0]
        if written.count(first) != len(written):
            raise InvalidRequest(
                "layer=None needs every layer's written length equal, got "
                f"min {min(written)} max {max(written)}"
            )
        return first
    check_layer(m, layer)
    return written[layer]


def check_length(m: BlockManager, field: str, tokens: int, what: str | None = None) -> None:
    """Refuse `tokens` tokens for one sequence past `max_sequence_tokens` (before the
    call counts or changes anything). With no worker registered, the call's own
    PoolExhausted says so instead.

    Raises:
        InvalidRequest: naming `field`, the length and the capacity.
    """
    cap = m.max_sequence_tokens()
    if tokens <= cap or not m._pools:
        return
    blocks = cap // m._bs
    said = what if what is not None else f" has {tokens} tokens"
    raise InvalidRequest(
        f"{field}{said}, more than any sequence can hold on this service: {cap} tokens "
        f"({blocks} blocks of {m._bs} tokens over {len(m._pools)} workers)"
    )
