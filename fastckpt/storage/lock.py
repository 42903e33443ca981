"""Root lock: one writing job per :class:`~fastckpt.CheckpointManager` root at a time.

Two independent jobs (not ranks of one job) that save into the same root would otherwise
interleave steps, prune each other's checkpoints and race on ``latest``. The manager takes
an exclusive ``flock`` on ``{root}/.fastckpt.storage.lock`` for every save (from before leftovers are
cleaned until the save committed or failed) and for every prune; a second job gets a
:class:`~fastckpt.errors.CheckpointLockedError` naming the holder instead of interleaving.

Properties:

- The kernel drops the lock when the holder dies (even by SIGKILL), so a crashed job never
  leaves the root locked; the lock file itself is never deleted (deleting lock files races).
- ``flock`` locks belong to an open file description: two managers in one process exclude
  each other too, while one manager may nest acquisitions (its next save, and the retention
  run from its commit hook). Acquire and release may happen on different threads.
- On NFS, Linux emulates ``flock`` with POSIX byte-range locks, so the lock also holds across
  hosts that share the root.
- The lock file holds an informational record of the holder (pid, host, start time) that
  only feeds error messages.

Readers (``load``, ``ls``, ``verify``) never take the lock: a checkpoint exists iff it was
committed, and commits are atomic renames.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time

from ..errors import CheckpointLockedError

LOCK_FILE = ".fastckpt.storage.lock"


def flock_exclusive(fd: int, timeout_s: float | None = None) -> bool:
    """Take the exclusive ``flock(2)`` of open file ``fd``; the one lock primitive of the library.

    Used by :class:`RootLock` and by the KV chunk store's folder lock (:mod:`fastckpt.kv`). The
    kernel drops it when the holder's file description closes or the holder dies.

    Args:
        fd: an open file descriptor of the lock file.
        timeout_s: seconds to wait for another holder to let go; 0 tries once, None (the
            default) waits as long as it takes.

    Returns:
        True once the lock is held; False if ``timeout_s`` passed first.

    Raises:
        OSError: ``flock`` failed for another reason than contention (e.g. EBADF).
    """
    if timeout_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


class RootLock:
    """Re-entrant (per object), inter-process exclusive lock on a checkpoint root.

    Args:
        root: the checkpoint root folder (must exist when :meth:`acquire` is called).

    Example::

        lock = RootLock("runs/a")
        lock.acquire(timeout_s=0)      # CheckpointLockedError if another job holds it
        try:
            ...
        finally:
            lock.release()
    """

    def __init__(self, root: str | os.PathLike):
        self.path = os.path.join(os.fspath(root), LOCK_FILE)
        self._fd = -1
        self._depth = 0
        self._mu = threading.Lock()

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._depth > 0

    def holder(self) -> dict | None:
        """The holder record in the lock file (``{"pid", "host", "since_unix_s"}``), or ``None``."""
        try:
            with open(self.path, "rb") as f:
                rec = json.loads(f.read(4096).decode("utf-8"))
            return rec if isinstance(rec, dict) else None
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    def acquire(self, timeout_s: float = 0.0) -> None:
        """Take the lock, waiting at most ``timeout_s`` seconds (default 0: do not wait).

        Raises:
            CheckpointLockedError: another job (or another manager object) holds the lock;
                the message names its pid and host.
            OSError: the lock file cannot be created (e.g. EROFS on a read-only tier).
        """
        with self._mu:
            if self._depth:
                self._depth += 1
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                self._flock(fd, timeout_s)
                rec = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "since_unix_s": time.time()}).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, rec, 0)
            except BaseException:
                os.close(fd)
                raise
            self._fd, self._depth = fd, 1

    def _flock(self, fd: int, timeout_s: float) -> None:
        if not flock_exclusive(fd, timeout_s):
            h = self.holder() or {}
            raise CheckpointLockedError(
                f"{os.path.dirname(self.path)}: another job is writing checkpoints here "
                f"(lock {self.path} held by pid {h.get('pid', '?')} on host {h.get('host', '?')}); "
                "use a different root, stop that job, or pass a larger lock_timeout_s"
                + ("; if that is another rank of this job (same host), only one rank may own a CheckpointManager "
                   "root: call it on rank 0 (DDP), or pass process_group= to every rank's save"
                   if h.get("host") == socket.gethostname() and os.environ.get("WORLD_SIZE", "1") != "1" else ""))

    def release(self) -> None:
        """Drop one level of the lock; the last release unlocks and closes the file."""
        with self._mu:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth:
                return
            fd, self._fd = self._fd, -1
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __enter__(self) -> "RootLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SharedStateFile:
    """A lock file whose first bytes hold state shared by the processes that lock it (the KV chunk
    store's ``.fckv.lock``: used bytes, generation, holder pid; :mod:`fastckpt.kv.folder_index`).

    The lock is the exclusive ``flock(2)`` of :func:`flock_exclusive` on this object's own open file
    description (the kernel drops it when the holder dies); the state is read and written at
    offset 0 with ``pread`` / ``pwrite`` while it is held. The file is never deleted.

    Args:
        path: the lock file.
        create: create it if missing and open it for writing (False: read only, must exist).

    Raises:
        OSError: the file cannot be opened (``FileNotFoundError`` with ``create=False``).
    """

    def __init__(self, path: str, *, create: bool = True):
        self.path = path
        flags = (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY
        self._fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)

    def lock(self) -> None:
        """Take the exclusive lock, waiting as long as another holder keeps it."""
        flock_exclusive(self._fd)

    def unlock(self) -> None:
        """Let go of the lock."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, n: int) -> bytes:
        """The file's first ``n`` bytes (fewer when it is shorter: a fresh file is empty)."""
        return os.pread(self._fd, n, 0)

    def write(self, data: bytes) -> None:
        """Write ``data`` at offset 0 (one ``pwrite``; not fsynced: the state is re-derivable)."""
        os.pwrite(self._fd, data, 0)

    def close(self) -> None:
        """Close the file (drops the lock if held); safe to call twice."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
