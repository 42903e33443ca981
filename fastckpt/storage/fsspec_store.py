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

from ..errors import CheckpointExistsError, CheckpointNotFoundError
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
        """Delete the object or every object under the prefix ``path``, one key at a time: fsspec's
        ``rm`` would expand ``*``, ``?`` and ``[...]`` in the key as a glob (``run*/step-1`` would
        delete ``runZ/step-1``), and s3fs's bulk delete ignores per-key failures.

        Raises:
            PermissionError: objects are still there afterwards (no delete permission, an object
                lock, a bucket policy): names the URL; the caller's removal did not happen.
        """
        p = self._p(path)
        self.fs.invalidate_cache(p)
        if not self.fs.exists(p):
            return False
        if self.fs.isdir(p):
            found = self.fs.find(p, withdirs=True, detail=True)
            files = sorted(k for k, info in found.items() if info.get("type") != "directory")
            for f in files:
                self.fs.rm_file(f)
            dirs = sorted({k for k in found if k not in files} | {p}, key=len, reverse=True)
            for d in dirs:  # emptied folders of file systems that keep them (memory://); never a bucket
                self.fs.invalidate_cache(d)
                if "/" in d and self.fs.exists(d):
                    self.fs.rmdir(d)
        else:
            self.fs.rm_file(p)
        self.fs.invalidate_cache(p)
        if self.fs.exists(p):
            raise PermissionError(13, "objects are still there after deleting them (no delete permission, an "
                                      "object lock or a bucket policy?)", self.normalize(path))
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
        """Download checkpoint folder ``path`` (or one file of it, with its folder's ``manifest.json``
        so that its checksums apply) into a local spool folder, yield the local path, remove it.
        Errors raised inside name ``path``'s URL, not the spool copy.

        Raises:
            CheckpointNotFoundError: no object under ``path``, or a run root (folders of committed
                checkpoints, named; nothing downloaded).
        """
        top = make_spool()
        url, p = self.normalize(path), self._p(path)
        name = self.basename(path) or "checkpoint"
        local = os.path.join(top, name)
        try:
            if self.isfile(path):  # one file of a checkpoint (README's CKPT/model.safetensors)
                parent = p.rsplit("/", 1)[0]
                local = os.path.join(top, parent.rsplit("/", 1)[-1] or "checkpoint", name)
                pairs = [(p, local)]
                if self.fs.exists(f"{parent}/{cm.MANIFEST}"):  # the file is checked against its manifest
                    pairs.append((f"{parent}/{cm.MANIFEST}", os.path.join(os.path.dirname(local), cm.MANIFEST)))
            elif self.isdir(path):
                found = self.fs.find(p, withdirs=False)  # listed, never glob-expanded (run*/step-1)
                if not self.fs.exists(f"{p}/{cm.MANIFEST}"):
                    ours = sorted({k[len(p) + 1:].split("/", 1)[0] for k in found
                                   if k.endswith("/" + cm.MANIFEST) and k.count("/") == p.count("/") + 2})
                    if ours and not any(k.endswith(".safetensors") and k.count("/") == p.count("/") + 1
                                        for k in found):
                        raise CheckpointNotFoundError(
                            f"{url}: a run root holding checkpoints ({', '.join(ours[:4])}"
                            f"{' ...' if len(ours) > 4 else ''}), not one checkpoint: pass one of them, e.g. "
                            f"{url}/{ours[-1]} (nothing was downloaded)")
                pairs = [(k, os.path.join(local, k[len(p) + 1:])) for k in found]
            else:
                raise CheckpointNotFoundError(f"{url}: nothing there (no object under this prefix); check the "
                                              f"bucket and prefix")
            for d in sorted({os.path.dirname(lp) for _, lp in pairs} | {local if not pairs else top}):
                os.makedirs(d, exist_ok=True)
            if pairs:
                self.fs.get([r for r, _ in pairs], [lp for _, lp in pairs])  # lists: no glob expansion
            try:
                yield local
            except BaseException as e:
                _name_url(e, local, url)
                raise
        finally:
            shutil.rmtree(top, ignore_errors=True)


def _name_url(e: BaseException, local: str, url: str) -> None:
    """Rewrite the spool copy's path ``local`` as ``url`` in ``e``'s message and path attributes."""
    e.args = tuple(a.replace(local, url) if isinstance(a, str) else a for a in e.args)
    for attr in ("path", "filename"):
        v = getattr(e, attr, None)
        if isinstance(v, str) and local in v:
            try:
                setattr(e, attr, v.replace(local, url))
            except (AttributeError, TypeError):
                pass


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
    url = store.normalize(path)
    try:
        folder = how.begin(store, path, overwrite=overwrite, subfolders=names)
    except FileExistsError as e:  # another writer's marker appeared since the check
        if isinstance(e, CheckpointExistsError):
            raise
        raise CheckpointExistsError(f"{url}: another save is writing there ({e}); nothing was uploaded") from None
    except OSError:
        raise
    except Exception as e:
        raise _upload_error(e, url, "starting the upload") from e
    try:
        for n in names:
            store.put_file(os.path.join(local, n), store.join(folder, n))
        store.put_file(os.path.join(local, cm.MANIFEST), store.join(folder, cm.MANIFEST))
        how.finish(store, folder, path, overwrite=overwrite)
    except BaseException as e:
        try:
            how.abort(store, folder)
        except Exception:  # noqa: BLE001 - the store is unreachable: the uncommitted prefix stays (no manifest)
            pass
        if isinstance(e, Exception) and not isinstance(e, OSError):
            raise _upload_error(e, url, "uploading") from e
        raise


def _upload_error(e: Exception, url: str, doing: str) -> OSError:
    """An error of the store's client library that is not an ``OSError`` (botocore's
    ``EndpointConnectionError``) as an ``OSError`` naming the checkpoint's URL."""
    return OSError(5, f"{doing} failed ({type(e).__name__}: {e}); nothing was committed (no manifest.json at "
                      "it); check the endpoint and credentials, then save again", url)
