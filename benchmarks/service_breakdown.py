"""Where the time of one append-and-attend RPC goes (a diagnostic).

One client process runs decode steps against a service whose pools live in this process
(or, with ``--ray``, in a Ray actor reached over its worker channel); per call it reports
the client's end-to-end time, the servicer handler's time, the worker call's time (thread
hop + pool work; over the channel: the round trip, and inside the actor the server's answer
and the call in it), the metrics' mean and the server process's CPU time,
and the call's timeline across both processes (perf_counter is one system-wide monotonic
clock): the client's work before it sends, the request's transit into the servicer, the
session call on the server, the reply's transit back, the client's work after it.
``--transport`` picks the client's (bench_service.TRANSPORTS; default Session stream with
shared-memory tensors). ``--stub`` replaces
the pool's write-and-attend by a zero-cost fake (what is left is the service's own cost).

    PYTHONPATH=. python3 benchmarks/service_breakdown.py --device cuda --dtype bfloat16
"""

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import pstats
import statistics
import time

import torch
from bench_service import TRANSPORTS


def client_main(addr, batch, context, steps, hq, dtype, api, transport, conn):
    from cache_service import call_stream, local_session_stream
    from cache_service.client import AppendAttendItem, KVCacheClient

    torch.set_num_threads(1)
    # When each call's message left and its reply arrived (the Session stream only).
    sends: list[tuple[float, float]] = []
    real_call = call_stream.CallStream.call
    real_local_call = local_session_stream.LocalSessionStream.call

    def timed_call(self, request, timeout_s):
        t_send = time.perf_counter()
        reply = real_call(self, request, timeout_s)
        sends.append((t_send, time.perf_counter()))
        return reply

    def timed_local_call(self, request, timeout_s):
        t_send = time.perf_counter()
        reply = real_local_call(self, request, timeout_s)
        sends.append((t_send, time.perf_counter()))
        return reply

    call_stream.CallStream.call = timed_call
    local_session_stream.LocalSessionStream.call = timed_local_call
    with KVCacheClient(
        addr,
        timeout_s=120,
        session=transport.session,
        shared_memory="auto" if transport.shared_memory else False,
        local_session=transport.local_session,
    ) as client:
        lay = client.info().layout
        gen = torch.Generator().manual_seed(0)
        seqs = [client.create_sequence() for _ in range(batch)]
        dt = getattr(torch, dtype)
        kv = torch.randn(lay.num_layers, context, lay.num_kv_heads, lay.head_dim, generator=gen)
        kv = kv.to(dt)
        for i, s in enumerate(seqs):
            ids = [(i * 104729 + t) % 2**31 for t in range(context)]
            client.append(s.seq_id, ids, kv, kv, layer=None)
        k = torch.randn(batch, 1, lay.num_kv_heads, lay.head_dim, generator=gen).to(dt)
        q = torch.randn(batch, 1, hq, lay.head_dim, generator=gen).to(dt)

        seq_ids = [s.seq_id for s in seqs]

        def step(times):
            for layer in range(lay.num_layers):
                if api == "batch":
                    t0 = time.perf_counter()
                    client.append_attend_batch(layer, seq_ids, [[7]] * batch, k, k, q)
                else:
                    items = [
                        AppendAttendItem(s, [7], k[i], k[i], q[i]) for i, s in enumerate(seq_ids)
                    ]
                    t0 = time.perf_counter()
                    client.append_attend(layer, items)
                times.append((t0, time.perf_counter()))

        for _ in range(3):
            step([])
        conn.send("ready")
        conn.recv()
        times = []
        sends.clear()
        cpu0 = time.process_time()
        for _ in range(steps):
            step(times)
        # Every thread of the client process (gRPC's included), per call.
        client_cpu = (time.process_time() - cpu0) / len(times)
        sends_kept = sends[-len(times) :] if len(sends) >= len(times) else []
        conn.send((times, sends_kept, client_cpu))
        conn.recv()
        for s in seqs:
            s.free()


