"""Files and folders that name the process that made them, so a later process can remove
those whose maker is gone (a coordinator killed with SIGKILL never removes its own
shared-memory regions, channel arenas or local-session socket folder).

A name reads ``<kind><pid>-<start>-<random>``: the maker's process id and its start time
(clock ticks after boot, field 22 of /proc/<pid>/stat), both in base 36 (short: a
socket's path is limited to 107 bytes), and the random rest the caller adds. The maker is
gone when no process has the id, or the process with that id started at another time
(the id was reused). Where /proc cannot say (not Linux), a process that exists counts as
the maker: a file is never removed while its maker may live, so two coordinators on one
host each keep theirs (a wrong guess can only keep a file). Names without the owner part
(other programs, older versions) are never touched.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass

__all__ = ["Owner", "owned_prefix", "owner_alive", "parse_owner", "reclaim_orphans"]

log = logging.getLogger("kvcache.owned_files")

_OWNER = re.compile(r"([0-9a-z]+)-([0-9a-z]+)-[A-Za-z0-9_]+")
_UNKNOWN_START = 0
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Owner:
    """The process a name says made it: id and start time (clock ticks after boot; 0 when
    unknown)."""

    pid: int
    start: int


def _base36(n: int) -> str:
    digits = ""
    while True:
        n, d = divmod(n, 36)
        digits = _DIGITS[d] + digits
        if n == 0:
            return digits


def _stat(pid: int) -> tuple[str, int] | None:
    """State letter and start time (clock ticks after boot) of process ``pid``; None when
    no such process exists or /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    # Field 2 (the command) is in parentheses and may hold spaces or ')': split after the last.
    fields = text[text.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[19])  # fields 3 and 22 overall
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def _start_ticks(pid: int) -> int | None:
    found = _stat(pid)
    return None if found is None else found[1]


def _me() -> Owner:
    pid = os.getpid()
    start = _start_ticks(pid)
    return Owner(pid, _UNKNOWN_START if start is None else start)


def owned_prefix(kind: str) -> str:
    """``kind`` followed by this process's owner part and a dash: the prefix for a new file
    or folder name (the caller adds a random rest of letters, digits or underscores).
    Computed at each call, so a forked child names itself."""
    me = _me()
    return f"{kind}{_base36(me.pid)}-{_base36(me.start)}-"


def parse_owner(name: str, kind: str) -> Owner | None:
    """The owner a file or folder name of ``kind`` states, or None when the name is not
    ``kind`` + an owner part + a random rest."""
    if not name.startswith(kind):
        return None
    m = _OWNER.fullmatch(name[len(kind) :])
    if m is None:
        return None
    return Owner(int(m.group(1), 36), int(m.group(2), 36))


def owner_alive(owner: Owner) -> bool:
    """Whether the process that made a name may still run (True when in doubt)."""
    found = _stat(owner.pid)
    if found is not None:
        state, start = found
        if state in ("Z", "X"):
            return False  # killed, not yet reaped by its parent: it runs no more
        return owner.start == _UNKNOWN_START or start == owner.start
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    # Exists, and /proc could not give its start time: keep the name.
    return True


def reclaim_orphans(directory: str, kind: str) -> list[str]:
    """Remove the files and folders of ``kind`` in ``directory`` that this user owns and
    whose maker is gone (see `owner_alive`); returns their paths. Links are never followed;
    a folder goes with its contents. Errors (a directory that cannot be listed, an entry
    removed meanwhile) skip the entry."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid = os.geteuid()
    removed = []
    for name in names:
        owner = parse_owner(name, kind)
        if owner is None or owner_alive(owner):
            continue
        path = os.path.join(directory, name)
        try:
            info = os.lstat(path)
            if info.st_uid != uid:
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    if removed:
        log.info(
            "removed %d leftovers of processes that are gone",
            len(removed),
            extra={"directory": directory, "kind": kind},
        )
    return removed
