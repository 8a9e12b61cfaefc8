"""A coordinator killed with SIGKILL leaves its shared-memory regions and its local-session
socket folder behind; the next coordinator to start on the host removes them, and never
a live coordinator's.

The end-to-end test runs real `kvcache serve` processes (in-process CPU pools, real gRPC
ports): coordinators A and C each create a shared region and serve local sessions in one
folder; A gets SIGKILL; B starts: A's region file and socket folder are gone, C's are
intact (C still serves its region and sessions). Then B and C stop with SIGTERM and their
files go too (the orderly path). The unit tests pin the owner rules with a real process
killed outright and a reused process id, and the ownership lock: a live owner whose
process id looks dead to the reclaimer (another pid namespace sharing /dev/shm) keeps its
files, and an owner that loses its new name to a reclaimer before it locks it makes
another.
"""

from __future__ import annotations

import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy
import pytest
import yaml

from cache_service._proto.kvcache.v1 import kvcache_pb2 as pb
from cache_service._proto.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from cache_service.api.local_sessions import DIR_PREFIX
from cache_service.wire.shared_regions import default_directory
from cache_service.wire.worker_channel import ARENA_PREFIX, remove_orphan_arenas
from workers import owned_files, shared_files
from workers.owned_files import (
    make_owned_dir,
    owned_prefix,
    owner_alive,
    parse_owner,
    reclaim_orphans,
    remove_owned_dir,
)
from workers.shared_files import create_mapped

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[1]
REGION_PREFIX = "kvcache-region-"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as exc:  # not ready yet
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} ({last})")


def base36(n: int) -> str:
    return numpy.base_repr(n, 36).lower()


# ---- the owner rules, with a real process killed outright -------------------------------

_CHILD = """
import os, sys, time
from workers.owned_files import make_owned_dir, owned_prefix
from workers.shared_files import create_mapped
d = sys.argv[1]
path, mm = create_mapped(d, owned_prefix("kvcache-arena-"), 4096)
folder, lock = make_owned_dir(d, "kvcache-local-")
print(path, folder, flush=True)
time.sleep(600)
"""


