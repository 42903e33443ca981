"""Reading model files from a store: safetensors headers, HF index files, file names from them.

The format layer (:mod:`fastckpt.format.safetensors`) parses and validates bytes; this module
opens the files through a :class:`~fastckpt.storage.store.Store` (default :data:`LOCAL`) and
adds what needs the file system: a path is a regular file, a shard an index names exists, a
name's folders do not lead out of the checkpoint folder through a symlink.
"""

from __future__ import annotations

import os
import stat

from ..errors import HeaderError, UnsafePathError
from ..format.safetensors import Header, check_name, parse_index, read_header_at
from .store import LOCAL, Store


def read_header(path: str | os.PathLike, store: Store = LOCAL) -> Header:
    """Open ``path`` (following a symlink) and return its validated safetensors :class:`Header`.

    Opened non-blocking, so a FIFO planted under a weight's name is refused instead of hanging
    the reader; the length field is checked against the file size before the header is read.

    Raises:
        HeaderError: not a regular file, or as :func:`fastckpt.format.safetensors.read_header_at`
            (``NotSafetensorsError`` for a ``torch.save`` / pickle / JSON file).
        OSError: ``path`` cannot be opened (``FileNotFoundError`` for a missing file or a
            dangling symlink).
    """
    path = os.fspath(path)
    with store.open_reader(path) as f:
        if not f.regular:
            raise HeaderError(f"{path}: not a regular file (a folder, FIFO or device{link_note(path, store)}); a "
                              "safetensors file must be a plain file or a symlink to one", path=path)
        return read_header_at(f.read_at, f.size, path)


def safe_join(folder: str | os.PathLike, name: str, store: Store = LOCAL) -> str:
    """Join a file ``name`` taken from an index or manifest onto ``folder``, for READING.

    The name itself must stay inside ``folder``: it is relative, has no ``..`` component and
    no NUL, and every folder it passes through resolves inside ``folder`` (a sub-folder that is
    a symlink out of it is refused). The file itself may be a symlink to anywhere: a model
    downloaded by ``huggingface_hub`` keeps every file of ``snapshots/<rev>/`` as a relative
    symlink into ``../../blobs/``, and shared model stores, git-annex and DVC do the same.
    Following such a link only ever reads; code that writes or deletes must not use this
    function to decide that a path is inside a folder.

    Args:
        folder: the checkpoint or model folder.
        name: a relative file name from an index, manifest or listing (``/``-separated).
        store: the store holding ``folder``.

    Returns:
        ``os.path.join(folder, name)`` (not resolved: messages keep the name the user knows).

    Raises:
        UnsafePathError: ``name`` is empty, absolute, contains ``..`` or a NUL, or one of its
            folders resolves (through a symlink) outside ``folder``.
    """
    folder = os.fspath(folder)
    full = check_name(folder, name)
    real_folder = store.realpath(folder)
    real_parent = store.realpath(os.path.dirname(full))
    if os.path.commonpath([real_folder, real_parent]) != real_folder:
        raise UnsafePathError(f"{folder}: {name!r} lies in {real_parent}, outside the folder (a sub-folder "
                              "is a symlink out of it)")
    return full


def read_index(index_path: str | os.PathLike, store: Store = LOCAL) -> dict[str, str]:
    """Read an HF ``*.safetensors.index.json`` and return its ``weight_map`` (tensor -> shard).

    Shard names are joined with :func:`safe_join`: a shard may be a symlink (the hub cache's
    ``snapshots/<rev>/`` files all are), a name may not leave the index's folder.

    Raises:
        HeaderError: not JSON, no ``weight_map`` object, a non-string entry, or a shard named
            by the index is missing or a dangling symlink (names the index and the shard).
        UnsafePathError: a shard name leaves the folder (absolute, ``..``).
        OSError: the index cannot be read.
    """
    index_path = os.fspath(index_path)
    wm = parse_index(store.read_bytes(index_path), index_path)
    folder = os.path.dirname(index_path)
    for shard in sorted(set(wm.values())):
        full = safe_join(folder, shard, store)
        if not store.exists(full):
            n = sum(1 for v in wm.values() if v == shard)
            raise HeaderError(f"{index_path}: names shard {shard!r}, which does not exist{link_note(full, store)} "
                              f"({n} of its {len(wm)} tensors are mapped there); the download is incomplete: "
                              "fetch the missing shard again, or load a folder whose index matches its files",
                              path=full)
    return wm


def link_note(path: str, store: Store = LOCAL) -> str:
    """``" (a symlink to X)"`` when ``path`` is a symlink, else ``""`` (for error messages)."""
    target = store.link_target(path)
    return f" (a symlink to {target})" if target is not None else ""


def read_header_fd(fd: int, path: str) -> Header:
    """Read and validate the safetensors header of the local file open as ``fd`` (``path`` for
    messages), as :func:`read_header`.

    Raises:
        HeaderError: as :func:`read_header`.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise HeaderError(f"{path}: not a regular file (a folder, FIFO or device); a safetensors file must be "
                          "a plain file or a symlink to one", path=path)
    return read_header_at(lambda off, n: os.pread(fd, n, off), st.st_size, path)


def is_inside(path: str, folder: str) -> bool:
    """True when ``path`` lies strictly inside ``folder`` (compared as given: pass both absolute,
    or both real paths)."""
    return path != folder and os.path.commonpath([path, folder]) == folder
