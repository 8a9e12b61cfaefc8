"""A Round (workers.round) as data: it crosses a process boundary and the worker channel
unchanged, and a pool serves a round that names its step's metadata by key alone."""

from __future__ import annotations

import pickle

import pytest
import torch

from workers.checks import AttendOptions
from workers.errors import InvalidWorkerRequest, NonFiniteInput
from workers.layout import KVLayout
from workers.pool import KVPool
from workers.round import WIRE_FIELDS, Round

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def _pool(seed: int) -> KVPool:
    pool = KVPool(LAYOUT, 16, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def _round(layer: int = 1, step_key: int | None = 7, seed: int = 1) -> Round:
    """A decode round of 3 sequences (one new token and one query row each)."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    lens = torch.tensor([5, 9, 12], dtype=torch.int32)
    slots = [int(tables[s, (n - 1) // 4]) * 4 + (n - 1) % 4 for s, n in enumerate(lens)]
    k, v = (torch.randn(3, 2, 16, generator=gen) for _ in range(2))
    q = torch.randn(3, 4, 16, generator=gen)
    starts = torch.arange(4, dtype=torch.int32)
    return Round(
        "e", layer, q, tables, lens, starts, slots, k, v,
        options=AttendOptions(return_lse=True, scale=0.5), check_finite=True, step_key=step_key,
    )  # fmt: skip


def _same(a: Round, b: Round) -> None:
    for name in Round.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x == y, name


def test_a_round_pickles_and_travels_as_its_wire_fields_unchanged() -> None:
    r = _round()
    _same(pickle.loads(pickle.dumps(r)), r)
    fields = r.wire_fields()
    assert len(fields) == len(WIRE_FIELDS)
    # Every tensor at the top level (where the channel places it), the options plain.
    assert type(fields[WIRE_FIELDS.index("options")]) is tuple
    _same(Round.from_wire("e", fields, step_key=7), r)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ((1, 2), "travels as 11 fields"),
        ((*_round().wire_fields()[:-2], ("bad",), False), "options must be a 5-tuple"),
        ((*_round().wire_fields()[:-2], (True, "no", None, None, None), False), "return_lse"),
    ],
)
def test_malformed_wire_fields_are_refused(fields: tuple, message: str) -> None:
    with pytest.raises(InvalidWorkerRequest, match=message):
        Round.from_wire("e", fields)


def test_a_round_naming_its_steps_metadata_by_key_alone_answers_as_with_it() -> None:
    # The step's first round sends its metadata; a later round (another layer) may leave
    # it out and name the step's key only: the same answer as a round that sends it.
    keyed, plain = _pool(3), _pool(3)
    first = _round(layer=0)
    keyed.run_round(first)
    plain.run_round(_round(layer=0, step_key=None))
    hits = keyed.metadata_hits
    later = _round(layer=2, seed=2)
    later.block_tables = later.seq_lens = later.query_start_loc = None
    out, lse = keyed.run_round(later)
    want_out, want_lse = plain.run_round(_round(layer=2, step_key=None, seed=2))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert keyed.metadata_hits == hits + 1
    assert torch.equal(keyed.data, plain.data)


def test_a_kept_steps_layers_share_its_plans_and_answer_as_unkept_rounds() -> None:
    # A CPU pool derives the write's rows and the attention's gathers once per kept step
    # (and per masking: a window plans apart); every layer answers bit for bit as a round
    # without a key, and a layer with a NaN writes nothing there either.
    keyed, plain = _pool(3), _pool(3)
    windowed = AttendOptions(return_lse=True, scale=0.5, sliding_window=3)
    for layer, options in [(0, None), (1, windowed), (2, None)]:
        rounds = [_round(layer=layer, step_key=key, seed=5) for key in (7, None)]
        if options is not None:
            rounds[0].options = rounds[1].options = options
        (out, lse), (want_out, want_lse) = keyed.run_round(rounds[0]), plain.run_round(rounds[1])
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), layer
    assert torch.equal(keyed.data, plain.data)
    entry = keyed._metadata.get(7)
    assert entry is not None and len(entry.derived) == 3  # write rows, two attention plans
    poisoned = _round(layer=1, seed=5)
    poisoned.query[0, 0, 0] = float("nan")
    before = keyed.data.clone()
    with pytest.raises(NonFiniteInput):
        keyed.run_round(poisoned)
    assert torch.equal(keyed.data, before)


@pytest.mark.parametrize("step_key", [None, 99])
def test_a_round_without_metadata_under_no_kept_key_is_refused_and_writes_nothing(
    step_key: int | None,
) -> None:
    pool = _pool(4)
    before = pool.data.clone()
    r = _round(step_key=step_key)
    r.block_tables = r.seq_lens = r.query_start_loc = None
    with pytest.raises(InvalidWorkerRequest, match="block tables"):
        pool.run_round(r)
    assert torch.equal(pool.data, before)


def test_a_rounds_key_value_and_query_lie_in_the_channel_arena_as_a_graph_loads_them() -> None:
    # The channel places a message's tensors in argument order; a CUDA worker's decode
    # graph loads key, value and query in one copy only when they lie at
    # workers.staging.packed_offsets (on the H100 a field order with the query first left
    # every decode round to three copies).
    from workers.channel_wire import ArenaLayout, ArenaViews, split
    from workers.staging import packed_offsets

    r = _round()
    layout = ArenaLayout(ArenaViews(torch.zeros(1 << 16, dtype=torch.uint8)))
    _, refs = split((r.epoch, *r.wire_fields()), layout.put)
    at = {where: ref for where, *ref in refs}
    kvq = [at[1 + WIRE_FIELDS.index(name)] for name in ("key", "value", "query")]
    offsets = [ref[1] for ref in kvq]  # (tag, offset, dtype, shape)
    want, _ = packed_offsets((r.key, r.value, r.query))
    assert [o - offsets[0] for o in offsets] == want, refs
