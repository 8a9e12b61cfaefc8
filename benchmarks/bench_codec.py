"""Host cost of encoding and decoding one per-layer append-and-attend call (CPU only).

What the client and the servicer spend per call outside the network and the coordinator:
the request's encoding (client) and decoding (server), and the reply's encoding (server) and
decoding (client), for the per-item AppendAttend and the AppendAttendBatch RPC, for a decode
batch of the Llama-3-8B layout (32 sequences, 8 KV / 32 query heads,
head_dim 128, bf16, one new token and one query row each). Each row is the median of
many calls on one core.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_codec.py --out benchmarks/results/codec-cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client import _batch_results, _results
from cache_service.request_codec import encode_append_attend, encode_append_attend_batch
from cache_service.request_decode import decode_append_attend, decode_append_attend_batch
from cache_service.result_codec import encode_batch_result, encode_results
from cache_service.tensor_codec import tensor_to_proto
from cache_service.worker_interface import AttentionResult
from workers.layout import KVLayout


def median_us(fn: Callable[[], object], calls: int) -> float:
    """Median wall time of one call of `fn`, microseconds (after 20 untimed calls)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    b, hkv, hq, d, dt = args.batch, 8, 32, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(b, 1, hkv, d, generator=gen).to(dt)
    value = torch.randn(b, 1, hkv, d, generator=gen).to(dt)
    query = torch.randn(b, 1, hq, d, generator=gen).to(dt)
    seq_ids = [f"{i:032x}" for i in range(b)]
    tokens = [[7]] * b

    def api_request() -> bytes:
        req = pb.AppendAttendRequest(layer=3)
        for i, s in enumerate(seq_ids):
            req.items.add(
                seq_id=s,
                token_ids=tokens[i],
                key=tensor_to_proto(key[i]),
                value=tensor_to_proto(value[i]),
                query=tensor_to_proto(query[i]),
            )
        return req.SerializeToString()

    def items_request() -> bytes:
        return encode_append_attend(
            3, seq_ids, tokens, list(key), list(value), list(query), return_lse=False
        )

    def batch_tensors_request() -> bytes:
        return encode_append_attend(3, seq_ids, tokens, key, value, query, return_lse=False)

    def batch_rpc_request() -> bytes:
        return encode_append_attend_batch(3, seq_ids, tokens, key, value, query, False)

    request = batch_tensors_request()
    batch_request = batch_rpc_request()
    layout = KVLayout(num_layers=32, num_kv_heads=hkv, head_dim=d, block_size=16, dtype="bfloat16")
    if pb.AppendAttendRequest.FromString(request) != pb.AppendAttendRequest.FromString(
        api_request()
    ):
        raise SystemExit("the codec's request differs from the protobuf API's")
    out = torch.randn(b, 1, hq, d, generator=gen).to(dt)
    results = [AttentionResult(out[i], None) for i in range(b)]

    def api_reply() -> bytes:
        reply = pb.AppendAttendResponse()
        for r in results:
            reply.results.add(output=tensor_to_proto(r.out))
        return reply.SerializeToString()

    reply = encode_results(results, False)
    if reply != api_reply():
        raise SystemExit("the codec's reply differs from the protobuf API's")
    batch_reply = encode_batch_result(out, None)
    rows = [
        ("AppendAttend: client request, protobuf API (one message per item)", api_request),
        ("AppendAttend: client request, `request_codec`, one tensor per item", items_request),
        ("AppendAttend: client request, `request_codec`, batch tensors", batch_tensors_request),
        (
            "AppendAttend: server request decode (`decode_append_attend`)",
            lambda: decode_append_attend(pb.AppendAttendRequest.FromString(request)),
        ),
        ("AppendAttend: server reply, protobuf API", api_reply),
        (
            "AppendAttend: server reply, `result_codec` (sent as bytes)",
            lambda: encode_results(results, False),
        ),
        (
            "AppendAttend: client reply decode (`append_attend`)",
            lambda: _results(pb.AppendAttendResponse.FromString(reply).results, False),
        ),
        ("AppendAttendBatch: client request (`append_attend_batch`)", batch_rpc_request),
        (
            "AppendAttendBatch: server request decode (`decode_append_attend_batch`)",
            lambda: decode_append_attend_batch(
                pb.AppendAttendBatchRequest.FromString(batch_request), layout
            ),
        ),
        (
            "AppendAttendBatch: server reply (`encode_batch_result`)",
            lambda: encode_batch_result(out, None),
        ),
        (
            "AppendAttendBatch: client reply decode",
            lambda: _batch_results(pb.AppendAttendBatchResponse.FromString(batch_reply), False),
        ),
    ]
    lines = [
        "# Codec cost of one per-layer append-and-attend call (CPU)",
        "",
        f"- date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.node()} / {platform.machine()} / {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}, torch {torch.__version__}, one torch thread",
        f"- command: `{' '.join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])}`",
        f"- batch {b}, Llama-3-8B heads ({hkv} KV / {hq} query, head_dim {d}), bf16, one "
        f"token and one query row per sequence: AppendAttend request {len(request)} bytes, "
        f"reply {len(reply)} bytes; AppendAttendBatch request {len(batch_request)} bytes, "
        f"reply {len(batch_reply)} bytes; median of {args.calls} calls",
        "",
        "| step | median us |",
        "| --- | ---: |",
    ]
    for label, fn in rows:
        lines.append(f"| {label} | {median_us(fn, args.calls):.1f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
