"""The storage seam: a folder-level store and the two commit strategies.

A :class:`Store` is everything the library asks of where checkpoints live: create a file and
write it at offsets, read a file, list a folder, test, remove, hard-link, free space, and the
folder moves a commit needs. :class:`LocalStore` (the default, :data:`LOCAL`) is the POSIX file
system with today's fast path (``pwrite``/``preadv`` through :class:`fastckpt.storage.io.FileWriter`,
O_DIRECT, ``fallocate``, fsync, hard links, hidden temporary folders with owner records);
:class:`fastckpt.storage.fsspec_store.FsspecStore` puts checkpoints in any fsspec file system
(``s3://bucket/prefix``). :func:`fastckpt.storage.locate.store_for` picks the store of a path (a
URL with a scheme other than ``file`` -> fsspec; anything else -> local) or returns an explicit
store object.

A commit makes a written folder a checkpoint. Two strategies (:data:`STRATEGIES`, chosen by the
``commit=`` save option; :func:`strategy`):

* :class:`RenameCommit` (``"rename"``): files go into a hidden sibling temporary folder with an
  owner record; the commit fsyncs the folder and renames it into place in one ``rename(2)``
  (``renameat2(RENAME_EXCHANGE)`` when replacing). After a crash at any point the path holds
  either nothing, or the previous checkpoint, or the complete new one; a leftover temporary is
  removed by :meth:`Store.clean_stale_temps` once its writer is dead. Needs an atomic rename:
  local (and shared POSIX) file systems only.
* :class:`MarkerCommit` (``"marker"``): files go straight to the final folder (an existing one is
  removed first with ``overwrite``), marked uncommitted by an empty ``state.json``; the
  ``manifest.json`` written last is the marker that commits it (one per node on node-local
  disks). After a crash the folder exists without a manifest: it is no checkpoint (readers,
  ``latest`` and retention skip it) and the previous checkpoint at that path, if it was
  replaced, is gone. The only strategy of stores without an atomic rename (object stores).

Units are bytes and seconds throughout. Errors are the built-in ``OSError`` family
(``FileNotFoundError``, ``FileExistsError``, ...) naming the path, unless a method says otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import json
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from typing import Iterator

from ..errors import CheckpointExistsError
from . import commit as cm
from .lock import RootLock
from .io import FileWriter, PosixBackend, copy_file, fsync_dir, get_backend


class Store:
    """A place that holds checkpoint folders (interface; :class:`LocalStore`, ``FsspecStore``).

    Paths are strings in the store's own spelling (absolute local paths, or URLs), joined with
    :meth:`join`. Methods raise ``OSError`` subclasses naming the path.

    Attributes:
        name: short name (``"local"``, ``"s3"``...).
        commits: names of the commit strategies this store supports, the default first.
        local: True when paths are local file-system paths (loaders read them in place).
    """

    name = "store"
    commits: tuple[str, ...] = ("marker",)
    local = False

    # -- paths -------------------------------------------------------------------------------------
    def path(self, path: str) -> "StorePath":
        """``path`` of this store as a value every API taking a path accepts (``fastckpt.save``,
        ``load``, ``verify``, ``is_committed``, ``prune_checkpoints``...): the explicit way to use a
        store object configured in code (credentials, endpoint) instead of the environment."""
        return StorePath(self.normalize(path), self)

    def normalize(self, path: str | os.PathLike) -> str:
        """The canonical spelling of ``path`` in this store (absolute)."""
        raise NotImplementedError

    def join(self, folder: str, *names: str) -> str:
        """``folder`` joined with ``/``-separated ``names``."""
        return "/".join([folder.rstrip("/"), *names])

    def parent(self, path: str) -> str:
        """The folder holding ``path``."""
        return path.rstrip("/").rsplit("/", 1)[0]

    def basename(self, path: str) -> str:
        """The last name of ``path``."""
        return path.rstrip("/").rsplit("/", 1)[-1]

    # -- queries -----------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        """True if a file or folder is at ``path`` (a local symlink counts when its target exists)."""
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        """True if ``path`` is a folder."""
        raise NotImplementedError

    def isfile(self, path: str) -> bool:
        """True if ``path`` is a file."""
        raise NotImplementedError

    def listdir(self, folder: str) -> list[str]:
        """Names (not paths) of the entries of ``folder``, hidden ones included, unsorted.

        Raises:
            FileNotFoundError: no such folder. NotADirectoryError: ``folder`` is a file.
        """
        raise NotImplementedError

    def glob(self, folder: str, pattern: str) -> list[str]:
        """Sorted paths of the entries of ``folder`` (one level) whose names match the shell
        ``pattern`` (``*``, ``?``, ``[...]``; a leading ``.`` is matched only by a pattern starting
        with one, as ``glob.glob``). ``folder`` itself is taken literally (no pattern in it).
        Empty when ``folder`` does not exist or is a file."""
        try:
            names = self.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        hidden = pattern.startswith(".")
        return sorted(self.join(folder, n) for n in names
                      if fnmatch.fnmatchcase(n, pattern) and (hidden or not n.startswith(".")))

    def entries(self, folder: str) -> list["Entry"]:
        """The entries of ``folder`` with their own size and times (a symlink is not followed), in
        no order; entries removed while the folder is read are left out.

        Raises:
            FileNotFoundError: no such folder. NotADirectoryError: ``folder`` is a file.
        """
        out = []
        for name in self.listdir(folder):
            try:
                out.append(self.entry(self.join(folder, name)))
            except FileNotFoundError:
                continue
        return out

    def entry(self, path: str) -> "Entry":
        """What is at ``path`` itself (a symlink is not followed): an :class:`Entry`.

        Raises:
            FileNotFoundError: nothing at ``path``.
        """
        folder = self.isdir(path)
        if not folder and not self.exists(path):
            raise FileNotFoundError(2, "no such file or folder", path)
        return Entry(self.basename(path), path, folder, 0 if folder else self.size(path), self.mtime(path), 0)

    def rename(self, src: str, dst: str) -> None:
        """Rename file ``src`` to ``dst`` in one atomic step, replacing a file at ``dst`` (``rename(2)``).

        Raises:
            FileNotFoundError: ``src`` is gone.
            NotImplementedError: the store has no atomic rename (object stores).
        """
        raise NotImplementedError(f"{self.name} store has no atomic rename")

    def lexists(self, path: str) -> bool:
        """True if an entry is at ``path``, a dangling local symlink included (:meth:`exists` is
        False for one)."""
        return self.exists(path)

    def realpath(self, path: str) -> str:
        """``path`` with every symlink in it resolved (:meth:`normalize` where the store has no links)."""
        return self.normalize(path)

    def link_target(self, path: str) -> str | None:
        """What the symlink ``path`` points to (as stored, maybe relative), or ``None`` when ``path``
        is no symlink or cannot be read; for messages (a hub cache snapshot is all symlinks)."""
        return None

    def size(self, path: str) -> int:
        """Size of file ``path`` in bytes."""
        raise NotImplementedError

    def mtime(self, path: str) -> float:
        """Modification time of ``path`` (seconds since the epoch)."""
        raise NotImplementedError

    def identity(self, path: str) -> tuple:
        """A value that changes whenever file ``path`` is replaced or rewritten (memo key)."""
        raise NotImplementedError

    def free_bytes(self, folder: str) -> int:
        """Bytes an unprivileged writer may still write under ``folder`` (a large number where unbounded)."""
        raise NotImplementedError

    def without_storage(self, folder: str) -> bool:
        """True when ``folder`` is on a file system that stores nothing (``/proc``, ``/sys``: no
        blocks at all), so 0 bytes free there is not a full disk. Default False."""
        return False

    # -- files -------------------------------------------------------------------------------------
    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The content of file ``path`` (small files: JSON, configs, headers), whole or its first
        ``limit`` bytes (fewer when the file is shorter)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def open_reader(self, path: str) -> Iterator["FileReader"]:
        """File ``path`` open for reads at offsets (a header, then a few ranges): a
        :class:`FileReader` with its ``size`` in bytes, ``regular`` (False for a folder, FIFO or
        device: read nothing then) and ``read_at(offset, n)``. Never blocks on a FIFO.

        Raises:
            FileNotFoundError: no such file (a dangling symlink included).
        """
        size = self.size(path)
        yield FileReader(size, True, lambda off, n: self.read_range(path, off, n))

    def read_range(self, path: str, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of file ``path`` from byte ``offset`` (fewer at the end of the file)."""
        raise NotImplementedError

    def write_file(self, path: str, data: bytes, *, fsync: bool = True, replace: bool = False) -> None:
        """Create file ``path`` holding ``data`` (durable when the call returns with ``fsync``).

        Args:
            replace: an existing file is replaced atomically (readers see old or new bytes);
                without it an existing file raises ``FileExistsError``.
        """
        raise NotImplementedError

    def put_file(self, local: str, path: str) -> None:
        """Copy the local file ``local`` to new file ``path`` of this store (durable on return)."""
        raise NotImplementedError

    def open_write(self, path: str, size: int, *, o_direct: bool = False, create: bool = True,
                   preallocate: bool = True, backend: str | PosixBackend | None = None):
        """A writer of file ``path`` of ``size`` bytes whose pieces may arrive at any offset, from
        any thread: ``write(data, offset)``, ``sync()`` (durable), ``close()`` (idempotent).
        ``create=False`` opens a file another rank created."""
        raise NotImplementedError

    def makedirs(self, folder: str) -> None:
        """Create ``folder`` and its parents (no error if it exists)."""
        raise NotImplementedError

    def remove(self, path: str) -> bool:
        """Remove file or folder tree ``path``; False if nothing was there. Errors inside a tree are
        ignored (what stays is a leftover for :meth:`clean_stale_temps`)."""
        raise NotImplementedError

    def link(self, src: str, dst: str) -> bool:
        """Make ``dst`` hold ``src``'s bytes without copying them (hard link, server-side copy);
        False when the store cannot (the caller writes the bytes instead)."""
        return False

    def sync_dir(self, folder: str) -> None:
        """Make the entries created in ``folder`` durable (no-op where entries are durable on creation)."""

    # -- commit support ----------------------------------------------------------------------------
    def make_temp_dir(self, path: str) -> str:
        """Create a hidden temporary sibling folder of ``path`` holding an owner record; returns it."""
        raise NotImplementedError

    def rename_into_place(self, tmp: str, path: str, *, overwrite: bool) -> None:
        """Atomically make folder ``tmp`` visible as ``path`` (:class:`RenameCommit`).

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is false.
            NotImplementedError: the store has no atomic rename (use ``commit="marker"``).
        """
        raise NotImplementedError(f"{self.name} store has no atomic folder rename: save with commit='marker'")

    def retire(self, path: str, suffix: str) -> str | None:
        """First, atomic step of deleting checkpoint folder ``path``: after it (and after a crash)
        ``path`` is no checkpoint. Returns what :meth:`remove` must then delete, or ``None`` when
        nothing was at ``path``. Default: remove the ``manifest.json`` (the marker), then the folder
        is an uncommitted one to remove.

        Args:
            suffix: added to the hidden name a store that renames gives the folder (``".del"``).
        """
        if not self.exists(path):
            return None
        self.remove(self.join(path, cm.MANIFEST))
        return path

    def owner_alive(self, tmp: str) -> bool:
        """True if the writer of temporary folder ``tmp`` may still be running."""
        return True

    def clean_stale_temps(self, root: str) -> list[str]:
        """Remove the temporary folders in ``root`` whose writer is dead; returns their names."""
        return []

    def root_lock(self, root: str) -> "RootLock | NoLock":
        """The lock that keeps a second job out of run root ``root`` (:class:`fastckpt.storage.lock.RootLock`
        where the store has file locks; :class:`NoLock` where it has none: one writing job per root)."""
        return NoLock()

    @contextlib.contextmanager
    def local_folder(self, path: str) -> Iterator[str]:
        """A local folder holding the checkpoint folder ``path``'s files, for the loaders (which read
        local files with ``preadv``): ``path`` itself for a local store, a downloaded copy otherwise
        (removed on exit)."""
        yield path


