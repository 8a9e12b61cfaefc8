"""Bad arguments raise KernelArgumentError (a ValueError) naming the argument, and nothing is
written, on both the Triton and the torch path."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch

import kernels
from kernels import KernelArgumentError
from kernels.testing import make_paged_batch

BACKENDS = ["torch", "triton"]


def batch():
    return make_paged_batch(
        [20, 9, 1], [3, 1, 1], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=1
    )


def call_attention(
    b, backend: str, out: torch.Tensor, check_values: bool = True, **changes
) -> None:
    args = dict(
        query=b.query,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        block_tables=b.block_tables,
        seq_lens=b.seq_lens,
        query_start_loc=b.query_start_loc,
    )
    kwargs = {"out": out, "check_values": check_values}
    for k, v in changes.items():
        (args if k in args else kwargs)[k] = v
    kernels.paged_attention(*args.values(), backend=backend, **kwargs)


def _tables_with(b, row: int, col: int, value: int) -> torch.Tensor:
    t = b.block_tables.clone()
    t[row, col] = value
    return t


# (id, changes(b) -> dict of replaced arguments, expected words in the message)
ATTENTION_CASES: list[tuple[str, Callable, str]] = [
    ("query_2d", lambda b: {"query": b.query[:, 0]}, "query must be 3-D"),
    ("value_shape", lambda b: {"value_cache": b.value_cache[:, :1]}, "value_cache shape"),
    ("query_dtype", lambda b: {"query": b.query.double()}, "query must have dtype"),
    ("cache_dtype", lambda b: {"query": b.query.half()}, "query dtype"),
    ("head_dim", lambda b: {"query": b.query[..., :8]}, "head_dim"),
    ("heads_divide", lambda b: {"query": torch.randn(5, 3, 16)}, "not a positive multiple"),
    ("cache_layout", lambda b: {"key_cache": b.key_cache.transpose(2, 3).contiguous().transpose(2, 3)}, "key_cache must be contiguous"),
    ("table_dtype", lambda b: {"block_tables": b.block_tables.float()}, "block_tables must have dtype"),
    ("seq_lens_len", lambda b: {"seq_lens": b.seq_lens[:2]}, "seq_lens has 2 entries"),
    ("qsl_len", lambda b: {"query_start_loc": b.query_start_loc[:3]}, "query_start_loc has 3"),
    ("device", lambda b: {"seq_lens": b.seq_lens.to("meta")}, "seq_lens is on meta"),
    ("block_id_high", lambda b: {"block_tables": _tables_with(b, 1, 0, 10**6)}, "block_tables row 1"),
    ("block_id_negative", lambda b: {"block_tables": _tables_with(b, 0, 2, -1)}, "block_tables row 0"),
    ("seq_len_beyond_table", lambda b: {"seq_lens": torch.tensor([20, 9, 99], dtype=torch.int32)}, "seq_lens[2] exceeds"),
    ("seq_len_negative", lambda b: {"seq_lens": torch.tensor([20, -1, 1], dtype=torch.int32)}, "seq_lens[1] is negative"),
    ("q_beyond_seq_len", lambda b: {"seq_lens": torch.tensor([2, 9, 1], dtype=torch.int32)}, "sequence 0 has more query tokens"),
    ("qsl_decreasing", lambda b: {"query_start_loc": torch.tensor([0, 3, 2, 5], dtype=torch.int32)}, "decreases at sequence 1"),
    ("qsl_end", lambda b: {"query_start_loc": torch.tensor([0, 1, 2, 3], dtype=torch.int32)}, "query_start_loc[-1]"),
    ("qsl_start", lambda b: {"query_start_loc": torch.tensor([1, 3, 4, 5], dtype=torch.int32)}, "query_start_loc[0]"),
    ("scale_nan", lambda b: {"scale": math.nan}, "scale"),
    ("window_zero", lambda b: {"sliding_window": 0}, "sliding_window"),
    ("window_float", lambda b: {"sliding_window": 2.5}, "sliding_window"),
    ("softcap_negative", lambda b: {"softcap": -1.0}, "softcap"),
    ("out_shape", lambda b: {"out": torch.zeros(5, 4, 8)}, "out shape"),
    ("out_dtype", lambda b: {"out": torch.zeros(5, 4, 16, dtype=torch.float16)}, "out dtype"),
]  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("changes", "words"), [c[1:] for c in ATTENTION_CASES], ids=[c[0] for c in ATTENTION_CASES]
)
def test_paged_attention_rejects(backend: str, changes: Callable, words: str) -> None:
    b = batch()
    sentinel = torch.full_like(b.query, 7.0)
    out = sentinel.clone()
    cache_before = b.key_cache.clone()
    replaced = changes(b)
    if "out" in replaced:
        out = replaced.pop("out")
        sentinel = out.clone()
    with pytest.raises(KernelArgumentError, match=re.escape(words)) as info:
        call_attention(b, backend, out, **replaced)
    assert isinstance(info.value, ValueError)
    assert torch.equal(out, sentinel) and torch.equal(b.key_cache, cache_before)


# The cases that need the index tensors' contents (check_values); the rest read metadata only.
VALUE_CASES = {
    "block_id_high", "block_id_negative", "seq_len_beyond_table", "seq_len_negative",
    "q_beyond_seq_len", "qsl_decreasing", "qsl_end", "qsl_start",
}  # fmt: skip
METADATA_CASES = [c for c in ATTENTION_CASES if c[0] not in VALUE_CASES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("changes", "words"), [c[1:] for c in METADATA_CASES], ids=[c[0] for c in METADATA_CASES]
)
def test_paged_attention_default_still_checks_metadata(
    backend: str, changes: Callable, words: str
) -> None:
    """The default (no value checks) still refuses every malformed shape, dtype, layout,
    device or option, and writes nothing."""
    b = batch()
    out = torch.full_like(b.query, 7.0)
    replaced = changes(b)
    if "out" in replaced:
        out = replaced.pop("out")
    sentinel = out.clone()
    args = dict(zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                     "query_start_loc"), b.args(), strict=True))  # fmt: skip
    kwargs = {"out": out}
    for k, v in replaced.items():
        (args if k in args else kwargs)[k] = v
    with pytest.raises(KernelArgumentError, match=re.escape(words)):
        kernels.paged_attention(*args.values(), backend=backend, **kwargs)
    assert torch.equal(out, sentinel)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_reads_no_index_values_by_default(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The public call's default is the fast path: the value checks (a device-to-host read
    on CUDA) run only when asked for, and both settings give the same answer."""
    import kernels.validation as validation

    b = batch()
    checked = kernels.paged_attention(*b.args(), backend=backend, check_values=True)
    calls = []
    real = validation._check_attention_values
    monkeypatch.setattr(
        validation, "_check_attention_values", lambda *a: calls.append(a) or real(*a)
    )
    fast = kernels.paged_attention(*b.args(), backend=backend)
    assert calls == []
    kernels.paged_attention(*b.args(), backend=backend, check_values=True)
    assert len(calls) == 1
    torch.testing.assert_close(fast, checked, rtol=0, atol=0)


