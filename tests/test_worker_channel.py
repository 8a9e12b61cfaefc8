"""The worker channel with real sockets (Unix and TCP), real shared memory and a real
PoolWorker (CPU pool) serving it on its own threads, in each of its modes (a shared arena;
private arenas whose bytes travel, over the Unix socket and over TCP): results equal the
worker's direct calls and dense attention, errors arrive as the worker raised them and
leave the connection usable, bad hellos are refused (and never unpickled), nothing is left
in the arena directory, and the ChannelPool declines (so the caller uses Ray) when a
connection breaks, the arena is too small or the worker is elsewhere with TCP off. With
real Ray actors: tests/test_workers_ray.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import json
import os
import pickle
import shutil
import socket
import tempfile
import time

import pytest
import torch
from round_calls import channel_call, write_and_attend
from workers_support import dense_attention, rel_err

from cache_service.wire.worker_channel import (
    ChannelBroken,
    ChannelOptions,
    ChannelPool,
    WorkerChannel,
)
from workers.actor import PoolWorker
from workers.channel_server import ChannelAddress, ChannelServer
from workers.channel_wire import (
    HEADER,
    ArenaFull,
    ArenaTensor,
    ChannelProtocolError,
    FileTensor,
    RepeatUnavailable,
    SharedFileUnavailable,
    frame,
    split,
)
from workers.config import PoolConfig
from workers.errors import InvalidWorkerRequest, StaleEpochError, WorkerError, WorkerUnavailable
from workers.layout import KVLayout
from workers.shared_files import SHARED_FILES, create_mapped

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
NODE = "node-a"


@pytest.fixture
def worker():
    w = PoolWorker("w0", PoolConfig(LAYOUT, num_blocks=16), "cpu")
    yield w
    w.close_channel()


@pytest.fixture
def arena_dir(tmp_path):
    return str(tmp_path)


def _step(n: int = 6, seed: int = 0):
    """A sequence of n tokens in blocks 2 and 3: its slots, K/V and queries for all n."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 2, 16, generator=g)
    v = torch.randn(n, 2, 16, generator=g)
    q = torch.randn(n, 4, 16, generator=g)
    slots = [(2 + i // 4) * 4 + i % 4 for i in range(n)]
    return slots, k, v, q, torch.tensor([[2, 3]], dtype=torch.int32), [n], [0, n]


def _tensor_step(n: int = 6, seed: int = 0):
    """`_step` with seq_lens and query_start_loc as int32 tensors (what a repeat may
    leave in place; lists are plain values it replaces)."""
    slots, k, v, q, bt, lens, starts = _step(n, seed)
    as_int32 = functools.partial(torch.tensor, dtype=torch.int32)
    return slots, k, v, q, bt, as_int32(lens), as_int32(starts)


def _address(worker: PoolWorker, tcp: bool = False) -> ChannelAddress:
    a = worker.channel_address(tcp)
    return ChannelAddress(NODE, a.socket_path, a.token, a.tcp_host, a.tcp_port)


MODES = {
    "shared": {},
    "private-unix": {"shared_memory": False},
    "tcp": {"tcp": True},
}


async def _connect(worker: PoolWorker, mode: str, arena_bytes: int, arena_dir: str):
    options = MODES[mode]
    address = _address(worker, tcp=bool(options.get("tcp")))
    return await WorkerChannel.connect(address, arena_bytes, arena_dir, **options)


@pytest.mark.parametrize("mode", MODES)
def test_write_and_attend_equals_the_direct_call_and_dense_attention(
    worker, arena_dir, mode
) -> None:
    async def run():
        chan = await _connect(worker, mode, 1 << 20, arena_dir)
        assert chan.shared == (mode == "shared")
        assert os.listdir(arena_dir) == []  # unlinked once the worker mapped it
        epoch = worker.epoch()
        slots, k, v, q, bt, lens, starts = _step()
        out = torch.full_like(q, float("nan"))
        ok, got = await channel_call(
            chan, "write_and_attend", (epoch, 1, slots, k, v, q, bt, lens, starts), {}, out
        )
        assert ok and got is out
        want, _ = dense_attention(q, k, v)
        assert rel_err(out, want) < 1e-5
        direct = write_and_attend(worker, epoch, 1, slots, k, v, q, bt, lens, starts)
        assert torch.equal(out, direct)
        # LSE, and a result that is the caller's own memory (not a view of the arena).
        ok, (o2, lse) = await channel_call(
            chan, "attend", (epoch, 1, q, bt, lens, starts, True, True), {"scale": None}
        )
        assert ok and torch.equal(o2, out)
        _, want_lse = dense_attention(q, k, v)
        assert rel_err(lse, want_lse) < 1e-5
        before = o2.clone()
        await channel_call(chan, "attend", (epoch, 1, q * 2, bt, lens, starts), {})
        assert torch.equal(o2, before)
        chan.close()

    asyncio.run(run())


@pytest.mark.parametrize("mode", MODES)
def test_worker_errors_arrive_as_raised_and_the_connection_stays_usable(
    worker, arena_dir, mode
) -> None:
    async def run():
        chan = await _connect(worker, mode, 1 << 20, arena_dir)
        slots, k, v, *_ = _step()
        epoch = worker.epoch()
        ok, err = await chan.call("write", ("stale", 0, slots, k, v), {})
        assert not ok and isinstance(err, StaleEpochError) and err.actual == epoch
        ok, err = await chan.call("write", (epoch, 5, slots, k, v), {})
        assert not ok and isinstance(err, InvalidWorkerRequest) and "layer" in str(err)
        ok, err = await chan.call("export_blocks", (epoch, [0]), {})
        assert not ok and "not served over the channel" in str(err)
        ok, _ = await chan.call("write", (epoch, 0, slots, k, v), {})
        assert ok
        chan.close()

    asyncio.run(run())


@pytest.mark.parametrize("mode", MODES)
def test_tensors_larger_than_the_arena_raise_arena_full_before_sending(
    worker, arena_dir, mode
) -> None:
    async def run():
        chan = await _connect(worker, mode, 1 << 16, arena_dir)
        big = torch.zeros(1 << 15)  # 128 KiB
        with pytest.raises(ArenaFull):
            await chan.call("write", (worker.epoch(), 0, [0], big, big), {})
        assert worker.health().calls == 0  # nothing reached the worker
        chan.close()

    asyncio.run(run())


def test_hellos_with_a_wrong_token_or_file_are_refused(worker, arena_dir, tmp_path) -> None:
    address = _address(worker, tcp=True)

    async def run():
        wrong = dataclasses.replace(address, token="0" * 32)
        for options in ({}, {"tcp": True}):
            with pytest.raises(ChannelBroken, match="wrong token"):
                await WorkerChannel.connect(wrong, 1 << 16, arena_dir, **options)
        assert os.listdir(arena_dir) == []

    asyncio.run(run())

    def raw_hello(payload: bytes, tcp: bool = False) -> dict:
        if tcp:
            s = socket.create_connection((address.tcp_host, address.tcp_port))
        else:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address.socket_path)
        s.sendall(frame(payload))
        reply = s.recv(1 << 16)
        s.close()
        return json.loads(reply[HEADER.size :])

    # A file of another size than the hello says.
    path = tmp_path / "wrong-size"
    path.write_bytes(b"\0" * 4096)
    hello = {"token": address.token, "arena_path": str(path), "arena_bytes": 8192}
    answer = raw_hello(json.dumps(hello).encode())
    assert not answer["ok"] and "has 4096 bytes, not 8192" in answer["error"]
    # Shared memory over TCP, a pickle instead of JSON (never unpickled), an absurd arena.
    hello["arena_bytes"] = 4096
    answer = raw_hello(json.dumps(hello).encode(), tcp=True)
    assert not answer["ok"] and "cannot share memory" in answer["error"]
    assert not raw_hello(pickle.dumps(hello))["ok"]
    huge = {"token": address.token, "arena_path": None, "arena_bytes": 1 << 40}
    assert "private arena" in raw_hello(json.dumps(huge).encode(), tcp=True)["error"]
    assert worker.health().calls == 0


def _pool(worker: PoolWorker, arena_dir: str, **kwargs) -> ChannelPool:
    async def address(tcp: bool):
        return _address(worker, tcp)

    timeout_s = kwargs.pop("timeout_s", None)
    options = ChannelOptions(
        arena_bytes=kwargs.pop("arena_bytes", 1 << 20), directory=arena_dir, **kwargs
    )
    return ChannelPool("w0", options, address, NODE, timeout_s)


def test_pool_runs_concurrent_calls_on_separate_connections(worker, arena_dir) -> None:
    async def run():
        pool = _pool(worker, arena_dir, connections=2)
        slots, k, v, q, bt, lens, starts = _step()
        epoch = worker.epoch()
        await pool.call("write", (epoch, 0, slots, k, v), {})
        results = await asyncio.gather(
            *[
                channel_call(pool, "attend", (epoch, 0, q * (i + 1), bt, lens, starts), {})
                for i in range(6)
            ]
        )
        assert pool.open_channels == 2 and pool.calls == 7
        for i, (done, out) in enumerate(results):
            want, _ = dense_attention(q * (i + 1), k, v)
            assert done and rel_err(out, want) < 1e-5
        pool.close()

    asyncio.run(run())


def test_pool_raises_worker_errors_and_wraps_others(worker, arena_dir) -> None:
    async def run():
        pool = _pool(worker, arena_dir)
        slots, k, v, *_ = _step()
        with pytest.raises(StaleEpochError):
            await pool.call("write", ("stale", 0, slots, k, v), {})
        with pytest.raises(WorkerError, match="worker 'w0' failed: ChannelProtocolError"):
            await pool.call("copy_blocks", (worker.epoch(), [0], [1]), {})
        pool.close()

    asyncio.run(run())


def test_pool_declines_when_the_connection_breaks_and_reopens_later(worker, arena_dir) -> None:
    async def run():
        pool = _pool(worker, arena_dir, retry_after_s=0.0)
        slots, k, v, *_ = _step()
        epoch = worker.epoch()
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        worker.close_channel()  # the worker side goes away (as when its process dies)
        assert await pool.call("write", (epoch, 0, slots, k, v), {}) == (None, None)
        assert pool.open_channels == 0
        # A new server: the next call opens a channel to it.
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        assert pool.open_channels == 1
        pool.close()

    asyncio.run(run())


def test_pool_declines_calls_that_do_not_fit_and_workers_elsewhere(worker, arena_dir) -> None:
    async def run():
        pool = _pool(worker, arena_dir, arena_bytes=1 << 16)
        big = torch.zeros(1 << 14, 2, 16)
        assert await pool.call("write", (worker.epoch(), 0, [0], big, big), {}) == (None, None)
        assert pool.open_channels == 1  # kept for calls that fit
        pool.close()

        lookups = []

        async def elsewhere(tcp: bool):
            lookups.append(tcp)
            a = worker.channel_address(tcp)
            return ChannelAddress("node-b", a.socket_path, a.token, a.tcp_host, a.tcp_port)

        slots, k, v, *_ = _step()
        off = ChannelOptions(directory=arena_dir, remote=False)
        far = ChannelPool("w0", off, elsewhere, NODE)
        assert await far.call("write", (worker.epoch(), 0, slots, k, v), {}) == (None, None)
        assert far.open_channels == 0
        # Not retried before retry_after_s (5 s): no second address lookup.
        assert await far.call("write", (worker.epoch(), 0, slots, k, v), {}) == (None, None)
        assert lookups == [False]
        # With remote channels on (the default), a worker elsewhere is reached over TCP.
        remote = ChannelPool("w0", ChannelOptions(directory=arena_dir), elsewhere, NODE)
        done, _ = await remote.call("write", (worker.epoch(), 0, slots, k, v), {})
        assert done == "channel_tcp" and lookups == [False, False, True]
        assert not remote._idle[0].shared
        remote.close()

    asyncio.run(run())


def test_a_call_past_the_timeout_is_worker_unavailable_and_drops_the_channel(
    worker, arena_dir
) -> None:
    async def run():
        pool = _pool(worker, arena_dir, timeout_s=0.2)
        slots, k, v, *_ = _step()
        epoch = worker.epoch()
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        with worker._lock:  # the worker is busy (another call holds it)
            with pytest.raises(WorkerUnavailable, match=r"no answer within 0\.2 s"):
                await pool.call("write", (epoch, 0, slots, k, v), {})
        assert pool.open_channels == 0
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        pool.close()

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["private-unix", "tcp"])
def test_payloads_larger_than_the_socket_buffers_arrive_whole(worker, arena_dir, mode) -> None:
    # A whole prompt written on every layer at once: megabytes of K/V in the request's
    # payload and an attention output of a megabyte in the reply's, read in many pieces
    # on both ends.
    async def run():
        chan = await _connect(worker, mode, 16 << 20, arena_dir)
        epoch = worker.epoch()
        g = torch.Generator().manual_seed(9)
        n = 64  # tokens: 16 blocks of 4
        k = torch.randn(LAYOUT.num_layers, n, 2, 16, generator=g)
        v = torch.randn(LAYOUT.num_layers, n, 2, 16, generator=g)
        pad = torch.randn(1 << 18, generator=g)  # a megabyte riding along, unused
        ok, _ = await chan.call("write", (epoch, None, list(range(n)), k, v), {"_pad": pad})
        assert not ok  # an unknown keyword: refused by the worker, after the payload arrived
        ok, _ = await chan.call("write", (epoch, None, list(range(n)), k, v), {})
        assert ok
        # 64 sequences over the same 16 blocks, 64 query rows each: a 1 MiB output.
        q = torch.randn(64 * n, 4, 16, generator=g)
        tables, lens, starts = [list(range(16))] * 64, [n] * 64, list(range(0, 64 * n + 1, n))
        ok, out = await channel_call(chan, "attend", (epoch, 1, q, tables, lens, starts, False), {})
        assert ok and out.shape == q.shape, out
        want, _ = dense_attention(q, k[1], v[1], causal=False)
        assert rel_err(out, want) < 1e-5
        chan.close()

    asyncio.run(run())


