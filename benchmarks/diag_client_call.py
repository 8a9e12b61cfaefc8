"""The client's own work per `append_attend_batch` call (a diagnostic).

Everything `KVCacheClient.append_attend_batch` does around the Session stream, with no
server: staging the tensors into a shared-memory region (a file here, as the server's
would be), encoding the request, parsing a canned reply and copying the output out. The
stream answers at once with a reply pointing at the output slice, so the figure is the
client's Python and torch work alone; the transport's cost is `service_breakdown.py`'s
"client process CPU" minus this.

    PYTHONPATH=. python3 benchmarks/diag_client_call.py --batch 32
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import tempfile
import timeit
from typing import Any

import torch

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service.client import KVCacheClient
from cache_service.client_shared_memory import SharedMemoryPath
from cache_service.tensor_codec import dtype_to_proto

_REGION_BYTES = 4 << 20


class _Region:
    """What CreateSharedRegion answers: a region backed by a temporary file."""

    def __init__(self, path: str) -> None:
        self.region_id = "diag-region"
        self.path = path
        self.size_bytes = _REGION_BYTES


def fake_client(path: str, query: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> Any:
    """A client whose region is the file at `path` and whose stream answers every call
    with the reply the server would send for `query`'s output."""
    client = KVCacheClient("127.0.0.1:1", shared_memory=True, local_session=False)  # no I/O
    client._shm = SharedMemoryPath(lambda size, timeout: _Region(path), lambda r, t: None)
    client._call_ids = itertools.repeat(1)  # the canned reply answers call 1
    staged = client._shm.stage(tensors, [(query.dtype, tuple(query.shape))], None)
    assert staged is not None
    region_id, offset = staged.outputs[0]
    staged.done()
    reply = pb.SessionResponse(call_id=1)
    out = reply.append_attend_batch.output
    out.dtype = dtype_to_proto(query.dtype)
    out.shape.extend(query.shape)
    out.shared.region_id = region_id
    out.shared.offset = offset
    raw = reply.SerializeToString()
    client._session.call = lambda request, timeout_s: raw
    return client


def main() -> None:
    """Time (and with --profile, profile) the client's work per call."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dt = getattr(torch, args.dtype)
    b = args.batch
    k = torch.randn(b, 1, args.kv_heads, args.head_dim).to(dt)
    q = torch.randn(b, 1, args.q_heads, args.head_dim).to(dt)
    seq_ids = [f"seq-{i:032x}" for i in range(b)]
    fd, path = tempfile.mkstemp(prefix="kvcache-diag-")
    try:
        os.ftruncate(fd, _REGION_BYTES)
        client = fake_client(path, q, (k, k, q))

        def call() -> None:
            client.append_attend_batch(3, seq_ids, [[7]] * b, k, k, q)

        call()
        per_call = min(timeit.repeat(call, number=args.calls, repeat=3)) / args.calls
        print(
            f"batch={b} dtype={args.dtype} q_heads={args.q_heads} kv_heads={args.kv_heads} "
            f"head_dim={args.head_dim}"
        )
        print(f"client work per append_attend_batch (no transport): {per_call * 1e6:.1f} us")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                call()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        client.close()
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()