@dataclass(frozen=True)
class Entry:
    """One entry of a folder (:meth:`Store.entries`, :meth:`Store.entry`).

    Attributes:
        name: its name in the folder. path: its path in the store.
        folder: True for a folder (a symlink to one is not). size: bytes (0 for a folder).
        mtime: modification time, seconds since the epoch. ino: the local inode number (0 where
            the store has none): a file replaced under the same name gets another one.
    """

    name: str
    path: str
    folder: bool
    size: int
    mtime: float
    ino: int


class FileReader:
    """An open file of a store (:meth:`Store.open_reader`).

    Attributes:
        size: the file's size in bytes.
        regular: False when the path is no regular file (a folder, FIFO or device).
        read_at: ``read_at(offset, n)`` -> up to ``n`` bytes from byte ``offset``.
    """

    def __init__(self, size: int, regular: bool, read_at):
        self.size, self.regular, self.read_at = size, regular, read_at


class NoLock:
    """The root lock of a store without locks (object stores): acquiring always succeeds, so two jobs
    writing one root are not detected; keep one writing job per root there."""

    def acquire(self, timeout_s: float = 0.0) -> None:
        """Succeeds at once (``timeout_s`` in seconds is ignored)."""

    def release(self) -> None:
        """Nothing to release."""


class StorePath(str):
    """A path string that carries its :class:`Store` (:meth:`Store.path`)."""

    def __new__(cls, path: str, store: Store):
        self = super().__new__(cls, path)
        self.store = store
        return self


