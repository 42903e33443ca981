"""Unchanged files are hard-linked from the previous committed checkpoint instead of rewritten.

A LoRA run snapshots the whole model every save, but the frozen base weights never change:
rewriting them is most of the bytes and most of the time. When a save is given
``link_from=<previous committed checkpoint>``, each planned safetensors file whose bytes would
be identical to the file of the same name there (same header bytes, same xxh3-64 of every
tensor, same size) is hard-linked into the new checkpoint instead of written. The new folder is
still complete and self-contained (a hard link is the same file under another name; deleting
the old checkpoint leaves it intact) and is committed the same way. Where links are impossible
(another file system, EXDEV/EPERM), the file is written as usual.

This module is pure decision logic plus one ``os.link``; the saver calls it.
"""

from __future__ import annotations

import errno
import os

import torch
import xxhash

from .commit import read_manifest
from .errors import CorruptCheckpointError
from .planner import FilePlan


def previous_manifest(link_from: str | os.PathLike | None) -> dict | None:
    """The manifest of ``link_from`` if it is a committed checkpoint, else ``None`` (never raises)."""
    if link_from is None:
        return None
    try:
        return read_manifest(os.fspath(link_from))
    except (OSError, CorruptCheckpointError):
        return None


def candidate_files(files: tuple[FilePlan, ...], prev: dict | None) -> set[str]:
    """Files whose name, size and header bytes match the previous checkpoint (hashes still to check)."""
    if prev is None:
        return set()
    out = set()
    for f in files:
        info = prev["files"].get(f.name)
        if not info or info.get("bytes") != f.size or info.get("header_bytes") != len(f.prefix):
            continue
        if info.get("header_xxh3") == xxhash.xxh3_64(f.prefix).hexdigest():
            out.add(f.name)
    return out


def identical(f: FilePlan, hashes: dict[str, str], prev: dict) -> bool:
    """True when every tensor of ``f`` has the same xxh3 as the same-named entry in ``prev``."""
    tensors = prev["tensors"]
    for t in f.tensors:
        old = tensors.get(t.spec.key)
        if not old or old.get("file") != f.name or old.get("xxh3") != hashes.get(t.spec.key) \
                or old.get("offsets") != [t.file_offset, t.file_offset + t.spec.nbytes]:
            return False
    return True


def link_file(prev_dir: str | os.PathLike, tmp_dir: str, name: str) -> bool:
    """Hard-link ``prev_dir/name`` to ``tmp_dir/name``; False where the file system refuses links."""
    try:
        os.link(os.path.join(os.fspath(prev_dir), name), os.path.join(tmp_dir, name))
        return True
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.ENOENT):
            return False
        raise


def source_hash(t) -> str | None:
    """xxh3-64 (hex) of a contiguous CPU tensor's bytes, as the saver would compute it; ``None``
    for device or non-contiguous tensors (those are staged and written, never linked)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    if t.numel() == 0:
        return xxhash.xxh3_64(b"").hexdigest()
    return xxhash.xxh3_64(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
