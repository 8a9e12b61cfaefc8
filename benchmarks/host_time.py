"""Host time per paged-attention call: the launcher and the public API (a diagnostic).

Why it matters: ``do_bench`` (and a decode loop without CUDA graphs) sees the kernel only
while the host enqueues calls faster than the GPU runs them. With the L2 flush in front of
every timed call, the window is the flush (~65 us on the H200) plus the kernel; a launcher
slower than that times the host (notes-kernels.md, v9: 98 us per split call on a slow host
read 0.57x SDPA at B=1 x 32768).

Two modes:

* on a CUDA device: real calls without a sync (``bench_kernels.host_us``), for the
  launcher as ``bench_kernels`` calls it (explicit config), the launcher choosing its
  config, the public ``kernels.paged_attention(check_values=False)``, and dense SDPA on the
  same data as the yardstick;
* ``--mock`` (CPU-only machines): the same Python work on CPU tensors of the benchmark's
  shapes, with Triton's compiled-kernel launch replaced by a no-op and the few CUDA queries
  (device, stream, capture) stubbed. It times everything up to the launch itself, so the
  launcher's own cost can be iterated on without a GPU; the driver's launch (and, for
  tensor arguments, Triton's per-pointer ``data_ptr`` call and attribute query) is not in
  it.

    PYTHONPATH=. python3 benchmarks/host_time.py [--mock] [--calls N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

CASES = ((1, 32768), (4, 16384), (64, 4096), (256, 128))


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Median over 5 bursts of ``calls // 5`` calls of host microseconds per call; ``sync``
    drains the device between bursts so a launch never waits on a full queue."""
    for _ in range(50):
        fn()
    sync()
    bursts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        bursts.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
        sync()
    return sorted(bursts)[2]


def _install_mock() -> None:
    """Stub the CUDA queries and the compiled kernel's launch (CPU-only machines)."""
    import torch

    import kernels
    import kernels.attention as attention
    import kernels.launch as launch

    class _Compiled:
        function = 0
        packed_metadata = (4, 1, 0)

        @staticmethod
        def run(*args: object) -> None:
            return None

    class _FakeJit:
        def __init__(self, real: object) -> None:
            self.arg_names = real.arg_names
            self.__name__ = getattr(real, "__name__", "kernel")

        def __getitem__(self, grid: object) -> Callable[..., _Compiled]:
            return lambda *a, **k: _Compiled()

    # The public API's dispatch: Triton whatever the device (here: CPU tensors).
    kernels._use_triton = lambda backend, device: True
    attention.num_sms = lambda device: 132  # the H200's, so the split cases split
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    launch.current_stream_handle = lambda device: 0
    if hasattr(attention, "current_stream_handle"):
        attention.current_stream_handle = lambda device: 0
    launcher = attention._ATTENTION_LAUNCHER
    launcher._fn = _FakeJit(launcher._fn)
    launcher._direct = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mock", action="store_true", help="CPU tensors, stubbed launch")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--label", default="", help="a name for this tree in the output")
    args = parser.parse_args(argv)
    if args.mock:
        os.environ["TRITON_INTERPRET"] = "0"
    import torch

    import kernels
    from kernels.attention import choose_config, num_sms, paged_attention_triton
    from kernels.validation import check_paged_attention_args

    if args.mock:
        _install_mock()
        device = "cpu"

        def sync() -> None:
            return None

    else:
        if not torch.cuda.is_available():
            print("needs a CUDA device (or --mock)", file=sys.stderr)
            return 2
        device = "cuda"
        sync = torch.cuda.synchronize

    rows = []
    for batch_size, kv_len in CASES:
        blocks = kv_len // 16
        q = torch.randn(batch_size, 32, 128, device=device).to(torch.bfloat16)
        pool = torch.empty(
            batch_size * blocks + 3, 2, 8, 16, 128, dtype=torch.bfloat16, device=device
        )
        kc, vc = pool[:, 0], pool[:, 1]
        tables = torch.randperm(batch_size * blocks, device=device).to(torch.int32)
        # One spare table column, as bench_kernels' batches have.
        tables = torch.cat(
            [tables.view(batch_size, blocks), torch.full((batch_size, 1), -1, device=device)], 1
        ).to(torch.int32)
        lens = torch.full((batch_size,), kv_len, dtype=torch.int32, device=device)
        qsl = torch.arange(batch_size + 1, dtype=torch.int32, device=device)
        call = (q, kc, vc, tables, lens, qsl)
        problem = check_paged_attention_args(
            *call, scale=None, sliding_window=None, softcap=None, out=None, check_values=False
        )
        config = choose_config(problem, q.dtype, 132 if args.mock else num_sms(q.device))
        fns: dict[str, Callable[[], object]] = {
            "launcher, config given": lambda c=call, p=problem, cfg=config: paged_attention_triton(
                *c, p, config=cfg
            ),
            "launcher, config chosen": lambda c=call, p=problem: paged_attention_triton(*c, p),
            "public API, check_values=False": lambda c=call: kernels.paged_attention(
                *c, check_values=False
            ),
            "validation alone": lambda c=call: check_paged_attention_args(
                *c, scale=None, sliding_window=None, softcap=None, out=None, check_values=False
            ),
        }
        if not args.mock:
            k = torch.empty(batch_size, 8, kv_len, 128, dtype=torch.bfloat16, device=device)
            qd = q.view(batch_size, 1, 32, 128).transpose(1, 2).contiguous()

            def sdpa(qd=qd, k=k, b=batch_size) -> object:
                out = torch.nn.functional.scaled_dot_product_attention(qd, k, k, enable_gqa=True)
                return out.transpose(1, 2).reshape(b, -1, 128)

            fns["dense SDPA (yardstick)"] = sdpa
        row = {"case": f"B={batch_size} x L={kv_len}", "partitions": config.num_partitions}
        for name, fn in fns.items():
            row[name] = round(per_call_us(fn, args.calls, sync), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del pool, kc, vc, call
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "mock": args.mock, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
