"""The I/O engine: positional reads/writes, fsync, O_DIRECT, behind a small swappable backend.

Backends are looked up by name in :data:`BACKENDS` (``"posix"`` by default); tests pass a
faulty subclass instance to inject ENOSPC/EIO/fsync failures. ``os.pwrite``/``os.preadv``
release the GIL, so a thread pool keeps many large requests in flight.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from ..errors import CorruptCheckpointError, InsufficientSpaceError, InvalidArgumentError

ALIGN = 4096
#: Default bytes per write or read request (8 MiB; a multiple of :data:`ALIGN`).
DEFAULT_CHUNK_BYTES = 8 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)



def default_threads() -> int:
    """Default I/O thread count: 8 on small machines, up to 16 with more cores."""
    return min(16, max(8, os.cpu_count() or 1))


class PosixBackend:
    """Plain POSIX file I/O. Subclass and override a method to inject faults.

    Call order for one file written by a save: ``open_write`` -> ``allocate`` (``set_size`` on a
    memory-backed file system) -> ``pwrite`` (any thread, any order) -> ``fsync`` -> ``close``.
    """

    name = "posix"

    def open_write(self, path: str, o_direct: bool = False) -> int:
        """Create ``path`` (must not exist) for writing; returns an fd. ``o_direct`` adds O_DIRECT."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        if o_direct and O_DIRECT:
            flags |= O_DIRECT
        return os.open(path, flags, 0o644)

    def open_existing(self, path: str) -> int:
        """Open an existing file for positional writes (another rank created it)."""
        return os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))

    def open_read(self, path: str, o_direct: bool = False) -> int:
        """Open ``path`` for reading; returns an fd."""
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if o_direct and O_DIRECT:
            flags |= O_DIRECT
        return os.open(path, flags)

    def allocate(self, fd: int, nbytes: int) -> None:
        """Reserve ``nbytes`` for the file (early ENOSPC, fewer extents); no-op where unsupported."""
        if nbytes and hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise

    def set_size(self, fd: int, nbytes: int) -> None:
        """Give the file its final size without reserving space (``ftruncate``: sparse until written)."""
        os.ftruncate(fd, nbytes)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """Write some of ``data`` at ``offset``; returns bytes written (may be short)."""
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Read into the buffers ``bufs`` (in order) from ``offset``; returns bytes read (0 at EOF)."""
        return os.preadv(fd, bufs, offset)

    def preadv_cached(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Read into ``bufs`` from ``offset`` only what the page cache holds, never waiting for the
        device (``RWF_NOWAIT``); returns bytes read (short or 0 when not cached).

        Raises:
            OSError: ``EAGAIN`` / ``EOPNOTSUPP`` / ``EINVAL`` where the kernel or file system cannot
                tell (the caller reads normally), or a read error.
        """
        return os.preadv(fd, bufs, offset, os.RWF_NOWAIT)

    def size(self, fd: int) -> int:
        """The size in bytes of the open file ``fd``."""
        return os.fstat(fd).st_size

    def inode(self, fd: int) -> int:
        """The inode number of the open file ``fd`` (a file replaced under its name gets another one)."""
        return os.fstat(fd).st_ino

    def advise_sequential(self, fd: int, offset: int, nbytes: int) -> None:
        """Tell the kernel bytes ``[offset, offset + nbytes)`` of ``fd`` will be read in order
        (larger read-ahead); no-op where unsupported."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_SEQUENTIAL)

    def fsync(self, fd: int) -> None:
        """Make the file's data and metadata durable."""
        os.fsync(fd)

    def close(self, fd: int) -> None:
        """Close ``fd``."""
        os.close(fd)


#: Backend registry: name -> class. Optional accelerated backends register here lazily.
BACKENDS: dict[str, type[PosixBackend]] = {"posix": PosixBackend}


def group_by_bytes(items, limit: int) -> list[list]:
    """Consecutive groups of ``items`` (tuples whose element 3 is a byte count) of at most ``limit``
    bytes each (a larger item gets a group of its own); ``[[]]`` for no items. Used to batch writes
    and reads into requests of about ``limit`` bytes."""
    out: list[list] = [[]]
    size = 0
    for e in items:
        if out[-1] and size + e[3] > limit:
            out.append([])
            size = 0
        out[-1].append(e)
        size += e[3]
    return out


