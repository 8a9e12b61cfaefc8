"""A co-located client's leased decode steps, stage by stage, without a model.

Against `kvcache serve` in a process of its own (in-process pools on the device), a client
on the same host runs decode steps the way the transformers integration does: one
StepLease call planning `--lease-steps` decode steps of one new token per sequence
(naming the client's lease connection, so the grant opens the lease for it and the reply
carries the plan), the lease opened here from that plan, every layer of each step run
here on the worker's mapped pool (`LeaseClient.run_layer`), the step's finite flags
fetched without waiting and the next step taken from the lease (`LeaseClient.advance`),
then, after the lease's last step, the end that reports them. Per batch size it prints
the p50 and p90 of each stage's host time: the StepLease call, the open, taking the next
step, a leased layer (the service's own cost around the kernels: input copies, the write
and the attention launched or replayed as a graph; on a GPU the kernels run meanwhile),
the end (which waits for the device to finish the lease's last layers), and all of the
lease's own stages spread over its steps. On a GPU it also times a step's last layer on
the device (CUDA events around the call, the device idle before it; not the first, whose
stream also waits for the worker's event).

    .venv/bin/python benchmarks/bench_leases.py --smoke       # CPU, seconds
    source .device/env.sh && python3 benchmarks/bench_leases.py --h200
        # the 1.1B Llama-shaped layout of bench_transformers --h200, batch 1 / 8 / 32

Prints a Markdown report (date, machine, command first).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from bench_transformers import ServedProcess

from cache_service.client import KVCacheClient
from workers.lease_client import LeaseClient


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--h200", action="store_true", help="CUDA, the 1.1B layout, bf16")
    mode.add_argument("--smoke", action="store_true", help="CPU, few steps (seconds)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per batch size")
    parser.add_argument(
        "--lease-steps",
        type=int,
        default=16,
        help="decode steps one lease covers (as SessionConfig.lease_steps; 1: a lease a step)",
    )
    args = parser.parse_args(argv)
    per_lease = args.lease_steps
    if per_lease < 1:
        parser.error("--lease-steps must be at least 1")
    if args.h200:
        device, dtype, (layers, kv_heads, head_dim, q_heads) = "cuda", "bfloat16", (16, 8, 64, 32)
        batches, steps, context = (1, 8, 32), args.steps or 60, 512
    else:
        device, dtype, (layers, kv_heads, head_dim, q_heads) = "cpu", "float32", (4, 4, 32, 8)
        batches = (1, 8) if args.smoke else (1, 8, 32)
        steps, context = args.steps or (8 if args.smoke else 60), 64
    flags = [
        "--num-layers", str(layers), "--num-kv-heads", str(kv_heads),
        "--head-dim", str(head_dim), "--block-size", "16", "--dtype", dtype,
        "--num-workers", "1", "--blocks-per-worker", "4096", "--device", device, "--in-process",
    ]  # fmt: skip
    dev, tdt = torch.device(device), getattr(torch, dtype)
    name = torch.cuda.get_device_name(dev) if device == "cuda" else "CPU"
    print("# Leased decode steps, by stage")
    print()
    print(f"- date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}")
    print(f"- command: `benchmarks/bench_leases.py {' '.join(sys.argv[1:])}`".rstrip())
    print(
        f"- device: {name} ({platform.machine()}, {os.cpu_count()} cores); torch "
        f"{torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"- layout: {layers} layers, {q_heads} query / {kv_heads} KV heads, head_dim "
        f"{head_dim}, {dtype}; contexts of {context} tokens; {steps} steps per row, "
        f"{per_lease} per lease; service: `kvcache serve` process, in-process pools"
    )
    print()
    print(
        "| batch | StepLease p50 / p90, us | open p50, us | next step p50, us "
        "| leased layer p50 / p90, us | end p50, us | the lease's stages per step, us "
        "| last layer on the device p50, us |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with ServedProcess(flags) as served, KVCacheClient(served.address) as client:
        prompt = list(range(1, context + 1))
        for batch in batches:
            ids = [client.create_sequence(prompt).seq_id for _ in range(batch)]
            grant = client.lease_step(ids, q_heads, [prompt] * batch)
            if grant is None or not grant.granted:
                raise SystemExit(f"no lease: {grant and grant.reason}")
            rows = batch * context
            leases = LeaseClient(grant.socket, dev)
            k = torch.randn(rows, kv_heads, head_dim, device=dev, dtype=tdt)
            q = torch.randn(rows, q_heads, head_dim, device=dev, dtype=tdt)
            opened = leases.open(grant.lease_id)
            for layer in range(layers):
                leases.run_layer(opened, layer, k, k, q)
            leases.end(opened)
            k1, q1 = k[:batch], q[:batch]
            connections = {leases.path: leases.connection}
            lease_t, open_t, next_t, layer_t, end_t, device_t = [], [], [], [], [], []
            # The first lease's steps capture graphs: timed from the second lease on.
            warm = per_lease if per_lease > 1 else 3
            opened = None
            for step in range(steps + warm):
                timed = step >= warm
                if opened is not None and opened.more_steps:
                    t = time.perf_counter()
                    leases.step_refused(opened)
                    leases.advance(opened, [7] * batch)
                    if timed:
                        next_t.append(time.perf_counter() - t)
                else:
                    if opened is not None:
                        t = time.perf_counter()
                        leases.end(opened)
                        if timed:
                            end_t.append(time.perf_counter() - t)
                    t0 = time.perf_counter()
                    grant = client.lease_step(
                        ids,
                        q_heads,
                        [[7]] * batch,
                        lease_connections=connections,
                        steps=per_lease,
                    )
                    t1 = time.perf_counter()
                    if grant is None or not grant.granted:
                        raise SystemExit(f"no lease: {grant and grant.reason}")
                    opened = leases.open(grant.lease_id, grant.plan)
                    if timed:
                        lease_t.append(t1 - t0)
                        open_t.append(time.perf_counter() - t1)
                for layer in range(layers):
                    t = time.perf_counter()
                    if device == "cuda" and step >= 3 and layer == layers - 1:
                        begin, done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        torch.cuda.synchronize()
                        begin.record()
                        leases.run_layer(opened, layer, k1, k1, q1)
                        done.record()
                        done.synchronize()
                        device_t.append(begin.elapsed_time(done) * 1e-3)
                        continue
                    leases.run_layer(opened, layer, k1, k1, q1)
                    if timed:
                        layer_t.append(time.perf_counter() - t)
                leases.fetch_flags(opened)
            if opened is not None:
                t = time.perf_counter()
                leases.end(opened)
                end_t.append(time.perf_counter() - t)
            leases.close()
            for seq_id in ids:
                client.free(seq_id)
            on_device = f"{_p(device_t, 0.5):.0f}" if device_t else "-"
            per_step = (sum(lease_t) + sum(open_t) + sum(next_t) + sum(end_t)) / steps * 1e6
            print(
                f"| {batch} | {_p(lease_t, 0.5):.0f} / {_p(lease_t, 0.9):.0f} | "
                f"{_p(open_t, 0.5):.0f} | {f'{_p(next_t, 0.5):.0f}' if next_t else '-'} | "
                f"{_p(layer_t, 0.5):.0f} / {_p(layer_t, 0.9):.0f} | "
                f"{statistics.median(end_t) * 1e6:.0f} | {per_step:.0f} | {on_device} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
