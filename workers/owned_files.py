"""Files and folders that a process owns while it lives, so a later process can remove
those whose owner is gone (a coordinator killed with SIGKILL never removes its own
shared-memory regions, channel arenas or local-session socket folder).

Ownership is an advisory lock. The owner holds a shared `flock` on an open file
description of each file it owns (for a folder: of the folder itself) for as long as the
file lives; the kernel drops it when the last descriptor closes, which a killed process's
exit does. A reclaimer removes an entry only while it holds ``LOCK_EX | LOCK_NB`` on it,
so never one whose owner lives, whichever pid namespace the owner runs in (containers
sharing /dev/shm through --ipc=host or a shared volume see each other's files but not
each other's processes; the lock is the inode's, the same for all of them). A region's or
arena's lock lives on the descriptor its mmap keeps (`mmap.mmap` duplicates the file's
descriptor, and a duplicate shares the lock): it goes when the mapping is closed, with no
descriptor of its own to keep or leak. A folder's is the descriptor `make_owned_dir`
returns, closed by `remove_owned_dir`. Processes that only map a file (clients, workers)
take no lock and are never blocked by one.

Creating races with reclaiming: the name is visible before the owner's lock is taken.
The owner therefore takes the lock, then checks that the name still refers to the file it
opened (`claim`); a reclaimer, once it holds the exclusive lock, checks the same before it
removes anything, and removes while holding it. If a reclaimer got in first, the owner's
lock waits until the reclaimer has removed the name and let go, the check fails and the
owner starts again under a new name; once the owner's check passes, no reclaimer can take
the lock while the owner lives. Nothing depends on timing, and a crash at any point leaves
either nothing or an unlocked file that the next reclaimer removes.

A name also states its maker, as a cheap first filter: ``<kind><pid>-<start>-<random>``,
the process id and its start time (clock ticks after boot, field 22 of /proc/<pid>/stat),
both in base 36 (short: a socket's path is limited to 107 bytes), and the random rest the
caller adds. A name whose maker looks alive in this pid namespace (a process with that id
and start time exists) is skipped without opening it: skipping can only keep a file. Any
other name (its pid is gone, reused, or another namespace's) is decided by the lock.
Names without the owner part (other programs) are never touched; files of this user only.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass

__all__ = [
    "Owner",
    "claim",
    "make_owned_dir",
    "owned_prefix",
    "owner_alive",
    "parse_owner",
    "reclaim_orphans",
    "remove_owned_dir",
]

log = logging.getLogger("kvcache.owned_files")

_OWNER = re.compile(r"([0-9a-z]+)-([0-9a-z]+)-[A-Za-z0-9_]+")
_UNKNOWN_START = 0
# Names tried by `make_owned_dir` (each lost only to a reclaimer that got in first).
_ATTEMPTS = 8
# flock errors of a file system that has no such locks: the owner goes on unlocked (a
# reclaimer there cannot lock either, and then keeps the file).
_NO_LOCKS = (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
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


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def claim(fd: int, path: str) -> bool:
    """Take this process's ownership lock (a shared `flock`) on ``fd``, a file or folder
    just created at ``path``, and say whether ``path`` still names it. False: a reclaimer
    removed the name meanwhile; the caller closes ``fd`` and creates under a new name. The
    lock lasts while any duplicate of ``fd`` (an mmap's) stays open: never take it on a
    descriptor that is not kept for the file's life.

    Raises:
        OSError: the lock could not be taken (other than on a file system without locks).
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a reclaimer holds it
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:
            raise
    try:
        return _same_file(os.lstat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def make_owned_dir(parent: str | None, kind: str) -> tuple[str, int]:
    """A new private folder (mode 0700) under ``parent`` (None: the temporary directory)
    named ``kind`` + this process's owner part + a random rest, and the descriptor holding
    its ownership lock: keep it open while the folder lives, and end both with
    `remove_owned_dir`.

    Raises:
        OSError: the folder could not be made or locked.
    """
    for _ in range(_ATTEMPTS):
        path = tempfile.mkdtemp(prefix=owned_prefix(kind), dir=parent)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW)
        except FileNotFoundError:
            continue  # a reclaimer removed it already
        try:
            if claim(fd, path):
                return path, fd
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        os.close(fd)
    raise OSError(
        errno.EAGAIN,
        f"could not make a folder in {parent or tempfile.gettempdir()}: "
        f"{_ATTEMPTS} new ones were removed before they were locked",
    )


def remove_owned_dir(path: str, fd: int) -> None:
    """Delete a folder of `make_owned_dir` with its contents, then let go of its lock."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


def _take_if_orphan(path: str, info: os.stat_result) -> bool:
    """Remove ``path`` (a file or folder that ``info`` describes) if no process holds its
    ownership lock; whether it was removed."""
    is_dir = stat.S_ISDIR(info.st_mode)
    if not (is_dir or stat.S_ISREG(info.st_mode)):
        return False  # a link or special file: never made by an owner
    flags = os.O_RDONLY | _NOFOLLOW | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    fd = os.open(path, flags)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner lives (maybe in another pid namespace)
        # The name may have changed hands between the listing and the open.
        if not (_same_file(info, os.fstat(fd)) and _same_file(os.lstat(path), info)):
            return False
        # Removed while locked: an owner racing us finds its name gone (`claim`).
        if is_dir:
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    finally:
        os.close(fd)


def reclaim_orphans(directory: str, kind: str) -> list[str]:
    """Remove the files and folders of ``kind`` in ``directory`` that this user owns and
    whose owner is gone: no process holds their lock (see the module's docstring); names
    whose maker looks alive here (`owner_alive`) are skipped without a look. Returns their
    paths. Links are never followed; a folder goes with its contents. Errors (a directory
    that cannot be listed, an entry removed meanwhile, a file system without locks) skip
    the entry."""
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
            if info.st_uid != uid or not _take_if_orphan(path, info):
                continue
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