def test_cancelled_callers_leave_the_pool_consistent(worker, arena_dir) -> None:
    async def run():
        slots, k, v, *_ = _step()
        epoch = worker.epoch()
        # Cancelled while its channel is being opened: the slot is given back.
        started = asyncio.Event()

        async def slow_address(tcp: bool):
            started.set()
            await asyncio.sleep(10)
            raise AssertionError("not reached")

        slow = ChannelPool("w0", ChannelOptions(directory=arena_dir), slow_address, NODE)
        task = asyncio.ensure_future(slow.call("write", (epoch, 0, slots, k, v), {}))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert slow.open_channels == 0
        # Cancelled while waiting for the one connection: the call holding it and the calls
        # after it still get it.
        pool = _pool(worker, arena_dir, connections=1)
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        with worker._lock:  # the worker is busy: the first call waits for it
            first = asyncio.ensure_future(pool.call("write", (epoch, 0, slots, k, v), {}))
            second = asyncio.ensure_future(pool.call("write", (epoch, 0, slots, k, v), {}))
            await asyncio.sleep(0.05)
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
        assert (await first)[0]
        assert (await pool.call("write", (epoch, 0, slots, k, v), {}))[0]
        assert pool.open_channels == 1 and pool.calls == 3
        pool.close()

    asyncio.run(run())