def get_backend(backend: str | PosixBackend | None) -> PosixBackend:
    """Return a backend instance for a name in :data:`BACKENDS`, or ``backend`` itself.

    Raises:
        InvalidArgumentError: an unknown name, or neither a name nor a :class:`PosixBackend`.
    """
    if backend is None:
        return PosixBackend()
    if isinstance(backend, str):
        try:
            return BACKENDS[backend]()
        except KeyError:
            raise InvalidArgumentError(f"io_backend: unknown I/O backend {backend!r}; known: {sorted(BACKENDS)} "
                                       "(or pass a PosixBackend instance)") from None
    if not isinstance(backend, PosixBackend):
        raise InvalidArgumentError(f"io_backend must be a name in {sorted(BACKENDS)} or a PosixBackend instance, "
                                   f"got {type(backend).__name__}")
    return backend


def write_all(be: PosixBackend, fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``, retrying short writes.

    Raises:
        OSError: from the backend (ENOSPC, EIO...), with its errno.
    """
    done, n = 0, len(data)
    while done < n:
        w = be.pwrite(fd, data[done:], offset + done)
        if w <= 0:
            raise OSError(errno.EIO, f"pwrite returned {w} at offset {offset + done}")
        done += w


def read_exact(be: PosixBackend, fd: int, buf: memoryview, offset: int, *, path: str, what: str = "") -> None:
    """Fill ``buf`` from ``offset``.

    Raises:
        CorruptCheckpointError: the file ended early (names the file, ``what`` and the numbers).
        OSError: from the backend.
    """
    done, n = 0, len(buf)
    while done < n:
        r = be.preadv(fd, [buf[done:]], offset + done)
        if r <= 0:
            try:
                size = f"is {os.fstat(fd).st_size} bytes long"
            except OSError:
                size = f"ends before byte {offset + done}"
            raise CorruptCheckpointError(
                f"{path}: the file {size}; reading {what or 'data'} needs bytes [{offset}, {offset + n}) "
                "(truncated)", path=path, tensor=what or None)
        done += r


def readv_exact(be: PosixBackend, fd: int, bufs: list[memoryview], offset: int, *, path: str,
                what: str = "") -> None:
    """Fill every buffer of ``bufs`` (in order) from ``offset`` with one ``preadv`` when possible.

    Raises:
        CorruptCheckpointError: the file ended early. OSError: from the backend.
    """
    total = sum(len(b) for b in bufs)
    r = be.preadv(fd, bufs, offset) if total else 0
    if r == total:
        return
    pos = offset
    for b in bufs:  # short read: finish buffer by buffer
        n = len(b)
        skip = min(max(r - (pos - offset), 0), n)
        if skip < n:
            read_exact(be, fd, b[skip:], pos + skip, path=path, what=what)
        pos += n


def fsync_dir(path: str) -> None:
    """fsync a directory so that entries created or renamed in it are durable.

    File systems that refuse fsync on a directory (EINVAL or EBADF: some FUSE and network
    file systems) are treated as having nothing to flush.

    Raises:
        OSError: the folder cannot be opened, or fsync failed otherwise (EIO...).
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def buffer_address(data: memoryview) -> int:
    """Address of the first byte of ``data`` (a C-contiguous buffer, writable or read-only).

    Used to decide whether a buffer may go through an O_DIRECT fd (its address must be a
    multiple of :data:`ALIGN`). Returns -1 when the address cannot be taken (non-contiguous).
    """
    try:
        return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)
    except (TypeError, ValueError, BufferError):
        return -1


def copy_file(src: str, dst: str, *, fsync: bool = True) -> int:
    """Copy file ``src`` to ``dst`` (must not exist) in the kernel where possible; fsync ``dst``.

    Uses ``copy_file_range`` (reflinks or server-side copies where the file system offers them),
    falling back to ``read``/``write`` in 8 MiB pieces.

    Args:
        src: file to copy.
        dst: new file (created with mode 0644; ``FileExistsError`` if it exists).
        fsync: make ``dst``'s data durable before returning (default True).

    Returns:
        Bytes copied.

    Raises:
        OSError: from open, copy or fsync (ENOSPC, EIO...); ``dst`` may then be partial.
    """
    with open(src, "rb") as fin:
        size = os.fstat(fin.fileno()).st_size
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            done = 0
            fast = hasattr(os, "copy_file_range")
            while done < size:
                n = 0
                if fast:
                    try:
                        n = os.copy_file_range(fin.fileno(), fd, size - done, done, done)
                    except OSError as e:
                        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                        fast = False
                        continue
                else:
                    piece = os.pread(fin.fileno(), min(DEFAULT_CHUNK_BYTES, size - done), done)
                    if piece:
                        write_all(PosixBackend(), fd, memoryview(piece), done)
                    n = len(piece)
                if n == 0:  # src shrank while copied
                    break
                done += n
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return done


#: File systems whose "disk" is memory: preallocating zero-fills pages that the writes fill again.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
_FS_TYPES: dict[int, str] = {}


