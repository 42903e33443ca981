"""The manifest: ``state.json``, HF index files, extra files, and ``manifest.json`` written last.

Shared by the single-process saver and the multi-rank writer so that both produce the same
format (docs/FORMAT.md; the types and the version are :mod:`fastckpt.format.manifest`).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import TYPE_CHECKING, Any

import xxhash

from ..storage import commit as cm
from ..storage.store import LOCAL
from .collect import STATE_GROUP
from ..format.safetensors import write_index
from ..format.layout import SavePlan
from ..format.manifest import Distributed, FileEntry, Manifest, TensorEntry

if TYPE_CHECKING:
    from .options import SaveOptions


def write_side_files(folder: str, plan: SavePlan, skeleton: Any, extra_files: dict[str, bytes] | None, *,
                     replace: bool = False) -> dict[str, FileEntry]:
    """Write ``state.json``, the HF index files and the extra files into ``folder`` (each fsynced;
    sub-folders of ``/``-separated names exist already, see :func:`fastckpt.saving.committer.create_folder`).

    Args:
        folder: the (temporary) checkpoint folder.
        plan: the save plan (its shard files get ``bytes``/``header_bytes``/``header_xxh3`` entries).
        skeleton: the state skeleton for ``state.json``.
        extra_files: file name -> bytes.
        replace: replace files that already exist (atomically: :meth:`fastckpt.storage.store.Store.write_file`).

    Returns:
        The manifest's ``files`` map for the shards and every file written here.
    """
    files = {f.name: FileEntry(f.size, header_bytes=len(f.prefix), header_xxh3=xxhash.xxh3_64(f.prefix).hexdigest())
             for f in plan.files}
    small: dict[str, bytes] = {cm.STATE_JSON: json.dumps(skeleton, separators=(",", ":")).encode()}
    for stem, wm in plan.index.items():
        if stem != STATE_GROUP:
            indexed = [t.spec for f in plan.files for t in f.tensors if f.name in wm.values()]
            small[f"{stem}.safetensors.index.json"] = write_index(
                wm, sum(s.nbytes for s in indexed), sum(math.prod(s.shape) for s in indexed))
    small.update(extra_files or {})
    for name, data in small.items():
        LOCAL.write_file(LOCAL.join(folder, name), data, replace=replace)
        files[name] = FileEntry(len(data), xxh3=xxhash.xxh3_64(data).hexdigest())
    for sub in sorted({os.path.dirname(n) for n in files if "/" in n}):  # sub-folders' entries are durable
        LOCAL.sync_dir(LOCAL.join(folder, sub))                            # before the manifest commits them
    return files


def tensor_entries(plan: SavePlan, hashes: dict[str, str], entries: dict[str, dict]) -> dict[str, TensorEntry]:
    """The manifest's ``tensors`` map: every planned tensor (file, name, dtype, shape, absolute
    offsets, xxh3) plus alias/view/ndarray entries from :func:`fastckpt.saving.collect.collect`."""
    empty = xxhash.xxh3_64(b"").hexdigest()
    tensors: dict[str, TensorEntry] = {}
    for f in plan.files:
        for t in f.tensors:
            s = t.spec
            tensors[s.key] = TensorEntry(file=f.name, name=s.name, dtype=s.dtype, shape=tuple(s.shape),
                                         offsets=(t.file_offset, t.file_offset + s.nbytes),
                                         xxh3=hashes.get(s.key) or empty)
    for k, e in entries.items():
        tensors[k] = merge_entry(tensors.get(k), e)
    return tensors


def merge_entry(base: TensorEntry | None, e: dict) -> TensorEntry:
    """``base`` (the planned tensor, if any) with a collected entry ``e`` applied: ``{"alias": key}``,
    ``{"view": blob, "offset", "dtype", "shape", "stride"}`` and/or ``{"ndarray": True}``."""
    if "alias" in e:
        out = TensorEntry(alias=e["alias"])
    elif "view" in e:
        out = TensorEntry(view=e["view"], offset=e["offset"], dtype=e["dtype"], shape=tuple(e["shape"]),
                          stride=tuple(e["stride"]))
    else:
        out = base if base is not None else TensorEntry()
    out.ndarray = bool(e.get("ndarray", out.ndarray))
    return out


def manifest_doc(opts: "SaveOptions", files: dict[str, FileEntry], tensors: dict[str, TensorEntry], *,
                 world_size: int = 1, distributed: Distributed | None = None) -> Manifest:
    """The manifest (docs/FORMAT.md) for ``files`` and ``tensors``, stamped with the time now."""
    return Manifest(files=files, tensors=tensors, step=opts.step, world_size=world_size,
                    metadata=opts.metadata,  # also kept when the state has no tensor (no shard)
                    weights=opts.stems, created_unix_s=time.time(), distributed=distributed)


def write_manifest(folder: str, manifest: Manifest) -> int:
    """Write ``manifest.json`` (last, fsynced); returns the bytes of all files of the checkpoint."""
    data = manifest.to_json()
    LOCAL.write_file(LOCAL.join(folder, cm.MANIFEST), data)
    return sum(f.bytes for f in manifest.files.values()) + len(data)