def _raw_request(method: str, args: tuple, files: object, forget: object = ()) -> bytes:
    """A request as WorkerChannel sends it (channel_wire's format), built by hand: the
    references in `args` travel as they are, nothing placed."""
    return pickle.dumps((method, 0, files, forget, *split(args, None), {}, ()))


def test_malformed_requests_get_an_error_or_end_the_connection(worker, arena_dir) -> None:
    # After a valid hello, over a raw socket: a message that is not a pickle gets an error
    # reply and the connection goes on; a tensor reference outside the arena too; a
    # payload on a shared arena (whose bytes never travel) ends the connection.
    address = _address(worker)
    path = os.path.join(arena_dir, "arena")
    with open(path, "wb") as f:
        f.write(b"\0" * 65536)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address.socket_path)
    s.settimeout(10)

    def exchange(message: bytes, payload: int = 0) -> bytes:
        s.sendall(frame(message, payload) + b"\0" * payload)
        head = s.recv(HEADER.size, socket.MSG_WAITALL)
        if not head:
            return b""
        n, _, _ = HEADER.unpack(head)
        return s.recv(n, socket.MSG_WAITALL)

    hello = {"token": address.token, "arena_path": path, "arena_bytes": 65536}
    assert json.loads(exchange(json.dumps(hello).encode()))["ok"]
    ok, err = pickle.loads(exchange(b"not a pickle"))
    assert not ok and type(err).__name__ == "UnpicklingError"
    outside = ArenaTensor(65536 - 4, "float32", (4,))
    ok, err = pickle.loads(exchange(_raw_request("run_round", ("e", 0, outside), ())))
    assert not ok and "outside the arena" in str(err)
    # A shared file never announced; one announced that is not there; one of another size.
    in_file = FileTensor(3, 0, "float32", (4,))
    ok, err = pickle.loads(exchange(_raw_request("run_round", (in_file,), ())))
    assert not ok and "shared file 3 was not announced" in str(err)
    gone = ((0, os.path.join(arena_dir, "no-such-file"), 4096),)
    ok, err = pickle.loads(exchange(_raw_request("run_round", (in_file,), gone)))
    assert not ok and type(err) is SharedFileUnavailable and "no-such-file" in str(err)
    other_size = ((3, path, 4096),)
    ok, err = pickle.loads(exchange(_raw_request("run_round", (in_file,), other_size)))
    assert not ok and type(err) is SharedFileUnavailable and "not 4096" in str(err)
    ok, err = pickle.loads(exchange(_raw_request("run_round", (), "junk")))
    assert not ok and "malformed" in str(err)
    # A reference of no known kind; arguments that are not a tuple; the old layout.
    odd = pickle.dumps(("run_round", 0, (), (), (None,), ((0, "zz", 1),), {}, ()))
    ok, err = pickle.loads(exchange(odd))
    assert not ok and "unknown tensor reference" in str(err)
    ok, err = pickle.loads(exchange(pickle.dumps(("run_round", 0, (), (), "e", (), {}, ()))))
    assert not ok and "must be a tuple and a dict" in str(err)
    ok, err = pickle.loads(exchange(pickle.dumps(("run_round", ("e",), {}, 0, (), ()))))
    assert not ok and type(err).__name__ == "ValueError"  # six items where eight belong
    try:
        assert exchange(b"x", payload=16) == b""  # closed by the worker
    except ConnectionResetError:  # ... before all of it was sent
        pass
    s.close()
    assert worker.health().calls == 0


