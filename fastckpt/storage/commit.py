"""Atomic commit: hidden temporary folder, fsync, one rename, manifest.

A fastckpt checkpoint exists if and only if a folder without a leading ``.`` holds a
``manifest.json`` that parses and names format ``fastckpt``. Writers fill a hidden
sibling ``.{name}.fastckpt-tmp-{pid}-{rand}`` (same file system, so the commit is one
``rename``), fsync every file and the folder, write the manifest last, then rename.
Replacing an existing checkpoint swaps the two folders with ``renameat2(RENAME_EXCHANGE)``
where the kernel offers it, so the path never lacks a committed checkpoint.
(Same idea as Orbax's atomicity module and DCP's ``FileSystemWriter.finish``.)
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections import OrderedDict

from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest, parse
from .io import fsync_dir, no_space_error

MANIFEST = "manifest.json"
STATE_JSON = "state.json"
OWNER = ".owner.json"
TMP_MARK = ".fastckpt-tmp-"


def host_tag() -> str:
    """Short stable tag of this host's name (8 hex digits), part of every temporary name."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


#: ``{TMP_MARK}{pid}@{host tag}-{random}`` optionally followed by ``.old`` / ``.del``.
_TMP_NAME = re.compile(re.escape(TMP_MARK) + r"(\d+)@([0-9a-f]{8})-[0-9a-f]+(?:\.old|\.del)?$")


def temp_dir_for(path: str) -> str:
    """Hidden sibling folder name for a save into ``path`` (does not create it).

    The name carries the writer's pid and host tag, so a leftover can be attributed to a
    dead writer even when its owner record is missing (killed before writing it, or after
    removing it just before the commit rename, or a ``.old``/``.del`` folder being deleted).
    """
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{name}{TMP_MARK}{os.getpid()}@{host_tag()}-{secrets.token_hex(4)}")


def make_temp_dir(path: str) -> str:
    """Create the temporary folder for ``path`` with an owner record (pid, host, time)."""
    tmp = temp_dir_for(path)
    os.makedirs(tmp)
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix_s": time.time()}
    write_small_file(os.path.join(tmp, OWNER), json.dumps(owner).encode())
    return tmp


def write_small_file(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Create ``path`` with ``data`` and fsync it (used for JSON and extra files).

    Raises:
        InsufficientSpaceError: the device filled while writing or syncing (ENOSPC, EDQUOT), naming
            ``path`` and keeping the ``OSError`` as its cause.
        OSError: any other failure to create, write or sync the file.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if fsync:
            os.fsync(fd)
    except OSError as e:
        err = no_space_error(e, path, len(data), "the file is left partial and nothing that names it is committed")
        if err is e:
            raise
        raise err from e
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2; False when the kernel/libc lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def commit_dir(tmp: str, path: str, *, overwrite: bool) -> None:
    """Make ``tmp`` visible as ``path`` with one rename, then fsync the parent folder.

    With ``overwrite`` an existing ``path`` is swapped out atomically and removed only after
    the new folder is in place.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
    """
    parent = os.path.dirname(os.path.abspath(path))
    fsync_dir(tmp)
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
        if _exchange(tmp, path):
            fsync_dir(parent)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        old = temp_dir_for(path) + ".old"
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, path)
    fsync_dir(parent)


def read_manifest(path: str | os.PathLike, store=None) -> Manifest:
    """Read and validate the manifest of the checkpoint folder ``path``.

    Returns:
        The :class:`~fastckpt.format.manifest.Manifest` (:func:`fastckpt.format.manifest.parse`).

    Args:
        path: the checkpoint folder.
        store: the :class:`fastckpt.storage.store.Store` holding it (default: the local file system).

    Raises:
        FileNotFoundError: no manifest (the folder is not a committed checkpoint).
        ManifestError: the manifest is not valid JSON, not a fastckpt manifest or has a malformed
            field (a :class:`~fastckpt.errors.CorruptCheckpointError`; names the key and the value).
        ManifestVersionError: its format version is newer than this library understands.
    """
    if store is None:
        mpath = os.path.join(os.fspath(path), MANIFEST)
        with open(mpath, "rb") as f:
            raw = f.read()
    else:
        mpath = store.join(os.fspath(path), MANIFEST)
        raw = store.read_bytes(mpath)
    return parse(raw, mpath)


_SHARED: "OrderedDict[str, tuple[tuple, Manifest]]" = OrderedDict()
_SHARED_LOCK = threading.Lock()