def fs_type(path: str) -> str:
    """The type of the file system holding ``path`` (``"ext4"``, ``"tmpfs"``, ``"nfs4"``...), from
    ``/proc/self/mountinfo`` (the mount whose device is ``path``'s, or its nearest existing folder's
    when ``path`` does not exist yet); ``""`` where unknown (not Linux)."""
    p = os.path.abspath(path)
    while True:
        try:
            dev = os.stat(p).st_dev
            break
        except FileNotFoundError:
            if os.path.dirname(p) == p:
                raise
            p = os.path.dirname(p)
    if dev not in _FS_TYPES:
        want, kind = f"{os.major(dev)}:{os.minor(dev)}", ""
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:  # "id parent major:minor root mountpoint options [optional...] - fstype source ..."
                    left, _, right = line.partition(" - ")
                    if left.split()[2:3] == [want] and right:
                        kind = right.split()[0]
                        break
        except OSError:
            pass
        _FS_TYPES[dev] = kind
    return _FS_TYPES[dev]


def memory_backed(path: str) -> bool:
    """True when ``path`` is on a memory-backed file system (:data:`MEMORY_FS`): there,
    preallocating a file costs as much as writing it (every page is allocated and zeroed) and
    buys nothing (no extents, and the free space was checked before the save started)."""
    return fs_type(path) in MEMORY_FS


_SAVE_FAILED = ("the disk filled after the save's free-space check; the save's temporary folder is removed and "
                "nothing is committed")


def no_space_error(e: OSError, path: str, nbytes: int, why: str = _SAVE_FAILED) -> OSError:
    """``e`` as an :class:`~fastckpt.errors.InsufficientSpaceError` naming ``path`` and ``nbytes`` (the
    write's size, bytes) when the device is full (ENOSPC, EDQUOT), else ``e`` itself: a bare
    ``OSError: [Errno 28]`` named no file (a README-only trial). ``why`` says what happened to the
    data (default: a save's shard, written after its free-space check)."""
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return e
    return InsufficientSpaceError(e.errno, f"{e.strerror or os.strerror(e.errno)}, while writing {nbytes} bytes of "
                                  f"this file ({why}): free space or save elsewhere", path)


class FileWriter:
    """Writes one file of known size through a backend, optionally with O_DIRECT.

    With ``o_direct=True`` the aligned prefix of each write goes through an O_DIRECT fd and
    the unaligned tail through a buffered fd; buffers must be 4096-aligned (ours are mmap
    backed) and offsets of O_DIRECT writes multiples of 4096. ``create=False`` opens a file
    another rank created instead of creating it. A created file is preallocated to ``size``
    bytes (``preallocate=True``, default) or only given that size, sparse (``preallocate=False``,
    for memory-backed file systems: see :func:`memory_backed`).
    """

    def __init__(self, be: PosixBackend, path: str, size: int, o_direct: bool = False, create: bool = True,
                 preallocate: bool = True):
        self.be, self.path, self.size = be, path, size
        self.fd = be.open_write(path, False) if create else be.open_existing(path)
        self.dfd = -1
        try:
            if create and preallocate:
                try:
                    be.allocate(self.fd, size)
                except OSError as e:
                    err = no_space_error(e, path, size)
                    if err is e:
                        raise
                    raise err from e
            elif create:
                be.set_size(self.fd, size)
            if o_direct and O_DIRECT:
                try:
                    self.dfd = os.open(path, os.O_WRONLY | O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                except OSError:
                    self.dfd = -1  # file system without O_DIRECT (tmpfs): buffered
        except BaseException:
            self.close()
            raise

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (bytes).

        Raises:
            InsufficientSpaceError: (an ``OSError``, errno ENOSPC/EDQUOT) the device is full, naming the file.
            OSError: any other write error.
        """
        try:
            self._write(data, offset)
        except OSError as e:
            err = no_space_error(e, self.path, len(data))
            if err is e:
                raise
            raise err from e

    def _write(self, data: memoryview, offset: int) -> None:
        if self.dfd >= 0 and offset % ALIGN == 0 and buffer_address(data) % ALIGN == 0:
            aligned = len(data) // ALIGN * ALIGN
            if aligned:
                try:
                    write_all(self.be, self.dfd, data[:aligned], offset)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    write_all(self.be, self.fd, data[:aligned], offset)  # O_DIRECT refused it: buffered
            if aligned < len(data):
                write_all(self.be, self.fd, data[aligned:], offset + aligned)
            return
        write_all(self.be, self.fd, data, offset)

    def sync(self) -> None:
        """fsync the file (data written through either fd)."""
        self.be.fsync(self.fd)

    def close(self) -> None:
        """Close both fds; safe to call twice."""
        for attr in ("dfd", "fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                if attr == "fd":
                    self.be.close(fd)
                else:
                    os.close(fd)
