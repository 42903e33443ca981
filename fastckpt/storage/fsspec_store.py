"""A store over any fsspec file system (``s3://bucket/prefix``, ``gs://``, ``memory://``...).

Object stores have no atomic rename, so the only commit strategy is :class:`MarkerCommit`
(``commit="marker"``): every file is uploaded, then ``manifest.json`` last; until it exists the
prefix is no checkpoint (readers, ``latest`` and retention skip it). A writer that dies before
the manifest leaves an uncommitted prefix, never a committed partial checkpoint.

Writes whose pieces arrive at any offset, from any thread (the saver's) go to a **local spool
file** (the local store's preallocated ``pwrite`` path, in ``$FASTCKPT_SPOOL_DIR`` or the system
temporary folder), uploaded as one object on ``close()`` (s3fs uploads large files as a
multipart upload). A whole checkpoint is saved the same way: into a local spool folder with the
local engine, then uploaded file by file with the manifest last (:func:`upload_checkpoint`).
Loads and verification read a local copy downloaded by :meth:`FsspecStore.local_folder` (the
loaders read local files with ``preadv``). The spool needs local free space of the size of the
checkpoint.

fsspec and the protocol's package (s3fs for ``s3://``) are imported only when a URL or an
instance is used. Endpoints and credentials come from the usual places (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``..., fsspec's ``FSSPEC_S3_*`` variables) or from the file system object
given to :class:`FsspecStore`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Any, Iterator

from ..errors import CheckpointNotFoundError
from . import commit as cm
from .io import FileWriter, PosixBackend, get_backend
from .store import Store, strategy


def spool_dir() -> str:
    """The local folder spool files and folders go into (``$FASTCKPT_SPOOL_DIR`` or the system temp folder)."""
    return os.environ.get("FASTCKPT_SPOOL_DIR") or tempfile.gettempdir()


def make_spool() -> str:
    """Create a spool folder of this process in :func:`spool_dir` and return it, first removing
    the spool folders of dead processes (a writer killed mid-save leaves its spool behind).

    Spool folders are named as the local store's temporaries (``.fastckpt-spool.fastckpt-tmp-{pid}@{host}-{hex}``),
    so :func:`fastckpt.storage.commit.clean_stale_temps` knows a dead writer's from a live one's.
    """
    top = spool_dir()
    cm.clean_stale_temps(top)
    path = cm.temp_dir_for(os.path.join(top, "fastckpt-spool"))
    os.makedirs(path)
    return path


class SpoolWriter:
    """A file of an object store written at offsets: a local spool file (preallocated, ``pwrite``),
    uploaded as one object by :meth:`close` after a successful :meth:`sync`.

    Raises (from ``close``): ``OSError`` of the upload (the object is then absent or partial
    under a name no manifest lists yet).
    """

    def __init__(self, store: "FsspecStore", path: str, size: int, be: PosixBackend, o_direct: bool):
        self.store, self.path, self.size = store, path, size
        self.top = make_spool()
        self.local = os.path.join(self.top, "file")
        self._w = FileWriter(be, self.local, size, o_direct)
        self._synced = False

    @property
    def fd(self) -> int:
        """The spool file's descriptor (buffered writes of unaligned prefixes go straight to it)."""
        return self._w.fd

    def write(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (bytes) into the spool file."""
        self._w.write(data, offset)

    def sync(self) -> None:
        """Upload the file (the spool file itself needs no fsync: it is a copy)."""
        self.store.put_file(self.local, self.path)
        self._synced = True

    def close(self) -> None:
        """Close and delete the spool file; safe to call twice."""
        self._w.close()
        shutil.rmtree(self.top, ignore_errors=True)


class FsspecStore(Store):
    """A store over an fsspec file system (see the module docstring).

    Args:
        fs: an ``fsspec.AbstractFileSystem`` (e.g. ``s3fs.S3FileSystem(endpoint_url=...)``).
        protocol: the URL scheme its paths are shown with (default: the file system's first).
    """

    name = "fsspec"
    commits = ("marker",)
    local = False

    def __init__(self, fs: Any, protocol: str | None = None):
        self.fs = fs
        proto = protocol or (fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0])
        self.protocol = proto
        self.name = proto

    _CACHE: dict[str, "FsspecStore"] = {}
    _CACHE_LOCK = threading.Lock()

    @classmethod
    def for_url(cls, url: str) -> "FsspecStore":
        """The store of ``url``'s scheme (one per scheme and process; fsspec's own options apply).

        Raises:
            ImportError: fsspec or the scheme's package (s3fs for ``s3://``) is not installed.
        """
        proto = url.split("://", 1)[0]
        with cls._CACHE_LOCK:
            st = cls._CACHE.get(proto)
            if st is None:
                import fsspec
                st = cls._CACHE[proto] = cls(fsspec.filesystem(proto), proto)
        return st

    # -- paths -------------------------------------------------------------------------------------
    def _p(self, path: str) -> str:
        """The file system's own spelling of ``path`` (no scheme)."""
        return self.fs._strip_protocol(os.fspath(path)).rstrip("/")

    def normalize(self, path) -> str:
        return f"{self.protocol}://{self._p(path)}"

    def join(self, folder: str, *names: str) -> str:
        return "/".join([self.normalize(folder), *names])

    def parent(self, path: str) -> str:
        return self.normalize(self._p(path).rsplit("/", 1)[0])

    def basename(self, path: str) -> str:
        return self._p(path).rsplit("/", 1)[-1]

    # -- queries -----------------------------------------------------------------------------------
    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(self._p(path))
        return self.fs.exists(self._p(path))

    def isdir(self, path: str) -> bool:
        self.fs.invalidate_cache(self._p(path))
        return self.fs.isdir(self._p(path))

    def isfile(self, path: str) -> bool:
        return self.fs.isfile(self._p(path))

    def listdir(self, folder: str) -> list[str]:
        p = self._p(folder)
        self.fs.invalidate_cache(p)
        if not self.fs.exists(p):
            raise FileNotFoundError(2, "no such folder", self.normalize(folder))
        if not self.fs.isdir(p):
            raise NotADirectoryError(20, "not a folder", self.normalize(folder))
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(p, detail=False, refresh=True)]

    def size(self, path: str) -> int:
        return int(self.fs.info(self._p(path))["size"])

    def mtime(self, path: str) -> float:
        return self.fs.modified(self._p(path)).timestamp()

    def identity(self, path: str) -> tuple:
        self.fs.invalidate_cache(self._p(path))
        info = self.fs.info(self._p(path))
        return (info.get("size"), info.get("ETag") or info.get("etag"), str(info.get("LastModified") or
                                                                            info.get("mtime") or ""))

    def free_bytes(self, folder: str) -> int:
        """Object stores have no free-space figure: the local spool's free space bounds a save."""
        st = os.statvfs(spool_dir())
        return st.f_bavail * st.f_frsize

    # -- files -------------------------------------------------------------------------------------
    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        try:
            if limit is not None:
                return self.fs.cat_file(self._p(path), start=0, end=limit) if limit else b""
            return self.fs.cat_file(self._p(path))
        except FileNotFoundError:
            raise FileNotFoundError(2, "no such file", self.normalize(path)) from None

    def read_range(self, path: str, offset: int, n: int) -> bytes:
        """One ranged GET."""
        try:
            return self.fs.cat_file(self._p(path), start=offset, end=offset + n) if n > 0 else b""
        except FileNotFoundError:
            raise FileNotFoundError(2, "no such file", self.normalize(path)) from None

    def write_file(self, path: str, data: bytes, *, fsync: bool = True, replace: bool = False) -> None:
        """Upload ``data`` as one object (a PUT is atomic: readers see old or new bytes)."""
        if not replace and self.fs.exists(self._p(path)):
            raise FileExistsError(17, "file exists", self.normalize(path))
        self.fs.pipe_file(self._p(path), bytes(data))

    def put_file(self, local: str, path: str) -> None:
        """Upload local file ``local`` as ``path`` (multipart for large files)."""
        self.fs.put_file(local, self._p(path))

    def open_write(self, path: str, size: int, *, o_direct: bool = False, create: bool = True,
                   preallocate: bool = True, backend: str | PosixBackend | None = None) -> SpoolWriter:
        if not create:
            raise NotImplementedError(f"{self.normalize(path)}: a file of an object store is written by one "
                                      "process (ranks cannot share it); save multi-rank checkpoints locally")
        return SpoolWriter(self, path, size, get_backend(backend), o_direct)

    def makedirs(self, folder: str) -> None:
        """Object stores have no empty folders: a folder exists once an object is under it."""
        self.fs.makedirs(self._p(folder), exist_ok=True)

    def remove(self, path: str) -> bool:
        p = self._p(path)
        self.fs.invalidate_cache(p)
        if not self.fs.exists(p):
            return False
        self.fs.rm(p, recursive=self.fs.isdir(p))
        self.fs.invalidate_cache(p)
        return True

    def link(self, src: str, dst: str) -> bool:
        """A server-side copy (no bytes through this host)."""
        try:
            self.fs.copy(self._p(src), self._p(dst))
            return True
        except (NotImplementedError, OSError):
            return False

    @contextlib.contextmanager
    def local_folder(self, path: str) -> Iterator[str]:
        """Download checkpoint folder ``path`` into a local spool folder, yield it, remove it.

        Raises:
            CheckpointNotFoundError: no object under ``path``.
        """
        top = make_spool()
        local = os.path.join(top, self.basename(path) or "checkpoint")
        try:
            if not self.isdir(path):
                raise CheckpointNotFoundError(f"{self.normalize(path)}: nothing there (no object under this "
                                              f"prefix); check the bucket and prefix")
            self.fs.get(self._p(path) + "/", local + "/", recursive=True)
            yield local
        finally:
            shutil.rmtree(top, ignore_errors=True)


def upload_checkpoint(local: str, store: Store, path: str, *, overwrite: bool, commit: str = "marker") -> None:
    """Commit the local checkpoint folder ``local`` as ``path`` of ``store`` with ``commit``'s strategy:
    every file uploaded, ``manifest.json`` last, then the strategy's commit.

    Raises:
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false (marker).
        OSError: an upload failed; what was uploaded is removed (never a manifest: no checkpoint).
    """
    names = []
    for dirpath, _, files in os.walk(local):
        rel = os.path.relpath(dirpath, local)
        names += [f if rel == "." else f"{rel}/{f}" for f in files]
    names = sorted(n for n in names if n not in (cm.MANIFEST, cm.OWNER))
    how = strategy(commit)
    folder = how.begin(store, path, overwrite=overwrite, subfolders=names)
    try:
        for n in names:
            store.put_file(os.path.join(local, n), store.join(folder, n))
        store.put_file(os.path.join(local, cm.MANIFEST), store.join(folder, cm.MANIFEST))
        how.finish(store, folder, path, overwrite=overwrite)
    except BaseException:
        how.abort(store, folder)
        raise
