"""Host cost of two per-call pieces of the Ray path, without I/O (a diagnostic).

* The worker channel's message round trip for one decode-step `write_and_attend` of
  Llama-3-8B heads at batch 32: the coordinator builds the request (key, value, query and
  the output in a client's shared file, the block tables copied into the arena), the
  channel server parses it and answers with the output in place (a stub call), and the
  coordinator reads the reply. No socket, no pool.
* The coordinator's per-sequence locks of a batch of 32, taken and given back.

Prints the best mean of several rounds, microseconds per operation.

    PYTHONPATH=.:benchmarks python3 benchmarks/diag_wire_cost.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

import torch

from cache_service.sequence_locks import SequenceLocks
from cache_service.worker_channel import WorkerChannel
from workers.channel_server import ChannelServer, _Arena
from workers.description import FencedEpoch
from workers.shared_files import SHARED_FILES, create_mapped


class _StubServer(ChannelServer):
    """A channel server's request handling only: the call returns its `out`."""

    def __init__(self) -> None:  # no sockets, no threads
        self._pin = False
        self._call = lambda method, args, kwargs: kwargs["out"]


def _best(run: Any, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def channel_round_trip_us(calls: int, rounds: int) -> float:
    region_path, region = create_mapped("/dev/shm", "kvcache-diag-", 8 << 20)
    arena_path, arena_map = create_mapped("/dev/shm", "kvcache-diag-", 32 << 20)
    try:
        base = torch.frombuffer(region, dtype=torch.uint8)
        SHARED_FILES.add(base.data_ptr(), 8 << 20, (region_path, 8 << 20))

        def at(offset: int, shape: tuple[int, ...]) -> torch.Tensor:
            n = 2 * shape[0] * shape[1] * shape[2]
            return base[offset : offset + n].view(torch.bfloat16).view(shape)

        key, value = at(0, (32, 8, 128)), at(65536, (32, 8, 128))
        query, out = at(131072, (32, 32, 128)), at(1 << 20, (32, 32, 128))
        chan = WorkerChannel(None, torch.empty(32 << 20, dtype=torch.uint8), True, False, False)  # type: ignore[arg-type]
        server, arena = _StubServer(), _Arena.shared_file(arena_map, False)
        tables = torch.zeros(32, 144, dtype=torch.int32)
        lens = torch.full((32,), 2049, dtype=torch.int32)
        starts = torch.arange(33, dtype=torch.int32)
        args = (FencedEpoch("e" * 32, 3), 5, list(range(1000, 1032)), key, value, query)
        args += (tables, lens, starts, True, False)
        kwargs = {"scale": None, "softcap": None, "metadata_key": 1 << 40, "check_finite": True}

        def one() -> None:
            request, out_ref, _, _ = chan._request("write_and_attend", args, kwargs, out)
            reply, _ = server._answer(arena, request)
            ok, got = chan._read_reply(reply, out, out_ref)
            if not ok or got is not out:
                raise RuntimeError(f"the stub round trip failed: {got!r}")

        return _best(one, calls, rounds)
    finally:
        SHARED_FILES.remove(base.data_ptr())
        for path in (region_path, arena_path):
            os.unlink(path)


def batch_locks_us(calls: int, rounds: int) -> float:
    locks = SequenceLocks()
    order = tuple(sorted(f"seq-{i:04d}" for i in range(32)))

    async def main() -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                async with locks.holding(order):
                    pass
            best = min(best, (time.perf_counter() - t0) / calls)
        return best * 1e6

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"channel round trip (no I/O): {channel_round_trip_us(args.calls, args.rounds):.1f} us")
    print(
        f"32 sequence locks, taken and released: {batch_locks_us(args.calls, args.rounds):.1f} us"
    )


if __name__ == "__main__":
    main()