class LocalStore(Store):
    """The POSIX file system (the default store, :data:`LOCAL`): ``pwrite``/``preadv``, O_DIRECT,
    ``posix_fallocate``, fsync of files and folders, hard links, ``renameat2``."""

    name = "local"
    commits = ("rename", "marker")
    local = True

    def normalize(self, path: str | os.PathLike) -> str:
        return os.path.abspath(os.fspath(path))

    def join(self, folder: str, *names: str) -> str:
        return os.path.join(folder, *names)

    def parent(self, path: str) -> str:
        return os.path.dirname(os.path.abspath(path))

    def basename(self, path: str) -> str:
        return os.path.basename(os.path.normpath(path))

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, folder: str) -> list[str]:
        return os.listdir(folder)

    def glob(self, folder: str, pattern: str) -> list[str]:
        return sorted(glob.glob(os.path.join(glob.escape(folder), pattern)))

    def lexists(self, path: str) -> bool:
        return os.path.lexists(path)

    def entries(self, folder: str) -> list[Entry]:
        """One ``scandir``; each entry's ``lstat`` (entries gone meanwhile are left out)."""
        out = []
        with os.scandir(folder) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append(Entry(e.name, e.path, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime, st.st_ino))
        return out

    def entry(self, path: str) -> Entry:
        st = os.stat(path, follow_symlinks=False)
        return Entry(os.path.basename(path), path, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime, st.st_ino)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def link_target(self, path: str) -> str | None:
        try:
            return os.readlink(path) if os.path.islink(path) else None
        except OSError:
            return None

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def mtime(self, path: str) -> float:
        return os.stat(path).st_mtime

    def identity(self, path: str) -> tuple:
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def free_bytes(self, folder: str) -> int:
        st = os.statvfs(folder)
        return st.f_bavail * st.f_frsize

    def without_storage(self, folder: str) -> bool:
        return os.statvfs(folder).f_blocks == 0

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        with open(path, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    @contextlib.contextmanager
    def open_reader(self, path: str) -> Iterator[FileReader]:
        """Opened non-blocking (a FIFO planted under a file's name is reported, not waited on),
        following symlinks; ``read_at`` is one ``pread``."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            yield FileReader(st.st_size, stat.S_ISREG(st.st_mode), lambda off, n: os.pread(fd, n, off))
        finally:
            os.close(fd)

    def read_range(self, path: str, offset: int, n: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def write_file(self, path: str, data: bytes, *, fsync: bool = True, replace: bool = False) -> None:
        if replace:  # through a hidden name of this process, then one rename
            folder, name = os.path.split(path)
            tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
            if os.path.lexists(tmp):
                os.unlink(tmp)
            cm.write_small_file(tmp, data, fsync=fsync)
            os.replace(tmp, path)
            return
        cm.write_small_file(path, data, fsync=fsync)

    def put_file(self, local: str, path: str) -> None:
        copy_file(local, path)

    def open_write(self, path: str, size: int, *, o_direct: bool = False, create: bool = True,
                   preallocate: bool = True, backend: str | PosixBackend | None = None) -> FileWriter:
        return FileWriter(get_backend(backend), path, size, o_direct, create, preallocate)

    def makedirs(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)

    def remove(self, path: str) -> bool:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            return True
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def link(self, src: str, dst: str) -> bool:
        try:
            os.link(src, dst)
            return True
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                return False
            raise

    def sync_dir(self, folder: str) -> None:
        fsync_dir(folder)

    def make_temp_dir(self, path: str) -> str:
        return cm.make_temp_dir(path)

    def rename_into_place(self, tmp: str, path: str, *, overwrite: bool) -> None:
        cm.commit_dir(tmp, path, overwrite=overwrite)

    def retire(self, path: str, suffix: str) -> str | None:
        """Rename ``path`` to a hidden temporary sibling ``.{name}.fastckpt-tmp-{pid}@{host}-{hex}{suffix}``
        (one atomic ``rename``), write an owner record into it (a later pid reuse cannot make it
        look alive), fsync the parent (the rename is durable before any file goes)."""
        doomed = cm.temp_dir_for(path) + suffix
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        try:
            cm.write_small_file(os.path.join(doomed, cm.OWNER), owner_record(), fsync=False)
        except OSError:
            pass  # without a record the cleaner attributes the folder by its name (same pid and host)
        fsync_dir(os.path.dirname(doomed))
        return doomed

    def owner_alive(self, tmp: str) -> bool:
        return cm.owner_alive(tmp)

    def root_lock(self, root: str) -> RootLock:
        return RootLock(root)

    def clean_stale_temps(self, root: str) -> list[str]:
        return cm.clean_stale_temps(root)


#: The local file system store (stateless; shared).
LOCAL = LocalStore()


# -- commit strategies -----------------------------------------------------------------------------

class CommitStrategy:
    """How a folder of written files becomes a checkpoint (see the module docstring).

    Call order: :meth:`begin` (before any file is written) -> writes -> ``manifest.json`` ->
    :meth:`finish` (the commit); on failure :meth:`abort`.

    Attributes:
        name: the ``commit=`` option value.
        per_node: each node writes (and marks) its own folder at the final path (multi-rank on
            node-local disks); rank 0 alone checks that the path is free.
        replaces_files: files of the final folder may already exist when written (an earlier try).
    """

    name = ""
    per_node = False
    replaces_files = False

    def begin(self, store: Store, path: str, *, overwrite: bool, subfolders=()) -> str:
        """Create the folder the files are written into; returns it.

        Raises:
            CheckpointExistsError: ``path`` exists and ``overwrite`` is false (marker).
            OSError: the folder could not be created.
        """
        raise NotImplementedError

    def finish(self, store: Store, folder: str, path: str, *, overwrite: bool) -> None:
        """The commit, after the manifest was written into ``folder``.

        Raises:
            FileExistsError: ``path`` exists and ``overwrite`` is false (rename).
        """

    def abort(self, store: Store, folder: str | None) -> None:
        """Remove ``folder`` of a save that will not be committed (never a committed checkpoint)."""
        raise NotImplementedError

    def session_tag(self, path: str, tag_of_path) -> str:
        """Coordination session tag of a save into ``path`` (``tag_of_path(path)`` where the folder
        is shared by every node; one tag for all paths where each node writes its own)."""
        return tag_of_path(path)


class RenameCommit(CommitStrategy):
    """``commit="rename"``: a hidden temporary folder renamed into place.

    After a crash at any point ``path`` holds nothing, the previous checkpoint or the whole new one
    (never a mix); the temporary is a dead writer's leftover that :meth:`Store.clean_stale_temps`
    removes. Needs :meth:`Store.rename_into_place` (local and shared POSIX file systems).
    """

    name = "rename"

    def begin(self, store: Store, path: str, *, overwrite: bool, subfolders=()) -> str:
        folder = store.make_temp_dir(path)
        for sub in _subfolders(subfolders):
            store.makedirs(store.join(folder, sub))
        return folder

    def finish(self, store: Store, folder: str, path: str, *, overwrite: bool) -> None:
        store.remove(store.join(folder, cm.OWNER))
        store.rename_into_place(folder, path, overwrite=overwrite)

    def abort(self, store: Store, folder: str | None) -> None:
        if folder and store.isdir(folder):
            store.remove(folder)


class MarkerCommit(CommitStrategy):
    """``commit="marker"``: files written in place, ``manifest.json`` written last is the marker.

    After a crash before the manifest, ``path`` is a folder without manifest: no checkpoint (loads
    raise ``CheckpointNotFoundError``; ``latest`` and retention skip it; a later save with
    ``overwrite=True`` replaces it). A checkpoint replaced with ``overwrite`` is removed before the
    new files are written, so a crash then leaves no checkpoint at ``path``. Works on any store.
    """

    name = "marker"
    per_node = True
    replaces_files = True

    def begin(self, store: Store, path: str, *, overwrite: bool, subfolders=()) -> str:
        if store.exists(path):
            if not overwrite:
                raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it")
            store.remove(path)
        store.makedirs(path)
        for sub in _subfolders(subfolders):
            store.makedirs(store.join(path, sub))
        # until its manifest exists, a state.json marks the folder as an uncommitted fastckpt save
        # (without it readers would take the preallocated safetensors files for a plain HF folder)
        store.write_file(store.join(path, cm.STATE_JSON), b"{}")
        return path

    def abort(self, store: Store, folder: str | None) -> None:
        if folder and store.isdir(folder) and not store.exists(store.join(folder, cm.MANIFEST)):
            store.remove(folder)

    def session_tag(self, path: str, tag_of_path) -> str:
        return "marker"  # a path per node: the nodes' paths differ


def _subfolders(names) -> list[str]:
    """The sub-folders the ``/``-separated file ``names`` sit in."""
    return sorted({n.rsplit("/", 1)[0] for n in names if "/" in n})


#: Commit strategies by ``commit=`` name.
STRATEGIES: dict[str, CommitStrategy] = {"rename": RenameCommit(), "marker": MarkerCommit()}


def strategy(name: "str | CommitStrategy") -> CommitStrategy:
    """The commit strategy named ``name`` (:data:`STRATEGIES`), or ``name`` itself.

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    if isinstance(name, CommitStrategy):
        return name
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown commit strategy {name!r}; known: {sorted(STRATEGIES)}") from None


def owner_record() -> bytes:
    """The owner record of a temporary folder written by this process (pid, host, start time)."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_unix_s": time.time()}).encode()
