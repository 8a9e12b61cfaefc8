"""Host cost of launching the paged-attention kernel, piece by piece (a diagnostic).

At small batch the kernel runs for 40-80 us on the H200, so the host's launch path decides
whether `do_bench` (and a real decode loop without CUDA graphs) sees the kernel or the host.
This prints, for a split (B=1 x L=32768) and an unsplit (B=64 x L=4096) decode case, the
host microseconds per call of the whole launcher and a cProfile of it; then the same for a
pool's write-and-attend of a decode step (batch 32 at context 2048, host tensors in, host
output back: what the service's worker does per layer).

    PYTHONPATH=. python3 benchmarks/launch_overhead.py
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.bench_kernels import host_us, problem_of, profile_calls
from kernels.attention import choose_config, num_sms, paged_attention_triton
from kernels.testing import make_paged_batch
from workers.layout import KVLayout
from workers.pool import KVPool


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    for batch_size, kv_len in ((1, 32768), (64, 4096)):
        batch = make_paged_batch(
            [kv_len] * batch_size, [1] * batch_size, num_q_heads=32, num_kv_heads=8,
            head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=1,
        )  # fmt: skip
        problem = problem_of(batch)
        config = choose_config(problem, torch.bfloat16, num_sms(batch.query.device))
        args = batch.args()

        def launcher(args=args, problem=problem, config=config) -> None:
            paged_attention_triton(*args, problem, config=config)

        def empty(q=batch.query) -> None:
            torch.empty_like(q)

        print(f"B={batch_size} x L={kv_len}: {config}")
        print(f"  launcher            {host_us(launcher):7.1f} us/call")
        print(f"  torch.empty_like    {host_us(empty):7.1f} us/call")
        print(profile_calls(launcher, 500, 25))
    pool_step(staged=False)
    pool_step(staged=True)
    return 0


def pool_step(batch: int = 32, context: int = 2048, *, staged: bool = True) -> None:
    """Time and profile KVPool.write_and_attend as the service calls it (with or without
    the pool's one-copy staging of the request)."""
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    per_seq = -(-(context + 64) // 16)
    pool = KVPool(layout, batch * per_seq + 1, "cuda")
    if not staged:
        pool._stager = None  # the diagnostic compares both paths
    tables = torch.arange(batch * per_seq, dtype=torch.int32).reshape(batch, per_seq)
    k = torch.randn(batch, 8, 128).to(torch.bfloat16)
    q = torch.randn(batch, 32, 128).to(torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    lens = torch.full((batch,), context + 1, dtype=torch.int32)
    slots = tables[:, context // 16].long() * 16 + context % 16

    def step() -> None:
        pool.write_and_attend(0, slots, k, k, q, tables, lens, qsl).cpu()

    for _ in range(20):
        step()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    print(
        f"pool write_and_attend B={batch} ctx={context}: p50 {times[100]:.0f} us, "
        f"p90 {times[180]:.0f} us"
    )
    print(profile_calls(step, 200, 25))


if __name__ == "__main__":
    sys.exit(main())
