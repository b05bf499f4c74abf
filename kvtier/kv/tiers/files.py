"""The file handling the disk tier and the stores beside it share: atomic writes whose temp files their writer
holds locked, leftovers of writers that are gone, and directory scans that see regular files only."""
from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile

TMP_SUFFIX = ".tmp"
IOV_MAX = 1024                     # buffers per writev call (the Linux limit)


def atomic_write(path: str, buffers: list) -> None:
    """Write buffers to path atomically: a temp file beside it (mode 0600), locked (flock) by its writer until it
    is renamed, so that no other process takes it for a leftover; fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f"{os.path.basename(path)}.", suffix=TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            _write_all(f.fileno(), buffers)
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def is_stale_temp(path: str) -> bool:
    """A temp file whose writer is gone (a write cut short by a crash): no process holds its lock. Decided by the
    lock, not by a process id, which means nothing to another PID namespace sharing the directory (a container).
    A writer locks its file just after creating it: taken in between, its write fails and the block is a miss."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False          # gone already
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def regular_files(directory: str) -> tuple[list[os.DirEntry], list[str]]:
    """The regular files in directory, and the names of entries skipped as anything else: symbolic links,
    FIFOs, sockets, devices, directories, or entries that cannot be examined."""
    found, skipped = [], []
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                regular = stat.S_ISREG(entry.stat(follow_symlinks=False).st_mode)
            except FileNotFoundError:     # removed since the listing (a peer's eviction): nothing to skip
                continue
            except OSError:
                regular = False
            (found.append(entry) if regular else skipped.append(entry.name))
    return found, skipped


def read_regular(path: str, size: int | None = None) -> bytes:
    """The first size bytes (all without size) of a regular file; OSError for anything else, without blocking
    on a FIFO or following a symbolic link."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read() if size is None else f.read(size)


def remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _write_all(fd: int, buffers: list) -> None:
    """One writev for the whole file, repeated only if the kernel writes less."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
