"""A core of its own for the coordinator's event-loop thread (a benchmark setting).

The loop thread is what concurrent clients share (its CPU per call sets the service's
throughput). On a host with two hardware threads per core, a client or worker running on
the loop's sibling thread slows every instruction the loop runs; and a scheduler waking a
client on the loop's core takes turns with it. `reserve_core` pins the calling thread to
one CPU and moves every other thread of this process and of its descendants (clients,
Ray's raylet and workers) off that CPU's whole core.

Linux only (sched_setaffinity on thread ids, /proc, /sys).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["core_siblings", "descendants", "reserve_core"]

# What the process may use, read before anything is pinned (a pinned thread's own set is
# its one CPU).
_USABLE = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())


def core_siblings(cpu: int) -> set[int]:
    """The CPUs sharing `cpu`'s physical core (itself included)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return {cpu}
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    seen: list[int] = []
    todo = _children(pid)
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += _children(p)
    return seen


def _move(pid: int, cpus: set[int], skip: int | None = None) -> int:
    """Every thread of `pid` but `skip` onto `cpus`; how many were moved."""
    moved = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        tid = int(task.name)
        if tid == skip:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except OSError:
            continue  # gone meanwhile, or not ours to move
    return moved


def reserve_core(cpu: int) -> tuple[set[int], int]:
    """Pin the calling thread to `cpu` and keep everything else of this process tree off
    its core.

    Returns:
        (the CPUs left to the others, how many threads were moved there). Threads made
        later by the pinned thread inherit its CPU: such a thread should call
        `os.sched_setaffinity(0, others)` first.
    """
    if cpu not in _USABLE:
        raise ValueError(f"CPU {cpu} is not one this process may use ({sorted(_USABLE)})")
    others = set(_USABLE - core_siblings(cpu))
    if not others:
        raise ValueError(f"no CPU left for the other threads once {cpu}'s core is reserved")
    me = os.getpid()
    moved = _move(me, others, skip=threading.get_native_id())
    for pid in descendants(me):
        moved += _move(pid, others)
    os.sched_setaffinity(0, {cpu})
    return others, moved
