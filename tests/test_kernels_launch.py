"""The cached launcher's specialization key (pure logic; the direct launch itself is
exercised by the GPU tests, whose repeated calls go through it)."""

from __future__ import annotations

import pytest
import torch

import kernels.launch as launch_module
from kernels.launch import CachedLauncher, _arg_key


def test_tensor_key_tracks_dtype_and_alignment() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    assert _arg_key(buf) == _arg_key(buf[8:])  # 16 bytes further: still aligned
    assert _arg_key(buf) != _arg_key(buf[1:])  # 2 bytes off
    assert _arg_key(buf) != _arg_key(buf.float())


def test_int_key_tracks_what_triton_specializes() -> None:
    assert _arg_key(32) == _arg_key(48)  # both multiples of 16
    assert _arg_key(1) != _arg_key(17)  # 1 is specialized as a constant
    assert _arg_key(16) != _arg_key(17)  # divisibility by 16
    assert _arg_key(2**31 - 16) != _arg_key(2**31 + 16)  # int32 vs int64
    assert _arg_key(True) != _arg_key(1)  # bool is not int


def test_float_key_ignores_value() -> None:
    assert _arg_key(0.125) == _arg_key(3.0)


def test_interpreter_always_goes_through_the_jit(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    class FakeJit:
        arg_names = ("x", "N")

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = CachedLauncher(FakeJit())
    for _ in range(3):
        launcher((1, 1, 1), (7,), {"N": 4}, num_warps=4)
    assert len(calls) == 3 and calls[0] == ((1, 1, 1), (7,), {"N": 4, "num_warps": 4})


# --- Launch plans of the paged-attention launcher (kernels.launch_plans.LaunchPlan) --------
# On a CPU-only machine the compiled kernel is replaced by a recorder, so these check the
# host logic: the plan launches exactly the arguments the full path passed (tensors as
# their addresses), once per call shape, and declines what it cannot launch.


class _Recorder:
    """Stands in for a compiled kernel: records every launch's arguments."""

    function = 7
    packed_metadata = (4, 1, 0)

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def run(self, *args: object) -> None:
        self.launches.append(args)


class _RecordingJit:
    def __init__(self, real: object, kernel: _Recorder) -> None:
        self.arg_names = real.arg_names
        self.__name__ = "recording_jit"
        self.kernel = kernel
        self.jit_calls = 0

    def __getitem__(self, grid: tuple) -> object:
        def launch(*args: object, **keywords: object) -> _Recorder:
            self.jit_calls += 1
            constexprs = [keywords[n] for n in self.arg_names[len(args) :]]
            self.kernel.run(*grid, None, None, None, None, None, None, *args, *constexprs)
            return self.kernel

        return launch


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch):
    """The attention launcher with a recording kernel, direct launches on, CUDA queries
    stubbed (capture state switchable through the returned dict)."""
    import kernels.attention as attention
    import kernels.launch_plans as launch_plans
    import kernels.split_buffers as split_buffers

    kernel = _Recorder()
    real = attention._ATTENTION_LAUNCHER._fn
    launcher = CachedLauncher(real)
    jit = _RecordingJit(real, kernel)
    launcher._fn = jit
    launcher._direct = True
    state = {"capturing": False, "jit": jit, "kernel": kernel}
    monkeypatch.setattr(attention, "_ATTENTION_LAUNCHER", launcher)
    monkeypatch.setattr(launch_plans, "PLANS", {})
    monkeypatch.setattr(split_buffers, "_BUFFERS", {})
    monkeypatch.setattr(attention, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(split_buffers, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(launch_module, "current_stream_handle", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return state


def _as_pointers(args: tuple) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def _batch():
    from kernels.testing import make_paged_batch

    return make_paged_batch(
        [300, 45], [1, 1], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=8, seed=3
    )


@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.parametrize("return_lse", [False, True])
def test_plan_launches_what_the_full_path_launched(recorded, parts: int, return_lse: bool) -> None:
    from dataclasses import replace

    from kernels.attention import choose_config, paged_attention_triton
    from kernels.validation import check_paged_attention_args

    b = _batch()
    problem = check_paged_attention_args(
        *b.args(), scale=None, sliding_window=None, softcap=None, out=None
    )
    cfg = replace(choose_config(problem, b.query.dtype, 4), num_partitions=parts, fused_merge=True)
    out = torch.empty_like(b.query)
    for _ in range(3):
        o, lse = paged_attention_triton(
            *b.args(), problem, config=cfg, out=out, return_lse=return_lse
        )
        assert o is out and (lse is not None) == return_lse
    jit, launches = recorded["jit"], recorded["kernel"].launches
    assert jit.jit_calls == 1 and len(launches) == 3
    grid = launches[0][:3]
    assert grid[2] == parts
    # The full path's arguments (after the JIT's 9 launch slots) as addresses: the plan's
    # launches pass the same ones, apart from the LSE buffer, new on every call.
    first = _as_pointers(launches[0][9:])
    for later in launches[1:]:
        assert later[:3] == grid
        args = later[9:]
        assert all(not isinstance(a, torch.Tensor) for a in args)
        lse_slot = 7
        assert args[:lse_slot] == first[:lse_slot]
        assert args[lse_slot + 1 :] == first[lse_slot + 1 :]
        if not return_lse:
            assert args[lse_slot] == out.data_ptr()


def _launch_paths(kernel: _Recorder) -> list[str]:
    """Which path made each recorded launch: the full one passes tensors, a plan addresses."""
    return [
        "full" if any(isinstance(a, torch.Tensor) for a in args) else "plan"
        for args in kernel.launches
    ]


def test_plan_is_per_call_shape_and_declines_misalignment_and_capture(recorded) -> None:
    from kernels.attention import paged_attention_triton
    from kernels.validation import check_paged_attention_args

    b = _batch()
    problem = check_paged_attention_args(
        *b.args(), scale=None, sliding_window=None, softcap=None, out=None
    )
    paged_attention_triton(*b.args(), problem)
    paged_attention_triton(*b.args(), problem)
    # Another option is another plan.
    paged_attention_triton(*b.args(), problem, softcap=30.0)
    paged_attention_triton(*b.args(), problem, softcap=30.0)
    # A query 4 bytes off 16-byte alignment: the same key, declined by the plan.
    store = torch.empty(b.query.numel() + 1, dtype=b.query.dtype)
    q_off = store[1:].view_as(b.query)
    paged_attention_triton(q_off, *b.args()[1:], problem)
    # Under capture the split buffers must be the graph's own: the full path, no new plan.
    recorded["capturing"] = True
    paged_attention_triton(*b.args(), problem)
    recorded["capturing"] = False
    paged_attention_triton(*b.args(), problem)
    assert _launch_paths(recorded["kernel"]) == [
        "full", "plan", "full", "plan", "full", "full", "plan",
    ]  # fmt: skip