def test_a_new_server_removes_the_socket_directories_of_dead_ones(worker) -> None:
    # A worker killed outright leaves its socket's directory behind; the next server of the
    # user removes it once it is a minute old, and leaves live servers' directories alone.
    root = tempfile.gettempdir()
    dead = tempfile.mkdtemp(prefix="kvcache-channel-")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(dead, "socket"))
    s.close()  # the socket file stays, nobody listens
    fresh = tempfile.mkdtemp(prefix="kvcache-channel-")  # a server starting right now
    old = time.time() - 120
    os.utime(dead, (old, old))
    live = os.path.dirname(worker.channel_address().socket_path)
    os.utime(live, (old, old))
    other = ChannelServer(lambda *a: None, pin_for_cuda=False, node_id=None, name="other")
    try:
        left = set(os.listdir(root))
        assert os.path.basename(dead) not in left
        assert os.path.basename(fresh) in left and os.path.basename(live) in left
    finally:
        other.close()
        shutil.rmtree(fresh, ignore_errors=True)


def _mappings_of(path: str) -> int:
    """How many mappings of `path` this process holds (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if path in line)


@pytest.fixture
def shared_file(arena_dir):
    """A file as a server's shared region is (mapped here and recorded in SHARED_FILES):
    (path, uint8 tensor over it); forgotten and unmapped afterwards."""
    made = []

    def make(size: int = 1 << 16) -> tuple[str, torch.Tensor]:
        path, mm = create_mapped(arena_dir, "kvcache-", size)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        SHARED_FILES.add(base.data_ptr(), size, (path, size))
        made.append((base, mm))
        return path, base

    yield make
    for base, _ in made:
        SHARED_FILES.remove(base.data_ptr())
    maps = [mm for _, mm in made]
    made.clear()
    gc.collect()
    for mm in maps:
        mm.close()


def _in(base: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `base` at byte `offset` (a view of base)."""
    view = base[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
    return view.copy_(t)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_tensors_in_shared_files_are_read_and_written_where_they_lie(
    worker, arena_dir, shared_file
) -> None:
    # Key, value, query and the output in a file the coordinator shares with its workers:
    # the worker maps the file once (announced by the first request), reads the inputs and
    # writes the output in place; a file deleted is unmapped by the worker at the next call.
    async def run():
        path, base = shared_file()
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k, v, q, bt, lens, starts = _step()
        k, v, q = _in(base, 0, k), _in(base, 4096, v), _in(base, 8192, q)
        out = _in(base, 16384, torch.full_like(q, float("nan")))
        assert _mappings_of(path) == 1
        for layer in (0, 1):
            ok, got = await channel_call(
                chan, "write_and_attend", (epoch, layer, slots, k, v, q, bt, lens, starts), {}, out
            )
            assert ok and got is out
            assert _mappings_of(path) == 2  # the worker's, mapped once
        want, _ = dense_attention(q, k, v)
        assert rel_err(out, want) < 1e-5
        assert torch.equal(
            out, write_and_attend(worker, epoch, 1, slots, k, v, q, bt, lens, starts)
        )
        # The file is deleted (as a released region is): the next call has the worker
        # unmap it.
        SHARED_FILES.remove(base.data_ptr())
        os.unlink(path)
        mine = [t.clone() for t in (k, v, q)]
        ok, got = await channel_call(chan, "attend", (epoch, 1, mine[2], bt, lens, starts), {})
        assert ok and torch.equal(got, out)
        assert _mappings_of(path) == 1  # this process's own mapping only
        chan.close()

    asyncio.run(run())


@pytest.mark.parametrize("mode", MODES)
def test_a_round_in_parts_is_read_and_written_where_its_callers_put_it(
    worker, arena_dir, shared_file, mode
) -> None:
    # A round of two callers in parts, each caller's key, value and query rows and its
    # output slot in its own shared region: the worker reads the parts and writes each
    # output part in place (the result is the list of slots). Without shared memory the
    # parts travel in the arena and the output comes back joined.
    async def run():
        (_, one), (_, two) = shared_file(), shared_file()
        chan = await _connect(worker, mode, 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k, v, q, bt, lens, starts = _step()
        rows = (2, 4)
        regions = []
        for base, part in zip((one, two), (slice(0, 2), slice(2, 6)), strict=True):
            regions.append(
                [_in(base, at, t[part]) for at, t in ((0, k), (4096, v), (8192, q))]
                + [_in(base, 16384, torch.full_like(q[part], float("nan")))]
            )
        parts = [list(ts) for ts in zip(*regions, strict=True)]  # key, value, query, out
        layers = ([1] * len(lens), [1] * len(slots))
        ok, got = await channel_call(
            chan,
            "write_and_attend_layers",
            (epoch, *layers, slots, parts[0], parts[1], parts[2], bt, lens, starts),
            {"check_finite": True},
            parts[3],
        )
        assert ok, got
        want, _ = dense_attention(q, k, v)
        if chan.shared:
            # Each part is the caller's own slot, written there by the worker.
            assert len(got) == 2 and all(g is o for g, o in zip(got, parts[3], strict=True))
            assert [o.shape[0] for o in got] == list(rows)
            assert rel_err(torch.cat(got), want) < 1e-5
        else:
            assert torch.isnan(parts[3][0]).all()  # not sent: the output came back joined
            assert rel_err(got, want) < 1e-5
        chan.close()

    asyncio.run(run())


def test_a_round_over_layers_in_parts_repeats_on_other_layers(
    worker, arena_dir, shared_file
) -> None:
    # Rounds of the same callers on other layers (one step key,
    # parts and output slots where the callers keep them) go as repeats carrying only the
    # new layers; each round's output is right, written in place.
    async def run():
        (_, one), (_, two) = shared_file(), shared_file()
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, _, _, _, bt, lens, starts = _tensor_step()
        g = torch.Generator().manual_seed(3)
        bases = (one, two)
        for n, layer in enumerate((1, 0, 1)):
            k, v, q = (torch.randn(6, h, 16, generator=g) for h in (2, 2, 4))
            parts = [
                [_in(base, at, t[rows]) for base, rows in zip(bases, (slice(0, 2), slice(2, 6)), strict=True)]
                for at, t in ((0, k), (4096, v), (8192, q))
            ]  # fmt: skip
            out = [_in(base, 16384, torch.full((n_rows, 4, 16), float("nan")))
                   for base, n_rows in zip(bases, (2, 4), strict=True)]  # fmt: skip
            ok, got = await channel_call(
                chan,
                "write_and_attend_layers",
                (epoch, [layer], [layer] * 6, slots, *parts, bt, lens, starts),
                {"metadata_key": 9, "check_finite": True},
                out,
            )
            assert ok, got
            assert all(g_ is o for g_, o in zip(got, out, strict=True))
            want, _ = dense_attention(q, k, v)
            assert rel_err(torch.cat(out), want) < 1e-5
            assert chan.repeats == n  # the first in full, the others as repeats
        chan.close()

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_a_shared_file_the_worker_cannot_map_is_copied_instead(
    worker, arena_dir, shared_file, caplog
) -> None:
    # One file went between the coordinator's look and the worker's open: the call runs
    # once, that file's tensors copied, and the file is not named to that worker again;
    # another file the same request announced is still read in place.
    async def run():
        path, base = shared_file()
        gone, gone_base = shared_file()
        os.unlink(gone)  # still recorded in SHARED_FILES
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k, v, q, bt, lens, starts = _step()
        k, v, q = _in(base, 0, k), _in(base, 4096, v), _in(gone_base, 8192, q)
        for layer in (0, 1):
            calls = worker.health().calls
            ok, got = await channel_call(
                chan, "write_and_attend", (epoch, layer, slots, k, v, q, bt, lens, starts), {}
            )
            assert ok and worker.health().calls == calls + 1
            want, _ = dense_attention(q, k, v)
            assert rel_err(got, want) < 1e-5
        assert _mappings_of(gone) == 1  # this process's own mapping only
        assert _mappings_of(path) == 2  # and the worker's
        warnings = [r for r in caplog.records if "could not map" in r.getMessage()]
        assert len(warnings) == 1 and gone in warnings[0].reason  # once, saying which
        chan.close()

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
@pytest.mark.parametrize("mode", ["private-unix", "tcp"])
def test_channels_without_shared_memory_never_name_files(
    worker, arena_dir, shared_file, mode
) -> None:
    async def run():
        path, base = shared_file()
        chan = await _connect(worker, mode, 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k, v, q, bt, lens, starts = _step()
        k, v, q = _in(base, 0, k), _in(base, 4096, v), _in(base, 8192, q)
        out = _in(base, 16384, torch.zeros_like(q))
        ok, got = await channel_call(
            chan, "write_and_attend", (epoch, 0, slots, k, v, q, bt, lens, starts), {}, out
        )
        assert ok and got is out
        want, _ = dense_attention(q, k, v)
        assert rel_err(out, want) < 1e-5
        assert _mappings_of(path) == 1
        chan.close()

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_a_connection_without_shared_memory_cannot_name_files(worker, shared_file) -> None:
    # Over TCP (a caller on another node) a request naming this node's files is refused,
    # the file left unmapped, and the connection goes on.
    path, _ = shared_file()
    address = _address(worker, tcp=True)
    s = socket.create_connection((address.tcp_host, address.tcp_port), timeout=10)

    def exchange(message: bytes) -> bytes:
        s.sendall(frame(message))
        n, _, _ = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
        return s.recv(n, socket.MSG_WAITALL)

    hello = {"token": address.token, "arena_bytes": 65536}
    assert json.loads(exchange(json.dumps(hello).encode()))["ok"]
    files = ((0, path, 1 << 16),)
    ref = FileTensor(0, 0, "float32", (4,))
    ok, err = pickle.loads(exchange(_raw_request("run_round", (ref,), files)))
    assert not ok and "without shared memory" in str(err)
    assert _mappings_of(path) == 1
    ok, err = pickle.loads(exchange(_raw_request("run_round", ("e",), ())))
    assert not ok and type(err).__name__ != "ChannelProtocolError"  # the call itself ran
    s.close()


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_an_idle_connection_unmaps_deleted_files_and_a_late_request_is_copied(
    worker, arena_dir, shared_file, monkeypatch
) -> None:
    # A file deleted while the connection is idle is unmapped by the worker without waiting
    # for the coordinator's next request (its memory goes back). A request that still names
    # it (built before the coordinator forgot the file) runs once, with its tensors copied.
    import workers.channel_server as channel_server

    monkeypatch.setattr(channel_server, "SWEEP_INTERVAL_S", 0.05)

    async def run():
        epoch = worker.epoch()
        slots, k0, v0, q0, bt, lens, starts = _step()
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        # Deleted and forgotten by the coordinator, as a released region is.
        path, base = shared_file()
        q = _in(base, 8192, q0)
        ok, _ = await channel_call(chan, "attend", (epoch, 0, q, bt, lens, starts), {})
        assert ok and _mappings_of(path) == 2
        SHARED_FILES.remove(base.data_ptr())
        os.unlink(path)
        assert await asyncio.to_thread(_wait_for, lambda: _mappings_of(path) == 1)
        # Deleted, but the coordinator still names it (the race the worker guards against).
        path2, base2 = shared_file()
        q2 = _in(base2, 8192, q0)
        ok, _ = await chan.call("write", (epoch, 0, slots, k0, v0), {})
        ok, first = await channel_call(chan, "attend", (epoch, 0, q2, bt, lens, starts), {})
        assert ok and _mappings_of(path2) == 2
        os.unlink(path2)  # still in SHARED_FILES
        assert await asyncio.to_thread(_wait_for, lambda: _mappings_of(path2) == 1)
        calls = worker.health().calls
        ok, again = await channel_call(chan, "attend", (epoch, 0, q2, bt, lens, starts), {})
        assert ok and torch.equal(again, first) and worker.health().calls == calls + 1
        assert _mappings_of(path2) == 1  # copied, not mapped again
        chan.close()

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_a_call_that_does_not_fit_changes_nothing_the_next_one_relies_on(
    worker, arena_dir, shared_file, monkeypatch
) -> None:
    # A call refused for the arena's size sends nothing: the next call still tells the
    # worker about the file deleted before it (the idle sweep kept out of the way).
    import workers.channel_server as channel_server

    monkeypatch.setattr(channel_server, "SWEEP_INTERVAL_S", 60.0)

    async def run():
        epoch = worker.epoch()
        q0, bt, lens, starts = _step()[3:]
        chan = await _connect(worker, "shared", 1 << 16, arena_dir)
        path, base = shared_file()
        ok, _ = await channel_call(
            chan, "attend", (epoch, 0, _in(base, 0, q0), bt, lens, starts), {}
        )
        assert ok and _mappings_of(path) == 2
        SHARED_FILES.remove(base.data_ptr())
        os.unlink(path)
        big = torch.zeros(1 << 15)  # 128 KiB: more than the arena
        with pytest.raises(ArenaFull):
            await channel_call(chan, "attend", (epoch, 0, big, bt, lens, starts), {})
        assert _mappings_of(path) == 2
        ok, _ = await channel_call(chan, "attend", (epoch, 0, q0, bt, lens, starts), {})
        assert ok and _mappings_of(path) == 1
        chan.close()

    asyncio.run(run())


# -- repeats: a decode step's other layers -------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_a_decode_steps_other_layers_go_as_repeats_and_read_the_files_anew(
    worker, arena_dir, shared_file
) -> None:
    # Key, value, query and output in a shared file, the index tensors copied into the
    # arena under a metadata_key: the second layer's call is a repeat of the first (only
    # the layer differs), reads what the file holds now, and gives what a direct call
    # gives; so are calls whose slots or plain keywords differ. Another key, or a tensor
    # that moved out of the file, goes in full.
    async def run():
        _, base = shared_file()
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k0, v0, q0, bt, lens, starts = _tensor_step()
        k, v, q = _in(base, 0, k0), _in(base, 4096, v0), _in(base, 8192, q0)
        out = _in(base, 16384, torch.full_like(q0, float("nan")))
        keyed = {"metadata_key": 11, "check_finite": True}

        async def call(layer, *, slots=slots, q=q, kw=keyed):
            ok, got = await channel_call(
                chan, "write_and_attend", (epoch, layer, slots, k, v, q, bt, lens, starts), kw, out
            )
            assert ok and got is out, got
            return out.clone()

        first = await call(0)
        assert chan.repeats == 0
        second = await call(1)
        assert chan.repeats == 1
        assert torch.equal(first, second)  # the same tokens on both layers
        assert torch.equal(
            second, write_and_attend(worker, epoch, 1, slots, k0, v0, q0, bt, lens, starts)
        )
        # New values where the old lay: the repeat reads them.
        g = torch.Generator().manual_seed(5)
        for t in (k, v, q):
            t.copy_(torch.randn(t.shape, generator=g))
        third = await call(1)
        assert chan.repeats == 2
        want, _ = dense_attention(q, k, v)
        assert rel_err(third, want) < 1e-5
        # Other slots (a list: not replaced in a repeat), a query copied into the arena,
        # another key: each in full.
        await call(1, slots=list(slots))  # equal slots, another list: still a repeat
        await call(1, kw={**keyed, "check_finite": False})  # a plain keyword's value
        assert chan.repeats == 4
        other = [s + 4 for s in slots]  # blocks 3 and 4
        await call(0, slots=other)  # other slots: a list of ints replaces the list
        assert chan.repeats == 5
        # Another key (it vouches for the index tensors the arena holds), a query that no
        # longer lies in the file: each in full.
        calls = worker.health().calls
        await call(1, slots=other, kw={**keyed, "metadata_key": 12})
        await call(1, slots=other, q=q.clone(), kw={**keyed, "metadata_key": 12})
        assert chan.repeats == 5 and worker.health().calls == calls + 2
        chan.close()

    asyncio.run(run())


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_a_worker_without_the_call_to_repeat_gets_it_in_full(
    worker, arena_dir, shared_file, monkeypatch
) -> None:
    # The worker drops the call it could repeat when it unmaps a file (here: one deleted
    # while the coordinator still records it, which the idle sweep finds): the repeat that
    # follows is answered RepeatUnavailable, nothing runs, and the call goes again in
    # full, once.
    import workers.channel_server as channel_server

    monkeypatch.setattr(channel_server, "SWEEP_INTERVAL_S", 0.05)

    async def run():
        _, base = shared_file()
        other, other_base = shared_file()
        chan = await _connect(worker, "shared", 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, k0, v0, q0, bt, lens, starts = _tensor_step()
        ok, _ = await channel_call(
            chan, "attend", (epoch, 0, _in(other_base, 0, q0), bt, lens, starts), {}
        )
        assert ok and _mappings_of(other) == 2
        k, v, q = _in(base, 0, k0), _in(base, 4096, v0), _in(base, 8192, q0)
        args = (epoch, 0, slots, k, v, q, bt, lens, starts)
        kw = {"metadata_key": 21}
        ok, first = await channel_call(chan, "write_and_attend", args, kw)
        assert ok
        os.unlink(other)  # still in SHARED_FILES: the coordinator would repeat
        assert await asyncio.to_thread(_wait_for, lambda: _mappings_of(other) == 1)
        calls = worker.health().calls
        ok, again = await channel_call(chan, "write_and_attend", (epoch, 1, *args[2:]), kw)
        assert ok and chan.repeats == 0 and worker.health().calls == calls + 1
        assert torch.equal(again, first)
        ok, _ = await channel_call(chan, "write_and_attend", (epoch, 0, *args[2:]), kw)
        assert ok and chan.repeats == 1  # the full call can be repeated again
        chan.close()

    asyncio.run(run())


def test_repeats_the_worker_cannot_honour_are_refused_and_run_nothing(worker, arena_dir) -> None:
    # Over a raw socket: a repeat before any call, after a call that failed, and one that
    # would replace anything but a plain argument by one of its type, are refused and run
    # nothing; a valid one runs the last call again.
    address = _address(worker)
    path = os.path.join(arena_dir, "arena")
    with open(path, "wb") as f:
        f.write(b"\0" * 65536)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(address.socket_path)
    s.settimeout(10)

    def exchange(message: bytes) -> tuple:
        s.sendall(frame(message))
        n, _, _ = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
        return pickle.loads(s.recv(n, socket.MSG_WAITALL))

    def repeat(*changes) -> tuple:
        return exchange(pickle.dumps((changes,)))

    hello = {"token": address.token, "arena_path": path, "arena_bytes": 65536}
    s.sendall(frame(json.dumps(hello).encode()))
    n, _, _ = HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))
    assert json.loads(s.recv(n, socket.MSG_WAITALL))["ok"]
    ok, err, *_ = repeat()
    assert not ok and type(err) is RepeatUnavailable
    epoch = worker.epoch()
    ok, err, *_ = exchange(_raw_request("health", (), ()))  # not served: refused, nothing kept
    assert not ok
    ok, err, *_ = repeat()
    assert not ok and type(err) is RepeatUnavailable
    ok, *_ = exchange(_raw_request("write", (epoch, 0, [8], None, None), ()))
    assert not ok  # a failed call is not kept either
    ok, err, *_ = repeat()
    assert not ok and type(err) is RepeatUnavailable
    k = ArenaTensor(0, "float32", (1, 2, 16))
    ok, *_ = exchange(_raw_request("write", (epoch, 0, [8], k, k), ()))
    assert ok
    calls = worker.health().calls
    for bad in ((3, None), (1, "1"), (1, True), (9, 1), ("1", 1), (1,), (2, 8)):
        ok, err, *_ = repeat(bad)
        assert not ok and isinstance(err, ChannelProtocolError), bad
    ok, err, *_ = repeat((0, 5))  # the epoch is a string: an int cannot take its place
    assert not ok and isinstance(err, ChannelProtocolError)
    assert worker.health().calls == calls
    ok, *_ = repeat((1, 1))  # the same write on layer 1
    assert ok and worker.health().calls == calls + 1
    ok, err, *_ = repeat((0, "stale"))
    assert not ok and type(err) is StaleEpochError
    s.close()


@pytest.mark.parametrize("mode", MODES)
def test_repeats_refill_tensors_copied_into_a_shared_arena(worker, arena_dir, mode) -> None:
    # Tensors in no shared file (a round joining several callers' rows, a client sending
    # bytes): over a shared arena the next layer's call is a repeat that copies the new
    # values into the arena first, and computes with them; over private arenas (whose
    # bytes would have to travel) each call goes in full.
    async def run():
        chan = await _connect(worker, mode, 1 << 20, arena_dir)
        epoch = worker.epoch()
        slots, _, _, _, bt, lens, starts = _tensor_step()
        for layer, seed in ((0, 1), (1, 2), (1, 3)):
            _, k, v, q, *_ = _step(seed=seed)
            ok, got = await channel_call(
                chan,
                "write_and_attend",
                (epoch, layer, slots, k, v, q, bt, lens, starts),
                {"metadata_key": 31},
            )
            assert ok
            want, _ = dense_attention(q, k, v)
            assert rel_err(got, want) < 1e-5
        assert chan.repeats == (2 if mode == "shared" else 0)
        chan.close()

    asyncio.run(run())


def test_the_pool_gives_a_call_the_connection_whose_last_call_it_repeats(worker, arena_dir) -> None:
    # Two groups of callers taking turns (two keys, one call each in flight): each group's
    # next call takes the idle connection that ran the group's last one, and goes as a
    # repeat of it, whichever connection came back last.
    async def run():
        pool = _pool(worker, arena_dir, connections=2)
        slots, k, v, q, bt, lens, starts = _tensor_step()
        epoch = worker.epoch()

        def call(layer: int, key: int):
            args = (epoch, layer, slots, k, v, q * key, bt, lens, starts)
            return channel_call(pool, "write_and_attend", args, {"metadata_key": key})

        await asyncio.gather(call(0, 1), call(0, 2))  # one connection each
        assert pool.open_channels == 2 and pool.repeats == 0
        for layer in (1, 0, 1):
            for key in (1, 2):
                ok, out = await call(layer, key)
                want, _ = dense_attention(q * key, k, v)
                assert ok and rel_err(out, want) < 1e-5
        assert pool.repeats == 6
        pool.close()

    asyncio.run(run())