def read_manifest_shared(path: str | os.PathLike, store=None) -> Manifest:
    """:func:`read_manifest`, memoised on the manifest file's identity (device, inode, size,
    mtime in ns): a committed manifest is never rewritten in place, so a repeated call (the
    Trainer callback checks the newest checkpoint before every save) costs one ``stat``.
    The returned manifest is shared: read it, never modify it. ``store``: as :func:`read_manifest`
    (its :meth:`~fastckpt.storage.store.Store.identity` is the memo key). Raises as :func:`read_manifest`."""
    path = os.fspath(path)
    if store is None:
        st = os.stat(os.path.join(path, MANIFEST))
        ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        key = os.path.abspath(path)
    else:
        ident = store.identity(store.join(path, MANIFEST))
        key = store.normalize(path)
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is not None and hit[0] == ident:
            _SHARED.move_to_end(key)
            return hit[1]
    m = read_manifest(path, store)
    with _SHARED_LOCK:
        _SHARED[key] = (ident, m)
        while len(_SHARED) > 16:
            _SHARED.popitem(last=False)
    return m


def listing_checkpoint(folder: str | os.PathLike, name: str) -> tuple[str, Manifest, str] | None:
    """The committed fastckpt checkpoint whose manifest lists file ``name`` of ``folder``, as
    ``(checkpoint folder, its manifest, the file's name there)``: ``folder``'s own manifest, else its
    parent's listing ``<folder's name>/<name>`` (peft's second adapter, ``CKPT/second/adapter_model.safetensors``,
    is listed by ``CKPT/manifest.json``). ``None`` when no visible (not ``.``-prefixed) folder's manifest lists it.
    Manifests are read through :func:`read_manifest_shared`. Raises as :func:`read_manifest` (a damaged manifest)."""
    folder = os.path.abspath(folder)
    for root, rel in ((folder, name), (os.path.dirname(folder), f"{os.path.basename(folder)}/{name}")):
        if os.path.basename(root).startswith(".") or not os.path.isfile(os.path.join(root, MANIFEST)):
            continue
        m = read_manifest_shared(root)
        if rel in m.files:
            return root, m, rel
    return None


def is_committed(path: str | os.PathLike, store=None) -> bool:
    """True if ``path`` is a committed fastckpt checkpoint folder (visible name + valid manifest).

    ``store``: the :class:`fastckpt.storage.store.Store` holding it (default: the local file system)."""
    path = os.fspath(path) if store is None else path
    name = os.path.basename(os.path.normpath(path)) if store is None else store.basename(path)
    if name.startswith("."):
        return False
    try:
        read_manifest_shared(path, store)
        return True
    except (OSError, CorruptCheckpointError):
        return False


def owner_alive(tmp: str) -> bool:
    """True if the writer that created temporary folder ``tmp`` may still be running.

    A folder whose owner record (or, without a record, whose name) names this host and a
    pid that no longer exists, or that was reused by a process started after the record,
    is dead; a folder of another host, or without record and parsable name younger than a
    day, counts as alive (never delete another live writer's files).
    """
    started = None
    try:
        with open(os.path.join(tmp, OWNER)) as f:
            owner = json.load(f)
        pid, local = int(owner["pid"]), owner["host"] == socket.gethostname()
        started = float(owner["started_unix_s"])
    except (OSError, ValueError, KeyError, TypeError):
        m = _TMP_NAME.search(os.path.basename(tmp))
        if m is None:
            try:
                return time.time() - os.stat(tmp).st_mtime < 86400
            except OSError:
                return False
        pid, local = int(m.group(1)), m.group(2) == host_tag()
    if not local or pid == os.getpid():
        return True
    return pid_alive(pid, started)


def pid_alive(pid: int, not_after_unix_s: float | None = None) -> bool:
    """True if local process ``pid`` may still be the writer of something made at ``not_after_unix_s``.

    The one stale-owner check of the library: temporary checkpoint folders (:func:`owner_alive`)
    and KV chunk temp files (:mod:`fastckpt.kv`) are removed only when it says their local writer
    is gone.

    Args:
        pid: a process id on this host.
        not_after_unix_s: when given, a process that started after this time (Unix seconds) is a
            reuse of the pid, not the writer, and counts as dead. Default None (no check).

    Returns:
        False if no such process exists (or it is a later reuse of the pid); True otherwise,
        including when it exists but belongs to another user.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if not_after_unix_s is None:
        return True
    try:  # pid reuse: a process that started after the record cannot be its writer
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/stat", "rb") as f:
            btime = next(int(l.split()[1]) for l in f if l.startswith(b"btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK") <= not_after_unix_s + 2.0
    except (OSError, ValueError, IndexError, StopIteration):
        return True


def clean_stale_temps(root: str) -> list[str]:
    """Remove temporary folders in ``root`` whose writer is dead; return the removed names."""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for n in names:
        full = os.path.join(root, n)
        if n.startswith(".") and TMP_MARK in n and os.path.isdir(full) and not owner_alive(full):
            shutil.rmtree(full, ignore_errors=True)
            removed.append(n)
    return removed
