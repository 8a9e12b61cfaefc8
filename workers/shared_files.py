"""Files in a memory-backed directory (/dev/shm) that two processes of one user map: the
creation rules both users of them follow (a client's shared region, a worker channel's
arena).

A file gets a random, unguessable name and mode 0600 (only processes of the creator's user
can open it), is created exclusively and without following links, and has its blocks
allocated at creation: a tmpfs file that is only truncated is sparse, and when the file
system fills up (a container's /dev/shm is 64 MiB by default) touching a page beyond its
room kills the toucher with SIGBUS. Allocating turns that into an error here.

The creator owns the file (workers.owned_files): it holds the file's ownership lock on the
descriptor its mapping keeps, from before the file has any content until the mapping is
closed, so a reclaimer never removes a file whose creator lives. Processes that only map
the file take no lock.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets

from workers.owned_files import claim
from workers.pinned_ranges import AddressRanges

__all__ = ["SHARED_FILES", "NoRoom", "create_mapped", "unlink_quietly"]

# Files of this process (the coordinator's shared regions) that a worker on this node may
# map too, as the address range of this process's mapping and the file's path: a worker
# channel names a tensor lying in one by file and offset instead of copying it into its
# arena (cache_service.wire.worker_channel). Values: (path, size in bytes). The owner adds a file
# once it is mapped and removes it before the file is unlinked.
SHARED_FILES: AddressRanges[tuple[str, int]] = AddressRanges()

# Names tried (each lost only to a reclaimer of another process that got in first).
_ATTEMPTS = 8


class NoRoom(OSError):
    """The file system has no room for the file (ENOSPC)."""


def create_mapped(directory: str, prefix: str, size: int) -> tuple[str, mmap.mmap]:
    """A new file of ``size`` bytes in ``directory``, named ``prefix`` + 32 random hex
    digits, mapped read-write and shared, and owned by this process until the mapping is
    closed (workers.owned_files); nothing is left behind on failure.

    Raises:
        NoRoom: the file system cannot hold ``size`` more bytes.
        OSError: the file could not be created, locked or mapped.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_ATTEMPTS):
        path = os.path.join(directory, prefix + secrets.token_hex(16))
        fd = os.open(path, flags, 0o600)
        # A reclaimer may remove the name before the lock is taken: then take another.
        try:
            if claim(fd, path):
                break
        except BaseException:
            os.close(fd)
            unlink_quietly(path)
            raise
        os.close(fd)
    else:
        raise OSError(
            errno.EAGAIN,
            f"could not create a file in {directory}: {_ATTEMPTS} new ones were removed "
            "before they were locked",
        )
    try:
        os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask (it can only remove bits)
        os.ftruncate(fd, size)
        _allocate(fd, size, directory)
        # MAP_SHARED, read-write. The mmap keeps a duplicate of fd, and with it the lock.
        return path, mmap.mmap(fd, size)
    except BaseException:
        unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    """Remove ``path``; a file already gone is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _allocate(fd: int, size: int, directory: str) -> None:
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:  # pragma: no cover - not on Linux
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise NoRoom(errno.ENOSPC, f"no room for {size} bytes in {directory}") from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        # A file system without fallocate: the file stays sparse (as on macOS).