def test_a_killed_makers_files_go_and_a_live_ones_stay() -> None:
    d = tempfile.mkdtemp(prefix="kvown")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, d],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            dead_file, dead_folder = child.stdout.readline().split()
            child.kill()
            # Killed and not yet reaped (a zombie): it runs no more, its files may go.
            wait_until("the child to die", lambda: Path(f"/proc/{child.pid}/stat").read_text()
                       .rsplit(")", 1)[1].split()[0] == "Z", 30)  # fmt: skip
            zombie = reclaim_orphans(d, "kvcache-arena-")
            assert zombie == [dead_file]
            Path(dead_file).write_bytes(b"x")  # again, for the reaped case below
        finally:
            child.kill()
            child.wait(timeout=30)
        assert os.path.isfile(dead_file) and os.path.isdir(dead_folder)
        assert parse_owner(os.path.basename(dead_file), "kvcache-arena-").pid == child.pid
        # This process's own files; a name without an owner; another kind's name.
        mine, _ = create_mapped(d, owned_prefix("kvcache-arena-"), 4096)
        my_folder, my_lock = make_owned_dir(d, "kvcache-local-")
        foreign, _ = create_mapped(d, "kvcache-arena-", 4096)
        # This process's id with another start time: the id was reused by a new process.
        me = parse_owner(os.path.basename(mine), "kvcache-arena-")
        reused = os.path.join(d, f"kvcache-arena-{base36(me.pid)}-{base36(me.start + 1)}-ab12")
        Path(reused).write_bytes(b"x")
        assert owner_alive(me)

        removed = reclaim_orphans(d, "kvcache-arena-") + reclaim_orphans(d, "kvcache-local-")

        assert sorted(removed) == sorted([dead_file, reused, dead_folder])
        for kept in (mine, my_folder, foreign):
            assert os.path.exists(kept), kept
        remove_owned_dir(my_folder, my_lock)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def start_owner(d: str) -> tuple[subprocess.Popen[str], str, str]:
    """A real process that creates an arena file and a folder in ``d`` (holding both) and
    sleeps; with the paths it printed."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, d],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().split()
    assert len(line) == 2, f"the owner exited with {child.wait(timeout=30)}"
    return child, line[0], line[1]


def reclaim_all(d: str) -> list[str]:
    return sorted(reclaim_orphans(d, "kvcache-arena-") + reclaim_orphans(d, "kvcache-local-"))


def test_a_live_owner_that_looks_dead_keeps_its_files_and_a_killed_ones_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = tempfile.mkdtemp(prefix="kvlock")
    try:
        child, region, folder = start_owner(d)
        try:
            # A client maps the owner's file as usual: the owner's lock is no obstacle.
            with open(region, "r+b") as f, mmap.mmap(f.fileno(), 4096) as client_map:
                client_map[:4] = b"seen"
            # Another pid namespace: the reclaimer sees no live process behind any name.
            with monkeypatch.context() as m:
                m.setattr(owned_files, "owner_alive", lambda owner: False)
                assert reclaim_all(d) == []
            # A name stating a process id that no process has: the lock still decides.
            pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
            renamed = os.path.join(d, f"kvcache-arena-{base36(pid_max + 1)}-{base36(5)}-ef56")
            os.rename(region, renamed)
            assert not owner_alive(parse_owner(os.path.basename(renamed), "kvcache-arena-"))
            assert reclaim_all(d) == []
            assert os.path.isfile(renamed) and os.path.isdir(folder)
        finally:
            child.kill()
            child.wait(timeout=30)
        # Killed: the kernel dropped its locks, and whatever the pid check says, its files go.
        with monkeypatch.context() as m:
            m.setattr(owned_files, "owner_alive", lambda owner: False)
            assert reclaim_all(d) == sorted([renamed, folder])
        assert os.listdir(d) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_an_owner_that_loses_its_new_name_before_locking_it_makes_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race of the module docstring, played in order: a reclaimer (to which the owner's
    process id looks dead) runs between the owner's create and its lock."""
    d = tempfile.mkdtemp(prefix="kvrace")
    monkeypatch.setattr(owned_files, "owner_alive", lambda owner: False)
    lost: list[str] = []
    real_claim = owned_files.claim

    def claim_after_a_reclaimer(fd: int, path: str) -> bool:
        if not lost:
            lost.extend(reclaim_all(d))
            assert lost == [path]
        return real_claim(fd, path)

    try:
        fds_before = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(shared_files, "claim", claim_after_a_reclaimer)
        path, mm = create_mapped(d, owned_prefix("kvcache-arena-"), 4096)
        assert path != lost[0] and os.listdir(d) == [os.path.basename(path)]
        assert reclaim_all(d) == []  # locked from the moment it was kept

        lost.clear()
        monkeypatch.setattr(owned_files, "claim", claim_after_a_reclaimer)
        folder, lock = make_owned_dir(d, "kvcache-local-")
        assert folder != lost[0] and os.path.isdir(folder)
        assert reclaim_all(d) == []

        # Letting go leaves no descriptor behind, and then the files are anyone's.
        mm.close()
        os.close(lock)
        assert len(os.listdir("/proc/self/fd")) == fds_before
        assert reclaim_all(d) == sorted([path, folder])
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_orphan_arenas_are_removed_from_the_arena_directory() -> None:
    d = tempfile.mkdtemp(prefix="kvarena")
    try:
        mine, _ = create_mapped(d, owned_prefix(ARENA_PREFIX), 4096)
        me = parse_owner(os.path.basename(mine), ARENA_PREFIX)
        gone = os.path.join(d, f"{ARENA_PREFIX}{base36(me.pid)}-{base36(me.start + 7)}-cd34")
        Path(gone).write_bytes(b"x")
        assert remove_orphan_arenas(d) == [gone]
        assert os.path.exists(mine)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- real coordinators --------------------------------------------------------------------