def start_py_spy(args, handles):
    """py-spy sampling this process (the coordinator) and each Ray actor for
    ``--py-spy-seconds`` from now, raw collapsed stacks under ``--py-spy-out``."""
    import os
    import subprocess

    import ray

    pids = {"server": os.getpid()}
    for i, h in enumerate(handles):
        pids[f"actor{i}"] = ray.get(h.__ray_call__.remote(lambda w: os.getpid()))
    os.makedirs(args.py_spy_out, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        out = os.path.join(args.py_spy_out, f"{name}.txt")
        command = [args.py_spy, "record", "--nonblocking", "-p", str(pid), "-r", "250"]
        command += ["-d", str(args.py_spy_seconds), "-f", "raw", "-o", out]
        spies.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return spies


async def main(args):
    from cache_service import server as srv
    from cache_service.config import ServiceConfig

    def stub_pool() -> None:
        """The pool's write-and-attend as a zero-cost fake (in this process)."""
        import workers.pool as wp

        def fake(
            self,
            layer,
            slot_mapping,
            key,
            value,
            query,
            block_tables,
            seq_lens,
            qsl,
            *,
            causal=True,
            return_lse=False,
            **kw,
        ):
            out = torch.zeros_like(query)
            if return_lse:
                return out, torch.zeros(query.shape[:2])
            return out

        wp.KVPool.write_and_attend = fake

    if args.stub:
        stub_pool()
    if args.no_shared_files:
        # The region files are not recorded for the workers: the channel copies the
        # tensors into its arena and the output out of it (the path before files in place).
        import workers.shared_files as shared_files

        shared_files.SHARED_FILES.add = lambda *a, **k: None  # type: ignore[method-assign]
    handler_times = []
    session = TRANSPORTS[args.transport].session
    # The handler body both the unary RPC and the session call run; the metric the call
    # is recorded under.
    method = "_append_attend_batch" if args.api == "batch" else "AppendAttend"
    label = "AppendAttend"
    if args.api == "batch":
        label = "Session.AppendAttendBatch" if session else "AppendAttendBatch"
    orig = getattr(srv.KVCacheServicer, method)
    rec = {"on": False}

    async def timed(self, request, *rest):
        t0 = time.perf_counter()
        try:
            return await orig(self, request, *rest)
        finally:
            if rec["on"]:
                handler_times.append(time.perf_counter() - t0)

    setattr(srv.KVCacheServicer, method, timed)
    session_spans: list[tuple[float, float]] = []
    real_session_call = srv.KVCacheServicer._session_call

    async def timed_session_call(self, request, tenant):
        t0 = time.perf_counter()
        try:
            return await real_session_call(self, request, tenant)
        finally:
            if rec["on"]:
                session_spans.append((t0, time.perf_counter()))

    srv.KVCacheServicer._session_call = timed_session_call
    from cache_service import worker_clients as wcm

    inv_times = []

    def time_invoke(cls, methods):
        """Time `cls._invoke` for `methods` (the worker call) while recording."""
        real = cls._invoke

        async def timed(self, method, *a, **k):
            t0 = time.perf_counter()
            try:
                return await real(self, method, *a, **k)
            finally:
                if rec["on"] and method in methods:
                    inv_times.append(time.perf_counter() - t0)

        cls._invoke = timed

    time_invoke(wcm.LocalWorkerClient, ("write_and_attend",))
    time_invoke(wcm.RayWorkerClient, ("write_and_attend", "write_and_attend_pages"))
    # The channel's stages on the coordinator's side (perf_counter stamps per call).
    from cache_service import worker_channel as wch

    chan: dict[str, list[float]] = {"start": [], "built": [], "arrive": [], "resume": [], "end": []}
    real_chan_call, real_request = wch.WorkerChannel.call, wch.WorkerChannel._request
    real_received, real_reply = wch._Connection.data_received, wch.WorkerChannel._read_reply

    async def chan_call(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return await real_chan_call(self, *a, **k)
        finally:
            if rec["on"]:
                chan["start"].append(t0)
                chan["end"].append(time.perf_counter())

    def chan_request(self, *a, **k):
        built = real_request(self, *a, **k)
        if rec["on"]:
            chan["built"].append(time.perf_counter())
        return built

    def chan_received(self, data):
        if rec["on"]:
            chan["arrive"].append(time.perf_counter())
        return real_received(self, data)

    def chan_reply(self, *a):
        if rec["on"]:
            chan["resume"].append(time.perf_counter())
        return real_reply(self, *a)

    wch.WorkerChannel.call = chan_call
    wch.WorkerChannel._request = chan_request
    wch._Connection.data_received = chan_received
    wch.WorkerChannel._read_reply = chan_reply
    cfg = ServiceConfig().with_overrides(
        {
            "server.port": 0,
            "metrics.enabled": True,
            "metrics.port": 0,
            "layout.num_layers": args.layers,
            "layout.num_kv_heads": args.kv_heads,
            "layout.head_dim": args.head_dim,
            "layout.block_size": 16,
            "layout.dtype": args.dtype,
            "workers.num_workers": 1,
            "workers.blocks_per_worker": args.batch
            * (-(-(args.context + 3 + args.steps + 2) // 16))
            + 64,
            "workers.device": args.device,
            "workers.in_process": not args.ray,
            "workers.ray_num_cpus": 2 if args.device == "cpu" else None,
            "coordinator.batch_window_ms": 0.5,
            "coordinator.correctness_check_fraction": args.check_fraction,
            "coordinator.health_check_interval_s": 0,
            "log_level": "WARNING",
        }
    )
    running = await srv.start_service(cfg)
    loop = asyncio.get_running_loop()
    handles = []
    if args.ray:
        import ray
        from diag_channel import _instrument

        handles = [c.handle for c in running.coordinator._clients.values()]
        if args.stub:
            for h in handles:
                await loop.run_in_executor(
                    None, ray.get, h.__ray_call__.remote(lambda w: stub_pool())
                )
    loop = asyncio.get_running_loop()
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=client_main,
        args=(
            running.address,
            args.batch,
            args.context,
            args.steps,
            args.q_heads,
            args.dtype,
            args.api,
            TRANSPORTS[args.transport],
            child,
        ),
    )
    proc.start()
    try:
        msg = await loop.run_in_executor(None, parent.recv)
        assert msg == "ready"
        for h in handles:  # the channel is open by now (the warm-up steps)
            await loop.run_in_executor(None, ray.get, h.__ray_call__.remote(_instrument))
        hist = running.metrics.rpc_duration

        def hsum():
            for m in hist.collect():
                s = c = 0
                for smp in m.samples:
                    if smp.labels.get("method") == label:
                        if smp.name.endswith("_sum"):
                            s += smp.value
                        if smp.name.endswith("_count"):
                            c += smp.value
                return s, c

        s0, c0 = hsum()
        prof = cProfile.Profile() if args.profile else None
        rec["on"] = True
        if prof:
            prof.enable()
        spies = start_py_spy(args, handles) if args.py_spy else []
        cpu0 = time.process_time()
        wall0 = time.perf_counter()
        parent.send("go")
        spans, sends, client_cpu = await loop.run_in_executor(None, parent.recv)
        for spy in spies:
            await loop.run_in_executor(None, spy.wait)
        times = [end - start for start, end in spans]
        regions = running.shared_regions
        pinned = sum(r.mapping.pinned for r in regions._regions.values()) if regions else 0
        held = len(regions._regions) if regions else 0
        if prof:
            prof.disable()
        rec["on"] = False
        server_cpu = (time.process_time() - cpu0) / len(handler_times)
        wall = (time.perf_counter() - wall0) / len(handler_times)
        s1, c1 = hsum()
        in_actor = {"answer": [], "call": [], "read": [], "answer_start": [], "answer_end": []}
        for h in handles:
            diag = await loop.run_in_executor(
                None, ray.get, h.__ray_call__.remote(lambda w: w.diag)
            )
            for k in in_actor:
                in_actor[k] += diag[k]
        parent.send("bye")
        await loop.run_in_executor(None, proc.join)
    finally:
        await running.stop()

    def ms(xs):
        return f"p50 {statistics.median(xs) * 1e3:.3f} ms, mean {statistics.fmean(xs) * 1e3:.3f} ms"

    print(
        f"mode={'stub' if args.stub else 'real'} api={args.api} device={args.device} dtype={args.dtype} batch={args.batch} context={args.context} calls={len(times)}"
    )
    print(f"transport:          {args.transport}")
    print("client e2e:        ", ms(times))
    print(f"client process CPU: {client_cpu * 1e3:.3f} ms per call (all its threads)")
    print("servicer handler:  ", ms(handler_times))
    print("worker invoke:     ", ms(inv_times))
    if handles and in_actor["call"]:
        print("  in the actor, the channel server's answer:", ms(in_actor["answer"]))
        print("  in the actor, the call in it:             ", ms(in_actor["call"]))
        # The channel's timeline, call by call (one worker, calls one at a time: the lists'
        # last stamps belong to the last call, and so on back; the actor's lists also hold
        # the warm-up calls after it was instrumented, its read stamps all but the first).
        n = min(len(chan["start"]), len(in_actor["read"]))
        if n and len(chan["built"]) == len(chan["arrive"]) == len(chan["start"]):
            a = {k: v[-n:] for k, v in in_actor.items()}
            c = {k: v[-n:] for k, v in chan.items()}
            stages = [
                ("request built (coordinator)", c["start"], c["built"]),
                ("sent -> read by the worker", c["built"], a["read"]),
                ("read -> answer begins", a["read"], a["answer_start"]),
                ("the worker's answer", a["answer_start"], a["answer_end"]),
                ("answer -> reply received", a["answer_end"], c["arrive"]),
                ("received -> caller resumed", c["arrive"], c["resume"]),
                ("result delivered", c["resume"], c["end"]),
            ]
            print("channel timeline (p50):")
            for name, begin, end in stages:
                lengths = [e - b for b, e in zip(begin, end, strict=True)]
                print(f"  {name:<28}", f"{statistics.median(lengths) * 1e3:.3f} ms")
    print(f"interceptor mean:   {(s1 - s0) / (c1 - c0) * 1e3:.3f} ms over {int(c1 - c0)} calls")
    print(
        f"server process CPU: {server_cpu * 1e3:.3f} ms per call (all its threads; wall "
        f"{wall * 1e3:.3f} ms per call)"
    )
    print(f"shared regions:     {held} held, {pinned} page-locked for CUDA")
    if sends and len(session_spans) == len(spans):
        # The call's timeline: client before the send, request transit, the server's
        # session call, reply transit, client after the reply.
        def med(xs):
            return f"{statistics.median(xs) * 1e3:.3f} ms"

        print("timeline (p50):")
        print(
            "  client, before send ", med([s[0] - c[0] for c, s in zip(spans, sends, strict=True)])
        )
        print(
            "  request transit     ",
            med([v[0] - s[0] for s, v in zip(sends, session_spans, strict=True)]),
        )
        print("  server session call ", med([v[1] - v[0] for v in session_spans]))
        print(
            "  reply transit       ",
            med([s[1] - v[1] for s, v in zip(sends, session_spans, strict=True)]),
        )
        print(
            "  client, after reply ", med([c[1] - s[1] for c, s in zip(spans, sends, strict=True)])
        )
    if prof:
        prof.dump_stats(args.profile)
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--stub", action="store_true", help="zero-cost fake pool operation")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--profile")
    ap.add_argument("--api", choices=("batch", "items"), default="batch")
    ap.add_argument("--transport", choices=tuple(TRANSPORTS), default="session-shm")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument(
        "--check-fraction",
        type=float,
        default=0.0,
        help="coordinator.correctness_check_fraction (default 0: no check, no fingerprints)",
    )
    ap.add_argument("--py-spy", help="path of a py-spy binary: sample the server and the actors")
    ap.add_argument("--py-spy-out", default="py-spy", help="where --py-spy writes its stacks")
    ap.add_argument("--py-spy-seconds", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="the pool in a Ray actor (worker channel)")
    ap.add_argument(
        "--no-shared-files",
        action="store_true",
        help="with --ray: copy region tensors through the channel's arena (no files in place)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    asyncio.run(main(args))