@pytest.mark.parametrize("check_values", [True, False])
def test_remembered_signature_still_rejects(check_values: bool) -> None:
    """The metadata checks remember a passing call's signature; a later call that differs
    only where the signature does not look (index values) is still value-checked, and one
    that differs in an option's type (True == 1 as a key) is checked in full."""
    b = batch()
    out = torch.zeros_like(b.query)
    for _ in range(2):  # the second call hits the remembered signature
        kernels.paged_attention(
            *b.args(), scale=1, sliding_window=1, out=out, check_values=check_values
        )
    if check_values:
        with pytest.raises(KernelArgumentError, match="block_tables row 1"):
            kernels.paged_attention(
                *b.args()[:3], _tables_with(b, 1, 0, 10**6), *b.args()[4:], scale=1,
                sliding_window=1, out=out, check_values=True,
            )  # fmt: skip
    with pytest.raises(KernelArgumentError, match="scale"):
        kernels.paged_attention(*b.args(), scale=True, sliding_window=1, out=out)
    with pytest.raises(KernelArgumentError, match="sliding_window"):
        kernels.paged_attention(*b.args(), scale=1, sliding_window=True, out=out)
    with pytest.raises(KernelArgumentError, match=re.escape("query must be a torch.Tensor")):
        kernels.paged_attention(b.query.tolist(), *b.args()[1:], check_values=check_values)
    with pytest.raises(KernelArgumentError, match="scale"):
        kernels.paged_attention(*b.args(), scale=[1.0], check_values=check_values)


