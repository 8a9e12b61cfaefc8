"""Start a fresh local Ray (the embedded deployment), surviving one slow start.

Ray gives its raylet a fixed 30 s to register with the GCS. On a loaded two-core machine
that can run out, and Ray then raises a bare ``Exception`` and leaves the half-started
processes behind. The embedded default and the tests should not fail on that once: this
module shows the raylet's own log lines (so the cause is visible), stops what the failed
attempt started, and tries again. Any other failure is raised at once.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import ray

__all__ = ["RAY_STARTUP_TIMEOUT_MARK", "is_startup_timeout", "start_local_ray"]

log = logging.getLogger(__name__)

# Ray's message when the raylet did not register in time (ray/_private/node.py).
RAY_STARTUP_TIMEOUT_MARK = "timed out during startup"
_LOG_FILES = ("raylet.out", "raylet.err", "gcs_server.err")


def is_startup_timeout(error: BaseException) -> bool:
    """Whether ``error`` is Ray's "node timed out during startup" (worth one more try)."""
    return RAY_STARTUP_TIMEOUT_MARK in str(error)


def start_local_ray(
    namespace: str,
    *,
    num_cpus: int | None = None,
    attempts: int = 2,
    init: Callable[..., object] | None = None,
    **init_kwargs: object,
) -> None:
    """Start a fresh local Ray in this process (never one found on the machine).

    Args:
        namespace: the Ray namespace of this job.
        num_cpus: logical CPUs of the local node (None: Ray counts them).
        attempts: how many starts to try when the raylet times out (at least 1).
        init: the function that starts Ray (``ray.init``; tests of the retry pass a fake).
        init_kwargs: more keyword arguments for ``ray.init`` (they override the defaults).

    Raises:
        ValueError: ``attempts`` is below 1.
        Exception: Ray's own error, when the last attempt fails or the failure is not a
            startup timeout.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts!r}")
    start = ray.init if init is None else init
    kwargs: dict[str, object] = {
        "address": "local",
        "namespace": namespace,
        "num_cpus": num_cpus,
        "include_dashboard": False,
        "log_to_driver": False,
    }
    kwargs.update(init_kwargs)
    for attempt in range(1, attempts + 1):
        before = _descendants(os.getpid())
        try:
            start(**kwargs)
            return
        except Exception as error:
            if not is_startup_timeout(error) or attempt == attempts:
                raise
            log.warning(
                "local Ray did not start (attempt %d of %d): %s\n%s",
                attempt,
                attempts,
                error,
                _ray_log_tails(),
            )
            if init is None:
                ray.shutdown()
            _terminate(_descendants(os.getpid()) - before)


def _ray_log_tails(lines: int = 15) -> str:
    """The last lines of the newest session's raylet and GCS logs, for the warning."""
    root = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "session_latest"
    parts = []
    for name in _LOG_FILES:
        path = root / "logs" / name
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        parts.append(f"--- {path} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts) if parts else f"(no Ray logs under {root})"


def _descendants(pid: int) -> set[int]:
    """Pids of every live process below ``pid`` (empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: fields follow the last ")".
        fields = stat.rsplit(")", 1)[-1].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _terminate(pids: set[int]) -> None:
    """SIGKILL the processes a failed start left behind (they hold ports and CPU)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
