"""workers.channel_wire: tensors laid out in an arena (aligned, bounded, bit for bit), the
references that replace them in messages, and the checks a malformed reference meets."""

from __future__ import annotations

import pickle

import pytest
import torch

from workers.channel_wire import (
    ALIGN,
    HEADER,
    ArenaFull,
    ArenaLayout,
    ArenaTensor,
    ArenaViews,
    ChannelProtocolError,
    FileTensor,
    frame,
    join,
    split,
    view,
)
from workers.staging import packed_offsets


def _arena(nbytes: int = 1 << 16) -> ArenaViews:
    return ArenaViews(torch.zeros(nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int32])
def test_put_then_view_is_bit_exact_and_aligned(dtype: torch.dtype) -> None:
    views = _arena()
    layout = ArenaLayout(views, start=3)
    source = torch.arange(3 * 5 * 7).reshape(3, 5, 7).to(dtype)
    strided = source.transpose(0, 2)  # not contiguous: copied as its values
    refs = [layout.put(source), layout.put(strided)]
    for ref, want in zip(refs, [source, strided], strict=True):
        assert ref.offset % ALIGN == 0
        got = views(ref)
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    assert refs[0].offset == ALIGN  # start 3 rounded up
    assert layout.end % ALIGN == 0 and layout.end >= refs[1].offset + strided.nbytes


def test_key_value_query_lie_as_a_decode_graph_loads_them() -> None:
    # workers.decode_graphs copies a step's key, value and query to the GPU in one copy
    # when they lie at workers.staging's offsets; the channel must place them that way.
    views = _arena()
    layout = ArenaLayout(views)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    query = torch.randn(5, 8, 16).half()
    refs = [layout.put(t) for t in (key, value, query)]
    offsets, _ = packed_offsets((key, value, query))
    assert [r.offset - refs[0].offset for r in refs] == offsets


def test_a_tensor_that_does_not_fit_raises_arena_full_and_leaves_the_layout() -> None:
    views = _arena(4096)
    layout = ArenaLayout(views)
    layout.put(torch.zeros(512, dtype=torch.float32))  # 2048 bytes
    end = layout.end
    with pytest.raises(ArenaFull, match="do not fit an arena of 4096 bytes"):
        layout.put(torch.zeros(1024, dtype=torch.float32))
    assert layout.end == end
    layout.put(torch.zeros(512, dtype=torch.float32))  # exactly the rest


def test_place_names_a_tensor_already_in_the_arena_without_copying() -> None:
    views = _arena()
    layout = ArenaLayout(views)
    ref, room = layout.reserve((4, 4), torch.float32)
    room.fill_(2.0)
    after = layout.end
    assert layout.place(room) == ref
    assert layout.end == after  # nothing new reserved
    elsewhere = torch.ones(4, 4)
    placed = layout.place(elsewhere)
    assert placed.offset == after and torch.equal(views(placed), elsewhere)
    assert layout.find(room.t()) is None  # not contiguous: copied when placed


def test_views_are_reused_and_change_with_the_arena() -> None:
    views = _arena()
    ref = ArenaTensor(256, "float32", (2, 3))
    first = views(ref)
    assert views(ref) is first
    views.arena[256 : 256 + 24].view(torch.float32).copy_(torch.arange(6.0))
    assert first.flatten().tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "ref, message",
    [
        (ArenaTensor(65536 - 8, "float32", (4,)), "lies outside the arena"),
        (ArenaTensor(-256, "float32", (1,)), "lies outside the arena"),
        (ArenaTensor(0, "float32", (-1, 4)), "lies outside the arena"),
        (ArenaTensor(0, "complex128", (1,)), "no tensor dtype is named 'complex128'"),
    ],
)
def test_a_malformed_reference_is_refused(ref: ArenaTensor, message: str) -> None:
    views = _arena()
    with pytest.raises(ChannelProtocolError, match=message):
        views(ref)
    with pytest.raises(ChannelProtocolError, match=message):
        view(views.arena, ref)


def test_split_join_round_trip_through_pickle() -> None:
    views = _arena()
    layout = ArenaLayout(views)
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int64)
    in_file = FileTensor(2, 4096, "float16", (2, 8))
    args = ("epoch", 7, [1, 2, 3], a, b, in_file, None)
    kwargs = {"out": b, "scale": None, "parts": [a, in_file], "nested": [[a]]}
    placed: list[ArenaTensor] = []

    def place(t: torch.Tensor) -> ArenaTensor:
        placed.append(layout.put(t))
        return placed[-1]

    wire = pickle.dumps((split(args, place), split(kwargs, place), split(a, place)))
    # a, b, kwargs' out, the first of the parts, the lone a; the nested one goes by value
    assert len(placed) == 5
    # The references travel as plain tuples: no class of this module in the pickle.
    assert b"channel_wire" not in wire and b"ArenaTensor" not in wire
    named: list[object] = []

    def tensor_of(ref: ArenaTensor | FileTensor) -> torch.Tensor:
        named.append(ref)
        return views(ref) if type(ref) is ArenaTensor else torch.zeros(2, 8).half()

    args_w, kwargs_w, lone_w = pickle.loads(wire)
    got_args, got_kwargs, got_lone = (join(*w, tensor_of) for w in (args_w, kwargs_w, lone_w))
    assert named == [placed[0], placed[1], in_file, placed[2], placed[3], in_file, placed[4]]
    assert type(got_args) is tuple and got_args[:3] == ("epoch", 7, [1, 2, 3])
    assert torch.equal(got_args[3], a) and torch.equal(got_args[4], b)
    assert torch.equal(got_args[5], torch.zeros(2, 8).half()) and got_args[6] is None
    assert torch.equal(got_kwargs["out"], b) and got_kwargs["scale"] is None
    assert torch.equal(got_kwargs["nested"][0][0], a) and torch.equal(got_lone, a)
    parts = got_kwargs["parts"]  # a tensor in parts: a list of the parts, each placed
    assert type(parts) is list and torch.equal(parts[0], a)
    assert torch.equal(parts[1], torch.zeros(2, 8).half())
    assert split((1, "x", None), place) == ((1, "x", None), ())
    assert split(5, place) == (5, ())


@pytest.mark.parametrize(
    ("plain", "refs", "message"),
    [
        ((None,), ((0, "zz", 1),), "unknown tensor reference"),
        ((None,), ((0, "a", 0, "float32"),), "unknown tensor reference"),
        ((None,), ((3, "a", 0, "float32", (4,)),), "no item"),
        ({"x": None}, (("y", "a", 0, "float32", (4,)),), "no key"),
        (None, ((0, "a", 0, "float32", (4,)),), "malformed"),
        ((None,), "junk", "malformed"),
        # Tensors in parts: none, a part that is not a tensor reference, not a tuple.
        ((None,), ((0, "p", ()),), "malformed tensor in parts"),
        ((None,), ((0, "p", (("e", "x", 1),)),), "malformed tensor in parts"),
        ((None,), ((0, "p", [("a", 0, "float32", (4,))]),), "unknown tensor reference"),
    ],
)
def test_join_refuses_malformed_references(plain: object, refs: object, message: str) -> None:
    with pytest.raises(ChannelProtocolError, match=message):
        join(plain, refs, lambda ref: torch.zeros(4))


def test_frame_prefixes_the_lengths_and_the_payload_offset() -> None:
    message = b"abc" * 100
    framed = frame(message)
    assert HEADER.unpack(framed[: HEADER.size]) == (300, 0, 0)
    assert framed[HEADER.size :] == message
    assert HEADER.unpack(frame(message, 4096, 512)[: HEADER.size]) == (300, 4096, 512)