def test_backend_names() -> None:
    b = batch()
    with pytest.raises(KernelArgumentError, match="backend must be"):
        kernels.paged_attention(*b.args(), backend="cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    b = batch()
    if b.query.is_cuda:
        pytest.skip("CPU tensors only")
    with pytest.raises(KernelArgumentError, match="TRITON_INTERPRET"):
        kernels.paged_attention(*b.args(), backend="triton")


def caches(num_blocks=6, hkv=2, bs=4, d=16):
    pool = torch.randn(num_blocks, 2, hkv, bs, d)
    return pool[:, 0], pool[:, 1]


WRITE_CASES = [
    ("slot_high", {"slot_mapping": torch.tensor([0, 24, 3])}, "slot 24, outside"),
    ("slot_duplicate", {"slot_mapping": torch.tensor([5, 1, 5])}, "more than once"),
    ("slot_float", {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])}, "slot_mapping must have dtype"),
    ("slot_count", {"slot_mapping": torch.tensor([0, 1])}, "slot_mapping has 2 entries"),
    ("key_dtype", {"key": torch.randn(3, 2, 16).half()}, "key dtype"),
    ("key_heads", {"key": torch.randn(3, 1, 16)}, "key shape"),
    ("value_tokens", {"value": torch.randn(4, 2, 16)}, "value has 4 tokens"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("changes", "words"), [c[1:] for c in WRITE_CASES], ids=[c[0] for c in WRITE_CASES]
)
def test_write_kv_rejects(backend: str, changes: dict, words: str) -> None:
    kc, vc = caches()
    before_k, before_v = kc.clone(), vc.clone()
    args = {
        "key": torch.randn(3, 2, 16),
        "value": torch.randn(3, 2, 16),
        "slot_mapping": torch.tensor([0, 1, 2]),
    }
    args.update(changes)
    with pytest.raises(KernelArgumentError, match=re.escape(words)):
        kernels.write_kv(args["key"], args["value"], kc, vc, args["slot_mapping"], backend=backend)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("src", "dst", "words"),
    [
        ([0, 9], [1, 2], "src holds a block id outside"),
        ([0, 1], [2, -1], "dst holds a block id outside"),
        ([0, 1], [3, 3], "dst names one block more than once"),
        ([0, 1, 2], [3, 4], "src has 3 entries but dst has 2"),
    ],
)
def test_copy_blocks_rejects(backend: str, src: list, dst: list, words: str) -> None:
    kc, vc = caches()
    before = kc.clone()
    with pytest.raises(KernelArgumentError, match=re.escape(words)):
        kernels.copy_blocks(kc, vc, torch.tensor(src), torch.tensor(dst), backend=backend)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_reject(backend: str) -> None:
    kc, vc = caches()
    before = kc.clone()
    with pytest.raises(KernelArgumentError, match="block_ids holds a block id outside"):
        kernels.gather_blocks(kc, vc, torch.tensor([0, 6]), backend=backend)
    blocks = torch.randn(2, *kc.shape[1:])
    with pytest.raises(KernelArgumentError, match="key_blocks shape"):
        kernels.scatter_blocks(kc, vc, torch.tensor([0, 1, 2]), blocks, blocks, backend=backend)
    with pytest.raises(KernelArgumentError, match="more than once"):
        kernels.scatter_blocks(kc, vc, torch.tensor([4, 4]), blocks, blocks, backend=backend)
    with pytest.raises(KernelArgumentError, match="value_blocks dtype"):
        kernels.scatter_blocks(kc, vc, torch.tensor([0, 1]), blocks, blocks.half(), backend=backend)
    assert torch.equal(kc, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_rejects(backend: str) -> None:
    outs = torch.randn(2, 3, 4, 16)
    with pytest.raises(KernelArgumentError, match="lses must be float32"):
        kernels.merge_attention_states(
            outs, torch.zeros(2, 3, 4, dtype=torch.float64), backend=backend
        )
    with pytest.raises(KernelArgumentError, match="lses shape"):
        kernels.merge_attention_states(outs, torch.zeros(2, 3, 5), backend=backend)
    with pytest.raises(KernelArgumentError, match="at least one part"):
        kernels.merge_attention_states(outs[:0], torch.zeros(0, 3, 4), backend=backend)
