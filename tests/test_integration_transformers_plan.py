"""BatchPlan: which columns of a left-padded batch each service sequence receives (pure logic)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service.integrations.batch_plan import BatchPlan


def test_prefill_without_cache_sends_every_real_token_and_no_padding() -> None:
    plan = BatchPlan(pads=[3, 0, 1], cached=[0, 0, 0], prompt_columns=6)
    assert plan.consumed == 0
    step = plan.plan(6)
    assert [(r.first_column, r.count, r.start_position) for r in step.rows] == [
        (3, 3, 0),
        (0, 6, 0),
        (1, 5, 0),
    ]
    plan.commit(step)
    assert plan.written == (3, 6, 5)
    assert plan.consumed == 6
    decode = plan.plan(1)
    assert [(r.first_column, r.count, r.start_position) for r in decode.rows] == [
        (6, 1, 3),
        (6, 1, 6),
        (6, 1, 5),
    ]


def test_prefix_hit_moves_the_prefill_start_to_the_first_uncached_column() -> None:
    # Row 0: 4 pads + 16 cached -> next column 20; row 1: 0 pads + 16 cached -> 16.
    plan = BatchPlan(pads=[4, 0], cached=[16, 16], prompt_columns=24)
    assert plan.consumed == 16
    step = plan.plan(24 - 16)
    assert [(r.first_column, r.count, r.start_position) for r in step.rows] == [
        (20, 4, 16),
        (16, 8, 16),
    ]
    assert step.tokens_sent == 12


def test_rejects_rows_with_nothing_left_to_compute() -> None:
    with pytest.raises(ValueError, match="leaves no prompt token"):
        BatchPlan(pads=[0], cached=[8], prompt_columns=8)
    with pytest.raises(ValueError, match="rows"):
        BatchPlan(pads=[0, 1], cached=[0], prompt_columns=8)
    with pytest.raises(ValueError, match="at least one row"):
        BatchPlan(pads=[], cached=[], prompt_columns=8)
    with pytest.raises(ValueError, match=">= 0"):
        BatchPlan(pads=[-1], cached=[0], prompt_columns=8)


def test_rejects_empty_steps_and_stale_commits() -> None:
    plan = BatchPlan(pads=[0], cached=[0], prompt_columns=4)
    with pytest.raises(ValueError, match="at least one column"):
        plan.plan(0)
    first = plan.plan(4)
    plan.commit(first)
    with pytest.raises(ValueError, match="not the current step"):
        plan.commit(first)
    assert plan.written == (4,)


def test_expected_mask_marks_only_padding() -> None:
    plan = BatchPlan(pads=[2, 0], cached=[0, 0], prompt_columns=4)
    assert plan.expected_mask(1, 5) == [[0, 1, 1, 1], [1, 1, 1, 1]]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 40), st.integers(1, 40), st.integers(0, 3)), min_size=1, max_size=5
    ),
    chunks=st.lists(st.integers(1, 17), min_size=1, max_size=8),
    decode_steps=st.integers(0, 5),
)
def test_every_real_token_is_sent_exactly_once_in_order(
    rows: list[tuple[int, int, int]], chunks: list[int], decode_steps: int
) -> None:
    """Whatever the padding, prefix hits and prefill chunking: each row's sequence receives
    positions cached, cached+1, ... contiguously, never a padding column, never twice."""
    lengths = [n for _, n, _ in rows]
    width = max(lengths) + max(p for p, _, _ in rows)
    pads = [width - n for n in lengths]
    # cached = whole blocks of 8, always leaving the last prompt token to compute
    cached = [min(k * 8, (n - 1) // 8 * 8) for (_, n, k) in rows]
    plan = BatchPlan(pads, cached, width)
    received: list[list[int]] = [
        list(range(pads[b], pads[b] + cached[b])) for b in range(len(pads))
    ]
    columns = width - plan.consumed
    sizes = []
    for c in chunks:
        if columns <= 0:
            break
        sizes.append(min(c, columns))
        columns -= sizes[-1]
    if columns > 0:
        sizes.append(columns)
    sizes += [1] * decode_steps
    for size in sizes:
        step = plan.plan(size)
        end = step.start_column + size
        for r in step.rows:
            assert r.first_column + r.count == end
            assert r.count == 0 or r.first_column >= pads[r.row]
            assert r.start_position == len(received[r.row])
            received[r.row].extend(range(r.first_column, r.first_column + r.count))
        plan.commit(step)
    for b in range(len(pads)):
        assert received[b] == list(range(pads[b], plan.consumed))
        assert plan.written[b] == plan.consumed - pads[b]