class Coordinators:
    """`kvcache serve` processes (each its own process group) sharing one socket parent."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvorph"))  # short: Unix socket paths
        self.sockets = self.tmp / "sockets"
        self.sockets.mkdir()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str) -> subprocess.Popen[bytes]:
        port = free_port()
        config = {
            "layout": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4},
            "workers": {"num_workers": 1, "blocks_per_worker": 8, "in_process": True},
            "server": {"port": port, "local_session_dir": str(self.sockets)},
            "metrics": {"enabled": False},
        }
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        with (self.tmp / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cache_service.cli", "serve", "--config", str(path)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs[name], self.ports[name] = proc, port
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-4000:]

    def stub(self, name: str) -> tuple[grpc.Channel, pb_grpc.KVCacheStub]:
        channel = grpc.insecure_channel(f"127.0.0.1:{self.ports[name]}")
        return channel, pb_grpc.KVCacheStub(channel)

    def ready(self, name: str) -> pb.GetInfoResponse:
        channel, stub = self.stub(name)

        def info() -> pb.GetInfoResponse:
            assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)}"
            return stub.GetInfo(pb.GetInfoRequest(), timeout=5)

        try:
            return wait_until(f"{name} to serve", info, 120)
        finally:
            channel.close()

    def region(self, name: str) -> pb.CreateSharedRegionResponse:
        channel, stub = self.stub(name)
        try:
            return stub.CreateSharedRegion(
                pb.CreateSharedRegionRequest(size_bytes=4096), timeout=30
            )
        finally:
            channel.close()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=30)
        # A coordinator this test killed left files that no later one removed (a failure).
        for name in os.listdir(default_directory()):
            for proc in self.procs.values():
                owner = parse_owner(name, REGION_PREFIX)
                if owner is not None and owner.pid == proc.pid:
                    os.unlink(os.path.join(default_directory(), name))
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture
def coordinators() -> Iterator[Coordinators]:
    c = Coordinators()
    try:
        yield c
    finally:
        c.stop_all()


def test_a_restarted_coordinator_removes_a_killed_ones_files_and_not_a_live_ones(
    coordinators: Coordinators,
) -> None:
    a, c = coordinators.start("a"), coordinators.start("c")
    info_a, info_c = coordinators.ready("a"), coordinators.ready("c")
    region_a, region_c = coordinators.region("a"), coordinators.region("c")
    folder_a = os.path.dirname(info_a.local_session_socket)
    for path, proc in ((region_a.path, a), (region_c.path, c)):
        assert os.path.isfile(path)
        assert parse_owner(os.path.basename(path), REGION_PREFIX).pid == proc.pid
    assert parse_owner(os.path.basename(folder_a), DIR_PREFIX).pid == a.pid
    assert os.path.exists(info_a.local_session_socket)

    os.killpg(a.pid, signal.SIGKILL)
    a.wait(timeout=30)
    # Nothing of A's is removed by its death alone.
    assert os.path.isfile(region_a.path) and os.path.isdir(folder_a)

    coordinators.start("b")
    info_b = coordinators.ready("b")

    assert not os.path.exists(region_a.path), "the killed coordinator's region is still there"
    assert not os.path.exists(folder_a), "the killed coordinator's socket folder is still there"
    # The live coordinator's files survived, and it still serves its region.
    assert os.path.isfile(region_c.path) and os.path.exists(info_c.local_session_socket)
    channel, stub = coordinators.stub("c")
    with channel:
        stub.ReleaseSharedRegion(pb.ReleaseSharedRegionRequest(region_id=region_c.region_id))
    assert not os.path.exists(region_c.path)
    region_c = coordinators.region("c")
    region_b = coordinators.region("b")

    # The orderly path: SIGTERM, and each removes its own.
    for name, region, info in (("b", region_b, info_b), ("c", region_c, info_c)):
        proc = coordinators.procs[name]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, coordinators.log(name)
        assert not os.path.exists(region.path), f"{name}'s region outlived its stop"
        assert not os.path.exists(os.path.dirname(info.local_session_socket))
    assert os.listdir(coordinators.sockets) == []
