"""Which threads of a process tree were busy over an interval (a benchmark diagnostic).

Reads utime + stime of every thread of a process and of its descendants (the clients,
Ray's raylet and workers) from /proc, before and after a run; `busiest` names the threads
that used the most CPU, as a fraction of the run's wall time (1.0: a CPU all the time).
Resolution: the kernel's clock tick (10 ms at the usual 100 Hz), so runs of seconds.

Linux only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from cpu_pinning import descendants

__all__ = ["ThreadTimes", "busiest", "snapshot", "thread_times"]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

Snapshot = dict[tuple[int, int], tuple[str, int]]


def _label(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
    except OSError:
        return str(pid)
    text = raw.decode(errors="replace")
    return text if text.startswith("ray::") else text.rsplit("/", 1)[-1][:48]


def snapshot(root: int | None = None) -> Snapshot:
    """CPU ticks so far of every thread of `root` (default: this process) and its
    descendants, keyed by (pid, tid), with a label "process | thread name"."""
    root = os.getpid() if root is None else root
    out: Snapshot = {}
    for pid in [root, *descendants(root)]:
        name = _label(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            tid = int(task.name)
            thread = f"{comm} (main)" if tid == pid else comm
            out[(pid, tid)] = (f"{name} | {thread}", sum(_cpu_ticks(stat)))
    return out


def _cpu_ticks(stat: str) -> tuple[int, int]:
    """(utime, stime) in clock ticks from a /proc/<pid>/task/<tid>/stat text."""
    # Fields after the parenthesised name (which may hold spaces): state is the first,
    # utime and stime the 12th and 13th.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[11]), int(fields[12])


def busiest(before: Snapshot, after: Snapshot, wall_s: float, top: int = 6) -> list[str]:
    """The `top` threads by CPU used between the snapshots, as "busy label" lines."""
    used = []
    for key, (label, ticks) in after.items():
        spent = (ticks - before.get(key, (label, 0))[1]) * _TICK_S
        used.append((spent, label))
    used.sort(reverse=True)
    return [f"{spent / wall_s:.2f} {label}" for spent, label in used[:top] if spent > 0]


class ThreadTimes(NamedTuple):
    """One thread's counters so far: user and system CPU seconds (clock-tick resolution)
    and its voluntary (it slept: a wait, a blocking read) and involuntary (preempted)
    context switches."""

    user_s: float
    system_s: float
    voluntary: int
    involuntary: int

    def __sub__(self, other: object) -> ThreadTimes:  # type: ignore[override]
        if not isinstance(other, ThreadTimes):
            return NotImplemented
        return ThreadTimes(*(a - b for a, b in zip(self, other, strict=True)))


def thread_times(tid: int, pid: int | None = None) -> ThreadTimes | None:
    """`tid`'s counters (a native thread id, `threading.get_native_id()`, of process `pid`,
    default this one) from /proc; None where they cannot be read (not Linux, thread gone).
    Differences of two readings say where a thread's CPU went between them: Python
    (user) or the kernel (system: syscalls, page faults), and how often it slept."""
    task = Path(f"/proc/{os.getpid() if pid is None else pid}/task/{tid}")
    try:
        stat = (task / "stat").read_text()
        status = (task / "status").read_text()
    except OSError:
        return None
    user, system = _cpu_ticks(stat)
    switches = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches" in line)
    return ThreadTimes(
        user * _TICK_S,
        system * _TICK_S,
        int(switches.get("voluntary_ctxt_switches", 0)),
        int(switches.get("nonvoluntary_ctxt_switches", 0)),
    )
