"""A Round: one worker call of an attention round, as plain data.

A coordinator's round writes new tokens' K/V into their slots and runs paged attention
over a batch of sequences, on one layer or on several (each sequence on its own layer: the
callers of a round are often a layer apart). Whatever the shape of the round, the worker
gets one :class:`Round` and decides itself how to run it (`workers.pool.KVPool.run_round`):
one layer, or the pool seen as pages of every layer (page ``block * num_layers + layer``,
made on the worker's device), replaying a CUDA graph where the round's step is known.

A Round is data only (tensors, lists and scalars), so it can cross a process boundary: Ray
pickles it, and the worker channel sends its fields as a flat tuple (`wire_fields`,
`from_wire`) in which every tensor sits at the top level, where the channel places it in
its arena or names it in a client's shared file.

The step key names a planned step (or a planned round of several steps) for the worker:
its block tables, lengths, query offsets and slots are validated and kept on the device
under the key on first sight, and a later round under the same key (the step's other
layers) reuses them. The coordinator never names other content with a key it used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from workers.checks import AttendOptions

__all__ = ["WIRE_FIELDS", "Round"]


@dataclass(slots=True)
class Round:
    """One worker call of an attention round: a write of new tokens (optional) then the
    attention of a batch of sequences.

    Attributes:
        epoch: the worker epoch the caller expects (a restarted worker refuses the round).
        layers: the layer of every sequence and new token (an int), or each sequence's
            layer (a list of ``S`` ints; `slot_layers` then names each new token's).
        query: ``[T, Hq, D]`` in the pool dtype, or in parts (a list of ``[T_i, Hq, D]``,
            rows joined in order: each caller's rows where it put them).
        block_tables: int32 ``[S, max_blocks]`` block ids of the pool, per layer (never page
            ids); None: the step's, which the worker holds under `step_key`.
        seq_lens: int32 ``[S]`` keys per sequence (None with `block_tables`).
        query_start_loc: int32 ``[S + 1]`` query row offsets (None with `block_tables`).
        slot_mapping: the new tokens' flat slots ``[n]`` (``block * block_size + offset``;
            negative: skipped), a list of ints or an int tensor; None: attend only.
        key, value: ``[n, Hkv, D]`` new K/V in the pool dtype, or in parts (as `query`).
        slot_layers: with a list `layers`, each new token's layer (``[n]`` ints).
        options: the attention options (`workers.checks.AttendOptions`; None: defaults).
        check_finite: refuse a NaN or infinity in key, value or query (NonFiniteInput),
            writing nothing; checked on the worker's device.
        step_key: the planned step's (or round's) key, an int; None for a one-off.
        out: host memory for the output: ``[T, Hq, D]`` of the pool dtype, or one part
            per query part; a worker that can deliver there does (the result is then
            `out`), others return the output.
    """

    epoch: str
    layers: int | list[int]
    query: Any
    block_tables: Any = None
    seq_lens: Any = None
    query_start_loc: Any = None
    slot_mapping: Any = None
    key: Any = None
    value: Any = None
    slot_layers: list[int] | None = None
    options: AttendOptions | None = None
    check_finite: bool = False
    step_key: int | None = None
    out: Any = None

    def metadata(self) -> tuple[Any, Any, Any]:
        """``(block_tables, seq_lens, query_start_loc)``: the kernel's index tensors."""
        return self.block_tables, self.seq_lens, self.query_start_loc

    def with_tensors(self, fn: Callable[[Any], Any]) -> Round:
        """This round with `fn` applied to each tensor field (each part of one given in
        parts; a slot list of ints is left as it is): how the Ray path packs and unpacks a
        round's tensors (workers.transport)."""
        fields = {}
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if type(value) is list:
                if value and type(value[0]) is not int:
                    fields[name] = [fn(v) for v in value]
            elif value is not None:
                fields[name] = fn(value)
        return replace(self, **fields)

    def wire_fields(self) -> tuple[Any, ...]:
        """The fields the worker channel sends as a flat tuple (tensors at the top level,
        the options as a plain tuple), the epoch, step key and output aside: the channel
        fences the epoch, keys its repeats on the step key and places the output itself.
        :meth:`from_wire` is the inverse."""
        options = self.options
        plain = None if options is None else _plain_options(options)
        return (
            self.layers,
            self.slot_mapping,
            self.key,
            self.value,
            self.query,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.slot_layers,
            plain,
            self.check_finite,
        )

    @classmethod
    def from_wire(
        cls, epoch: str, fields: Sequence[Any], step_key: int | None = None, out: Any = None
    ) -> Round:
        """The round :meth:`wire_fields` gave `fields` for (the options validated again).

        Raises:
            InvalidWorkerRequest: not the fields of a round, or malformed options.
        """
        from workers.checks import AttendOptions
        from workers.errors import InvalidWorkerRequest

        if len(fields) != len(WIRE_FIELDS):
            raise InvalidWorkerRequest(
                f"a round travels as {len(WIRE_FIELDS)} fields, got {len(fields)}"
            )
        (layers, slots, key, value, query, tables, lens, starts, slot_layers, plain, finite) = (
            fields
        )
        if plain is not None and (type(plain) is not tuple or len(plain) != 5):
            raise InvalidWorkerRequest(f"a round's options must be a 5-tuple, got {plain!r}")
        options = None if plain is None else AttendOptions(*plain)
        return cls(
            epoch, layers, query, tables, lens, starts, slots, key, value, slot_layers,
            options, finite, step_key, out,
        )  # fmt: skip


# The names of `Round.wire_fields`, in order (the worker channel's keyed positions count
# from them: workers.channel_wire.KEYED_ARGUMENTS). Key, value and query come one after the
# other because the channel lays tensors out in the arena in argument order, and a CUDA
# worker loads the three in one copy when they lie as its graph's buffers do
# (workers.staging.packed_offsets).
WIRE_FIELDS = (
    "layers",
    "slot_mapping",
    "key",
    "value",
    "query",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "slot_layers",
    "options",
    "check_finite",
)

_TENSOR_FIELDS = (
    "query",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "slot_mapping",
    "key",
    "value",
    "out",
)


def _plain_options(options: AttendOptions) -> tuple[Any, ...]:
    """`options` as a plain tuple, in AttendOptions' field order."""
    return (
        options.causal,
        options.return_lse,
        options.scale,
        options.sliding_window,
        options.softcap,
    )
